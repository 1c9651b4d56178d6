"""Ghost object tiers against the real bound they model: a :class:`FileTier` directory
with ``max_bytes`` kept by its own :class:`DirectorySweep` on every write, driven by the same random
writes and reads, holds exactly the keys the ghost of that bound holds, at every scale;
an unbounded tier's ghosts: scales >= 1 never evict, 0.5 keeps half."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from kvtier.objects.ghosts import ObjectGhost, ObjectGhostTiers
from kvtier.objects.tiers import file as file_mod
from kvtier.objects.tiers.file import FileTier

OBJ = 1000  # bytes per object
TOUCH = 60.0


class Clock:
    """The test's time; :meth:`stamp` is an mtime that follows every earlier one (the
    writes and reads of one step happen one after the other, as on a real clock, and a
    tie would fall to the sweep's order of names)."""

    def __init__(self) -> None:
        self.t = 1_000_000.0
        self._last = 0.0

    def __call__(self) -> float:
        return self.t

    def stamp(self) -> float:
        self._last = max(self.t, self._last + 1e-4)
        return self._last


class SweptDirectory:
    """A real file tier that keeps its bound on the write path as the engine's does (no
    sweep thread: with the bound kept on every write it evicts nothing more), written as
    :class:`~kvtier.objects.chunk_io.ChunkIO` writes (a stored chunk is not written
    again), with mtimes set from a test clock (the tier's own read refresh is turned
    off; reads refresh here by its rule: only an object older than ``TOUCH``), so the
    order is exact, not up to the kernel's timestamp granularity."""

    def __init__(self, root: Path, max_bytes: int | None, clock: Clock, obj: int = OBJ) -> None:
        self.tier = FileTier(
            str(root), max_bytes=max_bytes, background_sweep=False, bound_writes=True
        )
        self.root = root
        self.clock = clock
        self.obj = obj

    def path(self, key: bytes) -> str:
        sub, name = file_mod._place(key.hex())
        return os.path.join(self.root, sub, name)

    def put(self, key: bytes) -> None:
        if self.tier.exists([key.hex()])[0]:
            return  # ChunkIO: the key names the chunk, the stored object is it
        self.tier.put(key.hex(), [b"x" * self.obj])
        t = self.clock.stamp()
        os.utime(self.path(key), (t, t))

    def read_run(self, keys: list[bytes], start: int, stop: int) -> int:
        """Read ``keys[start:stop]`` in order up to the first missing one."""
        i = start
        while i < stop and self.tier.get(keys[i].hex()) is not None:
            path, now = self.path(keys[i]), self.clock()
            if now - os.stat(path).st_mtime > TOUCH:
                t = self.clock.stamp()
                os.utime(path, (t, t))
            i += 1
        return i

    def keys(self) -> set[str]:
        return {
            n
            for d in os.listdir(self.root)
            if len(d) == 2 and (self.root / d).is_dir()
            for n in os.listdir(self.root / d)
        }


@pytest.fixture(autouse=True)
def _no_read_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier's reads refresh by the wall clock: :class:`SweptDirectory` does it instead."""
    monkeypatch.setattr(file_mod, "_TOUCH_AFTER_S", float("inf"))


def test_ghosts_hold_what_the_swept_directory_holds(tmp_path: Path) -> None:
    clock = Clock()
    max_bytes = 20 * OBJ
    ghosts = ObjectGhostTiers(OBJ, max_bytes, touch_after_s=TOUCH, clock=clock)
    dirs = {
        s: SweptDirectory(tmp_path / s, round(max_bytes * float(s)), clock) for s in ghosts.scales
    }
    rng = random.Random(7)
    keys = [f"chunk-{i}".encode() for i in range(120)]
    hits = dict.fromkeys(ghosts.scales, 0)
    evicted = False
    for step in range(800):
        clock.t += rng.choice((0.5, 5.0, 40.0))
        if rng.random() < 0.5:
            k = min(int(rng.paretovariate(0.8)) - 1, len(keys) - 4)
            ends = ghosts.lookup(keys, k, k + 4)
            for s, end in zip(ghosts.scales, ends, strict=True):
                assert dirs[s].read_run(keys, k, k + 4) == end, (step, s)
                hits[s] += end - k
            continue
        key = rng.choice(keys)
        ghosts.uploaded([key])
        for d in dirs.values():
            d.put(key)
        for s in ghosts.scales:  # (a write makes its room first)
            want = {file_mod._place(k.hex())[1] for k in ghosts.ghost(s).keys()}
            assert dirs[s].keys() == want, (step, s)
        evicted = evicted or len(ghosts.ghost("1")) < len({*ghosts.ghost("8").keys()})
    assert evicted  # the bound was reached: the sweep's order was exercised
    assert list(hits.values()) == sorted(hits.values()) and hits["8"] > hits["0.5"], hits


def test_a_young_object_is_not_made_young_by_a_read() -> None:
    clock = Clock()
    g = ObjectGhost(1, None, low_water=0.9, touch_after_s=TOUCH, clock=clock)
    g.put(b"a")
    g.put(b"b")
    g.read_run([b"a"], 0, 1)  # younger than TOUCH: the real tier leaves its mtime
    assert g.keys() == [b"a", b"b"]
    clock.t += TOUCH + 1
    g.read_run([b"a"], 0, 1)
    assert g.keys() == [b"b", b"a"]


def test_unbounded_tier_scales() -> None:
    ghosts = ObjectGhostTiers(10, None, clock=Clock())
    keys = [bytes([i]) for i in range(40)]
    ghosts.uploaded(keys)
    # scales >= 1 are the tier itself (one ghost, never evicting); 0.5 keeps half, LRU
    assert len(ghosts.ghosts) == 2
    assert all(len(ghosts.ghost(s)) == 40 for s in ("1", "2", "4", "8"))
    assert ghosts.ghost("0.5").keys() == keys[20:]
    assert ghosts.lookup(keys, 0, 40) == (0, 40, 40, 40, 40)
    assert ghosts.lookup(keys, 30, 40) == (40, 40, 40, 40, 40)
