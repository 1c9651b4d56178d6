"""Weight tensors as vLLM holds them: fused names, declaration order, bytes per TP rank.

Weight offload works on vLLM's parameters, not the checkpoint's: q/k/v become
``qkv_proj``, gate/up become ``gate_up_proj``, per-expert MoE weights become
``experts.w13_weight``/``experts.w2_weight``. Both the size that is budgeted
and the size that pinning rounds are those of the fused tensors, so the
planner rebuilds them here, either from the safetensors headers (exact) or
from the config (when no weights are present).
"""

from __future__ import annotations

import glob
import json
import os
import re
import struct
from dataclasses import dataclass, replace
from typing import Any

from kvtier.sizing.model import DTYPE_BYTES, ModelConfigError, ModelShape
from kvtier.sizing.state import mixer_weights

#: bytes per element of each safetensors dtype code
ST_DTYPE_BYTES: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
}
_FLOAT_CODES = ("F64", "F32", "F16", "BF16")

#: declaration order of the submodules vLLM's decoder layers register (what
#: ``named_parameters`` yields, and so the order UVA offload takes tensors in)
_ORDER = [
    "self_attn",
    "attn",
    "attention",
    "mixer",
    "linear_attn",
    "mamba",
    "fused_qkv_a_proj",
    "q_a_proj",
    "kv_a_proj_with_mqa",
    "q_a_layernorm",
    "q_b_proj",
    "q_proj",
    "qkv_proj",
    "kv_a_layernorm",
    "kv_b_proj",
    "o_proj",
    "q_norm",
    "k_norm",
    "mlp",
    "block_sparse_moe",
    "feed_forward",
    "gate",
    "shared_expert_gate",
    "shared_expert",
    "shared_experts",
    "experts",
    "gate_up_proj",
    "down_proj",
    "w13_weight",
    "w2_weight",
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "weight",
    "bias",
]
_RANK = {name: i for i, name in enumerate(_ORDER)}

#: modules whose weights every TP rank holds whole
_REPLICATED = {"gate", "shared_expert_gate", "fused_qkv_a_proj", "q_a_proj", "kv_a_proj_with_mqa"}
_COLUMN = {"qkv_proj", "gate_up_proj", "q_b_proj", "kv_b_proj", "q_proj"}

_LAYER_RE = re.compile(
    r"^(?:model\.|model\.language_model\.|language_model\.model\.|transformer\.|backbone\.|"
    r"model\.decoder\.)?(?:layers|h|blocks)\.(\d+)\.(.+)$"
)
_EXPERT_RE = re.compile(r"^(.*)\.experts\.(\d+)\.(gate_proj|up_proj|w1|w3|down_proj|w2)\.(.+)$")


@dataclass(frozen=True, slots=True)
class WeightTensor:
    """One vLLM parameter: ``name`` is relative to its decoder layer (or the model root)."""

    name: str
    layer: int | None
    numel: int
    elt: int
    #: elements one TP rank holds
    rank_numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.elt

    @property
    def rank_bytes(self) -> int:
        return self.rank_numel * self.elt


@dataclass(frozen=True, slots=True)
class Weights:
    """Every tensor of the model, decoder layers in order, for one TP size."""

    layers: tuple[tuple[WeightTensor, ...], ...]
    other: tuple[WeightTensor, ...]
    source: str  # "safetensors" or "config"
    #: the checkpoint's bytes as the hub or the safetensors index gives them, beside a
    #: "config" estimate (quantized or float32 checkpoints differ from it); None unknown
    checkpoint_bytes: int | None = None

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.all())

    @property
    def rank_bytes(self) -> int:
        return sum(t.rank_bytes for t in self.all())

    def all(self) -> list[WeightTensor]:
        return [t for layer in self.layers for t in layer] + list(self.other)


def _sort_key(name: str) -> tuple[tuple[int, str], ...]:
    return tuple((_RANK.get(seg, len(_ORDER)), seg) for seg in name.split("."))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _rank_numel(name: str, numel: int, ndim: int, tp: int) -> int:
    """Elements one rank holds: column/row-parallel weights split, norms and routers whole."""
    if tp == 1:
        return numel
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if module in _REPLICATED or "norm" in module or "e_score_correction_bias" in name:
        return numel
    if ndim <= 1 and module not in _COLUMN and "experts" not in parts:
        return numel
    return _ceil_div(numel, tp)


