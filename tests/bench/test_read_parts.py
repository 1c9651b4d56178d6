"""``bench/read_parts.py``: a tiny run checks that kvtier's read and the checked raw read
land the stored payloads, prints a row per prompt length with its chunk count and ratios
that follow from its times, and refuses a bad argument."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import read_parts  # noqa: E402


def test_a_tiny_run_prints_a_row_per_length(capsys, tmp_path: Path) -> None:
    rc = read_parts.main(["--tokens", "300", "2816", "--chunk-mib", "1", "--rounds", "1",
                          "--dir", str(tmp_path)])  # fmt: skip
    assert rc == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.split() and line.split()[0].isdigit()]  # fmt: skip
    # 11 chunks: keys ...-9 and ...-10, so heads of two lengths
    assert [(r[0], r[1]) for r in rows] == [("300", "2"), ("2816", "11")]
    for r in rows:
        new, slots, crc, kvtier, crc_ratio, kvtier_ratio = map(float, r[2:])
        assert min(new, slots, crc, kvtier) > 0
        assert crc_ratio == pytest.approx(crc / slots, rel=0.05, abs=0.01)
        assert kvtier_ratio == pytest.approx(kvtier / crc, rel=0.05, abs=0.01)
    assert len(list(tmp_path.rglob("*"))) > 0, "chunks were stored where --dir says"


def test_a_spoiled_chunk_stops_the_run(tmp_path: Path, monkeypatch) -> None:
    """The check before timing fails when a read lands other bytes than were stored."""
    real = read_parts.payload_crc32
    calls = {"n": 0}

    def off_by_one(data, value=0):  # the first store's CRC is wrong
        calls["n"] += 1
        return real(data, value) ^ (1 if calls["n"] == 1 else 0)

    monkeypatch.setattr(read_parts, "payload_crc32", off_by_one)
    with pytest.raises(RuntimeError, match="did not land the stored payload"):
        read_parts.main(["--tokens", "256", "--chunk-mib", "0.25", "--rounds", "1",
                         "--dir", str(tmp_path)])  # fmt: skip


def test_bad_arguments_are_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        read_parts.main(["--threads", "0"])
    assert "--threads" in capsys.readouterr().err
