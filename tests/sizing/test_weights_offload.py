"""Weight offload replay against tiny checkpoints the test writes and hand-computed sizes."""

from __future__ import annotations

import numpy as np
import pytest
from sizing_helpers import TINY_LLAMA, GiB, MiB, model, tiny_llama_tensors, write_model

from kvtier.sizing import offload as off
from kvtier.sizing.model import load_shape
from kvtier.sizing.weights import (
    Weights,
    WeightTensor,
    load_weights,
    read_safetensors_header,
    weights_from_config,
)

LAYER_ORDER = [
    "self_attn.qkv_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
]


def _tiny(tiny_llama):
    shape = load_shape(tiny_llama)
    return load_weights(tiny_llama, shape)


def test_header_read_without_tensors(tiny_llama):
    header = read_safetensors_header(tiny_llama + "/model.safetensors")
    assert header["model.layers.0.self_attn.k_proj.weight"]["shape"] == [32, 64]
    assert header["model.layers.0.self_attn.k_proj.weight"]["dtype"] == "F16"


def test_fused_names_sizes_and_declaration_order(tiny_llama):
    w = _tiny(tiny_llama)
    assert w.source == "safetensors"
    assert [t.name for t in w.layers[0]] == LAYER_ORDER
    sizes = {t.name: t.nbytes for t in w.layers[1]}
    assert sizes["self_attn.qkv_proj.weight"] == (64 + 32 + 32) * 64 * 2  # 16,384
    assert sizes["mlp.gate_up_proj.weight"] == (96 + 96) * 64 * 2  # 24,576
    assert sizes["mlp.down_proj.weight"] == 64 * 96 * 2  # 12,288
    # embeddings, final norm and lm_head are outside the decoder layers
    assert sorted(t.name for t in w.other) == [
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
    ]
    per_layer = 16384 + 8192 + 24576 + 12288 + 128 + 128
    assert w.total_bytes == 2 * per_layer + 2 * 100 * 64 * 2 + 128


def test_sharded_checkpoint_with_index_is_the_same(tmp_path, tiny_llama):
    sharded = write_model(tmp_path / "sharded", TINY_LLAMA, tiny_llama_tensors(), shards=3)
    a, b = _tiny(tiny_llama), load_weights(sharded, load_shape(sharded))
    assert [(t.name, t.nbytes) for t in a.all()] == [(t.name, t.nbytes) for t in b.all()]


def test_layers_beyond_num_hidden_layers_are_not_decoder_layers(tmp_path):
    # DeepSeek-style MTP layer stored as model.layers.<num_hidden_layers>
    d = write_model(tmp_path / "mtp", TINY_LLAMA, tiny_llama_tensors(layers=3))
    w = load_weights(d, load_shape(d))
    assert len(w.layers) == 2


def test_uva_budget_checked_before_each_tensor_and_last_one_overshoots(tiny_llama):
    w = _tiny(tiny_llama)
    # budget 20,000 B: qkv (16,384) fits under it, then o_proj (8,192) is still taken
    r = off.uva_offload(w, 20_000 / GiB, pin=True)
    assert r.budget_bytes == 20_000
    assert [t.name for t in r.tensors] == LAYER_ORDER[:2]
    assert r.gpu_bytes == 16384 + 8192


def test_pin_rounding_applies_to_the_fused_tensor(tiny_llama):
    w = _tiny(tiny_llama)
    r = off.uva_offload(w, 20_000 / GiB, ["mlp"], pin=True)
    # gate_up_proj is 24,576 B (two 12,288 B checkpoint tensors): pinned as 32,768
    assert [t.name for t in r.tensors] == ["mlp.gate_up_proj.weight"]
    assert r.gpu_bytes == 24_576 and r.host_bytes == 32_768
    exact = off.uva_offload(w, 20_000 / GiB, ["mlp"], pin=False)
    assert exact.host_bytes == 24_576


