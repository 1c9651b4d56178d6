"""kvtier.costs: the estimates of a tier's reads and of the prefill, and the price of a load.

Why: a hit is worth loading only if its bytes arrive before vLLM would have computed the
same tokens (issue 59). These pin the arithmetic with an injected clock: which prefix a
lookup loads, the deadline it gets, what the prior does before anything is measured, and
that one outlier cannot swing an estimate.
"""

from __future__ import annotations

import pytest

from kvtier.costs import (
    MAX_AGE_S,
    MIN_MARGINAL_SHARE,
    MIN_SAMPLES,
    STALL_FACTOR,
    STALL_FLOOR,
    STALL_MIN_STEPS,
    WINDOW,
    FetchTimes,
    PrefillCosts,
    StepTimes,
    TierCosts,
    WindowedMedian,
    price_load,
)

MB = 1_000_000


def tier_of(latency_s: float, bps: float, now: float = 0.0) -> TierCosts:
    tier = TierCosts()
    for _ in range(MIN_SAMPLES):
        tier.observe(latency_s=latency_s, nbytes=int(bps), seconds=1.0, now=now)
    return tier


def prefill_of(
    spt: float, now: float = 0.0, tokens: int = 2048, step_s: float | None = None
) -> PrefillCosts:
    """A prefill measured at ``spt`` per token, no fixed cost; with ``step_s``, most of its
    steps (empty ones: a lookup's waits) took that long."""
    prefill = PrefillCosts(256)
    for _ in range(MIN_SAMPLES):
        prefill.observe_step(spt * tokens, tokens, now)
    for _ in range(2 * MIN_SAMPLES if step_s is not None else 0):
        prefill.observe_step(step_s, 0, now)
    return prefill


def test_a_median_needs_its_samples_and_one_outlier_does_not_move_it() -> None:
    m = WindowedMedian()
    for i in range(MIN_SAMPLES - 1):
        m.add(1.0, float(i))
    assert m.value(10.0) is None, "the prior holds until MIN_SAMPLES are in"
    m.add(1.0, 10.0)
    assert m.value(10.0) == 1.0
    m.add(1000.0, 11.0)  # one fetch that stalled
    assert m.value(11.0) == 1.0
    for i in range(WINDOW):  # the tier really got slower: the window follows it
        m.add(5.0, 12.0 + i)
    assert m.value(40.0) == 5.0


def test_old_samples_stop_counting() -> None:
    m = WindowedMedian()
    for _ in range(MIN_SAMPLES):
        m.add(2.0, 0.0)
    assert m.value(MAX_AGE_S) == 2.0
    assert m.value(MAX_AGE_S + 1) is None and m.count(MAX_AGE_S + 1) == 0


def test_a_fetch_costs_latency_plus_bytes_plus_the_bytes_in_flight_ahead() -> None:
    tier = tier_of(0.05, 100 * MB)
    assert tier.fetch_seconds(200 * MB, 0.0) == pytest.approx(2.05)
    tier.planned(1, 100 * MB, 0.0)
    assert tier.fetch_seconds(200 * MB, 0.0) == pytest.approx(3.05)
    assert tier.fetch_seconds(200 * MB, 0.0, queued=False) == pytest.approx(2.05)
    tier.settled(1)
    assert tier.inflight_bytes(0.0) == 0
    tier.planned(2, 100 * MB, 0.0)  # never reported (a read stuck in its backend call)
    assert tier.inflight_bytes(MAX_AGE_S + 1) == 0
    assert TierCosts().fetch_seconds(1, 0.0) is None


def test_prefill_counts_steps_of_at_least_a_chunk_from_plan_to_report() -> None:
    prefill = PrefillCosts(256)
    steps = StepTimes(prefill, keep=4)
    for step in range(1, 4):
        steps.began(step, 2048, now=float(step))
        steps.began(100 + step, 0, now=float(step))  # an empty step: how often reports come
        steps.reported(step, now=step + 0.5)
        steps.reported(100 + step, now=step + 0.002)
    assert steps.last == 103
    assert prefill.seconds_per_token(10.0) == pytest.approx(0.5 / 2048)
    assert prefill.fixed_seconds(10.0) == 0.0, "no step of a few tokens yet"
    assert prefill.step_seconds(10.0) == pytest.approx((0.5 + 0.002) / 2)
    for step in range(10, 20):  # never reported: at most `keep` wait
        steps.began(step, 2048, now=0.0)
    assert len(steps._began) == 4


