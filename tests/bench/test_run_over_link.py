"""``bench/run_over_link.py``: a tiny run over a throttled link times both ways on real
S3 (moto) and Redis servers, and refuses a tier it does not know."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import run_over_link  # noqa: E402

pytestmark = pytest.mark.integration


def test_a_tiny_run_prints_both_ways_per_tier(capsys) -> None:
    rc = run_over_link.main(["--chunks", "3", "--chunk-mib", "0.25", "--reps", "1",
                             "--latency-ms", "1", "--mb-per-s", "50"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith(("s3 ", "redis "))}  # fmt: skip
    assert set(rows) == {"s3", "redis"}, out
    for row in rows.values():
        found, after, ratio = float(row[1]), float(row[2]), float(row[3].rstrip("x"))
        assert found > 0 and after > 0 and ratio == pytest.approx(found / after, abs=0.01)


def test_an_unknown_tier_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        run_over_link.main(["--tiers", "s3,nfs"])
    assert "--tiers: unknown ['nfs']" in capsys.readouterr().err
