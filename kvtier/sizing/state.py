"""Recurrent state of hybrid models (Mamba1, Mamba2, gated delta-net, short conv), sized
as vLLM sizes it: one state per state layer per request, not per token.

With ``--mamba-cache-mode align`` and prefix caching, vLLM keeps the state at each block
boundary, and kvtier stores, with each chunk's attention KV, each state layer's state at
the chunk's end: one state (vLLM's ``MambaSpec`` page, unpadded) per state layer per
chunk. The shapes follow vLLM 0.32's ``MambaStateShapeCalculator`` and each model's
``get_mamba_state_shape_from_config``, the dtypes its ``MambaStateDtypeCalculator``
(tests/sizing/test_state.py compares them with vLLM's own); ``kvtier size`` never loads
vLLM, so they are written out here. Tensor parallelism divides heads (and the conv
channels) as vLLM's ``divide`` does, which refuses what does not divide.

A model whose state layers kvtier cannot size (Falcon-H1's parallel Mamba, Zamba2's
shared attention, Kimi's KDA, MiniMax's lightning attention...) is named with its layer
type, so that ``kvtier size`` refuses it rather than planning it as attention only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError, ModelConfigError

MAMBA1, MAMBA2, GDN, SHORT_CONV = "mamba1", "mamba2", "gated_delta_net", "short_conv"
#: vLLM's ``--mamba-cache-dtype`` / ``--mamba-ssm-cache-dtype`` choices
MAMBA_DTYPES = ("auto", "float32", "float16", "bfloat16")
_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class StateConfig:
    """What a config says of its state layers: the family, the layer type as the config
    names it, how many layers, and the numbers vLLM's calculator takes."""

    kind: str
    layer_type: str
    layers: int
    intermediate_size: int = 0
    n_groups: int = 0
    num_heads: int = 0
    head_dim: int = 0
    state_size: int = 0
    conv_kernel: int = 0
    num_k_heads: int = 0
    head_k_dim: int = 0
    #: which decoder layers hold state (their weights are the mixer's, not attention's)
    layer_ids: tuple[int, ...] = ()
    #: the SSM state dtype a model's config asks for when ``--mamba-ssm-cache-dtype`` is
    #: auto (vLLM: Nemotron-H's ``mamba_ssm_cache_dtype``, float32 by default; Qwen3.5's
    #: ``mamba_ssm_dtype``); None: the conv state's dtype
    ssm_dtype_default: str | None = None


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One state layer's state on one TP rank, as vLLM's ``MambaSpec`` holds it."""

    kind: str
    layer_type: str
    layers: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @property
    def bytes_per_layer(self) -> int:
        """``MambaSpec.page_size_bytes`` (unpadded): what one state of one layer holds."""
        return sum(math.prod(s) * _BYTES[d] for s, d in zip(self.shapes, self.dtypes, strict=True))

    @property
    def bytes(self) -> int:
        """One state of every state layer: what kvtier stores of them per chunk."""
        return self.layers * self.bytes_per_layer


def _int(cfg: dict[str, Any], key: str) -> int:
    value = cfg.get(key)
    if value is None:
        raise ModelConfigError(f"config.json lacks {key}, which vLLM sizes the state with")
    return int(value)


def _ids(types: list[Any] | str, *names: str) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(types) if str(t) in names)


def state_config(cfg: dict[str, Any], n: int, kinds: tuple[str, ...]) -> StateConfig | str | None:
    """The state layers of a (text) config of ``n`` layers (``kinds``: which hold KV, as
    :func:`kvtier.sizing.model._layer_kinds` reads them): a :class:`StateConfig`, a
    description of state layers kvtier cannot size (a string naming the layer type,
    refused by :mod:`kvtier.sizing.validate`), or None when the model has no state."""
    attention = sum(1 for k in kinds if k != "none")
    no_kv = tuple(i for i, k in enumerate(kinds) if k == "none")
    return _state_config(cfg, n, attention, no_kv)


def _state_config(
    cfg: dict[str, Any], n: int, attention: int, no_kv: tuple[int, ...]
) -> StateConfig | str | None:
    mtype = str(cfg.get("model_type", ""))
    types = cfg.get("layer_types")
    if not (isinstance(types, list) and len(types) == n):
        types = cfg.get("layers_block_type")  # Nemotron-H as transformers 5 saves it
    types = types if isinstance(types, list) and len(types) == n else None
    if mtype == "jamba":
        return StateConfig(
            MAMBA1,
            "mamba",
            len(no_kv),
            layer_ids=no_kv,
            intermediate_size=_int(cfg, "mamba_expand") * _int(cfg, "hidden_size"),
            state_size=_int(cfg, "mamba_d_state"),
            conv_kernel=_int(cfg, "mamba_d_conv"),
        )
    if mtype in ("granitemoehybrid", "bamba"):
        ids = _ids(types, "mamba") if types else no_kv
        return StateConfig(
            MAMBA2,
            "mamba",
            len(ids),
            layer_ids=ids,
            intermediate_size=_int(cfg, "mamba_expand") * _int(cfg, "hidden_size"),
            n_groups=_int(cfg, "mamba_n_groups"),
            num_heads=_int(cfg, "mamba_n_heads"),
            head_dim=_int(cfg, "mamba_d_head"),
            state_size=_int(cfg, "mamba_d_state"),
            conv_kernel=_int(cfg, "mamba_d_conv"),
        )
    if mtype == "nemotron_h":
        pattern = cfg.get("hybrid_override_pattern")
        if isinstance(pattern, str) and len(pattern) == n:
            ids = _ids(pattern, "M")
        elif types:  # transformers 5 names Mamba layers linear_attention
            ids = _ids(types, "mamba", "linear_attention")
        else:
            return "'mamba' layers without a hybrid_override_pattern of one letter a layer"
        heads, head_dim = _int(cfg, "mamba_num_heads"), _int(cfg, "mamba_head_dim")
        return StateConfig(
            MAMBA2,
            "mamba",
            len(ids),
            layer_ids=ids,
            intermediate_size=heads * head_dim,
            n_groups=_int(cfg, "n_groups"),
            num_heads=heads,
            head_dim=head_dim,
            state_size=_int(cfg, "ssm_state_size"),
            conv_kernel=_int(cfg, "conv_kernel"),
            ssm_dtype_default=str(cfg.get("mamba_ssm_cache_dtype") or "float32"),
        )
    if mtype.startswith(("qwen3_next", "qwen3_5")):
        ids = _ids(types, "linear_attention") if types else no_kv
        ssm = cfg.get("mamba_ssm_dtype") if mtype.startswith("qwen3_5") else None
        return StateConfig(
            GDN,
            "linear_attention",
            len(ids),
            layer_ids=ids,
            num_k_heads=_int(cfg, "linear_num_key_heads"),
            num_heads=_int(cfg, "linear_num_value_heads"),
            head_k_dim=_int(cfg, "linear_key_head_dim"),
            head_dim=_int(cfg, "linear_value_head_dim"),
            conv_kernel=_int(cfg, "linear_conv_kernel_dim"),
            ssm_dtype_default=str(ssm) if ssm else None,
        )
    if mtype in ("lfm2", "lfm2_moe"):
        ids = _ids(types, "conv") if types else no_kv
        return StateConfig(
            SHORT_CONV,
            "conv",
            len(ids),
            layer_ids=ids,
            intermediate_size=_int(cfg, "conv_dim"),
            conv_kernel=_int(cfg, "conv_L_cache"),
        )
    return _unsized(cfg, mtype, types, n, attention)


_ATTENTION_TYPES = frozenset(
    {
        "full_attention",
        "attention",
        "global_attention",
        "sliding_attention",
        "local_attention",
        "chunked_attention",
    }
)
#: layer types that hold neither KV nor state (Nemotron-H's MLP and MoE layers)
_STATELESS_TYPES = frozenset({"mlp", "moe"})
#: config keys only a model with recurrent state has
_STATE_KEYS = (
    "mamba",
    "ssm_state",
    "linear_num_",
    "linear_attn_config",
    "conv_l_cache",
    "attn_layer_indices",
    "attn_type_list",
    "block_types",
)


def _unsized(
    cfg: dict[str, Any], mtype: str, types: list[Any] | None, n: int, attention: int
) -> str | None:
    """State layers of a model type kvtier has no sizer for, named by their layer type;
    None when the model shows no state at all."""
    if types:
        other = sorted({str(t) for t in types} - _ATTENTION_TYPES - _STATELESS_TYPES)
        if other:
            return f"{', '.join(repr(t) for t in other)} layers of model type {mtype!r}"
    if attention < n or any(k in key.lower() for key in cfg for k in _STATE_KEYS):
        kind = "linear_attention" if any("linear" in k.lower() for k in cfg) else "mamba"
        return f"{kind!r} (recurrent-state) layers of model type {mtype!r}"
    return None


def _divide(n: int, tp: int, what: str) -> int:
    """vLLM's ``divide``: it asserts that the state's heads and channels split evenly."""
    if n % tp:
        raise ConfigError(
            "tensor_parallel_size",
            tp,
            f"a divisor of the model's {n} {what} (vLLM divides the recurrent state's "
            "heads and channels over the ranks and refuses to start otherwise)",
        )
    return n // tp


def _dtype(name: str, model_dtype: str) -> str:
    """``get_kv_cache_torch_dtype``: auto follows the model dtype."""
    out = model_dtype if name == "auto" else name
    aliases = {
        "bf16": "bfloat16",
        "fp16": "float16",
        "half": "float16",
        "float": "float32",
        "fp32": "float32",
    }
    out = aliases.get(out, out)
    if out not in _BYTES:
        raise ConfigError("mamba_cache_dtype", name, f"one of {', '.join(MAMBA_DTYPES)}")
    return out


def state_spec(
    state: StateConfig,
    *,
    tp: int = 1,
    model_dtype: str = "bfloat16",
    mamba_cache_dtype: str = "auto",
    mamba_ssm_cache_dtype: str = "auto",
    num_spec: int = 0,
    conv_layout: str = "SD",
) -> StateSpec:
    """Shapes and dtypes of one state layer on one of ``tp`` ranks, as vLLM 0.32 computes
    them (conv state ``(kernel - 1 + num_spec, dim)``, or ``(dim, ...)`` with
    VLLM_SSM_CONV_STATE_LAYOUT=DS: the same bytes)."""
    conv_dtype = _dtype(mamba_cache_dtype, model_dtype)
    ssm_name = mamba_ssm_cache_dtype
    if ssm_name == "auto" and state.ssm_dtype_default:
        ssm_name = state.ssm_dtype_default
    ssm_dtype = conv_dtype if ssm_name == "auto" else _dtype(ssm_name, model_dtype)

    def conv(dim: int, length: int) -> tuple[int, int]:
        return (dim, length) if conv_layout == "DS" else (length, dim)

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    if state.kind == MAMBA1:
        inner = _divide(state.intermediate_size, tp, "Mamba channels")
        shapes = (conv(inner, state.conv_kernel - 1), (inner, state.state_size))
        dtypes = (conv_dtype, ssm_dtype)
    elif state.kind == MAMBA2:
        groups = state.n_groups
        if groups % tp:  # vLLM replicates groups so that every head's group is on its rank
            groups += tp - groups
        conv_dim = state.intermediate_size + 2 * groups * state.state_size
        shapes = (
            conv(_divide(conv_dim, tp, "Mamba conv channels"), state.conv_kernel - 1 + num_spec),
            (_divide(state.num_heads, tp, "Mamba heads"), state.head_dim, state.state_size),
        )
        dtypes = (conv_dtype, ssm_dtype)
    elif state.kind == GDN:
        conv_dim = 2 * state.head_k_dim * state.num_k_heads + state.head_dim * state.num_heads
        shapes = (
            conv(
                _divide(conv_dim, tp, "linear-attention conv channels"),
                state.conv_kernel - 1 + num_spec,
            ),
            (
                _divide(state.num_heads, tp, "linear-attention value heads"),
                state.head_dim,
                state.head_k_dim,
            ),
        )
        dtypes = (conv_dtype, ssm_dtype)
    elif state.kind == SHORT_CONV:
        shapes = (
            conv(
                _divide(state.intermediate_size, tp, "conv channels"),
                state.conv_kernel - 1 + num_spec,
            ),
        )
        dtypes = (conv_dtype,)
    else:  # pragma: no cover - StateConfig is only built above
        raise ValueError(f"unknown state kind {state.kind!r}")
    return StateSpec(state.kind, state.layer_type, state.layers, shapes, dtypes)


def mixer_weights(state: StateConfig, hidden: int) -> list[tuple[str, int]]:
    """The parameters (name, elements) of one state layer's mixer, as vLLM builds them,
    so that a plan from the config alone counts these layers' weights too (all split
    over TP but the small per-head vectors)."""
    k = state.conv_kernel
    if state.kind == MAMBA1:  # Jamba: dt_rank = hidden / 16
        inner, n, dt = state.intermediate_size, state.state_size, -(-hidden // 16)
        return [
            ("mamba.in_proj.weight", hidden * 2 * inner),
            ("mamba.conv1d.weight", inner * k),
            ("mamba.x_proj.weight", inner * (dt + 2 * n)),
            ("mamba.dt_proj.weight", dt * inner),
            ("mamba.A", inner * n),
            ("mamba.D", inner),
            ("mamba.out_proj.weight", inner * hidden),
        ]
    if state.kind == MAMBA2:
        inner, heads = state.intermediate_size, state.num_heads
        gs = state.n_groups * state.state_size
        return [
            ("mamba.in_proj.weight", hidden * (2 * inner + 2 * gs + heads)),
            ("mamba.conv1d.weight", (inner + 2 * gs) * k),
            ("mamba.A", 3 * heads),
            ("mamba.norm.weight", inner),
            ("mamba.out_proj.weight", inner * hidden),
        ]
    if state.kind == GDN:
        kd, vd = state.num_k_heads * state.head_k_dim, state.num_heads * state.head_dim
        return [
            ("linear_attn.in_proj_qkvz.weight", hidden * (2 * kd + 2 * vd)),
            ("linear_attn.in_proj_ba.weight", hidden * 2 * state.num_heads),
            ("linear_attn.conv1d.weight", (2 * kd + vd) * k),
            ("linear_attn.A_log", 2 * state.num_heads),
            ("linear_attn.out_proj.weight", vd * hidden),
        ]
    c = state.intermediate_size  # short conv
    return [
        ("conv.in_proj.weight", hidden * 3 * c),
        ("conv.conv.weight", c * k),
        ("conv.out_proj.weight", c * hidden),
    ]


def hybrid_block_size(
    state_page: int, attn_page_per_token: int, block_size: int, kernel_alignment: int = 16
) -> int:
    """vLLM's ``_align_hybrid_block_size``: the attention block grows (in steps of the
    kernel's alignment, at least ``block_size``) until one attention layer's page holds
    one state layer's page; in align mode the state is kept at these block boundaries."""
    align = max(kernel_alignment, block_size)
    if state_page <= 0 or attn_page_per_token <= 0:
        return block_size
    return max(block_size, align * -(-state_page // (align * attn_page_per_token)))


__all__ = [
    "GDN",
    "MAMBA1",
    "MAMBA2",
    "MAMBA_DTYPES",
    "SHORT_CONV",
    "StateConfig",
    "StateSpec",
    "hybrid_block_size",
    "mixer_weights",
    "state_config",
    "state_spec",
]
