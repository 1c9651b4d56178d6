"""Loads priced against recomputing (kvtier.costs), end to end: a real engine restarts
onto a real redis-server that another engine filled, through a loopback proxy
(tests/faultproxy.py) that sets how fast Redis answers.

Through a link far slower than the prefill (64 KiB/s: a prompt's 2 MiB of KV would take
half a minute, its prefill takes well under that on any CPU), the first lookups load
whole (the prior: the tier is unmeasured) and are cut at their deadline, about one
prefill, not at ``lookup_timeout_ms`` (set to a minute here: a wait that long shows as a
timeout); once the tier is measured, lookups are declined without a read, and every
output is vLLM's own whole prefill. Unthrottled, the same engine loads every chunk and
answers as vLLM's own prefix hit does. Behaviour only: no wall-clock assertion.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.conftest import run_engine

pytestmark = pytest.mark.e2e

ENV = {"KVTIER_TEST_SCENARIO_MODULES": "tests.e2e.pricing_scenarios,tests.e2e.canary_scenarios"}
PREFIX = 1024  # each prompt's full chunks: 4 of 256 tokens
WARM = [91, 92, 93]  # computed first by each reader: its prefill measured
SEEDS = [81, 82, 83, 84, 85, 86]
#: lookups the slow tier is read by before it is measured (kvtier.costs.MIN_SAMPLES cuts)
MEASURED_AFTER = 3


def same(out: dict[str, Any], want: dict[str, Any]) -> bool:
    return (out["tokens"], out["logprobs"]) == (want["tokens"], want["logprobs"])


def test_a_tier_slower_than_prefill_is_cut_then_declined_and_a_fast_one_loads(
    tiny_model: str, services: Any
) -> None:
    redis = services.redis()
    extra = {"cpu_bytes": "64MiB", "remote_url": redis.url, "lookup_timeout_ms": 60_000}
    run_engine("store_prompts", env=ENV, model=tiny_model, extra=extra, seeds=SEEDS)
    ref = run_engine("canary_prompts", env=ENV, model=tiny_model, extra=None, seeds=SEEDS)
    assert [o["cached"] for o in ref["hits"]] == [PREFIX] * len(SEEDS)

    proxy = services.proxy((redis.host, redis.port))
    proxy.link_bps = 64 * 1024
    through = {**extra, "remote_url": f"redis://127.0.0.1:{proxy.port}/0"}
    slow = run_engine("priced_reads", env=ENV, model=tiny_model, extra=through,
                      warm_seeds=WARM, seeds=SEEDS)  # fmt: skip
    assert slow["prefill_s_per_token"], "the prefill was measured on the warm prompts"
    outs = slow["outs"]
    assert [o["served"] for o in outs] == [0] * len(SEEDS), outs
    assert [o["cached"] for o in outs] == [0] * len(SEEDS), outs
    first, later = outs[:MEASURED_AFTER], outs[MEASURED_AFTER:]
    # read (the prior), each cut at its deadline: never the minute of lookup_timeout_ms
    assert all(o["reads"] > 0 and o["cut"] == 1 for o in first), first
    assert not any(k.startswith("kvtier:errors|timeout") for k in slow["counters"]), slow
    # measured: declined whole, the tier never asked
    assert all(o["declined"] == PREFIX and o["reads"] == 0 for o in later), later
    for out, want in zip(outs, ref["outs"], strict=True):
        assert same(out, want), (out, want)  # computed whole, as vLLM alone computes it

    proxy.link_bps = None
    fast = run_engine("priced_reads", env=ENV, model=tiny_model, extra=through,
                      warm_seeds=WARM, seeds=SEEDS)  # fmt: skip
    outs = fast["outs"]
    assert [o["served"] for o in outs] == [PREFIX] * len(SEEDS), outs
    assert [o["declined"] for o in outs] == [0] * len(SEEDS), outs
    for out, want in zip(outs, ref["hits"], strict=True):
        assert same(out, want), (out, want)  # as vLLM's own prefix hit of the same split
