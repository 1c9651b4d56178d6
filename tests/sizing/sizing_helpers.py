"""Helpers for the planner tests: fixture paths and tiny safetensors checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MODELS = FIXTURES / "models"
LOGS = FIXTURES / "logs"

GiB = 1024**3
MiB = 1024**2


def model(name: str) -> str:
    return str(MODELS / name)


TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "vocab_size": 100,
    "torch_dtype": "float16",
    "tie_word_embeddings": False,
}


def tiny_llama_tensors(layers: int = 2) -> dict[str, np.ndarray]:
    """HF-named tensors of a 2-layer Llama: hidden 64, 4 heads x 16, 2 KV heads, MLP 96."""
    z = np.zeros
    t: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": z((100, 64), np.float16),
        "model.norm.weight": z((64,), np.float16),
        "lm_head.weight": z((100, 64), np.float16),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = z((64, 64), np.float16)
        t[p + "self_attn.k_proj.weight"] = z((32, 64), np.float16)
        t[p + "self_attn.v_proj.weight"] = z((32, 64), np.float16)
        t[p + "self_attn.o_proj.weight"] = z((64, 64), np.float16)
        t[p + "mlp.gate_proj.weight"] = z((96, 64), np.float16)
        t[p + "mlp.up_proj.weight"] = z((96, 64), np.float16)
        t[p + "mlp.down_proj.weight"] = z((64, 96), np.float16)
        t[p + "input_layernorm.weight"] = z((64,), np.float16)
        t[p + "post_attention_layernorm.weight"] = z((64,), np.float16)
    return t


def write_model(path: Path, config: dict, tensors: dict[str, np.ndarray], shards: int = 1) -> str:
    """A model directory with config.json and 1 or more safetensors shards (+ index)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return str(path)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(path / fname))
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(path)
