"""``bench/tier_codecs.py``: the compression table's ``auto`` replica, on a real directory
tier behind the bench's simulated link."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import tier_codecs  # noqa: E402
from kit import kv_like  # noqa: E402

from kvtier.objects.tiers import FileTier  # noqa: E402


def test_auto_replica_compresses_behind_a_thin_link(tmp_path: Path) -> None:
    """Behind a 20 Mbit/s link a 64 KiB chunk takes ~26 ms on the wire and ~0.1 ms to
    decompress, so the replica must settle on compressed uploads, and its timed run is
    stored so (fewer bytes than raw) and read back exactly."""
    chunks = [kv_like(32768, seed) for seed in range(2)]
    args = argparse.Namespace(putget_threads=2)

    def reader() -> tier_codecs.LinkTier:
        return tier_codecs.LinkTier(FileTier(str(tmp_path / "o")), 0.02)

    rio, z = tier_codecs.auto_replica(reader, args, chunks, n=2)
    try:
        assert z.compressing, z
        stored = rio.take_compression()["write"]
        assert stored[1] < stored[0]
        slots = [memoryview(bytearray(len(chunks[0]))) for _ in range(2)]
        rio.submit_get_run(
            [(i, f"z-auto-{i}", slots[i]) for i in range(2)],
            dtype="bfloat16",
            shape=[len(chunks[0]) // 2],
        )
        tier_codecs.wait_for_results(rio, 2)
        assert [bytes(s) for s in slots] == chunks
    finally:
        rio.close()
    assert len(os.listdir(tmp_path / "o")) > 0
