"""``bench/gpu_copy_variants.py`` on the CPU (no streams): each of the three ways of loading
paged KV puts every slot's bytes in its blocks (the script compares them byte for byte
after every run and raises otherwise), and the figures are reported for each."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_copy_variants  # noqa: E402


def test_a_tiny_cpu_run_loads_every_way_bit_exact(tmp_path) -> None:
    out = tmp_path / "v.json"
    rc = gpu_copy_variants.main([
        "--layers", "3", "--chunks", "5", "--heads", "2", "--head-dim", "16", "--repeats", "1",
        "--json", str(out),
    ])  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["device"] == "CPU (no CUDA)"
    assert set(result["rows"]) == {"kvtier", "layer_copy", "chunk_copy"}
    # 5 chunks x 3 layers x K/V x 16 blocks x 16 tokens x 2 heads x 16 dims x 2 bytes
    assert result["bytes"] == 5 * 3 * 2 * 16 * 16 * 2 * 16 * 2
    for row in result["rows"].values():
        assert row["gbps"] > 0 and 0.0 <= row["hidden"] <= 1.0
        raw_s = result["bytes"] / (result["raw_gbps"] * 1e9)
        assert row["over_raw"] == pytest.approx(raw_s / (row["copy_ms"] / 1e3), rel=1e-6)


def test_a_wrong_scatter_is_caught(monkeypatch) -> None:
    """The check is real: a scatter that puts K where V belongs fails the run."""
    real = gpu_copy_variants.Loads._scatter

    def swapped(self, li: int) -> None:  # type: ignore[no-untyped-def]
        real(self, li)
        self.kv[li][:] = self.kv[li].flip(0)

    monkeypatch.setattr(gpu_copy_variants.Loads, "_scatter", swapped)
    with pytest.raises(AssertionError, match="layer_copy: layer 0 chunk 0 differs"):
        gpu_copy_variants.main(["--layers", "2", "--chunks", "2", "--heads", "1",
                                "--head-dim", "8", "--repeats", "1"])  # fmt: skip