def test_only_the_per_token_part_of_a_step_is_what_a_load_saves() -> None:
    """A hit's request still takes a step for its last tokens, so a step's fixed cost is
    paid either way: steps of a few tokens measure it and it comes off the prefill steps.
    A fixed cost measured on busy decode steps cannot make recomputing look free."""
    prefill = prefill_of(0.04 / 2048)  # 40 ms per 2,048-token step
    assert prefill.seconds_per_token(0.0) == pytest.approx(0.04 / 2048)
    for _ in range(MIN_SAMPLES):
        prefill.observe_step(0.008, 32, 0.0)  # a hit's last step: 32 tokens in 8 ms
    assert prefill.fixed_seconds(0.0) == pytest.approx(0.008)
    assert prefill.seconds_per_token(0.0) == pytest.approx(0.032 / 2048)
    for _ in range(WINDOW):
        prefill.observe_step(0.5, 64, 0.0)  # 64 decodes over long contexts: 0.5 s
    assert prefill.seconds_per_token(0.0) == pytest.approx(MIN_MARGINAL_SHARE * 0.04 / 2048)


def test_a_step_fixed_cost_turns_a_break_even_load_into_a_recompute() -> None:
    """The bench's "even" tier on a fast CPU: 2,016 tokens arrive in 37 ms against a
    40 ms step for all 2,048, of which 9 ms are the step's own (as measured there): loading
    them saves 30.5 ms of compute, less than the fetch costs."""
    tier = tier_of(0.005, 131 * MB)
    n = chunks(8, 512 * 1024, tokens=252)
    prefill = prefill_of(0.04 / 2048)
    assert price_load(n, tier=tier, prefill=prefill, margin=1.0, now=0.0).load == 8
    for _ in range(MIN_SAMPLES):
        prefill.observe_step(0.009, 32, 0.0)
    price = price_load(n, tier=tier, prefill=prefill, margin=1.0, now=0.0)
    assert (price.load, price.reason) == (0, "slower_than_prefill")


def test_a_run_over_several_steps_splits_latency_from_throughput() -> None:
    tier = TierCosts()
    times = FetchTimes(tier)
    for r in range(MIN_SAMPLES):
        base = 10 * r
        ops = [(100 * r + i, 10 * MB) for i in range(5)]
        times.started(ops, now=base)
        # the first chunk after 0.15 s (0.05 latency + 0.1 s of read), then one per 0.1 s
        for i, (op_id, _) in enumerate(ops):
            times.settled(op_id, True, now=base + 0.15 + 0.1 * i)
    assert tier.bytes_per_second(30.0) == pytest.approx(100 * MB)
    assert tier.latency.value(30.0) == pytest.approx(0.05)
    assert tier.inflight_bytes(30.0) == 0


def test_a_run_reported_at_once_is_latency_and_says_nothing_of_the_throughput() -> None:
    """Its time is mostly the engine steps before the report, a cost per lookup: as bytes/s
    it would make a longer prompt look slower by that lag per chunk. A tier this fast stays
    at the prior (loaded whole); once a throughput is known, its bytes' share comes off."""
    tier = TierCosts()
    times = FetchTimes(tier)
    for r in range(MIN_SAMPLES):
        times.started([(10 * r + i, 10 * MB) for i in range(4)], now=0.0)
        for i in range(4):
            times.settled(10 * r + i, True, now=0.4)
    assert tier.latency.value(1.0) == pytest.approx(0.4)
    assert tier.bytes_per_second(1.0) is None and not tier.measured(1.0)
    for _ in range(MIN_SAMPLES):
        tier.throughput.add(100 * MB, 1.0)
    times.started([(100, 10 * MB)], now=2.0)
    times.settled(100, True, now=2.3)
    assert list(tier.latency._samples)[-1] == (2.3, pytest.approx(0.2))


def test_a_miss_measures_latency_and_a_cut_run_bounds_the_throughput() -> None:
    tier = TierCosts()
    times = FetchTimes(tier)
    times.started([(1, 10 * MB), (2, 10 * MB)], now=0.0)
    times.settled(1, False, now=0.03)
    times.settled(2, False, now=0.03)
    assert list(tier.latency._samples) == [(0.03, 0.03)]
    assert not tier.throughput._samples
    # a tier that stops sending: nothing reported by the deadline, 1 s after the start
    times.started([(3, 10 * MB), (4, 10 * MB)], now=1.0)
    times.cut([3, 4], now=2.0)
    assert list(tier.latency._samples)[-1] == (2.0, 1.0)
    assert list(tier.throughput._samples) == [(2.0, 10 * MB / 1.0)]
    times.settled(3, True, now=9.0)  # late: lands, not sampled again
    times.settled(4, True, now=9.0)
    assert len(tier.throughput._samples) == 1 and tier.inflight_bytes(9.0) == 0


