"""``bench/block_runs.py``: a tiny run times each block-list shape's loads and stores both
ways (the script checks that both put the same bytes in the same places before it
prints)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import block_runs  # noqa: E402


def test_a_tiny_run_times_every_shape_both_ways(capsys) -> None:
    assert block_runs.main(["--tokens", "512", "--layers", "2", "--reps", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("2 chunks of ")
    rows = {(line[:19].strip(), *line[19:].split()[:1]): line[19:].split()[1:]
            for line in lines[2:]}  # fmt: skip
    shapes = {"ascending", "descending", "two descending", "scattered"}
    assert set(rows) == {(s, d) for s in shapes for d in ("loads", "stores")}
    for runs, index_copy, ratio in rows.values():
        assert float(runs) > 0 and float(index_copy) > 0 and ratio.endswith("x")
