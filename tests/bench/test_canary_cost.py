"""``bench/ttft.py --canary-rates`` (bench/canary_cost.py) without an engine: its flags,
the rates it measures, and the ratios and counts its table reports from a run's samples."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

_ENV = dict(os.environ)
import canary_cost  # noqa: E402
import ttft  # noqa: E402  (sets vLLM's variables for its engines: not for other tests')

for _name in set(os.environ) - set(_ENV):
    del os.environ[_name]


def test_rates_are_sorted_with_rate_0_first_and_bounded() -> None:
    assert canary_cost.rates("0.01,0.001") == [0.0, 0.001, 0.01], "0: the baseline, added"
    assert canary_cost.rates("0,0.01,0.01") == [0.0, 0.01]
    for bad in ("", "2", "-0.1"):
        with pytest.raises(argparse.ArgumentTypeError):
            canary_cost.rates(bad)


def test_help_explains_the_mode_and_the_flags_parse() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        ttft.parse_args(["--help"])
    text = " ".join(out.getvalue().split())
    assert "--canary-rates" in text and "rate 0 the baseline" in text
    args = ttft.parse_args(["--canary-rates", "0.001,0.01", "--rounds", "3", "--prompts", "8"])
    assert (args.canary_rates, args.rounds, args.prompts) == ([0.0, 0.001, 0.01], 3, 8)
    assert ttft.parse_args([]).canary_rates is None, "the TTFT bench as before"


def _per(
    ttft_s: list[float], cached: list[int], batch_s: float, sampled: int, checks: dict[str, int]
) -> dict:
    return {
        "ttft": ttft_s,
        "cached": cached,
        "batch_s": [batch_s],
        "batch_tokens": 4 * 100,
        "batch_requests": 4,
        "batch_sampled": sampled,
        "checks": checks,
    }


def test_summary_ratios_against_rate_0_counts_and_projection() -> None:
    args = argparse.Namespace(prompts=4, tokens=512, rounds=1, max_tokens=4, layers=8, hidden=1024)
    per = {
        0.0: _per([0.02, 0.02, 0.02, 0.02], [512] * 4, 1.0, 0, {"match": 0}),
        # one of four TTFT requests drawn (no cached token: a prefill), one in the batch
        0.25: _per([0.02, 0.02, 0.02, 0.22], [512, 512, 512, 0], 2.0, 1, {"match": 1}),
    }
    res = canary_cost._summary(args, per, "trusted")
    base, drawn = res["rows"]
    assert base["ttft_median_ratio"] == base["throughput_ratio"] == 1.0
    assert drawn["sampled"] == 2 and drawn["expected_sampled"] == 0.25 * 8
    assert drawn["ttft_mean_ratio"] == pytest.approx(0.07 / 0.02)
    assert drawn["throughput_ratio"] == pytest.approx(0.5)
    assert res["sampled_over_hit_ttft"] == pytest.approx(11.0)  # 0.22 / 0.02
    assert drawn["projected_ttft_mean_ratio"] == pytest.approx(1 + 0.25 * 10)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        canary_cost.print_table(res)
    assert "11.00x" in out.getvalue() and '{"match": 1}' in out.getvalue()
