"""A sliding-window model in a real engine (vLLM's CPU build) with kvtier.

Every layer of a tiny random-weight Mistral attends to the last 128 tokens, so vLLM
keeps one group of ``SlidingWindowSpec`` (its hybrid manager is off with kvtier) and
backs a hit's blocks outside the window with its null block; kvtier loads only the
blocks vLLM backs. The shared-prefix scenario then checks that a prefix kvtier serves
gives the tokens and top logprobs of the same prefix served by vLLM's own cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.conftest import run_engine

pytestmark = pytest.mark.e2e

WINDOW = 128


@pytest.fixture(scope="module")
def sliding_window_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama's tokenizer and a random-weight Mistral of the same size whose layers
    all use a 128-token sliding window. Built locally, nothing downloaded."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    from kvtier.cli.tinymodel import build_tiny_llama

    base = build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny4")
    out = tmp_path_factory.mktemp("tiny-swa")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base / name).exists():
            (out / name).write_bytes((base / name).read_bytes())
    config = MistralConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        sliding_window=WINDOW,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        initializer_range=0.08,
    )
    torch.manual_seed(0)
    MistralForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    assert json.loads((Path(out) / "config.json").read_text())["sliding_window"] == WINDOW
    return str(out)


def test_a_sliding_window_hit_loads_its_window_and_outputs_stay_exact(
    sliding_window_model: str,
) -> None:
    r = run_engine("shared_prefix", model=sliding_window_model, extra={"cpu_bytes": "256MiB"})
    assert r["b_ref"]["cached"] == 1024, "vLLM's own prefix cache should serve S"
    assert r["b"]["cached"] >= 1024, "kvtier should serve S after the flush"
    assert r["b"]["tokens"] == r["b_ref"]["tokens"]
    assert r["b"]["logprobs"] == r["b_ref"]["logprobs"]
    assert r["a2"]["tokens"] == r["a_ref"]["tokens"]
    assert r["a2"]["logprobs"] == r["a_ref"]["logprobs"]
    idx = r["index"]
    assert idx["refs"] == 0 and idx["invariants"] is True and idx["pending_ops"] == 0
