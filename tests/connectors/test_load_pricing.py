"""Priced object-tier lookups (``load_policy: cost``, kvtier.costs) through the scheduler side.

Why: a hit is worth loading only if it arrives before vLLM would have computed the same
tokens (issue 59). Driven like vLLM drives the scheduler, with fake steps and a clock of
the test's own: the estimates are fed by the steps and the fetch reports the side sees, a
lookup against a tier measured slower than the prefill asks it for nothing (counted), and
a fetch still running at its deadline lets the request go on with what landed. Each test
also runs under ``load_policy: always``, which must keep today's behaviour.
"""

from __future__ import annotations

import pytest

from kvtier import metrics
from kvtier.connectors.scheduler import SchedulerSide
from kvtier.costs import DEADLINE_SLACK_S, MIN_SAMPLES
from kvtier.stats import series_id
from tests.connectors.test_scheduler_side import (
    CHUNK,
    empty_step,
    make_side,
    report,
    request,
    schedule_new,
)

PROMPT = 4 * CHUNK + 10  # 4 full chunks, all loadable
#: what a measured prefill step takes per token: 0.1 s for 2,058 tokens
SPT = 0.1 / (8 * CHUNK + 10)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def priced_side(policy: str) -> tuple[SchedulerSide, Clock]:
    side = make_side("4MiB", {"remote_url": "file:///nonexistent", "write_policy": "none",
                              "load_policy": policy})  # fmt: skip
    clock = Clock()
    side.lookups.clock = clock
    return side, clock


def measure_prefill(side: SchedulerSide, clock: Clock) -> None:
    """Three prefill steps of 2,058 tokens, 0.1 s each from plan to report."""
    for i in range(MIN_SAMPLES):
        meta = schedule_new(side, request(f"prefill-{i}", 900 + i, 8 * CHUNK + 10), 0,
                            8 * CHUNK + 10)  # fmt: skip
        clock.t += 0.1
        report(side, meta)


def slow_hit(side: SchedulerSide, clock: Clock, prefix: int, seconds: float) -> None:
    """A lookup whose four chunks the tier sends in one report after ``seconds``."""
    req = request(f"warm-{prefix}", prefix, PROMPT)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    meta = empty_step(side)
    assert len(meta.fetches) == 1 and len(meta.fetches[0]) == 4
    clock.t += seconds
    report(side, meta)
    assert side.get_num_new_matched_tokens(req, 0) == (4 * CHUNK, False)
    side.request_finished(req, [])


@pytest.mark.parametrize("policy", ["cost", "always"])
def test_a_tier_slower_than_the_prefill_is_not_asked(policy: str) -> None:
    side, clock = priced_side(policy)
    measure_prefill(side, clock)
    for i in range(MIN_SAMPLES):  # 4 chunks in 10 s: 0.1 MB/s, against 0.05 s of compute
        slow_hit(side, clock, 10 + i, seconds=10.0)
    req = request("priced", 20, PROMPT)
    answer = side.get_num_new_matched_tokens(req, 0)
    declined = side.totals["loads_declined_tokens_remote_slower_than_prefill"]
    if policy == "always":
        assert answer == (None, False)
        assert len(empty_step(side).fetches) == 1
        assert declined == 0
        return
    # answered at once: vLLM computes the prompt, the tier is never asked
    assert answer == (0, False)
    assert empty_step(side).fetches == []
    assert declined == 4 * CHUNK
    assert side.totals["loads_declined_tokens_remote_queued"] == 0


@pytest.mark.parametrize("policy", ["cost", "always"])
def test_a_fast_tier_is_still_loaded_and_the_estimates_are_exported(policy: str) -> None:
    side, clock = priced_side(policy)
    measure_prefill(side, clock)
    for i in range(MIN_SAMPLES):  # 4 chunks in 10 ms
        slow_hit(side, clock, 10 + i, seconds=0.01)
    slow_hit(side, clock, 20, seconds=0.01)
    assert side.totals["loads_declined_tokens_remote_slower_than_prefill"] == 0
    gauges = side.get_stats()["gauges"]
    bps = gauges[series_id(metrics.TIER_READ_BPS, ("remote",))]
    assert bps == pytest.approx(4 * side.slot_bytes / 0.01)
    assert gauges[series_id(metrics.PREFILL_SPT)] == pytest.approx(SPT)


@pytest.mark.parametrize("policy", ["cost", "always"])
def test_at_the_deadline_the_request_goes_on_with_what_landed(policy: str) -> None:
    """The prefill measured, the tier not yet (the prior loads it all): the fetch's
    deadline is the recompute of its 1,024 tokens (~50 ms). Two chunks landed, two still
    fetching at 0.5 s: a partial hit, counted; the late chunks still land in the host tier.
    Under ``always`` the request waits on (up to lookup_timeout_ms, 2 s)."""
    side, clock = priced_side(policy)
    measure_prefill(side, clock)
    req = request("a", 7, PROMPT)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    deadline = side._reqs["a"].lookup.deadline_s
    if policy == "cost":
        assert deadline == pytest.approx(4 * CHUNK * SPT + DEADLINE_SLACK_S)
    else:
        assert deadline is None
    run = empty_step(side).fetches[0]
    clock.t += 0.01
    report(side, _only(run[:2]))
    assert side.get_num_new_matched_tokens(req, 0) == (None, False), "before the deadline"
    clock.t += 0.5
    answer = side.get_num_new_matched_tokens(req, 0)
    missed = side.totals["fetch_deadline_missed_remote"]
    if policy == "always":
        assert answer == (None, False)
        assert missed == 0
        return
    assert answer == (2 * CHUNK, False)
    assert missed == 1
    report(side, _only(run[2:]))  # late: into the host tier for the next request
    keys = side._reqs["a"].chunk_hashes
    assert all(side.index.is_ready(k) for k in keys)
    # the cut run taught the estimate that this tier is slow (a bound, not a sample of
    # the late reports)
    assert side.lookups.tier_costs.throughput.count(clock.t) == 1


def _only(ops):
    """A step's metadata carrying just these fetches (the rest still in flight)."""
    from kvtier.connectors.metadata import KVTierMetadata

    return KVTierMetadata(step=0, fetches=[list(ops)])
