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
from kvtier.connectors.scheduler.side import SchedulerSide
from kvtier.costs import MIN_SAMPLES
from kvtier.stats import series_id
from tests.connectors.scheduler.test_scheduler_side import (
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
    side = make_side(
        "4MiB", {"remote_url": "file:///nonexistent", "write_policy": "none", "load_policy": policy}
    )
    clock = Clock()
    side.lookups.clock = clock
    return side, clock


def measure_prefill(side: SchedulerSide, clock: Clock) -> None:
    """Three prefill steps of 2,058 tokens, 0.1 s each from plan to report."""
    for i in range(MIN_SAMPLES):
        meta = schedule_new(
            side, request(f"prefill-{i}", 900 + i, 8 * CHUNK + 10), 0, 8 * CHUNK + 10
        )
        clock.t += 0.1
        report(side, meta)


def slow_hit(side: SchedulerSide, clock: Clock, prefix: int, seconds: float) -> None:
    """A lookup whose four chunks the tier sends one per report, ``seconds`` apart."""
    req = request(f"warm-{prefix}", prefix, PROMPT)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    run = empty_step(side).fetches[0]
    assert len(run) == 4
    for op in run:
        clock.t += seconds
        report(side, _only([op]))
    assert side.get_num_new_matched_tokens(req, 0) == (4 * CHUNK, False)
    side.request_finished(req, [])


@pytest.mark.parametrize("policy", ["cost", "always"])
def test_a_tier_slower_than_the_prefill_is_not_asked(
    policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("WARNING", logger="kvtier.scheduler")
    side, clock = priced_side(policy)
    measure_prefill(side, clock)
    for i in range(MIN_SAMPLES):  # 64 KiB per 2.5 s, against 0.05 s of compute for 1,024
        slow_hit(side, clock, 10 + i, seconds=2.5)
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
    side.update_state_after_alloc(req, None, 0)  # misses of their own reason, not "absent"
    assert side.totals["miss_tokens_declined"] == 4 * CHUNK
    assert side.totals["miss_tokens_absent"] == 0
    # said once (not per lookup), with the figures an operator needs
    warned = [r.getMessage() for r in caplog.records if "slower than computing" in r.getMessage()]
    assert len(warned) == 1 and "25.60 KiB/s" in warned[0], warned
    assert side.get_num_new_matched_tokens(request("again", 21, PROMPT), 0) == (0, False)
    assert len([r for r in caplog.records if "slower than computing" in r.getMessage()]) == 1


@pytest.mark.parametrize("policy", ["cost", "always"])
def test_a_fast_tier_is_still_loaded_and_the_estimates_are_exported(policy: str) -> None:
    side, clock = priced_side(policy)
    measure_prefill(side, clock)
    for i in range(MIN_SAMPLES):  # a chunk every 2.5 ms
        slow_hit(side, clock, 10 + i, seconds=0.0025)
    slow_hit(side, clock, 20, seconds=0.0025)
    assert side.totals["loads_declined_tokens_remote_slower_than_prefill"] == 0
    stats = side.get_stats()
    gauges = stats["gauges"]
    bps = gauges[series_id(metrics.TIER_READ_BPS, ("remote",))]
    assert bps == pytest.approx(side.slot_bytes / 0.0025)
    assert gauges[series_id(metrics.PREFILL_SPT)] == pytest.approx(SPT)
    # the cost model beside what happened: only the lookup priced with a measured tier
    # (the first three ran on the prior), its four chunks predicted and landing in 10 ms
    fetch = {
        v: stats["samples"].get(series_id(metrics.PRICED_FETCH_SECONDS, ("remote", v)))
        for v in ("predicted", "measured")
    }
    if policy == "always":
        assert fetch == {"predicted": None, "measured": None}
        return
    assert fetch["measured"] == [pytest.approx(4 * 0.0025)], fetch
    assert fetch["predicted"] == [pytest.approx(4 * 0.0025, rel=0.2)], fetch


@pytest.mark.parametrize("policy", ["cost", "always"])
def test_at_the_deadline_the_request_goes_on_with_what_landed(policy: str) -> None:
    """The prefill measured, the tier not yet (the prior loads it all): the fetch's
    deadline is the recompute of its 1,024 tokens (~50 ms). Two chunks landed, two still
    fetching at 0.5 s and after the next step's reports: a partial hit, counted; the late
    chunks still land in the host tier.
    Under ``always`` the request waits on (up to lookup_timeout_ms, 2 s)."""
    side, clock = priced_side(policy)
    measure_prefill(side, clock)
    req = request("a", 7, PROMPT)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    deadline = side._reqs["a"].lookup.deadline_s
    if policy == "cost":
        assert deadline == pytest.approx(4 * CHUNK * SPT)
    else:
        assert deadline is None
    run = empty_step(side).fetches[0]
    clock.t += 0.01
    report(side, _only(run[:2]))
    assert side.get_num_new_matched_tokens(req, 0) == (None, False), "before the deadline"
    clock.t += 0.5
    answer = side.get_num_new_matched_tokens(req, 0)
    if policy == "cost":
        # past the deadline: one more step, whose reports may still say the chunks landed
        assert answer == (None, False)
        assert side.totals["fetch_deadline_missed_remote"] == 0
        assert side.get_num_new_matched_tokens(req, 0) == (None, False), "the same step"
        report(side, empty_step(side))
        answer = side.get_num_new_matched_tokens(req, 0)
    missed = side.totals["fetch_deadline_missed_remote"]
    if policy == "always":
        assert answer == (None, False)
        assert missed == 0
        return
    assert answer == (2 * CHUNK, False)
    assert missed == 1
    side._kv_cache_manager.blocks["a"] = list(range(100, 100 + 4 * 8 + 1))
    side.update_state_after_alloc(req, None, 2 * CHUNK)
    assert side.totals["miss_tokens_fetching"] == 2 * CHUNK
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


def test_a_one_step_lookup_is_priced_and_its_reads_bounded_by_the_deadline(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local directory tier under ``kv_load_failure_policy: recompute``: the stored run is
    answered in the lookup's own step, its reads bounded by the priced deadline (the
    step's ``fetches_now_s``); once the tier is measured slower than the prefill, the same
    lookup answers 0 at once, its tokens counted as declined."""
    from kvtier.config import KVTierConfig
    from tests.connectors.test_one_step_lookups import keys_of, prompt_on, side_on

    monkeypatch.setitem(KVTierConfig.__init__.__kwdefaults__, "load_policy", "cost")
    side = side_on(tmp_path)
    side.set_worker_keys([keys_of()])
    assert side.lookups.probe is not None and side.lookups.priced
    clock = Clock()
    side.lookups.clock = clock
    measure_prefill(side, clock)
    req, _ = prompt_on(side, tmp_path, PROMPT, {keys_of(): 3})
    assert side.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, False)  # the prior: load
    side._kv_cache_manager.blocks["a"] = list(range(100, 100 + 4 * 8 + 1))
    side.update_state_after_alloc(req, None, 3 * CHUNK)
    meta = schedule_new(side, req, 3 * CHUNK, PROMPT - 3 * CHUNK)
    assert len(meta.fetches_now) == 1
    assert meta.fetches_now_s == pytest.approx(3 * CHUNK * SPT)
    report(side, meta)
    side.request_finished(req, [])
    assert empty_step(side).fetches_now_s == 0.0, "a step without one-step reads: no bound"

    for _ in range(MIN_SAMPLES):  # the tier measured: 0.1 MB/s
        side.lookups.tier_costs.observe(latency_s=0.0, nbytes=100_000, seconds=1.0, now=clock.t)
    side.index.clear()
    req = request("b", 1, PROMPT)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.totals["loads_declined_tokens_remote_slower_than_prefill"] == 3 * CHUNK
    assert side.index.used_slots == 0, "nothing claimed"


def test_the_worker_reads_one_step_runs_until_the_steps_deadline(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fetches_now_s`` bounds the reads before the step's loads (the worker's own bound,
    lookup_timeout_ms, when it is 0 or longer); the lookups' plain runs keep theirs."""
    import kvtier.connectors.worker.side as worker_mod
    from kvtier.connectors.metadata import FetchOp
    from tests.connectors.worker.test_worker_side import _pp_worker, step_meta

    w, _caches, _results = _pp_worker(tmp_path / "kv", 0, seed=1, layer_offset=0)
    assert w.fetch_now_s == 2.0
    bounds: list[float] = []
    monkeypatch.setattr(w, "_fetch_run", lambda slab, run, until: bounds.append(until))
    monkeypatch.setattr(worker_mod.time, "monotonic", lambda: 100.0)
    for step, priced in enumerate((0.25, 0.0, 5.0), 1):
        meta = step_meta(step, w.layout.slot_bytes)
        meta.fetches_now = [[FetchOp(10 * step, 0, b"\x01" * 32)]]
        meta.fetches_now_s = priced
        w.begin_step(meta)
    assert bounds == [100.25, 102.0, 102.0]
    w.shutdown()


def test_a_steps_tokens_are_vllms_total_for_it() -> None:
    """vLLM's SchedulerOutput says how many tokens the step scheduled
    (``total_num_scheduled_tokens``): the prefill's sample is the step's time over it."""
    from types import SimpleNamespace

    side, clock = priced_side("cost")
    for _ in range(MIN_SAMPLES):
        so = SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={},
            scheduled_spec_decode_tokens={},
            total_num_scheduled_tokens=1000,
        )
        meta = side.build_connector_meta(so)
        clock.t += 0.1
        report(side, meta)
    assert side.lookups.prefill.seconds_per_token(clock.t) == pytest.approx(0.1 / 1000)
