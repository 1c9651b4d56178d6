"""The hand-off on drain (``write_policy: write_back``, issue 61), end to end in real vLLM
CPU engines.

Engine 1 keeps its chunks in its host tier only (``write_back``: the object tier is
written on eviction or drain, and its 64 MiB host tier never evicts here). It serves
three prompts, each then hit twice from kvtier's host tier (hot), and one prompt once
(stored, never hit), and drains: the hand-off writes the hot chunks the object tier
lacks, and only those, before the queue's flush. Engine 2, fresh, on the same directory
(no warm-up), hits the hot prompts' chunks in the object tier with vLLM's own outputs of
the same split; the cold prompt was never written and is computed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kit import chunk_files

from tests.e2e.conftest import run_engine

pytestmark = pytest.mark.e2e

ENV = {"KVTIER_TEST_SCENARIO_MODULES": "tests.e2e.warmup_scenarios,tests.e2e.handoff_scenarios"}
PREFIX, CHUNKS = 1024, 4  # each prompt's full chunks: 4 of 256 tokens
HOT, COLD = [71, 72, 73], [74]


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["tokens"], a["logprobs"]) == (b["tokens"], b["logprobs"])


def test_a_draining_engine_hands_its_hot_chunks_to_the_next(
    tiny_model: str, tmp_path: Path
) -> None:
    tier = tmp_path / "kv"
    extra = {"cpu_bytes": "64MiB", "remote_url": f"file://{tier}", "write_policy": "write_back"}
    one = run_engine(
        "leaving_replica",
        env=ENV,
        model=tiny_model,
        extra=extra,
        tier=str(tier),
        hot=HOT,
        cold=COLD,
        hits=2,
    )
    log = one["_log"]
    assert one["files_before"] == [], "write_back: nothing written before the drain"
    assert one["totals"]["hit_tokens_host"] == 2 * len(HOT) * PREFIX, one["totals"]
    for ref, hit in zip(one["refs"], one["served"][::2], strict=True):
        assert ref["cached"] == hit["cached"] == PREFIX and same(hit, ref), (hit, ref)
    hot_chunks = len(HOT) * CHUNKS
    assert one["listed"] == hot_chunks, one["listed"]
    assert one["handoff"] == {"chunks": hot_chunks, "written": hot_chunks, "failed": 0}
    assert f"handed off {hot_chunks} of {hot_chunks} hot chunks" in log, log[-4000:]
    # the hot chunks, not the cold prompt's: write_back writes nothing else at the drain
    assert len(chunk_files(tier)) == hot_chunks
    # recorded after vLLM's last stats pass (the worker's shutdown): never scraped, the
    # log line above is the report (docs/metrics.md)
    assert one["unreported"] == {"written": hot_chunks, "left": 0}, one["unreported"]

    two = run_engine(
        "warm_fleet", env=ENV, model=tiny_model, extra=extra, hot=HOT, cold=COLD, serve_hot=False
    )
    hot_served, cold_served = two["served"][: len(HOT)], two["served"][len(HOT) :]
    for out, ref in zip(hot_served, one["refs"], strict=True):
        assert (out["hit_host"], out["hit_remote"]) == (0, PREFIX), out
        assert out["cached"] == PREFIX and same(out, ref), (out, ref)
    [cold] = cold_served
    assert cold["hit_host"] == cold["hit_remote"] == 0 and cold["cached"] == 0, cold
    assert two["totals"]["fetch_ok"] == hot_chunks, two["totals"]