# ---------------------------------------------------------------- safetensors


def read_safetensors_header(path: str) -> dict[str, dict[str, Any]]:
    """Tensor name -> {dtype, shape} from one file's header; the tensors are never read."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ModelConfigError(f"{path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20:
            raise ModelConfigError(f"{path}: implausible safetensors header length {n}")
        raw = f.read(n)
    try:
        header: dict[str, dict[str, Any]] = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{path}: unreadable safetensors header: {e}") from None
    header.pop("__metadata__", None)
    return header


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's files: those the index names, else every ``*.safetensors``."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted({os.path.join(model_dir, v) for v in weight_map.values()})
        # a hub snapshot kvtier size fetched holds the index without the shards: their
        # headers are not there to read, and a part of them would undercount
        return files if all(os.path.isfile(f) for f in files) else []
    return sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))


def _elt(code: str, name: str, model_dtype: str) -> int:
    """Float weights are cast to the model dtype on load; scales and quantized data are not."""
    if code not in ST_DTYPE_BYTES:
        raise ModelConfigError(f"unknown safetensors dtype {code!r} for {name}")
    leaf = name.rsplit(".", 1)[-1]
    if code in _FLOAT_CODES and leaf in ("weight", "bias"):
        cast: int = DTYPE_BYTES[model_dtype]
        return cast
    return ST_DTYPE_BYTES[code]


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def weights_from_safetensors(model_dir: str, shape: ModelShape, tp: int = 1) -> Weights | None:
    """Weights from the checkpoint headers, fused the way vLLM fuses them; None without files."""
    files = safetensors_files(model_dir)
    if not files:
        return None
    raw: dict[str, tuple[list[int], int]] = {}
    for path in files:
        for name, info in read_safetensors_header(path).items():
            raw[name] = (list(info["shape"]), _elt(info["dtype"], name, shape.dtype))
    per_layer: dict[int, dict[str, tuple[list[int], int]]] = {}
    other: list[WeightTensor] = []
    for name, (shp, elt) in raw.items():
        m = _LAYER_RE.match(name)
        if m is None:
            n = _numel(shp)
            other.append(WeightTensor(name, None, n, elt, _rank_numel(name, n, len(shp), tp)))
            continue
        idx = int(m.group(1))
        if idx >= shape.num_layers:  # e.g. DeepSeek's MTP layer: not a decoder layer
            continue
        per_layer.setdefault(idx, {})[m.group(2)] = (shp, elt)
    layers = []
    for idx in sorted(per_layer):
        fused = _fuse(per_layer[idx], shape, tp, idx)
        layers.append(tuple(sorted(fused, key=lambda t: _sort_key(t.name))))
    return Weights(tuple(layers), tuple(other), "safetensors")


def _fuse(
    tensors: dict[str, tuple[list[int], int]], shape: ModelShape, tp: int, layer: int
) -> list[WeightTensor]:
    """Merge one layer's checkpoint tensors into vLLM's fused parameters."""
    groups: dict[str, list[tuple[str, list[int], int]]] = {}
    plain: dict[str, tuple[list[int], int]] = {}
    for name, (shp, elt) in tensors.items():
        m = _EXPERT_RE.match(name)
        if m:
            which = "w2" if m.group(3) in ("down_proj", "w2") else "w13"
            groups.setdefault(f"{m.group(1)}.experts.{which}_{m.group(4)}", []).append(
                (m.group(3), shp, elt)
            )
        else:
            plain[name] = (shp, elt)
    out: list[WeightTensor] = []
    for fused_name, members in groups.items():
        numel = sum(_numel(s) for _, s, _ in members)
        out.append(WeightTensor(fused_name, layer, numel, members[0][2], _ceil_div(numel, tp)))
    used: set[str] = set()
    for name, (shp, _) in plain.items():
        parent, _, rest = name.rpartition(".")
        module_parent, _, module = parent.rpartition(".")
        pre = f"{module_parent}." if module_parent else ""
        if module == "q_proj" and f"{pre}k_proj.{rest}" in plain and f"{pre}v_proj.{rest}" in plain:
            q, k, v = (plain[f"{pre}{p}.{rest}"] for p in ("q_proj", "k_proj", "v_proj"))
            numel = _numel(q[0]) + _numel(k[0]) + _numel(v[0])
            kv_share = shape.kv_heads_per_rank(tp) / shape.num_kv_heads if tp > 1 else 1.0
            rank = _ceil_div(_numel(q[0]), tp) + int((_numel(k[0]) + _numel(v[0])) * kv_share)
            out.append(WeightTensor(f"{pre}qkv_proj.{rest}", layer, numel, q[1], rank))
            used |= {f"{pre}{p}.{rest}" for p in ("q_proj", "k_proj", "v_proj")}
        elif module == "gate_proj" and f"{pre}up_proj.{rest}" in plain:
            up = plain[f"{pre}up_proj.{rest}"]
            numel = _numel(shp) + _numel(up[0])
            out.append(
                WeightTensor(f"{pre}gate_up_proj.{rest}", layer, numel, up[1], _ceil_div(numel, tp))
            )
            used |= {name, f"{pre}up_proj.{rest}"}
        elif module == "q_a_proj" and f"{pre}kv_a_proj_with_mqa.{rest}" in plain:
            kv = plain[f"{pre}kv_a_proj_with_mqa.{rest}"]
            numel = _numel(shp) + _numel(kv[0])
            out.append(WeightTensor(f"{pre}fused_qkv_a_proj.{rest}", layer, numel, kv[1], numel))
            used |= {name, f"{pre}kv_a_proj_with_mqa.{rest}"}
    for name, (shp, elt) in plain.items():
        if name not in used:
            n = _numel(shp)
            out.append(WeightTensor(name, layer, n, elt, _rank_numel(name, n, len(shp), tp)))
    return out


# ---------------------------------------------------------------- from config


def weights_from_config(shape: ModelShape, tp: int = 1) -> Weights:
    """The tensors vLLM would create for this config (dense, MoE and MLA decoders).

    Used when no checkpoint is at hand. Quantized checkpoints (``fp8``) are
    counted at one byte per linear weight; their small scale tensors are left out.
    """
    s = shape
    dt = DTYPE_BYTES[s.dtype]
    lin = 1 if s.weight_quant in ("fp8", "fbgemm_fp8") else dt
    h = s.hidden_size
    kv_share = s.kv_heads_per_rank(tp) / s.num_kv_heads if tp > 1 else 1.0

    def t(
        name: str, layer: int | None, numel: int, elt: int, rank: int | None = None
    ) -> WeightTensor:
        return WeightTensor(name, layer, numel, elt, numel if rank is None else rank)

    def col(name: str, layer: int, numel: int, elt: int = lin) -> WeightTensor:
        return t(name, layer, numel, elt, _ceil_div(numel, tp))

    state_ids = frozenset(s.state.layer_ids) if s.state is not None else frozenset()
    layers = []
    for i in range(s.num_layers):
        ts: list[WeightTensor] = []
        if s.layer_kinds[i] != "none":
            if s.is_mla:
                rope, nope, v = s.qk_rope_head_dim, s.qk_nope_head_dim, s.v_head_dim
                kvl = s.kv_lora_rank or 0
                q_out = s.num_heads * (nope + rope)
                if s.q_lora_rank:
                    ts.append(
                        t(
                            "self_attn.fused_qkv_a_proj.weight",
                            i,
                            (s.q_lora_rank + kvl + rope) * h,
                            lin,
                        )
                    )
                    ts.append(t("self_attn.q_a_layernorm.weight", i, s.q_lora_rank, dt))
                    ts.append(col("self_attn.q_b_proj.weight", i, q_out * s.q_lora_rank))
                else:
                    ts.append(t("self_attn.kv_a_proj_with_mqa.weight", i, (kvl + rope) * h, lin))
                    ts.append(col("self_attn.q_proj.weight", i, q_out * h))
                ts.append(t("self_attn.kv_a_layernorm.weight", i, kvl, dt))
                ts.append(col("self_attn.kv_b_proj.weight", i, s.num_heads * (nope + v) * kvl))
                ts.append(col("self_attn.o_proj.weight", i, h * s.num_heads * v))
            else:
                q_rows = s.num_heads * s.head_dim
                kv_rows = 2 * s.num_kv_heads * s.head_dim
                rank_rows = _ceil_div(q_rows, tp) + int(kv_rows * kv_share)
                ts.append(
                    t("self_attn.qkv_proj.weight", i, (q_rows + kv_rows) * h, lin, rank_rows * h)
                )
                if s.attention_bias:
                    ts.append(t("self_attn.qkv_proj.bias", i, q_rows + kv_rows, dt, rank_rows))
                ts.append(col("self_attn.o_proj.weight", i, h * q_rows))
                if s.model_type.startswith("qwen3"):
                    ts.append(t("self_attn.q_norm.weight", i, s.head_dim, dt))
                    ts.append(t("self_attn.k_norm.weight", i, s.head_dim, dt))
        if s.state is not None and i in state_ids:  # a hybrid model's Mamba/GDN/conv mixer
            ts.extend(col(name, i, numel, dt) for name, numel in mixer_weights(s.state, h))
        p = s.moe_prefix
        if s.is_moe and i in s.moe_layers:
            e, mi = s.num_experts, s.moe_intermediate_size
            ts.append(t(f"{p}.gate.weight", i, e * h, dt))
            if s.shared_expert_intermediate_size:
                si = s.shared_expert_intermediate_size
                name = "shared_experts" if s.model_type.startswith("deepseek") else "shared_expert"
                if name == "shared_expert":
                    ts.append(t(f"{p}.shared_expert_gate.weight", i, h, dt))
                ts.append(col(f"{p}.{name}.gate_up_proj.weight", i, 2 * si * h))
                ts.append(col(f"{p}.{name}.down_proj.weight", i, h * si))
            ts.append(col(f"{p}.experts.w13_weight", i, e * 2 * mi * h))
            ts.append(col(f"{p}.experts.w2_weight", i, e * h * mi))
        elif s.intermediate_size and s.model_type == "nemotron_h":
            if s.mlp_layers is None or i in s.mlp_layers:  # relu², no gate
                ts.append(col("mlp.up_proj.weight", i, s.intermediate_size * h))
                ts.append(col("mlp.down_proj.weight", i, h * s.intermediate_size))
        elif s.intermediate_size and (s.mlp_layers is None or i in s.mlp_layers):
            ts.append(col("mlp.gate_up_proj.weight", i, 2 * s.intermediate_size * h))
            ts.append(col("mlp.down_proj.weight", i, h * s.intermediate_size))
        ts.append(t("input_layernorm.weight", i, h, dt))
        ts.append(t("post_attention_layernorm.weight", i, h, dt))
        if s.model_type.startswith("gemma2") or s.model_type.startswith("gemma3"):
            ts.append(t("pre_feedforward_layernorm.weight", i, h, dt))
            ts.append(t("post_feedforward_layernorm.weight", i, h, dt))
        layers.append(tuple(ts))
    other = [
        t("model.embed_tokens.weight", None, s.vocab_size * h, dt, _ceil_div(s.vocab_size * h, tp)),
        t("model.norm.weight", None, h, dt),
    ]
    if not s.tie_word_embeddings:
        other.append(
            t("lm_head.weight", None, s.vocab_size * h, dt, _ceil_div(s.vocab_size * h, tp))
        )
    return Weights(tuple(layers), tuple(other), "config")


def load_weights(path: str, shape: ModelShape, tp: int = 1) -> Weights:
    """Safetensors headers when ``path`` is a directory holding them, else the config
    (with the checkpoint's size from the safetensors index or the hub, when known)."""
    from kvtier.sizing import hub

    hub_model = hub.fetch(path) if hub.is_hub_id(path) else None
    path = hub_model.directory if hub_model else path
    model_dir = path if os.path.isdir(path) else os.path.dirname(path)
    found = weights_from_safetensors(model_dir, shape, tp) if model_dir else None
    if found is not None:
        return found
    checkpoint = (
        hub_model.checkpoint_bytes
        if hub_model
        else (hub.index_total_size(os.path.join(model_dir or ".", hub.INDEX)))
    )
    return replace(weights_from_config(shape, tp), checkpoint_bytes=checkpoint)