def chunks(n: int, nbytes: int, tokens: int = 256) -> list[tuple[int, int]]:
    return [(nbytes, tokens)] * n


def test_the_prior_loads_everything_until_both_sides_are_measured() -> None:
    slow = tier_of(1.0, 1 * MB)
    price = price_load(
        chunks(8, 32 * MB), tier=slow, prefill=PrefillCosts(256), margin=1.0, now=0.0
    )
    assert (price.load, price.deadline_s, price.declined_tokens) == (8, None, 0)
    # the prefill measured, the tier not: load it all, but no longer than its recompute
    price = price_load(
        chunks(8, 32 * MB), tier=TierCosts(), prefill=prefill_of(1e-3), margin=1.0, now=0.0
    )
    assert price.load == 8
    assert price.deadline_s == pytest.approx(8 * 256 * 1e-3)


def test_a_fast_tier_loads_all_a_slow_one_none() -> None:
    n = chunks(8, 256 * 131_072)  # Llama-3-8B bf16: 32 MiB per 256-token chunk
    h100 = prefill_of(0.1 / 2048)  # a 2,048-token prefill in ~100 ms
    s3 = tier_of(0.03, 100 * MB)
    price = price_load(n, tier=s3, prefill=h100, margin=1.0, now=0.0)
    assert (price.load, price.deadline_s) == (0, None)
    assert (price.declined_tokens, price.reason) == (2048, "slower_than_prefill")
    local = tier_of(0.001, 5_000 * MB)
    price = price_load(n, tier=local, prefill=h100, margin=1.0, now=0.0)
    assert price.load == 8 and price.declined_tokens == 0
    assert price.predicted_s == pytest.approx(0.001 + 8 * 32 * 2**20 / (5_000 * MB))
    assert price.deadline_s == pytest.approx(0.1)


def test_a_measured_fast_tier_is_cut_at_twice_its_predicted_fetch_not_at_the_recompute() -> None:
    # the 8B model's chunks from a local NVMe-class tier against a slower prefill: 0.055 s
    # predicted against 0.5 s of recompute. A stall is cut at 0.11 s, not after 0.5 s.
    n = chunks(8, 256 * 131_072)
    local = tier_of(0.001, 5_000 * MB)
    prefill = prefill_of(0.5 / 2048, step_s=0.005)
    price = price_load(n, tier=local, prefill=prefill, margin=1.0, now=0.0)
    assert price.load == 8 and price.predicted_s is not None
    assert price.deadline_s == pytest.approx(STALL_FACTOR * price.predicted_s)
    assert price.deadline_s < 0.15
    # a fetch predicted at a hair of the prefill is not cut before its floor: a tenth of
    # the recompute, or a few engine steps (busy steps must not turn a good read into a
    # partial hit), whichever is longer; and never after the whole recompute
    instant = tier_of(0.0, 1e6 * MB)
    price = price_load(n, tier=instant, prefill=prefill, margin=1.0, now=0.0)
    assert price.deadline_s == pytest.approx(STALL_FLOOR * 0.5)
    busy = prefill_of(0.5 / 2048, step_s=0.03)
    price = price_load(n, tier=instant, prefill=busy, margin=1.0, now=0.0)
    assert price.deadline_s == pytest.approx(STALL_MIN_STEPS * 0.03)
    # steps as long as the prefill (an engine busy with prefills): the whole recompute
    price = price_load(n, tier=instant, prefill=prefill_of(0.05 / 2048), margin=1.0, now=0.0)
    assert price.deadline_s == pytest.approx(0.05)


def test_a_tier_whose_runs_land_at_once_is_cut_at_twice_the_time_they_took() -> None:
    # every run reported at its first report: no throughput (the prior loads it whole);
    # the time its runs took to land is what a stall is measured against
    n = chunks(8, 4 * MB)
    prompt_s = 2.0  # the 2,048 tokens' recompute
    prefill = prefill_of(prompt_s / 2048, step_s=0.01)

    def priced(took_s: float, runs: int = MIN_SAMPLES) -> float | None:
        tier = TierCosts()
        times = FetchTimes(tier)
        for i in range(runs):
            times.started([(10 * i, 4 * MB), (10 * i + 1, 4 * MB)], now=float(i))
            times.settled(10 * i, True, now=i + took_s)
            times.settled(10 * i + 1, True, now=i + took_s)
        assert not tier.measured(10.0)
        price = price_load(n, tier=tier, prefill=prefill, margin=1.0, now=10.0)
        assert price.load == 8
        return price.deadline_s

    assert priced(0.05) == pytest.approx(STALL_FLOOR * prompt_s)
    assert priced(0.3) == pytest.approx(STALL_FACTOR * 0.3)
    assert priced(0.3, runs=MIN_SAMPLES - 1) == pytest.approx(prompt_s)


