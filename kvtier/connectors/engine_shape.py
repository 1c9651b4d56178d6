"""vLLM's config, read once: the engine as kvtier sees it.

vLLM hands the connector its ``VllmConfig`` (and, with it, the ``KVCacheConfig`` of the
KV cache it allocated). kvtier needs a few dozen values of them: the model's identity
(its path, revision, dtype, the settings that change what the weights compute), the KV
cache's dtype and block size, its groups and layers, the parallel ranks, and a handful
of engine settings (events, the load-failure policy, the shutdown window, host memory).
:meth:`EngineShape.from_vllm` reads them here, and only here, into frozen values that
the rest of kvtier's vLLM layer takes instead of vLLM's objects: one place to follow
when vLLM renames a field, and no module that reaches into vLLM's config on its own.

The connector (:mod:`kvtier.connectors.vllm`) builds it; :func:`shape_being_built`
builds it from the config vLLM is still constructing, for the checks before any engine
process starts (:mod:`kvtier.connectors.startup`). Every value is read leniently (a
missing field takes vLLM's default), as kvtier has always read the optional ones.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import FrameType, MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

_EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """What kvtier needs of one of vLLM's KV cache specs (a kind of attention layer)."""

    #: vLLM's class name, for messages (``FullAttentionSpec``, ``MambaSpec``...)
    type_name: str
    #: an attention spec (vLLM's ``AttentionSpec``): KV per token
    attention: bool
    #: Mamba/SSM state: one state per request, not per token
    mamba: bool
    #: sliding-window attention
    sliding: bool
    #: plain full attention (``FullAttentionSpec`` or ``MLAAttentionSpec`` itself, no
    #: chunked-local attention): a group kvtier stores whole
    full: bool
    #: tokens per block (None where vLLM names none)
    block_size: int | None
    #: sliding: the window kvtier must keep, vLLM's window plus its retained tokens
    window: int | None
    #: Mamba/SSM state: each state tensor's (shape, dtype) of one block, in vLLM's order
    #: (conv, then SSM / recurrent state); empty for attention
    states: tuple[tuple[tuple[int, ...], str], ...] = ()
    #: Mamba/SSM state: vLLM's ``mamba_cache_mode`` for it ("align": a state per block
    #: boundary, what a prefix cache needs; "none", "all")
    state_mode: str | None = None
    #: Mamba/SSM state: the bytes of one block's state tensors, without vLLM's padding of
    #: the page to the attention page (vLLM's ``state_content_size_bytes``)
    state_bytes: int = 0


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """One of vLLM's KV cache groups (one block table): its layers and their specs."""

    layer_names: tuple[str, ...]
    specs: tuple[LayerSpec, ...]
    #: the group spec's bytes per block of one layer
    page_bytes: int
    #: HiSparse: the group lives in host memory, which kvtier cannot move
    host_resident: bool = False
    #: vLLM keeps the group out of KV transfers when False
    transfers: bool = True
    #: what vLLM's KV events call the group's spec (``get_kv_cache_spec_kind``)
    event_kind: str | None = None
    #: the sliding window vLLM's KV events name (``get_kv_cache_spec_sliding_window``)
    event_window: int | None = None

    def describe(self) -> str:
        """``FullAttentionSpec x 2 layers``: the group's kinds and size, for messages."""
        kinds = "/".join(sorted({s.type_name for s in self.specs}))
        return f"{kinds} x {len(self.layer_names)} layers"


@dataclass(frozen=True, slots=True)
class KVCacheShape:
    """The KV cache vLLM allocated (its ``KVCacheConfig``), as kvtier stores it."""

    num_blocks: int
    groups: tuple[CacheGroup, ...]
    #: bytes per block of every layer, as vLLM placed them in its tensors (the smaller of
    #: each tensor's layer and block strides); None where vLLM says nothing usable (then
    #: each group's spec page stands for its layers)
    layer_pages: Mapping[str, int] | None = None

    @classmethod
    def from_vllm(cls, kv_cache_config: KVCacheConfig) -> KVCacheShape:
        groups = tuple(_group(g) for g in getattr(kv_cache_config, "kv_cache_groups", ()) or ())
        return cls(
            num_blocks=int(getattr(kv_cache_config, "num_blocks", 0) or 0),
            groups=groups,
            layer_pages=_layer_pages(kv_cache_config, groups),
        )


