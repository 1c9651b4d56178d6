"""``bench/copy_overlap.py``: a tiny run times the three ways, and each moves every
chunk's bytes into its blocks (the script checks them, and the checksums of the chunks
read straight into the KV cache, before it prints)."""

from __future__ import annotations

import sys
from pathlib import Path

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
        ms, ratio = float(cols[-3]), float(cols[-1].strip("()x"))
        assert ms > 0
        # the ratio of the unrounded times; the printed ones are rounded to 0.1 ms
        low, high = (ms - 0.05) / (after + 0.05), (ms + 0.05) / max(after - 0.05, 1e-9)
        assert low - 0.005 <= ratio <= high + 0.005, (ms, after, ratio)