def test_a_run_of_misses_predicts_no_fetch() -> None:
    # "absent" answers come fast and carry no bytes: they set the tier's latency, never
    # the time a fetch of data takes (a slow tier would be cut at once, and each early
    # cut would read as a fast tier: loaded and cut forever, never declined)
    tier = TierCosts()
    times = FetchTimes(tier)
    for i in range(MIN_SAMPLES):
        times.started([(i, 4 * MB)], now=float(i))
        times.settled(i, False, now=i + 0.01)
    assert tier.latency.value(10.0) is not None and tier.landed.value(10.0) is None
    price = price_load(
        chunks(8, 4 * MB), tier=tier, prefill=prefill_of(2.0 / 2048), margin=1.0, now=10.0
    )
    assert price.deadline_s == pytest.approx(2.0)


def test_the_margin_tips_a_break_even_tier_and_scales_the_deadline() -> None:
    # 1 s per chunk of reading against 0.9 s of computing it
    tier, prefill = tier_of(0.0, 10 * MB), prefill_of(0.9 / 256)
    n = chunks(4, 10 * MB)
    assert price_load(n, tier=tier, prefill=prefill, margin=1.0, now=0.0).load == 0
    price = price_load(n, tier=tier, prefill=prefill, margin=1.5, now=0.0)
    assert price.load == 4
    assert price.deadline_s == pytest.approx(1.5 * 4 * 0.9)


def test_fetches_in_flight_ahead_can_make_a_load_not_worth_it() -> None:
    tier, prefill = tier_of(0.0, 10 * MB), prefill_of(2.0 / 256)  # 1 s to read, 2 to compute
    n = chunks(2, 10 * MB)
    assert price_load(n, tier=tier, prefill=prefill, margin=1.0, now=0.0).load == 2
    tier.planned(1, 50 * MB, 0.0)  # 5 s of reads queued ahead
    price = price_load(n, tier=tier, prefill=prefill, margin=1.0, now=0.0)
    assert (price.load, price.declined_tokens, price.reason) == (0, 512, "queued")


def test_the_latency_makes_the_shortest_prefix_the_dearest() -> None:
    """Each chunk pays off (0.1 s read, 0.2 s compute) but the first carries 0.5 s of
    latency: one chunk is not worth it, three are; a chunk held already costs no read."""
    tier, prefill = tier_of(0.5, 10 * MB), prefill_of(0.2 / 256)
    assert price_load(chunks(1, 1 * MB), tier=tier, prefill=prefill, margin=1.0, now=0.0).load == 0
    assert price_load(chunks(6, 1 * MB), tier=tier, prefill=prefill, margin=1.0, now=0.0).load == 6
    held = [(0, 256)] * 2 + chunks(1, 1 * MB)
    assert price_load(held, tier=tier, prefill=prefill, margin=1.0, now=0.0).load == 2


def test_a_tier_with_a_cut_fetch_still_out_is_not_asked_again_until_it_reports() -> None:
    """The tier stopped sending mid-fetch: the lookup was cut at its deadline. Its one
    slow sample does not move the medians (the tier still looks fast), but a new fetch
    would queue behind the stuck one: declined ("queued") until it reports, then loaded."""
    tier = tier_of(0.003, 2_000 * MB)
    prefill = prefill_of(0.04 / 2048, step_s=0.001)
    n = chunks(8, 512 * 1024)
    times = FetchTimes(tier)
    times.started([(1, 512 * 1024), (2, 512 * 1024)], now=0.0)
    times.settled(1, True, now=0.002)
    times.cut([1, 2], now=0.01)
    assert tier.measured(0.01) and tier.stalled(0.01)
    price = price_load(n, tier=tier, prefill=prefill, margin=1.0, now=0.01)
    assert (price.load, price.declined_tokens, price.reason) == (0, 2048, "queued")
    # chunks the host tier holds already are loaded all the same
    held = [(0, 256)] * 2 + n[2:]
    price = price_load(held, tier=tier, prefill=prefill, margin=1.0, now=0.01)
    assert (price.load, price.declined_tokens) == (2, 1536)
    assert price.deadline_s == pytest.approx(512 * 0.04 / 2048)
    times.settled(2, True, now=0.5)  # late: it reported
    assert not tier.stalled(0.5)
    assert price_load(n, tier=tier, prefill=prefill, margin=1.0, now=0.5).load == 8
    # one never reported ages out with the fetches in flight
    times.started([(3, 512 * 1024)], now=1.0)
    times.cut([3], now=1.1)
    assert tier.stalled(1.1) and not tier.stalled(1.0 + MAX_AGE_S + 1)