@dataclass(frozen=True, slots=True)
class EngineShape:
    """Everything kvtier reads of vLLM's config, read once (:meth:`from_vllm`)."""

    # ---- the model ------------------------------------------------------------------------
    #: the model as vLLM was given it: a directory or a hub id
    model: str = ""
    revision: str | None = None
    #: the name it is served under (``--served-model-name``), else ``model``
    served_name: str = ""
    #: the weights' dtype, without ``torch.``
    dtype: str = "auto"
    #: MLA: every tensor-parallel rank holds the same KV
    use_mla: bool = False
    #: the model config as vLLM runs it (after ``hf_overrides``), without transformers'
    #: private bookkeeping; None where there is none
    hf_config_dict: Any = None
    quantization: str = "None"
    max_model_len: int | None = None
    attention_dtype: str = "None"
    #: how vLLM loads the weights (``--load-format``), lower case
    load_format: str = "auto"
    #: the speculative drafter's own weights (EAGLE heads, a draft model), None when it
    #: has none apart from the target's (n-gram, MTP) or there is no drafter
    draft_model: str | None = None
    draft_revision: str | None = None
    # ---- the KV cache -----------------------------------------------------------------------
    #: tokens per block; None until a GPU backend picks one (while vLLM builds its config)
    block_size: int | None = None
    kv_cache_dtype: str = "auto"
    prefix_hash_algo: str = "sha256"
    calculate_kv_scales: bool = False
    #: vLLM's weight offload to host memory per worker (``--cpu-offload-gb``), GiB
    cpu_offload_gb: float = 0.0
    gpu_memory_utilization: float = 0.9
    #: the KV cache per worker when sized explicitly (``--kv-cache-memory-bytes``)
    kv_cache_memory_bytes: int | None = None
    #: the KV cache vLLM allocated; None before it exists (while vLLM builds its config)
    kv_cache: KVCacheShape | None = None
    # ---- parallelism ------------------------------------------------------------------------
    tp_size: int = 1
    pp_size: int = 1
    nnodes: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    #: vLLM's executor (``mp``: the workers are processes of their own)
    executor_backend: str | None = None
    #: micro-batches: a layer's attention runs once per ubatch
    ubatching: bool = False
    # ---- the engine -------------------------------------------------------------------------
    #: tokens one step schedules at most (0: not known)
    max_num_batched_tokens: int = 0
    #: ``cpu``, ``cuda``...; None where vLLM's config names no device
    device_type: str | None = None
    #: vLLM publishes KV-cache events (``--kv-events-config``)
    kv_events: bool = False
    #: what vLLM does with a block whose load failed (``recompute`` or ``fail``)
    kv_load_failure_policy: str = "fail"
    #: ``--shutdown-timeout`` (vLLM >= 0.32), None where vLLM has none
    shutdown_timeout_s: float | None = None
    #: the connector vLLM was told to load, and its extra config
    connector: str | None = None
    connector_extra: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)

    def kv_block_size(self) -> int:
        """The block size, once vLLM has chosen one (the connector is built after)."""
        if self.block_size is None:
            raise ValueError("vLLM has not chosen the KV cache's block size yet")
        return self.block_size

    def allocated_kv_cache(self) -> KVCacheShape:
        """The KV cache vLLM allocated (the connector is built with it)."""
        if self.kv_cache is None:
            raise ValueError("vLLM has not allocated the KV cache yet")
        return self.kv_cache

    @property
    def world_size(self) -> int:
        """The engine's workers: tensor-parallel ranks times pipeline stages."""
        return self.tp_size * self.pp_size

    @classmethod
    def from_vllm(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None = None
    ) -> EngineShape:
        """Read what kvtier needs of ``vllm_config`` (and of the KV cache vLLM allocated,
        when it exists)."""
        vc: Any = vllm_config
        model = getattr(vc, "model_config", None)
        cache = getattr(vc, "cache_config", None)
        par = getattr(vc, "parallel_config", None)
        name = str(getattr(model, "model", "") or "")
        offload = getattr(vc, "offload_config", None)
        offload_gb = float(getattr(getattr(offload, "uva", None), "cpu_offload_gb", 0.0) or 0.0)
        if not offload_gb:
            offload_gb = float(getattr(cache, "cpu_offload_gb", 0.0) or 0.0)
        explicit_kv = getattr(cache, "kv_cache_memory_bytes", None)
        device = getattr(getattr(vc, "device_config", None), "device_type", None)
        events = getattr(vc, "kv_events_config", None)
        transfer = getattr(vc, "kv_transfer_config", None)
        backend = getattr(par, "distributed_executor_backend", None)
        draft = _draft_model(vc, name)
        return cls(
            model=name,
            revision=getattr(model, "revision", None),
            served_name=str(getattr(model, "served_model_name", None) or name),
            dtype=str(getattr(model, "dtype", "auto")).removeprefix("torch."),
            use_mla=bool(getattr(model, "use_mla", False)),
            hf_config_dict=_config_dict(getattr(model, "hf_config", None)),
            quantization=str(getattr(model, "quantization", None)),
            max_model_len=getattr(model, "max_model_len", None),
            attention_dtype=str(getattr(model, "override_attention_dtype", None)),
            load_format=_load_format(vc),
            draft_model=None if draft is None else str(draft.model),
            draft_revision=None if draft is None else getattr(draft, "revision", None),
            block_size=getattr(cache, "block_size", None),
            kv_cache_dtype=str(getattr(cache, "cache_dtype", "auto")),
            prefix_hash_algo=str(getattr(cache, "prefix_caching_hash_algo", "sha256")),
            calculate_kv_scales=bool(getattr(cache, "calculate_kv_scales", False)),
            cpu_offload_gb=offload_gb,
            gpu_memory_utilization=float(getattr(cache, "gpu_memory_utilization", 0.9)),
            kv_cache_memory_bytes=None if explicit_kv is None else int(explicit_kv),
            kv_cache=None if kv_cache_config is None else KVCacheShape.from_vllm(kv_cache_config),
            tp_size=int(getattr(par, "tensor_parallel_size", 1)),
            pp_size=int(getattr(par, "pipeline_parallel_size", 1)),
            nnodes=int(getattr(par, "nnodes", 1) or 1),
            decode_context_parallel_size=int(getattr(par, "decode_context_parallel_size", 1) or 1),
            prefill_context_parallel_size=int(
                getattr(par, "prefill_context_parallel_size", 1) or 1
            ),
            executor_backend=None if backend is None else str(backend),
            ubatching=bool(getattr(par, "use_ubatching", False)),
            max_num_batched_tokens=int(
                getattr(getattr(vc, "scheduler_config", None), "max_num_batched_tokens", 0) or 0
            ),
            device_type=None if device is None else str(device),
            kv_events=bool(events is not None and getattr(events, "enable_kv_cache_events", False)),
            kv_load_failure_policy=str(getattr(transfer, "kv_load_failure_policy", "fail")),
            shutdown_timeout_s=getattr(vc, "shutdown_timeout", None),
            connector=None if transfer is None else getattr(transfer, "kv_connector", None),
            connector_extra=MappingProxyType(
                dict(getattr(transfer, "kv_connector_extra_config", None) or {})
            ),
        )


