"""The directory tier stays bounded and private: LRU eviction, stale temp files, file modes."""

from __future__ import annotations

import multiprocessing
import os
import random
import stat
import time
from collections.abc import Iterator

import pytest

from kvtier.config import load_config
from kvtier.objects import codec
from kvtier.objects.tiers import FileTier, open_tier

pytestmark = pytest.mark.integration

OBJ = 10_000  # payload bytes of one test chunk


def chunk(key: str, size: int = OBJ) -> list[bytes | memoryview]:
    return codec.encode(key, bytes([len(key) % 251]) * size, dtype="u8", shape=[size])


def usage(root: str) -> tuple[int, list[str]]:
    """Bytes of stored objects under ``root`` and their names (temp files excluded)."""
    total, names = 0, []
    for folder, _, files in os.walk(root):
        for name in files:
            if folder != root and not name.startswith(".tmp-"):
                try:
                    total += os.lstat(os.path.join(folder, name)).st_size
                except FileNotFoundError:
                    continue  # evicted while we walk
                names.append(name)
    return total, names


def wait_for(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


@pytest.fixture
def umask() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_files_are_not_world_readable(tmp_path, umask) -> None:
    root = tmp_path / "objects"
    with FileTier(str(root)) as tier:
        tier.put("a", chunk("a", 8))
        assert stat.S_IMODE(os.stat(tier.path("a")).st_mode) == 0o640
        assert stat.S_IMODE(os.stat(root).st_mode) & 0o007 == 0
        assert stat.S_IMODE(os.stat(os.path.dirname(tier.path("a"))).st_mode) & 0o007 == 0
        os.umask(0o077)  # the operator's umask is respected, never widened
        tier.put("b", chunk("b", 8))
        assert stat.S_IMODE(os.stat(tier.path("b")).st_mode) == 0o600
        os.umask(0o002)
        tier.put("c", chunk("c", 8))
        assert stat.S_IMODE(os.stat(tier.path("c")).st_mode) == 0o640


def _age(tier: FileTier, keys: list[str], start: float) -> None:
    """Give the keys mtimes 10 s apart, the first the oldest."""
    for i, key in enumerate(keys):
        os.utime(tier.path(key), (start + 10 * i, start + 10 * i))


def test_sweep_evicts_least_recently_used_to_low_water(tmp_path) -> None:
    tier = FileTier(str(tmp_path), max_bytes=10 * OBJ, background_sweep=False)
    keys = [f"k{i:02d}" for i in range(15)]
    for key in keys:
        tier.put(key, chunk(key))
    _age(tier, keys, time.time() - 3600)
    assert tier.get(keys[0]) is not None  # a hit: the oldest is now the youngest
    total, _ = usage(str(tmp_path))
    assert total > 15 * OBJ
    stats = tier.sweep()
    total, names = usage(str(tmp_path))
    assert total <= 0.9 * 10 * OBJ and stats.total_bytes > 15 * OBJ
    assert stats.evicted == 15 - len(names) and stats.evicted >= 6
    survivors = {k for k in keys if os.path.exists(tier.path(k))}
    assert keys[0] in survivors  # read recently
    assert survivors - {keys[0]} == set(keys[15 - len(names) + 1 :])  # the newest writes
    assert tier.sweep().evicted == 0  # under the bound: nothing more goes


def test_bound_holds_across_restarts(tmp_path) -> None:
    root = str(tmp_path)
    with FileTier(root, background_sweep=False) as first:  # an unbounded engine filled it
        for i in range(30):
            first.put(f"k{i}", chunk(f"k{i}"))
    with FileTier(root, max_bytes=10 * OBJ):  # the next engine sweeps at open
        assert wait_for(lambda: usage(root)[0] <= 10 * OBJ), usage(root)[0]


def test_puts_trigger_a_background_sweep(tmp_path) -> None:
    root = str(tmp_path)
    with FileTier(root, max_bytes=20 * OBJ, sweep_interval_s=0.1) as tier:
        for i in range(80):
            tier.put(f"k{i}", chunk(f"k{i}"))
        assert wait_for(lambda: usage(root)[0] <= 20 * OBJ), usage(root)[0]
        assert tier.get("k79") is not None  # the newest stays


def test_stale_temp_files_are_swept_at_open(tmp_path) -> None:
    folder = tmp_path / "ab"
    folder.mkdir()
    stale, live = folder / ".tmp-crashed", folder / ".tmp-writing"
    for path in (stale, live):
        path.write_bytes(b"x" * 100)
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    with FileTier(str(tmp_path)):  # unbounded: temp files are swept anyway
        assert wait_for(lambda: not stale.exists())
        assert live.exists()  # a writer in another engine may still be using it
    tier = FileTier(str(tmp_path), tmp_max_age_s=0.0, background_sweep=False)
    time.sleep(0.01)
    assert tier.sweep().temp_removed == 1 and not live.exists()


def test_sweep_leaves_foreign_entries_and_reads_never_sweep(tmp_path, monkeypatch) -> None:
    tier = FileTier(str(tmp_path), max_bytes=0, background_sweep=False)
    (tmp_path / "notes.txt").write_text("operator's file")
    (tmp_path / "not-hex").mkdir()
    (tmp_path / "not-hex" / "x").write_bytes(b"y" * 100)
    tier.put("a", chunk("a"))
    monkeypatch.setattr(tier, "sweep", lambda: pytest.fail("sweep on the read path"))
    assert tier.get("a") is not None and tier.exists(["a"]) == [True]
    monkeypatch.undo()
    tier.sweep()
    assert tier.exists(["a"]) == [False]
    assert (tmp_path / "notes.txt").exists() and (tmp_path / "not-hex" / "x").exists()


def test_open_tier_passes_the_bound(tmp_path) -> None:
    cfg = load_config({"remote_url": f"file://{tmp_path}", "file_max_bytes": 12345}, environ={})
    with open_tier(cfg) as tier:
        assert isinstance(tier, FileTier) and tier.max_bytes == 12345


def _engine(root: str, worker: int, bound: int, puts: int, evicted) -> None:
    """One engine: writes, reads and sweeps a shared bounded directory."""
    rng = random.Random(worker)
    tier = FileTier(root, max_bytes=bound, sweep_interval_s=0.05)
    swept = 0
    for i in range(puts):
        key = f"w{worker}-{i}"
        tier.put(key, chunk(key))
        other = f"w{rng.randrange(3)}-{rng.randrange(i + 1)}"
        blob = tier.get(other)  # may vanish under us: evicted by another engine
        if blob is not None:
            codec.decode(blob, key=other, dtype="u8")
        if i % 10 == 0:
            swept += tier.sweep().evicted
    tier.close()
    assert tier.sweeper.evicted >= swept
    evicted.put(tier.sweeper.evicted)  # by its writes (which make their room) and sweeps


def test_engines_share_a_bounded_directory(tmp_path) -> None:
    """Engines writing, reading and sweeping one directory never break each other.

    The bound itself across processes is tests/objects/tiers/test_tier_bound_shared.py's (the
    engines' shared count); this checks the rest: reads see whole objects or nothing,
    the engines' sweeps evict, nothing is left half-written, and one sweep after them
    brings the directory under the bound.
    """
    root = str(tmp_path / "shared")
    bound, puts = 40 * OBJ, 150
    ctx = multiprocessing.get_context("spawn")
    evicted = ctx.Queue()
    procs = [ctx.Process(target=_engine, args=(root, w, bound, puts, evicted)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert sum(evicted.get(timeout=5) for _ in procs) > 0  # the engines' own sweeps
    written = 3 * puts * OBJ
    assert 0 < usage(root)[0] < written
    FileTier(root, max_bytes=bound, background_sweep=False).sweep()
    assert 0 < usage(root)[0] <= bound
    leftovers = [n for _, _, files in os.walk(root) for n in files if n.startswith(".tmp-")]
    assert leftovers == []
