"""A hybrid model (full and sliding-window layers) in a real engine with kvtier.

vLLM's CPU build runs the hybrid KV cache manager (its platform supports it), and since
kvtier subclasses ``SupportsHMA`` vLLM keeps it on: a tiny random-weight Llama whose odd
layers slide over the last 128 tokens (``layer_types``, as Gemma 2/3, gpt-oss and newer
Mistral configs say it) gets a full-attention and a sliding-window KV cache group. kvtier
stores every block of the full group's chunks and the last 4 of 8 blocks of the sliding
group's (window 128, block 32), and a prefix it serves gives the tokens and top logprobs
of the same prefix served by vLLM's own cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.conftest import run_engine

pytestmark = pytest.mark.e2e

WINDOW = 128


def hybrid_model(base: Path, out: Path) -> str:
    """The tiny Llama (its weights and tokenizer) with layers 1 and 3 sliding-window."""
    for f in base.iterdir():
        if f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((out / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    cfg["layer_types"] = [
        "full_attention" if i % 2 == 0 else "sliding_attention" for i in range(layers)
    ]
    cfg["sliding_window"] = WINDOW
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvtier.cli.tinymodel import build_tiny_llama

    base = build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny4")
    return hybrid_model(base, tmp_path_factory.mktemp("tiny-hybrid"))


def test_a_hybrid_models_prefix_from_kvtier_equals_vllms_own(model: str) -> None:
    r = run_engine("shared_prefix", model=model, extra={"cpu_bytes": "256MiB"})
    log = r["_log"]
    assert "Turning off hybrid kv cache manager" not in log, "vLLM turned its HMA off"
    assert "kv cache group sizes (32, 32)" in log, "not two KV cache groups"
    assert r["b_ref"]["cached"] == 1024, "vLLM's own prefix cache should serve S"
    assert r["b"]["cached"] >= 1024, "kvtier should serve S after the flush"
    assert r["b_hit_tokens"] == 1024
    assert r["b"]["tokens"] == r["b_ref"]["tokens"]
    assert r["b"]["logprobs"] == r["b_ref"]["logprobs"]
    assert r["a2"]["tokens"] == r["a_ref"]["tokens"]
    assert r["a2"]["logprobs"] == r["a_ref"]["logprobs"]
    idx = r["index"]
    assert idx["refs"] == 0 and idx["invariants"] is True and idx["pending_ops"] == 0
    totals = idx["totals"]
    assert totals["store_failed"] == 0 and totals["load_failed"] == 0
    assert totals["load_ok"] >= 4 + 5