@pytest.mark.parametrize(
    "selector, expected",
    [
        ("self_attn", ["self_attn.qkv_proj.weight", "self_attn.o_proj.weight"] * 2),
        ("qkv_proj", ["self_attn.qkv_proj.weight"] * 2),
        ("mlp.down_proj", ["mlp.down_proj.weight"] * 2),
        ("layers.0", []),
        ("model.layers.0.mlp.down_proj.weight", []),
        ("embed_tokens", []),
        ("lm_head", []),
        ("proj", []),  # must be a whole segment
    ],
)
def test_selector_matching_is_literal_segments(tiny_llama, selector, expected):
    r = off.uva_offload(_tiny(tiny_llama), 1.0, [selector], pin=False)
    assert [t.name for t in r.tensors] == expected
    assert r.unmatched_selectors == (() if expected else (selector,))


def test_moe_experts_fused_into_w13_and_w2(tmp_path):
    cfg = {
        "model_type": "qwen3_moe",
        "hidden_size": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "num_hidden_layers": 1,
        "num_experts": 2,
        "moe_intermediate_size": 8,
        "vocab_size": 10,
        "torch_dtype": "float16",
    }
    z = np.zeros
    t = {"model.layers.0.mlp.gate.weight": z((2, 16), np.float16)}
    for e in range(2):
        for proj, shp in (("gate_proj", (8, 16)), ("up_proj", (8, 16)), ("down_proj", (16, 8))):
            t[f"model.layers.0.mlp.experts.{e}.{proj}.weight"] = z(shp, np.float16)
    d = write_model(tmp_path / "moe", cfg, t)
    w = load_weights(d, load_shape(d))
    sizes = {x.name: x.nbytes for x in w.layers[0]}
    assert sizes == {
        "mlp.gate.weight": 2 * 16 * 2,
        "mlp.experts.w13_weight": 2 * (8 * 16 + 8 * 16) * 2,
        "mlp.experts.w2_weight": 2 * 16 * 8 * 2,
    }
    # the router is declared before the experts
    assert [x.name for x in w.layers[0]][0] == "mlp.gate.weight"
    r = off.uva_offload(w, 1.0, ["experts"], pin=True)
    assert [x.name for x in r.tensors] == ["mlp.experts.w13_weight", "mlp.experts.w2_weight"]
    assert r.host_bytes == 1024 + 512


