"""Model shape from a Hugging Face ``config.json``: what one token of KV cache costs.

Only the config is read (no weights, no transformers), so ``kvtier size`` can
answer for a model that is not downloaded yet. The rules follow what vLLM
allocates, not what the paper says: an explicit ``head_dim`` wins, MLA stores
one latent per token replicated on every TP rank, and KV heads are replicated
when TP exceeds them.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ModelConfigError as ModelConfigError  # (re-exported)
from kvtier.sizing.state import (
    GDN,
    StateConfig,
    StateSpec,
    hybrid_block_size,
    state_config,
    state_spec,
)


def host_has_avx512_bf16() -> bool:
    """Whether this CPU has AVX512-BF16, as vLLM's CPU platform asks it (through torch)
    before it moves a hybrid model's SSM state to float32. Asked of torch where it is
    loaded already (inside an engine), else read from the kernel's CPU flags, so that
    `kvtier size` does not load torch."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return bool(torch.cpu._is_avx512_bf16_supported())
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return any(line.startswith("flags") and " avx512_bf16" in line for line in f)
    except OSError:
        return False


#: bytes per element of the dtype names found in configs and on the command line
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "fp32": 4,
    "float16": 2,
    "half": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "fp8_ds_mla": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")

FULL, SLIDING, NONE = "full", "sliding", "none"


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The parts of a model config that decide KV and weight bytes."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    dtype: str
    #: one entry per decoder layer: "full", "sliding" or "none" (no KV: Mamba, linear
    #: attention, short conv, or an MLP-only layer)
    layer_kinds: tuple[str, ...]
    sliding_window: int | None = None
    #: MLA (DeepSeek V2/V3): latent width per token per layer = kv_lora_rank + qk_rope_head_dim
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int | None = None
    intermediate_size: int = 0
    vocab_size: int = 0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_experts: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: frozenset[int] = field(default_factory=frozenset)
    #: the layers with a dense MLP when not every other one has (Nemotron-H's "-" layers)
    mlp_layers: frozenset[int] | None = None
    moe_prefix: str = "mlp"
    weight_quant: str | None = None
    max_position_embeddings: int | None = None
    #: the recurrent-state layers (Mamba, gated delta-net, short conv) of a hybrid model
    state: StateConfig | None = None
    #: state layers kvtier cannot size, named by their layer type (refused)
    unsized_state: str | None = None

    @property
    def state_layers(self) -> int:
        return self.state.layers if self.state else 0

    def state_spec(
        self, tp: int = 1, *, mamba_cache_dtype: str = "auto", mamba_ssm_cache_dtype: str = "auto"
    ) -> StateSpec | None:
        """One state layer's state per rank (vLLM's ``MambaSpec``); None without state."""
        if self.state is None:
            return None
        return state_spec(
            self.state,
            tp=tp,
            model_dtype=self.dtype,
            mamba_cache_dtype=mamba_cache_dtype,
            mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
        )

    def engine_block_size(
        self,
        block_size: int,
        kv_cache_dtype: str = "auto",
        tp: int = 1,
        *,
        state: StateSpec | None = None,
        kernel_alignment: int = 16,
    ) -> int:
        """The block size vLLM runs with: ``block_size``, or for a hybrid model with state
        the one it raises it to so that an attention page holds a state page."""
        if state is None or not self.attention_layers:
            return block_size
        return hybrid_block_size(
            state.bytes_per_layer,
            self.kv_bytes_per_layer_token(kv_cache_dtype, tp),
            block_size,
            kernel_alignment,
        )

    def engine_state(
        self,
        block_size: int,
        kv_cache_dtype: str = "auto",
        tp: int = 1,
        *,
        mamba_cache_dtype: str = "auto",
        mamba_ssm_cache_dtype: str = "auto",
        cpu_build: bool = False,
        cpu_avx512_bf16: bool | None = None,
    ) -> tuple[StateSpec | None, int]:
        """The state per rank as the engine holds it and the block size it runs with: on
        a GPU blocks grow in steps of 16 tokens; vLLM's CPU build grows them in steps of
        32 and, on a CPU with AVX512-BF16 (``cpu_avx512_bf16``; None: this host's), keeps
        the SSM state in float32 unless a gated delta-net model asks for float16/bfloat16
        (``CpuPlatform``). Without AVX512-BF16 it keeps the dtype asked for."""
        ssm = mamba_ssm_cache_dtype
        if cpu_avx512_bf16 is None:
            cpu_avx512_bf16 = cpu_build and host_has_avx512_bf16()
        if (
            cpu_build
            and cpu_avx512_bf16
            and self.state is not None
            and ssm != "float32"
            and not (ssm in ("float16", "bfloat16") and self.state.kind == GDN)
        ):
            ssm = "float32"
        spec = self.state_spec(tp, mamba_cache_dtype=mamba_cache_dtype, mamba_ssm_cache_dtype=ssm)
        block = self.engine_block_size(
            block_size, kv_cache_dtype, tp, state=spec, kernel_alignment=32 if cpu_build else 16
        )
        return spec, block

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_layers(self) -> int:
        return sum(1 for k in self.layer_kinds if k != NONE)

    def kv_heads_per_rank(self, tp: int) -> int:
        """vLLM splits KV heads across TP ranks and replicates them when TP > heads."""
        return max(1, self.num_kv_heads // tp)

    def kv_bytes_per_layer_token(self, kv_cache_dtype: str = "auto", tp: int = 1) -> int:
        """KV bytes one token costs in one attention layer on one TP rank (tp=1: whole model)."""
        elt = kv_dtype_bytes(kv_cache_dtype, self.dtype)
        if self.is_mla:
            return ((self.kv_lora_rank or 0) + self.qk_rope_head_dim) * elt
        heads = self.num_kv_heads if tp == 1 else self.kv_heads_per_rank(tp)
        return 2 * heads * self.head_dim * elt

    def kv_bytes_per_token(self, kv_cache_dtype: str = "auto", tp: int = 1) -> int:
        """KV bytes per token over every layer that holds KV (sliding layers included)."""
        return self.attention_layers * self.kv_bytes_per_layer_token(kv_cache_dtype, tp)

    def session_kv_bytes(self, context: int, kv_cache_dtype: str = "auto", tp: int = 1) -> int:
        """KV bytes one sequence of ``context`` tokens holds on the GPU.

        Sliding-window layers keep at most ``sliding_window`` tokens; full layers keep all.
        """
        per = self.kv_bytes_per_layer_token(kv_cache_dtype, tp)
        total = 0
        for kind in self.layer_kinds:
            if kind == FULL:
                total += per * context
            elif kind == SLIDING:
                total += per * min(context, self.sliding_window or context)
        return total

    def kv_groups(
        self,
        kv_cache_dtype: str = "auto",
        tp: int = 1,
        *,
        chunk_size: int = 256,
        block_size: int = 16,
        state: StateSpec | None = None,
    ) -> list[dict[str, Any]]:
        """The KV cache groups of the model as kvtier stores them, per rank.

        With full and sliding-window layers, vLLM's hybrid KV cache manager (which kvtier
        keeps on) keeps them apart: a sliding layer holds ``sliding_window`` tokens of a
        sequence, not its whole context, and kvtier stores of each chunk only its last
        blocks the window before the chunk's end needs (:func:`sliding_blocks`). A model
        of one kind is one group, every block of a chunk stored. Per group: its kind,
        layers and window, KV bytes per token and per block (vLLM's page over the group's
        layers) and the bytes kvtier stores of one chunk.

        A hybrid model's state layers (``state``: :meth:`state_spec`) are one more group:
        kvtier stores one state per state layer per chunk (the state at the chunk's end),
        whatever the chunk's length. ``block_size`` is vLLM's (:meth:`engine_block_size`),
        whose attention page the engine pads each state page to."""
        per = self.kv_bytes_per_layer_token(kv_cache_dtype, tp)
        bpc = max(1, chunk_size // block_size)
        counts = {kind: sum(1 for k in self.layer_kinds if k == kind) for kind in (FULL, SLIDING)}
        hybrid = all(counts.values())
        out: list[dict[str, Any]] = []
        for kind, layers in counts.items():
            if not layers:
                continue
            window = (self.sliding_window or 0) if kind == SLIDING else 0
            blocks = sliding_blocks(window, block_size, bpc) if hybrid and window else bpc
            out.append(
                {
                    "kind": kind,
                    "layers": layers,
                    "window": window or None,
                    "bytes_per_token": per * layers,
                    "page_bytes": per * layers * block_size,
                    "stored_blocks_per_chunk": blocks,
                    "blocks_per_chunk": bpc,
                    "chunk_bytes": per * layers * block_size * blocks,
                }
            )
        if state is not None and state.layers:
            out.append(
                {
                    "kind": "state",
                    "state_kind": state.kind,
                    "layer_type": state.layer_type,
                    "layers": state.layers,
                    "window": None,
                    "shapes": [list(s) for s in state.shapes],
                    "dtypes": list(state.dtypes),
                    "bytes_per_token": 0,
                    # one state per layer (vLLM's MambaSpec page, unpadded) and the page the
                    # engine pads it to (one attention layer's block)
                    "state_bytes_per_layer": state.bytes_per_layer,
                    "page_bytes": state.bytes,
                    "padded_page_bytes": max(per * block_size, state.bytes_per_layer)
                    * state.layers,
                    "stored_blocks_per_chunk": 1,
                    "blocks_per_chunk": bpc,
                    "chunk_bytes": state.bytes,
                }
            )
        return out


def sliding_blocks(window: int, block_size: int, blocks_per_chunk: int) -> int:
    """Blocks of each chunk kvtier stores of a sliding-window group: the last
    ``ceil(window / block_size)`` (``kvtier.host.layout.sliding_blocks``, which needs torch)."""
    return max(1, min(blocks_per_chunk, -(-window // block_size)))


def kv_dtype_bytes(kv_cache_dtype: str, model_dtype: str) -> int:
    """Bytes per KV element: ``auto`` follows the model dtype, ``fp8*`` is one byte."""
    name = model_dtype if kv_cache_dtype in ("auto", None) else kv_cache_dtype
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        raise ModelConfigError(f"unknown KV cache dtype {kv_cache_dtype!r}") from None


def local_model(path: str) -> str:
    """``path`` itself, or for a hub id (``org/name``) its cached snapshot directory,
    holding config.json and the safetensors index (fetched by :mod:`kvtier.sizing.hub`)."""
    from kvtier.sizing import hub

    return hub.fetch(path).directory if hub.is_hub_id(path) else path


def read_config(path: str) -> dict[str, Any]:
    """Read ``config.json`` from a file path, a model directory or a hub id."""
    path = local_model(path)
    cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(cfg_path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ModelConfigError(
            f"no config.json at {cfg_path}: pass a model directory, its "
            "config.json or a hub id (org/name)"
        ) from None
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{cfg_path} is not valid JSON: {e}") from None
    except OSError as e:
        raise ModelConfigError(f"cannot read {cfg_path}: {e}") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{cfg_path} does not hold a JSON object")
    return raw


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs (Gemma 3, Llama 4, Qwen-VL) keep the decoder under text_config."""
    text = raw.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" not in raw:
        merged = {k: v for k, v in raw.items() if k != "text_config"}
        merged.update(text)
        return merged
    return raw


def _need(cfg: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        value = cfg.get(key)
        if value is not None:
            return value
    raise ModelConfigError(f"config.json lacks {' / '.join(keys)}")


def _resolve_dtype(cfg: dict[str, Any], override: str | None) -> str:
    """vLLM's ``--dtype auto``: the config dtype, with float32 checkpoints run in bfloat16."""
    if override and override != "auto":
        name = override
    else:
        name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        if name in ("float32", "float"):
            name = "bfloat16"
    if name.lower() not in DTYPE_BYTES:
        raise ModelConfigError(f"unknown dtype {name!r}")
    return name.lower()


def _layer_kinds(cfg: dict[str, Any], n: int) -> tuple[tuple[str, ...], int | None]:
    """Which layers hold KV, and which of those keep only a sliding window."""
    window = cfg.get("sliding_window")
    mtype = str(cfg.get("model_type", ""))
    if cfg.get("use_sliding_window") is False:
        window = None
    types = cfg.get("layer_types")
    if not (isinstance(types, list) and len(types) == n):
        types = cfg.get("layers_block_type")  # Nemotron-H as transformers 5 saves it
    if isinstance(types, list) and len(types) == n:
        kinds = []
        for t in types:
            t = str(t)
            if t in ("full_attention", "attention", "global_attention"):
                kinds.append(FULL)
            elif t in ("sliding_attention", "local_attention", "chunked_attention"):
                kinds.append(SLIDING if window else FULL)
            else:
                kinds.append(NONE)
        return tuple(kinds), window
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and len(pattern) == n:
        return tuple(FULL if c == "*" else NONE for c in pattern), None
    indices = cfg.get("attn_layer_indices")
    if isinstance(indices, list) and indices:  # Bamba
        at = {int(i) for i in indices}
        return tuple(FULL if i in at else NONE for i in range(n)), None
    if "attn_layer_period" in cfg:
        period, offset = int(cfg["attn_layer_period"]), int(cfg.get("attn_layer_offset", 0))
        return tuple(FULL if i % period == offset else NONE for i in range(n)), None
    if "full_attention_interval" in cfg:
        iv = int(cfg["full_attention_interval"])
        return tuple(FULL if (i + 1) % iv == 0 else NONE for i in range(n)), None
    if window and mtype == "gemma2":
        # Gemma 2 alternates: even layers slide, odd layers are global.
        return tuple(SLIDING if i % 2 == 0 else FULL for i in range(n)), window
    if window and mtype.startswith("gemma3"):
        p = int(cfg.get("sliding_window_pattern") or 6)
        return tuple(FULL if (i + 1) % p == 0 else SLIDING for i in range(n)), window
    if window and mtype in ("mistral", "mixtral"):
        return tuple(SLIDING for _ in range(n)), window
    return tuple(FULL for _ in range(n)), None


def _ffn_size(cfg: dict[str, Any]) -> int:
    """The MLP's width: ``intermediate_size``, which LFM2 adjusts (vLLM's ``Lfm2MLP``:
    two thirds, times ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``;
    transformers' defaults when the config leaves them out)."""
    size = int(cfg.get("intermediate_size") or 0)
    if cfg.get("model_type") == "lfm2" and cfg.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        mult = cfg.get("block_ffn_dim_multiplier", 1.0)
        if mult is not None:
            size = int(float(mult) * size)
        of = int(cfg.get("block_multiple_of") or 256)
        size = of * -(-size // of)
    return size


def _moe_layers(cfg: dict[str, Any], n: int) -> tuple[int, frozenset[int]]:
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or 0)
    experts = experts or int(cfg.get("num_local_experts") or 0)
    if not experts:
        return 0, frozenset()
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    if "expert_layer_period" in cfg:  # Jamba
        period, offset = int(cfg["expert_layer_period"]), int(cfg.get("expert_layer_offset", 0))
        layers = frozenset(i for i in range(n) if i % period == offset)
    elif "moe_layer_freq" in cfg:  # DeepSeek: dense first k layers, then every freq-th
        freq = int(cfg.get("moe_layer_freq") or 1)
        layers = frozenset(i for i in range(first_dense, n) if i % freq == 0)
    else:  # Qwen MoE: decoder_sparse_step, minus mlp_only_layers; Mixtral: every layer
        step = int(cfg.get("decoder_sparse_step") or 1)
        layers = frozenset(
            i for i in range(first_dense, n) if (i + 1) % step == 0 and i not in mlp_only
        )
    return experts, layers


def shape_from_config(
    raw: dict[str, Any], *, dtype: str | None = None, num_layers: int | None = None
) -> ModelShape:
    """Build a :class:`ModelShape` from a parsed config dict."""
    cfg = _text_config(raw)
    n = int(num_layers or _need(cfg, "num_hidden_layers", "n_layer", "num_layers"))
    heads = int(_need(cfg, "num_attention_heads", "n_head"))
    kv_heads = int(cfg.get("num_key_value_heads") or cfg.get("num_kv_heads") or heads)
    hidden = int(_need(cfg, "hidden_size", "d_model", "n_embd"))
    head_dim = cfg.get("head_dim") or hidden // heads
    kinds, window = _layer_kinds(cfg, n)
    experts, moe_layers = _moe_layers(cfg, n)
    mlp_layers = None
    pattern = cfg.get("hybrid_override_pattern")
    if cfg.get("model_type") == "nemotron_h" and isinstance(pattern, str) and len(pattern) == n:
        # one block a layer: Mamba (M), attention (*), MLP (-) or MoE (E)
        mlp_layers = frozenset(i for i, c in enumerate(pattern) if c == "-")
        moe_layers = frozenset(i for i, c in enumerate(pattern) if c == "E")
    mtype = str(cfg.get("model_type", ""))
    quant = cfg.get("quantization_config")
    weight_quant = quant.get("quant_method") if isinstance(quant, dict) else None
    n_shared = int(cfg.get("n_shared_experts") or 0)
    shared = int(
        cfg.get("shared_expert_intermediate_size") or cfg.get("shared_intermediate_size") or 0
    )  # Granite-4.0-H: the latter
    moe_inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0)
    if n_shared and not shared:
        shared = n_shared * moe_inter
    state = state_config(cfg, n, kinds)
    return ModelShape(
        model_type=mtype,
        num_layers=n,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        hidden_size=hidden,
        dtype=_resolve_dtype(cfg, dtype),
        layer_kinds=kinds,
        sliding_window=int(window) if window else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]) if cfg.get("kv_lora_rank") else None,
        qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
        qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
        v_head_dim=int(cfg.get("v_head_dim") or 0),
        q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
        intermediate_size=_ffn_size(cfg),
        vocab_size=int(cfg.get("vocab_size") or 0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_bias=bool(cfg.get("attention_bias", False)) or mtype.startswith("qwen2"),
        num_experts=experts,
        moe_intermediate_size=moe_inter if experts else 0,
        shared_expert_intermediate_size=shared if experts else 0,
        moe_layers=moe_layers,
        mlp_layers=mlp_layers,
        moe_prefix="block_sparse_moe" if mtype == "mixtral" else "mlp",
        weight_quant=weight_quant,
        max_position_embeddings=cfg.get("max_position_embeddings"),
        state=state if isinstance(state, StateConfig) and state.layers else None,
        unsized_state=state if isinstance(state, str) else None,
    )


def load_shape(path: str, *, dtype: str | None = None) -> ModelShape:
    """Shape of the model whose ``config.json`` (or directory) is at ``path``."""
    return shape_from_config(read_config(path), dtype=dtype)