def shape_being_built() -> EngineShape | None:
    """The shape of the ``VllmConfig`` vLLM is building, when this call is part of
    building it (its ``__post_init__`` asks for the connector class); None otherwise.

    vLLM 0.32 passes the connector no config before it constructs it in the workers, so
    the config is read from the frame of ``VllmConfig.__post_init__`` below this one."""
    try:
        from vllm.config import VllmConfig
    except ImportError:  # pragma: no cover - vLLM is a dependency of the connector
        return None
    code = getattr(VllmConfig.__post_init__, "__code__", None)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            config = frame.f_locals.get("self")
            return None if config is None else EngineShape.from_vllm(config)
        frame = frame.f_back
    return None


def _load_format(vc: Any) -> str:
    load = getattr(vc, "load_config", None)
    fmt = str(getattr(load, "load_format", "auto") or "auto")
    return str(getattr(fmt, "value", fmt)).lower()  # an enum in some vLLM versions


def _draft_model(vc: Any, target: str) -> Any:
    """The speculative drafter's model config when it has weights of its own (another
    directory than the target's: EAGLE heads, a draft model), else None (n-gram, MTP)."""
    spec = getattr(vc, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    if draft is None or str(draft.model) == target:
        return None
    return draft


def _config_dict(hf_config: Any) -> Any:
    """The model config as vLLM runs it, without transformers' private bookkeeping
    (``_name_or_path`` holds the path, which must not split replicas)."""
    if hf_config is None:
        return None
    to_dict = getattr(hf_config, "to_dict", None)
    return _public(to_dict() if callable(to_dict) else repr(hf_config))


def _public(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _public(v) for k, v in value.items() if not str(k).startswith("_")}
    if isinstance(value, list | tuple):
        return [_public(v) for v in value]
    return value


def _specs_of(spec: Any) -> list[Any]:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return list(spec.kv_cache_specs.values())
    return [spec]


def _layer_spec(spec: Any) -> LayerSpec:
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    sliding = isinstance(spec, SlidingWindowSpec)
    return LayerSpec(
        type_name=type(spec).__name__,
        attention=isinstance(spec, AttentionSpec),
        mamba=isinstance(spec, MambaSpec),
        sliding=sliding,
        full=type(spec) in (FullAttentionSpec, MLAAttentionSpec)
        and getattr(spec, "attention_chunk_size", None) is None,
        block_size=getattr(spec, "block_size", None),
        window=spec.sliding_window + int(getattr(spec, "extra_retained_tokens", 0) or 0)
        if sliding
        else None,
        states=_state_tensors(spec) if isinstance(spec, MambaSpec) else (),
        state_mode=str(getattr(spec, "mamba_cache_mode", "none"))
        if isinstance(spec, MambaSpec)
        else None,
        state_bytes=int(spec.state_content_size_bytes) if isinstance(spec, MambaSpec) else 0,
    )


def _state_tensors(spec: Any) -> tuple[tuple[tuple[int, ...], str], ...]:
    """A Mamba spec's state tensors of one block: (shape, dtype without ``torch.``)."""
    shapes = tuple(tuple(int(d) for d in shape) for shape in spec.shapes)
    dtypes = tuple(str(dt).removeprefix("torch.") for dt in spec.dtypes)
    return tuple(zip(shapes, dtypes, strict=True))


def _group(group: Any) -> CacheGroup:
    spec = group.kv_cache_spec
    event_kind, event_window = _event_spec(spec)
    return CacheGroup(
        layer_names=tuple(group.layer_names),
        specs=tuple(_layer_spec(s) for s in _specs_of(spec)),
        page_bytes=int(getattr(spec, "page_size_bytes", 0) or 0),
        host_resident=bool(getattr(group, "host_resident", False)),
        transfers=getattr(group, "enable_kv_transfer", True) is not False,
        event_kind=event_kind,
        event_window=event_window,
    )


def _event_spec(spec: Any) -> tuple[str | None, int | None]:
    """What vLLM's KV events say of a group's spec: its kind and its sliding window
    (None, None with a vLLM that names neither)."""
    try:
        from vllm.v1.kv_cache_interface import (
            get_kv_cache_spec_kind,
            get_kv_cache_spec_sliding_window,
        )
    except ImportError:  # pragma: no cover - a vLLM without KV events of its own
        return None, None
    return get_kv_cache_spec_kind(spec).value, get_kv_cache_spec_sliding_window(spec)


def _layer_pages(kv_cache_config: Any, groups: tuple[CacheGroup, ...]) -> Mapping[str, int] | None:
    """Each layer's bytes per block from its ``kv_cache_tensors`` entry: the smaller of its
    layer and block strides (a layer-outermost tensor steps blocks by the page, a
    block-outermost one steps layers by it). None where an entry names no layers or no
    strides, or the entries do not cover exactly the groups' layers."""
    every = {n for g in groups for n in g.layer_names}
    pages: dict[str, int] = {}
    for tensor in getattr(kv_cache_config, "kv_cache_tensors", None) or ():
        layers = getattr(tensor, "layers", None)
        strides = getattr(tensor, "layer_stride", 0), getattr(tensor, "block_stride", 0)
        if not layers or min(strides) <= 0:
            return None
        pages.update(dict.fromkeys(layers, min(strides)))
    if set(pages) != every:
        return None
    return MappingProxyType(pages)