def test_47_7_gib_tensor_pins_64_gib():
    n = int(47.7 * GiB)
    t = WeightTensor("mlp.experts.w13_weight", 0, n // 2, 2, n // 2)
    assert off.host_bytes([t], pin=True) == 64 * GiB
    assert off.host_bytes([t], pin=False) == n
    assert off.next_pow2(32 * MiB) == 32 * MiB and off.next_pow2(32 * MiB + 1) == 64 * MiB


def test_pin_env_read_exactly_as_vllm():
    env = off.PIN_ENV
    assert off.pin_disabled_from_env({}) is False
    assert off.pin_disabled_from_env({env: "1"}) is True
    assert off.pin_disabled_from_env({env: "0"}) is False
    assert off.pin_disabled_from_env({env: "2"}) is True  # bool(int("2"))
    for bad in ("true", "", "yes"):
        with pytest.raises(ValueError, match="int"):
            off.pin_disabled_from_env({env: bad})
    # an explicit flag wins over the environment
    assert off.resolve_pin(True, {env: "0"}) is False
    assert off.resolve_pin(None, {env: "1"}) is False


# per-layer tensors of Llama 3 8B in bf16, computed by hand
QKV = (4096 + 2 * 1024) * 4096 * 2  # 48 MiB
O_PROJ = 4096 * 4096 * 2  # 32 MiB
GATE_UP = 2 * 14336 * 4096 * 2  # 224 MiB
DOWN = 4096 * 14336 * 2  # 112 MiB
NORM = 4096 * 2
LAYER = QKV + O_PROJ + GATE_UP + DOWN + 2 * NORM


def test_llama3_8b_uva_10_gib_from_config():
    shape = load_shape(model("llama3-8b"))
    w = weights_from_config(shape)
    assert [t.name for t in w.layers[0]] == LAYER_ORDER
    assert sum(t.nbytes for t in w.layers[0]) == LAYER
    r = off.uva_offload(w, 10, pin=True)
    # 24 whole layers, then qkv, o and gate_up of layer 24 (gate_up crosses 10 GiB)
    assert 24 * LAYER + QKV + O_PROJ < 10 * GiB <= 24 * LAYER + QKV + O_PROJ + GATE_UP
    assert r.gpu_bytes == 24 * LAYER + QKV + O_PROJ + GATE_UP
    assert len(r.tensors) == 24 * 6 + 3
    pinned_layer = 64 * MiB + 32 * MiB + 256 * MiB + 128 * MiB + 2 * NORM
    assert r.host_bytes == 24 * pinned_layer + 64 * MiB + 32 * MiB + 256 * MiB


def test_qwen3_moe_experts_selector_from_config():
    w = weights_from_config(load_shape(model("qwen3-30b-a3b")))
    w13 = 128 * 2 * 768 * 2048 * 2  # 768 MiB
    w2 = 128 * 2048 * 768 * 2  # 384 MiB
    r = off.uva_offload(w, 10, ["experts"], pin=True)
    # 8 layers = 9 GiB; layer 8's w13 reaches 9.75 GiB, its w2 crosses 10 GiB
    assert r.gpu_bytes == 9 * (w13 + w2)
    assert all("experts" in t.name for t in r.tensors) and len(r.tensors) == 18
    assert r.host_bytes == 9 * (1024 * MiB + 512 * MiB)


def test_deepseek_v3_first_dense_layers_and_mla_tensors():
    w = weights_from_config(load_shape(model("deepseek-v3")))
    names0 = [t.name for t in w.layers[0]]
    names3 = [t.name for t in w.layers[3]]
    assert "mlp.gate_up_proj.weight" in names0 and "mlp.experts.w13_weight" not in names0
    assert "mlp.experts.w13_weight" in names3 and "mlp.shared_experts.gate_up_proj.weight" in names3
    fused = next(t for t in w.layers[0] if t.name == "self_attn.fused_qkv_a_proj.weight")
    # fp8 weights: (q_lora_rank + kv_lora_rank + rope) x hidden, one byte each
    assert fused.nbytes == (1536 + 512 + 64) * 7168


def test_prefetch_last_layers_of_each_group_and_buffer_pool():
    w = weights_from_config(load_shape(model("llama3-8b")))
    r = off.prefetch_offload(w, group_size=4, num_in_group=1, prefetch_step=2, pin=False)
    assert r.layers_touched == 8  # layers 3, 7, ..., 31
    assert {t.layer for t in r.tensors} == {3, 7, 11, 15, 19, 23, 27, 31}
    assert r.gpu_bytes == 8 * LAYER
    assert r.buffer_pool_bytes == 2 * LAYER  # prefetch_step copies of one layer
    mlp = off.prefetch_offload(w, 4, 2, 1, ["mlp"], pin=False)
    assert mlp.gpu_bytes == 16 * (GATE_UP + DOWN)
    assert mlp.buffer_pool_bytes == GATE_UP + DOWN


def test_prefetch_validation_matches_vllm():
    w = Weights((), (), "config")
    with pytest.raises(ValueError, match=r"offload_num_in_group \(3\) must be <= "):
        off.prefetch_offload(w, 2, 3)
    with pytest.raises(ValueError, match="offload_prefetch_step"):
        off.prefetch_offload(w, 2, 1, 0)


def test_backend_selection():
    assert off.select_backend("auto", 10, 4) == "prefetch"
    assert off.select_backend("auto", 10, 0) == "uva"
    assert off.select_backend("auto", 0, 0) == "none"
    assert off.select_backend("uva", 0, 4) == "uva"
