"""``bench/load_pricing.py`` without an engine: the link it sets from the measured prefill,
the goals it checks, its table and its flags."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

_ENV = dict(os.environ)
import load_pricing  # noqa: E402  (sets vLLM's variables for its engines: not for other tests')

for _name in set(os.environ) - set(_ENV):
    del os.environ[_name]

MIB = 2**20


def test_the_link_follows_the_prefill_measured_in_the_same_run() -> None:
    assert load_pricing.kv_bytes_per_token(8, 1024) == 2 * 8 * 8 * 64 * 2
    kv = 32 * MIB
    assert load_pricing.shaping("slow", kv, 0.5) == {"link_bps": kv / 2.5, "stall_bytes": None}
    assert load_pricing.shaping("even", kv, 0.5) == {"link_bps": kv / 0.5, "stall_bytes": None}
    assert load_pricing.shaping("stall", kv, 0.5) == {"link_bps": None, "stall_bytes": kv // 2}
    assert load_pricing.shaping("fast", kv, 0.5) == {"link_bps": None, "stall_bytes": None}
    with pytest.raises(ValueError, match="one of fast"):
        load_pricing.shaping("slower", kv, 0.5)


def run(cost: float, always: float, cached: int = 0) -> dict:
    return {
        "cost": {"ttft_s": [cost] * 3, "cached": [cached] * 3},
        "always": {"ttft_s": [always] * 3, "cached": [cached] * 3},
    }


def result(**cases: dict) -> dict:
    shaped = {k: {**v, "shaping": {"link_bps": 1e6, "stall_bytes": None}} for k, v in cases.items()}
    return {"tokens": 2048, "cold_s": 1.0, "prompt_bytes": 4 * MIB, "cases": shaped}


def test_each_case_is_held_to_its_goal() -> None:
    met = load_pricing.verdicts(
        result(
            slow=run(1.04, 2.1),
            fast=run(0.5, 0.5, cached=1792),
            even=run(0.9, 0.88),
            stall=run(1.19, 2.0),
        )
    )
    assert {k: v["ok"] for k, v in met.items()} == dict.fromkeys(met, True)
    assert met["even"]["ratio"] == pytest.approx(0.9 / 0.88)
    missed = load_pricing.verdicts(
        result(
            slow=run(1.06, 2.1),
            fast=run(0.5, 0.5, cached=1791),
            even=run(0.95, 0.88),
            stall=run(1.21, 2.0),
        )
    )
    assert {k: v["ok"] for k, v in missed.items()} == dict.fromkeys(missed, False)
    text = load_pricing.table(result(slow=run(1.06, 2.1), fast=run(0.5, 0.5, cached=1792)))
    assert "slow" in text and "NO" in text and "yes" in text


def test_a_case_it_does_not_know_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_pricing.parse_args(["--cases", "fast,slowest"])
    assert "not slowest" in capsys.readouterr().err
    assert load_pricing.parse_args([]).cases.split(",") == list(load_pricing.CASES)


def test_a_case_is_measured_against_the_cold_runs_either_side_of_it() -> None:
    """The engine without a connector runs again after each case: a case's own
    ``cold_s`` (the runs either side) is its baseline, where a run has one."""
    shaped = result(slow=run(1.04, 2.1))
    assert load_pricing.verdicts(shaped)["slow"]["ok"]
    shaped["cases"]["slow"]["cold_s"] = 0.9  # the engines either side ran faster
    v = load_pricing.verdicts(shaped)["slow"]
    assert v["cold_s"] == 0.9 and v["ratio"] == pytest.approx(1.04 / 0.9) and not v["ok"]


def test_the_processes_of_a_case_are_pooled() -> None:
    """``--repeats``: the timed prompts of a case's engine processes are one sample, each
    process's median kept beside it."""
    a = {"ttft_s": [1.0, 1.1, 1.2], "cached": [0, 0, 256], "fresh_ttft_s": [1.0]}
    b = {"ttft_s": [1.5, 1.4, 1.6], "cached": [0, 0, 0], "fresh_ttft_s": [1.4]}
    pooled = load_pricing.pooled([a, b])
    assert pooled["ttft_s"] == [1.0, 1.1, 1.2, 1.5, 1.4, 1.6]
    assert pooled["cached"] == [0, 0, 256, 0, 0, 0] and pooled["fresh_ttft_s"] == [1.0, 1.4]
    assert pooled["process_median_s"] == [1.1, 1.5]
    v = load_pricing.verdicts(result(slow={"cost": pooled, "always": pooled}))["slow"]
    assert v["cost_s"] == pytest.approx(1.3) and v["cached_min"] == 0
    assert load_pricing.parse_args([]).repeats == 3


@pytest.mark.parametrize("tier", load_pricing.TIERS)
def test_the_proxy_stands_in_front_of_either_tier(tier: str) -> None:
    """``--tier``: the read engines reach Redis, or SeaweedFS's S3 gateway, through the
    proxy; the keys that name the tier are pointed at it, the others kept."""
    from faultproxy import FaultProxy

    if tier == "s3":
        extra = {"remote_url": "s3://kvtier-probe/pricing", "s3_endpoint_url": "http://127.0.0.1:9"}
    else:
        extra = {"remote_url": "redis://127.0.0.1:9/3"}
    proxy, through = load_pricing._through_proxy({**extra, "load_policy": "cost"}, FaultProxy)
    try:
        assert proxy.upstream == ("127.0.0.1", 9)
        assert through["load_policy"] == "cost"
        if tier == "s3":
            assert through["remote_url"] == extra["remote_url"]
            assert through["s3_endpoint_url"] == f"http://127.0.0.1:{proxy.port}"
        else:
            assert through["remote_url"] == f"redis://127.0.0.1:{proxy.port}/3"
    finally:
        proxy.close()
    assert load_pricing.parse_args(["--tier", "s3"]).tier == "s3"
