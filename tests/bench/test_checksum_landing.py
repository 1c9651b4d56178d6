"""``bench/checksum_landing.py``: a tiny run on the directory tier and Redis times both ways
for every chunk size, and refuses a backend it does not know."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import checksum_landing  # noqa: E402


def test_a_tiny_run_prints_a_row_per_backend_and_size(capsys, redis_url: str) -> None:
    rc = checksum_landing.main(["--only", "file,redis", "--chunk-mib", "0.5", "2",
                                "--chunks", "2", "--rounds", "1", "--redis-url", redis_url])
    assert rc == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith(("file ", "redis "))]  # fmt: skip
    assert [(r[0], r[1]) for r in rows] == [("file", "0.5"), ("file", "2"),
                                            ("redis", "0.5"), ("redis", "2")]  # fmt: skip
    for r in rows:
        land, after, ratio = float(r[2]), float(r[3]), float(r[4])
        assert land > 0 and after > 0 and ratio == pytest.approx(land / after, rel=0.1)


def test_an_unknown_backend_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        checksum_landing.main(["--only", "file,nfs"])
    assert "--only: unknown ['nfs']" in capsys.readouterr().err
