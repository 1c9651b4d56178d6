"""The host tier inside a real vLLM engine (CPU build)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import run_engine

pytestmark = pytest.mark.e2e


def test_shared_prefix_hits_and_exact_outputs(tiny_model: str) -> None:
    r = run_engine("shared_prefix", model=tiny_model, extra={"cpu_bytes": "256MiB"})
    assert r["a"]["cached"] == 0
    assert r["b_ref"]["cached"] == 1024, "vLLM's own prefix cache should serve S"
    # after reset_prefix_cache(), only kvtier can supply S
    assert r["b"]["cached"] >= 1024
    assert r["b_hit_tokens"] == r["b"]["cached"], "kvtier's counters agree with vLLM's"
    assert r["b_lookup_tokens"] >= r["b_hit_tokens"]
    assert r["b"]["tokens"] == r["b_ref"]["tokens"]
    assert r["b"]["logprobs"] == r["b_ref"]["logprobs"]
    # A = S + U1 (1,281 tokens): five full chunks were stored when A ran
    assert r["a2"]["cached"] >= 1280
    assert r["a2"]["tokens"] == r["a_ref"]["tokens"]
    assert r["a2"]["logprobs"] == r["a_ref"]["logprobs"]
    assert r["a2"]["tokens"] == r["a"]["tokens"]
    idx = r["index"]
    assert idx["refs"] == 0 and idx["invariants"] is True and idx["pending_ops"] == 0


def test_eviction_keeps_outputs_exact_and_leaks_nothing(tiny_model: str) -> None:
    # 4 layers x 2 x 2 kv heads x 64 x bf16 x 256 tokens = 512 KiB a chunk: 6 slots for
    # 5 prompts x 4 chunks each
    r = run_engine("eviction", model=tiny_model, extra={"cpu_bytes": "3MiB"})
    idx = r["index"]
    assert idx["num_slots"] == 6
    # cold runs compute every token, warm runs load part of the prompt: the same math
    # split differently, so bf16 logprobs may move in the last digit, tokens may not: one
    # bf16 step at |logprob| in [4, 8) is 2**-5 = 0.031 (wrong KV moves them by far more)
    assert r["tokens_identical"], (r["warm_cached"], r["cold_cached"])
    assert r["max_logprob_diff"] <= 0.05, r["max_logprob_diff"]
    assert idx["totals"]["evictions"] > 0
    # every prompt's second run hits its own freshly stored chunks
    assert all(c >= 1024 for c in r["warm_cached"][1::2]), r["warm_cached"]
    assert idx["refs"] == 0 and idx["invariants"] is True
    assert idx["pending_ops"] == 0 and idx["open_requests"] == 0


def test_hits_into_a_cycled_pool_load_descending_runs_exactly(tiny_model: str) -> None:
    """Once vLLM's block pool has cycled, a chunk's blocks come in descending runs; the
    CPU copier copies them as slices (not one index copy), to the same outputs."""
    r = run_engine("cycled_pool", model=tiny_model, extra={"cpu_bytes": "64MiB"})
    assert r["cold_cached"] == [0] * 6, r["cold_cached"]
    assert all(c >= 1024 for c in r["warm_cached"]), r["warm_cached"]
    assert r["tokens_identical"], r
    assert r["max_logprob_diff"] <= 0.05, r["max_logprob_diff"]
    loads = r["load_copies"]
    assert loads.get("descending", 0) > 0 and "index copy" not in loads, loads
    assert r["store_copies"].get("descending", 0) > 0, r["store_copies"]
    # each load's and store's blocks, read back in the engine, hold its slot's bytes
    copies = sum(loads.values()) + sum(r["store_copies"].values())
    assert r["copies_checked"]["copies"] >= copies, r["copies_checked"]
    assert r["copies_checked"]["wrong"] == 0, r["copies_checked"]
    idx = r["index"]
    assert idx["refs"] == 0 and idx["invariants"] is True and idx["pending_ops"] == 0


def test_preemption_and_abort_leak_nothing(tiny_model: str) -> None:
    r = run_engine("preempt_abort", model=tiny_model, extra={"cpu_bytes": "64MiB"})
    assert r["preemptions"] > 0, "the device cache was meant to be too small for the batch"
    assert r["tokens_identical"], r
    assert r["max_logprob_diff"] <= 0.001
    idx = r["index"]
    assert idx["refs"] == 0 and idx["invariants"] is True
    assert idx["pending_ops"] == 0 and idx["open_requests"] == 0


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"cpu_bytes": "256MiB", "chunk_sise": 256}, "chunk_sise"),
        ({"cpu_bytes": "256MiB", "chunk_size": 100}, "chunk_size"),
        ({"cpu_bytes": "lots"}, "cpu_bytes"),
    ],
)
def test_config_error_stops_startup(tiny_model: str, extra: dict, key: str) -> None:
    r = run_engine("start_only", model=tiny_model, extra=extra)
    assert r["started"] is False
    # refused as vLLM builds its config (kvtier.connectors.startup), before any engine
    # process: pydantic reports kvtier's ConfigError as a "Value error" of VllmConfig
    if key == "chunk_sise":  # a key kvtier does not know: named, with the nearest one
        assert (
            "kvtier config: unknown key 'chunk_sise': did you mean 'chunk_size'?" in r["error"]
        ), r["error"]
    else:
        assert f"kvtier config {key!r}" in r["error"], r["error"]
