"""A hung object tier (every call blocks for good) in a real engine: lookups pay the
lookup deadline only until the tier is marked down, then miss at once; nothing grows;
the shutdown flush says what became of every upload."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import run_engine

pytestmark = pytest.mark.e2e

TIMEOUT_MS = 400


def test_a_hung_tier_costs_one_lookup_deadline_per_read_thread_then_nothing(
    tiny_model: str, tmp_path: Path
) -> None:
    extra = {
        "cpu_bytes": "64MiB",
        "remote_url": f"file://{tmp_path / 'tier'}",
        "lookup_timeout_ms": TIMEOUT_MS,
        "io_threads": 4,  # two read threads, two write threads
        "shutdown_flush_s": 0.5,
        # a hung NFS mount: not a local filesystem, so every read is on the I/O threads
        # (inline reads would hold the engine's step on the hung call)
        "inline_read_ms": 0,
    }
    n = 10
    r = run_engine(
        "hung_tier",
        env={"KVTIER_TEST_SCENARIO_MODULES": "tests.e2e.hung_scenarios"},
        model=tiny_model,
        extra=extra,
        n_prompts=n,
    )
    during, delays = r["during"], r["delays"]
    read_threads = during["read_threads"]
    assert read_threads == 2
    # each of n prompts looked past the host tier; only reads that got a thread waited the
    # deadline (one per read thread); then the tier was down and lookups missed at once
    waited = [d for d in delays if d >= 0.9 * TIMEOUT_MS / 1000]
    assert len(waited) <= read_threads, delays
    assert all(d < 5 * TIMEOUT_MS / 1000 for d in delays), delays  # (a busy step beside)
    # nothing grew while it hung: one stuck read per read thread (each stuck in its one
    # backend call: the read, or on a local directory the stat before it), no new threads
    assert r["calls"]["on_read_threads"] == during["stuck_reads"] <= read_threads, r
    assert during["reads_out"] <= read_threads and during["threads_grew"] == 0, during
    assert during["counters"]["reads_stuck"] == during["stuck_reads"]
    # every upload pending at shutdown is accounted for, with why it was not written
    flush = r["flush"]
    assert flush is not None and flush["written"] == 0, flush
    assert flush["pending"] == sum(flush["failed"].values()) + flush["queued"] + flush["writing"]
    assert flush["pending"] >= 1 and "still in a backend call" in r["_log"], flush
    print(
        f"\nhung tier: lookup waits {[round(d, 3) for d in delays]} s, "
        f"prompt times {[round(s, 2) for s in r['seconds']]} s, flush: {flush['text']}"
    )
