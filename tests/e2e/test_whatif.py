"""Ghost host tiers in a real vLLM engine (CPU build): on a Zipf workload over 16
documents of 1,024 tokens, with a host tier that holds a few of them, the scale-1 ghost
counts exactly the host hits the engine measured, larger ghosts never fewer, and the
scale-2 ghost predicts the hits an engine with twice the host tier measures."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import run_engine

pytestmark = pytest.mark.e2e

ENV = {"KVTIER_TEST_SCENARIO_MODULES": "tests.e2e.whatif_scenarios"}
SCALES = ("0.5", "1", "2", "4", "8")
# 4 layers x 2 x 2 kv heads x 64 x bf16 x 256 tokens = 512 KiB a chunk: 12 slots hold
# 3 of the 16 documents (4 chunks each), 24 slots 6 of them
SMALL, DOUBLE = "6MiB", "12MiB"


def _whatif(totals: dict[str, int]) -> dict[str, int]:
    return {s: totals[f"whatif_hit_tokens_host_{s}"] for s in SCALES}


def test_ghosts_match_measured_host_hits(tiny_model: str) -> None:
    small = run_engine("whatif_zipf", model=tiny_model, extra={"cpu_bytes": SMALL}, env=ENV)
    idx = small["index"]
    assert idx["num_slots"] == 12 and idx["invariants"] is True and idx["refs"] == 0
    assert small["ghost_capacity"] == {"0.5": 6, "1": 12, "2": 24, "4": 48, "8": 96}
    totals = idx["totals"]
    lookup, host = totals["lookup_tokens"], totals["hit_tokens_host"]
    got = _whatif(totals)
    assert totals["evictions"] > 0 and 0 < host < lookup, totals
    # scale 1 is the real tier: the same tokens, not merely within 2 points
    assert got["1"] == host, (got, host)
    assert list(got.values()) == sorted(got.values()), got
    assert got["8"] > got["1"] > got["0.5"], got
    assert got["8"] <= lookup

    double = run_engine("whatif_zipf", model=tiny_model, extra={"cpu_bytes": DOUBLE}, env=ENV)
    assert double["index"]["num_slots"] == 24
    measured = double["index"]["totals"]
    assert measured["lookup_tokens"] == lookup  # the same workload, the same questions
    predicted = got["2"] / lookup
    actual = measured["hit_tokens_host"] / lookup
    print(f"hit rate: 1x {host / lookup:.3f}, ghost 2x {predicted:.3f}, real 2x {actual:.3f}")
    assert abs(predicted - actual) <= 0.05, (predicted, actual)
    # and the doubled engine's own scale-1 ghost is its measured hits again
    assert _whatif(measured)["1"] == measured["hit_tokens_host"]


def test_whatif_false_counts_nothing(tiny_model: str) -> None:
    r = run_engine(
        "whatif_zipf",
        model=tiny_model,
        extra={"cpu_bytes": SMALL, "whatif": False},
        n_requests=16,
        env=ENV,
    )
    assert r["ghost_capacity"] is None
    totals = r["index"]["totals"]
    assert set(_whatif(totals).values()) == {0} and totals["hit_tokens_host"] > 0
