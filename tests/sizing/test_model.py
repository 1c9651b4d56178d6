"""KV bytes per token from real published configs, computed by hand in each test."""

from __future__ import annotations

import json

import pytest
from sizing_helpers import model

from kvtier.sizing.model import ModelConfigError, load_shape, shape_from_config


def test_guide_example_llama3_8b():
    # 32 layers x 8 KV heads x 128 head_dim x 2 (K and V) x 2 bytes (bf16)
    s = load_shape(model("llama3-8b"))
    assert s.kv_bytes_per_token() == 32 * 2 * 8 * 128 * 2 == 131_072
    # an 8k-token session is 1 GiB
    assert s.session_kv_bytes(8192) == 131_072 * 8192 == 2**30


def test_qwen25_gqa_and_tp_split_and_replication():
    s = load_shape(model("qwen2.5-7b"))
    assert s.kv_bytes_per_token() == 28 * 2 * 4 * 128 * 2  # 57,344
    assert s.kv_bytes_per_token(tp=2) == 28 * 2 * 2 * 128 * 2  # 2 heads per rank
    # TP 8 > 4 KV heads: each rank keeps one whole head
    assert s.kv_bytes_per_token(tp=8) == 28 * 2 * 1 * 128 * 2
    # use_sliding_window is false: no layer is treated as sliding
    assert set(s.layer_kinds) == {"full"}


def test_mistral_nemo_explicit_head_dim_wins():
    s = load_shape(model("mistral-nemo-12b"))
    assert s.head_dim == 128  # not 5120 / 32 = 160
    assert s.kv_bytes_per_token() == 40 * 2 * 8 * 128 * 2 == 163_840


def test_mistral_7b_sliding_window_caps_session():
    s = load_shape(model("mistral-7b-v0.1"))
    assert s.kv_bytes_per_token() == 32 * 2 * 8 * 128 * 2
    # every layer keeps at most 4096 tokens
    assert s.session_kv_bytes(8192) == 32 * 2 * 8 * 128 * 2 * 4096
    assert s.session_kv_bytes(1000) == 32 * 2 * 8 * 128 * 2 * 1000


def test_gemma2_mixed_local_global_and_float32_config_runs_bf16():
    s = load_shape(model("gemma2-9b"))
    assert s.dtype == "bfloat16"  # config says float32; vLLM's auto dtype downcasts
    assert s.head_dim == 256
    per_layer = 2 * 8 * 256 * 2
    assert s.kv_bytes_per_token() == 42 * per_layer == 344_064
    assert s.layer_kinds.count("sliding") == 21 and s.layer_kinds[0] == "sliding"
    # 21 global layers keep 8192 tokens, 21 local layers 4096
    assert s.session_kv_bytes(8192) == 21 * per_layer * 8192 + 21 * per_layer * 4096


def test_deepseek_v3_mla_latent_replicated_on_every_rank():
    s = load_shape(model("deepseek-v3"))
    assert s.is_mla
    assert s.kv_bytes_per_token() == 61 * (512 + 64) * 2 == 70_272
    assert s.kv_bytes_per_token(tp=8) == 70_272
    assert s.kv_bytes_per_token("fp8", tp=8) == 61 * 576


def test_qwen3_moe_tp8_replicates_kv_heads():
    s = load_shape(model("qwen3-30b-a3b"))
    assert s.kv_bytes_per_token() == 48 * 2 * 4 * 128 * 2 == 98_304
    assert s.kv_bytes_per_token(tp=8) == 48 * 2 * 1 * 128 * 2
    assert s.num_experts == 128 and len(s.moe_layers) == 48


def test_fp8_kv_cache_llama31_70b():
    s = load_shape(model("llama3.1-70b"))
    assert s.kv_bytes_per_token("fp8") == 80 * 2 * 8 * 128 * 1 == 163_840
    assert s.kv_bytes_per_token("fp8", tp=4) == 80 * 2 * 2 * 128 * 1
    assert s.kv_bytes_per_token("auto") == 2 * 163_840


def test_hybrid_jamba_only_attention_layers_hold_kv():
    s = load_shape(model("jamba-v0.1"))
    # attn_layer_period 8, offset 4: layers 4, 12, 20, 28
    assert [i for i, k in enumerate(s.layer_kinds) if k == "full"] == [4, 12, 20, 28]
    assert s.kv_bytes_per_token() == 4 * 2 * 8 * 128 * 2


def test_layer_types_and_hybrid_pattern():
    cfg = {
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 512,
        "torch_dtype": "float16",
        "layer_types": [
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ],
    }
    s = shape_from_config(cfg)
    assert s.kv_bytes_per_token() == 1 * 2 * 2 * 64 * 2
    cfg2 = dict(cfg, layer_types=None, hybrid_override_pattern="M*M-")
    assert shape_from_config(cfg2).layer_kinds == ("none", "full", "none", "none")


def test_text_config_is_used_for_multimodal():
    cfg = {
        "model_type": "gemma3",
        "text_config": {
            "model_type": "gemma3_text",
            "num_hidden_layers": 6,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "hidden_size": 2560,
            "sliding_window": 1024,
            "sliding_window_pattern": 6,
        },
        "torch_dtype": "bfloat16",
    }
    s = shape_from_config(cfg)
    assert s.layer_kinds == ("sliding",) * 5 + ("full",)
    assert s.kv_bytes_per_token() == 6 * 2 * 4 * 256 * 2


def test_missing_and_malformed_configs(tmp_path):
    with pytest.raises(ModelConfigError, match="no config.json"):
        load_shape(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        load_shape(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ModelConfigError, match="num_hidden_layers"):
        load_shape(str(tmp_path))
