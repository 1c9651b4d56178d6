"""``bench/scheduler_cost.py --quick``: the output is well formed and its numbers are real.

Runs the benchmark in a subprocess (vLLM's real Scheduler, no model) and checks
what the timings rest on, never the timings themselves: the schedulers ran the
phases they claim (decode steps complete no chunk, prefill steps do), kvtier's
index held the number of chunks asked for, stores happened and made metadata,
and the lookups found what was put there (hit, half, nothing).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROMPT = 32 * 1024
BLOCK = 32


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """The JSON results and the printed tables."""
    out = tmp_path_factory.mktemp("sched") / "scheduler.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "scheduler_cost.py"),
            "--quick",
            "--no-progress",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kvtier ÷ vLLM" in proc.stdout  # the table was printed
    return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def result(run: tuple[dict, str]) -> dict:
    return run[0]


def test_steps_are_well_formed(result: dict) -> None:
    steps = result["steps"]
    cases = {(r["running_requests"], r["index_chunks"]) for r in steps}
    assert len(cases) >= 2
    for case in cases:
        phases = sorted(
            r["phase"] for r in steps if (r["running_requests"], r["index_chunks"]) == case
        )
        assert phases == ["decode", "prefill"], case
    for r in steps:
        for key in ("vllm_step_us", "kvtier_step_us", "kvtier_ratio"):
            assert isinstance(r[key], int | float) and r[key] > 0, (key, r)
        assert r["kvtier_ratio"] == pytest.approx(r["kvtier_step_us"] / r["vllm_step_us"], rel=0.01)
        assert r["steps"] > 0
        # every running request was scheduled (nothing preempted or left waiting)
        assert r["scheduled_requests"] >= r["running_requests"]


def test_index_holds_the_requested_chunks(result: dict) -> None:
    for r in result["steps"]:
        # the tier is full at the requested size and stays there: each store evicts one
        assert r["kvtier_index_chunks_after"] == r["index_chunks"], r
    for r in result["lookups"]:
        assert r["index_chunks_actual"] == r["index_chunks"], r


def test_phases_do_what_they_say(result: dict) -> None:
    for r in result["steps"]:
        if r["phase"] == "decode":
            assert r["steps_completing_chunks"] == 0, r
            assert r["kvtier_stores"] == 0, r
        else:
            assert r["steps_completing_chunks"] == r["steps"], r
            # 8k-token budget, 256-token chunks: a prefill step completes many chunks
            assert r["kvtier_stores"] >= r["steps"] * 4, r
            decode = next(
                d
                for d in result["steps"]
                if d["phase"] == "decode"
                and d["running_requests"] == r["running_requests"]
                and d["index_chunks"] == r["index_chunks"]
            )
            # stores travel to the workers: the metadata carries them
            assert r["kvtier_meta_bytes_median"] > decode["kvtier_meta_bytes_median"] + 200, r
            assert r["kvtier_loads"] == 0  # unique prompts: nothing to load


def test_lookups_find_what_was_stored(result: dict) -> None:
    kv = [r for r in result["lookups"] if r["connector"] == "kvtier"]
    assert {r["outcome"] for r in kv} == {"hit", "partial", "miss"}
    for r in kv:
        assert r["prompt_tokens"] == PROMPT
        assert 0 < r["p50_us"] <= r["p99_us"]
        expected = {"hit": PROMPT - BLOCK, "partial": PROMPT // 2, "miss": 0}[r["outcome"]]
        assert r["matched_tokens"] == expected, r


def test_memory_per_chunk_is_measured(run: tuple[dict, str]) -> None:
    result, printed = run
    kv = [r for r in result["memory"] if r["connector"] == "kvtier"]
    assert kv and kv[0]["index_chunks"] > 0
    # an entry, its key and its hash cannot take less than ~100 bytes of Python heap
    assert 100 < kv[0]["heap_bytes_per_chunk"] < 10_000, kv
    # the index's entries are kept out of the garbage collector's lists: after vLLM's
    # start-up freeze, filling it leaves the collector nothing per chunk to walk
    assert kv[0]["gc_tracked_per_chunk"] < 0.05, kv
    # so a full collection (the median of three, in ms) walks next to nothing
    assert isinstance(kv[0]["full_gc_ms"], float) and kv[0]["full_gc_ms"] < 100, kv
    # and the table prints each connector's figures as measured
    for r in result["memory"]:
        row = (
            f"| {r['connector']} | {r['index_chunks']:,} | {r['bytes_per_chunk']:.0f} | "
            f"{r['heap_bytes_per_chunk']:.0f} | {r['gc_tracked_per_chunk']:.2f} | "
            f"{r['full_gc_ms']:.1f} |"
        )
        assert row in printed.splitlines(), (row, printed[-1500:])


def test_the_worker_side_is_measured_in_steps_where_nothing_moves(result: dict) -> None:
    rows = {r["layers"]: r for r in result["worker"]}
    assert set(rows) == {32, 80}, rows
    for r in rows.values():
        # the facade ran every per-step hook over every layer; the metadata it unpickled
        # is a step's with no ops (what the scheduler sends on a decode step)
        assert r["steps"] >= 10 and 0 < r["worker_step_us"] <= r["worker_step_p99_us"]
        assert 50 < r["meta_bytes"] < 500, r


def test_pricing_is_measured_beside_unpriced_lookups(run: tuple[dict, str]) -> None:
    result, printed = run
    rows = result["pricing"]
    sizes = {r["index_chunks"] for r in result["lookups"]}
    assert {r["index_chunks"] for r in rows} == sizes
    for n in sizes:
        whats = {r["what"]: r for r in rows if r["index_chunks"] == n}
        assert set(whats) == {
            "a 32k-token lookup, load_policy always",
            "a 32k-token lookup, load_policy cost",
            "a step's prefill sample (StepTimes), either policy",
        }, whats
        for r in whats.values():
            assert r["samples"] > 0 and 0 < r["p50_us"] <= r["p99_us"], r
        # the priced lookup's cost is paired with the unpriced one, request by request
        assert isinstance(
            whats["a 32k-token lookup, load_policy cost"]["added_us_paired_median"], float
        )
    assert "| pricing: index chunks |" in printed
