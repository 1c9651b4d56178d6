"""``bench/copy_overlap.py``: a tiny run times the three ways, and each moves every
chunk's bytes into its blocks (the script checks them, and the checksums of the chunks
read straight into the KV cache, before it prints)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import copy_overlap  # noqa: E402


def test_a_tiny_run_times_the_three_ways(capsys) -> None:
    assert copy_overlap.main(["--tokens", "1024", "--layers", "2", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 chunks, ")
    rows = {line.split("  ")[1].strip(): line for line in out.splitlines()[1:]}
    assert set(rows) == {"read all, then copy", "copy as landed", "read into KV cache"}
    after = float(rows["read all, then copy"].split()[-2])
    assert after > 0
    for way in ("copy as landed", "read into KV cache"):
        cols = rows[way].split()
        assert float(cols[-3]) > 0
        ratio = float(cols[-1].strip("()x"))
        assert ratio == pytest.approx(float(cols[-3]) / after, rel=0.1)
