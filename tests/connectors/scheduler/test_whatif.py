"""The scheduler side's ghost tiers, driven by vLLM's calls: on a skewed workload the
scale-1 ghost counts exactly the host tier's measured hits (host only, and with an
object tier behind it written through or written back), larger ghosts never count less,
and ``whatif: false`` counts nothing."""

from __future__ import annotations

import random

import pytest

from kvtier import metrics
from kvtier.connectors.scheduler.side import SchedulerSide
from kvtier.stats import total_name
from tests.connectors.scheduler.test_scheduler_side import (
    CHUNK,
    empty_step,
    make_side,
    report,
    request,
    schedule_new,
)


def whatif(side: SchedulerSide) -> dict[str, int]:
    if side.ghosts is not None:
        side.ghosts.drain()  # what their thread has not applied yet
    return {
        s: side.totals[total_name(metrics.WHATIF_HIT_TOKENS, ("host", s))]
        for s in metrics.WHATIF_SCALES
    }


def drive(side: SchedulerSide, n_requests: int, seed: int = 1) -> None:
    """Zipf over 12 documents of 4 chunks; an object tier that holds what was uploaded."""
    rng = random.Random(seed)
    weights = [1 / (d + 1) for d in range(12)]
    remote: set[bytes] = set()

    def settle(meta) -> None:
        fetches = [op for run in meta.fetches + meta.fetches_now for op in run]
        report(side, meta, results={op.op_id: [op.block_hash in remote] for op in fetches})
        remote.update(op.block_hash for op in meta.uploads)

    for i in range(n_requests):
        doc = rng.choices(range(12), weights)[0]
        req = request(f"r{i}", doc, 4 * CHUNK + 10)
        while (offered := side.get_num_new_matched_tokens(req, 0)[0]) is None:
            settle(empty_step(side))
        side._kv_cache_manager.blocks[req.request_id] = list(range(100, 100 + 4 * 8 + 1))
        side.update_state_after_alloc(req, None, offered)
        settle(schedule_new(side, req, offered, req.num_tokens - offered))
        side.request_finished(req, [])
    for _ in range(3):
        settle(empty_step(side))
    side.index.check()


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"remote_url": "file:///nonexistent", "write_policy": "write_through"},
        {"remote_url": "file:///nonexistent", "write_policy": "write_back"},
        # canary requests get no hit from the real tier, and so none from the ghosts
        {"remote_url": "file:///nonexistent", "write_policy": "write_through", "canary_rate": 0.3},
    ],
    ids=["host_only", "write_through", "write_back", "canary_rate"],
)
def test_scale_one_counts_the_measured_host_hits(extra: dict) -> None:
    side = make_side("1MiB", extra)  # 16 slots of 64 KiB: 4 of the 12 documents
    drive(side, 300)
    got = whatif(side)
    host = side.totals[total_name(metrics.HIT_TOKENS, ("host",))]
    # the tier was too small: it evicted, or (uploads holding its slots) skipped stores
    assert host > 0 and side.index.evictions + side.totals["stores_skipped"] > 0
    assert got["1"] == host, (got, host)
    if not extra:  # stores and loads only: more slots never serve less
        assert list(got.values()) == sorted(got.values()) and got["8"] > got["1"], got
        assert got["8"] <= side.totals[total_name(metrics.LOOKUP_TOKENS)]


def test_whatif_false_keeps_no_ghosts() -> None:
    side = make_side("1MiB", {"whatif": False})
    assert side.index.ghost_events is None and side.ghosts is None
    drive(side, 50)
    assert set(whatif(side).values()) == {0}
    assert side.totals[total_name(metrics.HIT_TOKENS, ("host",))] > 0


def test_ghosts_predict_the_hits_of_tiers_of_other_sizes() -> None:
    """The same skewed workload on tiers of half and twice the size: what the 1 MiB
    tier's ghosts of scale 0.5 and 2 counted is what those tiers measured, within 1 and
    3 points of the looked-up tokens (the ghosts are LRU caches fed the same chunks;
    the real tier passes over busy chunks, the ghosts do not)."""
    sides = {size: make_side(size, {}) for size in ("512KiB", "1MiB", "2MiB")}
    for side in sides.values():
        drive(side, 300)
    lookup = sides["1MiB"].totals[total_name(metrics.LOOKUP_TOKENS)]
    ghosts = whatif(sides["1MiB"])
    measured = {
        size: side.totals[total_name(metrics.HIT_TOKENS, ("host",))] / lookup
        for size, side in sides.items()
    }
    assert all(s.totals[total_name(metrics.LOOKUP_TOKENS)] == lookup for s in sides.values())
    print({s: round(v, 3) for s, v in measured.items()}, ghosts, lookup)
    assert abs(ghosts["2"] / lookup - measured["2MiB"]) <= 0.01, (ghosts, measured)
    assert abs(ghosts["0.5"] / lookup - measured["512KiB"]) <= 0.03, (ghosts, measured)
    assert measured["512KiB"] < measured["1MiB"] < measured["2MiB"]
