"""``file_max_bytes`` holds while the engine writes, not only after a sweep: a write that
would take the directory past its bound makes its room first.

Before, the bound was kept by the sweep thread alone, which sweeps at most once a
second: an engine writing faster than that (a real CPU engine: 60 chunks of 512 KiB in
under a second) ran an 8 MiB directory to 41 objects, 21 MB, between sweeps. And the
sweep evicted the generation's manifest, the engine's claim of its generation, as the
oldest object of all.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from kit import directory_usage

from kvtier.objects import codec
from kvtier.objects.manifest import manifest_key
from kvtier.objects.tiers.file import FileTier
from kvtier.objects.tiers.file_layout import is_manifest, place
from kvtier.objects.tiers.file_ledger import LEDGER_NAME

pytestmark = pytest.mark.integration

OBJ = 10_000  # payload bytes of one test chunk
BOUND = 20 * OBJ


def chunk(key: str, size: int = OBJ) -> list[bytes | memoryview]:
    return codec.encode(key, bytes([len(key) % 251]) * size, dtype="u8", shape=[size])


def counted(root: Path) -> int:
    """What the bound counts of the directory: every file but the shared count's own
    (bookkeeping of a fixed size, like the lock file)."""
    ledger = root / LEDGER_NAME
    return directory_usage(root)["bytes"] - (ledger.stat().st_size if ledger.exists() else 0)


def test_a_fast_writer_never_takes_the_directory_past_its_bound(tmp_path: Path) -> None:
    """The engine's tier (sweep thread on), written back to back: checked after every
    write, never past the bound (the old sweep thread let it grow for a second)."""
    with FileTier(str(tmp_path), max_bytes=BOUND) as tier:
        peak = 0
        for i in range(200):
            tier.put(f"k{i}", chunk(f"k{i}"))
            peak = max(peak, directory_usage(tmp_path)["bytes"])
        assert peak <= BOUND, f"{peak} bytes on disk, bound {BOUND}"
        assert peak > 0.8 * BOUND  # and it is used: evicted to low water, not emptied
        assert tier.get("k199") is not None  # the newest stays


def test_concurrent_writers_never_take_the_directory_past_its_bound(tmp_path: Path) -> None:
    """Like the engine's write threads: the bytes of writes in flight count before the
    write starts, so temp files being written are within the bound too."""
    peaks: list[int] = []
    with FileTier(str(tmp_path), max_bytes=BOUND) as tier:

        def writer(w: int) -> None:
            for i in range(60):
                tier.put(f"w{w}-{i}", chunk(f"w{w}-{i}"))
                peaks.append(directory_usage(tmp_path)["bytes"])

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert max(peaks) <= BOUND, max(peaks)
        # the count is exact again
        assert tier.sweeper.used_bytes == counted(tmp_path)


def test_create_if_absent_counts_against_the_bound(tmp_path: Path) -> None:
    with FileTier(str(tmp_path), max_bytes=BOUND) as tier:
        for i in range(100):
            assert tier.create_if_absent(f"c{i}", chunk(f"c{i}"))
            assert directory_usage(tmp_path)["bytes"] <= BOUND
        assert not tier.create_if_absent("c99", chunk("c99"))  # lost: nothing counted
        assert tier.sweeper.used_bytes == counted(tmp_path)


def test_rewrites_free_what_they_replace(tmp_path: Path) -> None:
    """A key written again replaces its object: the count does not grow, nothing else is
    evicted for it."""
    with FileTier(str(tmp_path), max_bytes=BOUND) as tier:
        for i in range(15):
            tier.put(f"k{i}", chunk(f"k{i}"))
        for _ in range(100):
            tier.put("k3", chunk("k3"))
        assert all(tier.exists([f"k{i}"]) == [True] for i in range(15))
        assert tier.sweeper.used_bytes == counted(tmp_path)


def test_deletes_free_what_they_remove(tmp_path: Path) -> None:
    """Objects deleted through the tier leave the count: the writes after them evict
    nothing while there is room (an overcount evicts the oldest objects for nothing)."""
    tier = FileTier(str(tmp_path), max_bytes=BOUND, background_sweep=False, bound_writes=True)
    for i in range(18):
        tier.put(f"k{i:02d}", chunk(f"k{i:02d}"))
    tier.sweep()  # the count, and the oldest objects in eviction order
    tier.delete([f"k{i:02d}" for i in range(8, 18)])
    for i in range(10):
        tier.put(f"n{i}", chunk(f"n{i}"))
    assert all(tier.exists([f"k{i:02d}"]) == [True] for i in range(8))
    assert tier.sweeper.used_bytes == counted(tmp_path)


def test_a_write_evicts_the_least_recently_used(tmp_path: Path) -> None:
    """The write's eviction keeps the sweep's order: oldest mtime first, and an object
    read since the scan that ordered them (young now) stays."""
    keys = [f"k{i:02d}" for i in range(18)]
    with FileTier(str(tmp_path), max_bytes=BOUND) as tier:
        for key in keys:
            tier.put(key, chunk(key))
        start = time.time() - 3600
        for i, key in enumerate(keys):  # an hour old, 10 s apart, k00 the oldest
            os.utime(tier.path(key), (start + 10 * i, start + 10 * i))
        tier.sweep()  # the order the writes evict in
        assert tier.get("k00") is not None  # a hit an hour later: young again
        for i in range(4):
            tier.put(f"new{i}", chunk(f"new{i}"))
        survivors = {k for k in keys if tier.exists([k]) == [True]}
        assert "k00" in survivors
        gone = sorted(set(keys) - survivors)
        assert gone and gone == keys[1 : 1 + len(gone)], gone  # the oldest went, in order
        assert directory_usage(tmp_path)["bytes"] <= BOUND


def test_manifests_are_counted_but_never_evicted(tmp_path: Path) -> None:
    """A generation's manifest (its claim: an absent one makes the next engine its first
    writer) is the oldest object of a busy tier; neither a write nor a sweep evicts it."""
    key = manifest_key("0123456789abcdef")
    assert is_manifest(place(key)[1])
    assert not is_manifest(place("gen-0123456789abcdef/manifes")[1])
    with FileTier(str(tmp_path), max_bytes=BOUND) as tier:
        assert tier.create_if_absent(key, chunk(key, 300))
        old = time.time() - 3600
        os.utime(tier.path(key), (old, old))
        for i in range(100):
            tier.put(f"k{i}", chunk(f"k{i}"))
        assert tier.exists([key]) == [True]
        assert directory_usage(tmp_path)["bytes"] <= BOUND
    swept = FileTier(str(tmp_path), max_bytes=0, background_sweep=False)
    stats = swept.sweep()
    assert stats.evicted > 0 and swept.exists([key]) == [True]


def test_a_tier_without_its_own_sweeps_leaves_the_bound_to_the_caller(tmp_path: Path) -> None:
    """``background_sweep=False`` (tests, tools): writes evict nothing unless
    ``bound_writes``; the caller's sweep does."""
    tier = FileTier(str(tmp_path), max_bytes=BOUND, background_sweep=False)
    for i in range(40):
        tier.put(f"k{i}", chunk(f"k{i}"))
    assert directory_usage(tmp_path)["bytes"] > BOUND
    tier.sweep()
    assert directory_usage(tmp_path)["bytes"] <= 0.9 * BOUND
    bounded = FileTier(
        str(tmp_path / "b"), max_bytes=BOUND, background_sweep=False, bound_writes=True
    )
    for i in range(40):
        bounded.put(f"k{i}", chunk(f"k{i}"))
        assert directory_usage(tmp_path / "b")["bytes"] <= BOUND
