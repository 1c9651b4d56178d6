"""The object tier's ghosts driven by vLLM's calls through the real scheduler side, with a
real bounded directory tier (``file_max_bytes``, swept by its own :class:`DirectorySweep`)
behind it: on a skewed workload the scale-1 ghost counts exactly the object tier's
measured hits (``hit_tokens{tier="remote"}``), written through or written back."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvtier import metrics
from kvtier.connectors.scheduler.side import SchedulerSide
from kvtier.stats import total_name
from kvtier.whatif.objects import ObjectGhostTiers
from tests.connectors.scheduler.test_scheduler_side import (
    CHUNK,
    empty_step,
    make_side,
    report,
    request,
    schedule_new,
)
from tests.whatif.test_object_ghosts import TOUCH, Clock, SweptDirectory
from tests.whatif.test_object_ghosts import _no_read_refresh as _no_read_refresh  # noqa: F401

SLOT = 64 * 1024  # make_side's slot: 2 layers x 4 KiB x 8 blocks
MAX_BYTES = 20 * SLOT  # 5 of the 12 documents; the host tier (1 MiB) holds 4


def whatif_remote(side: SchedulerSide) -> dict[str, int]:
    assert side.lookups.ghosts is not None
    side.lookups.ghosts.drain()  # what their thread has not applied yet
    return {
        s: side.totals[total_name(metrics.WHATIF_HIT_TOKENS, ("remote", s))]
        for s in metrics.WHATIF_SCALES
    }


def drive(side: SchedulerSide, tier: SweptDirectory, clock: Clock, n: int, seed: int = 3) -> None:
    """Zipf over 12 documents of 4 chunks; the workers' reads and writes go to ``tier``
    (a run's reads stop at its first missing chunk, as the workers' do)."""
    rng = random.Random(seed)
    weights = [1 / (d + 1) for d in range(12)]

    def settle(meta) -> None:
        results: dict[int, list[bool]] = {}
        for run in meta.fetches + meta.fetches_now:
            keys = [op.block_hash for op in run]
            end = tier.read_run(keys, 0, len(keys))
            results |= {op.op_id: [i < end] for i, op in enumerate(run)}
        for op in meta.stores:
            if op.upload_op_id is not None:  # write-through: uploaded once stored
                tier.put(op.block_hash)
                results[op.upload_op_id] = [True]
        report(side, meta, results=results)
        for op in meta.uploads:
            tier.put(op.block_hash)

    for i in range(n):
        clock.t += rng.choice((1.0, 30.0))
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


def bounded_side(root: Path, policy: str, max_bytes: int | None) -> tuple[SchedulerSide, Clock]:
    extra = {
        "remote_url": f"file://{root}",
        "write_policy": policy,
        # no first-hit check: this harness's workers do not compare KV (test_canary does)
        "canary_first_hit": False,
    }
    if max_bytes is not None:
        extra["file_max_bytes"] = max_bytes
    side = make_side("1MiB", extra)
    assert side.slot_bytes == SLOT and side.lookups.ghosts is not None
    assert side.lookups.ghosts.max_bytes == max_bytes  # what the scheduler reads of the config
    clock = Clock()
    # the same ghosts on the test's clock (the directory's mtimes are set from it)
    side.lookups.ghosts = ObjectGhostTiers(
        SLOT, max_bytes, side.stats, touch_after_s=TOUCH, clock=clock
    )
    return side, clock


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_scale_one_counts_the_measured_remote_hits(tmp_path: Path, policy: str) -> None:
    root = tmp_path / "tier"
    side, clock = bounded_side(root, policy, MAX_BYTES)
    tier = SweptDirectory(root, MAX_BYTES, clock, obj=SLOT)
    drive(side, tier, clock, 300)
    got = whatif_remote(side)
    remote = side.totals[total_name(metrics.HIT_TOKENS, ("remote",))]
    lookup = side.totals[total_name(metrics.LOOKUP_TOKENS)]
    assert remote > 0 and len(tier.keys()) < 12 * 4  # the bound evicted
    assert got["1"] == remote, (got, remote)
    assert got["0.5"] < got["1"] < got["8"] <= lookup, got
    # the host tier's own ghosts are not disturbed by the object tier's
    assert side.ghosts is not None
    side.ghosts.drain()  # what their thread has not applied yet
    host = side.totals[total_name(metrics.HIT_TOKENS, ("host",))]
    assert side.totals[total_name(metrics.WHATIF_HIT_TOKENS, ("host", "1"))] == host


def test_unbounded_object_tier(tmp_path: Path) -> None:
    """No bound: scale 1 and up are the tier itself, 0.5 half of what it holds."""
    root = tmp_path / "tier"
    side, clock = bounded_side(root, "write_through", None)
    tier = SweptDirectory(root, None, clock, obj=SLOT)
    drive(side, tier, clock, 200)
    got = whatif_remote(side)
    remote = side.totals[total_name(metrics.HIT_TOKENS, ("remote",))]
    assert remote > 0 and got["1"] == remote, (got, remote)
    assert got["0.5"] < got["1"] == got["2"] == got["8"], got


def test_whatif_false_or_no_object_tier_keeps_no_object_ghosts(tmp_path: Path) -> None:
    assert (
        make_side("1MiB", {"remote_url": f"file://{tmp_path}", "whatif": False}).lookups.ghosts
        is None
    )
    assert make_side("1MiB").lookups.ghosts is None
