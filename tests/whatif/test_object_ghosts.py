"""Ghost object tiers against the real bound they model: a :class:`FileTier` directory
with ``max_bytes`` kept by its own :class:`DirectorySweep` on every write, driven by the same random
writes and reads, holds exactly the keys the ghost of that bound holds, at every scale;
an unbounded tier's ghosts: scales >= 1 never evict, 0.5 keeps half; the ghosts (keys kept
as fingerprints in flat arrays) equal the plain OrderedDict model they replaced, and a
ghost entry costs at most 64 bytes."""

from __future__ import annotations

import os
import random
import tracemalloc
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.objects.tiers import file as file_mod
from kvtier.objects.tiers.file import FileTier
from kvtier.objects.tiers.file_layout import place
from kvtier.whatif import objects as ghosts_mod
from kvtier.whatif.objects import ObjectGhost, ObjectGhostTiers
from kvtier.whatif.queue import fingerprint

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


def held(ghost: ObjectGhost, candidates: Iterable[bytes]) -> list[bytes]:
    """The keys of ``candidates`` the ghost holds, least recently used first (the ghost
    keeps fingerprints only); every key it holds must be among them."""
    by_fp = {fingerprint(k): k for k in candidates}
    return [by_fp[fp] for fp in ghost.fingerprints()]


class RefObjectGhost:
    """The plain model the ghost must equal: the keys themselves in an OrderedDict, key ->
    when it was last made young (the implementation before fingerprints)."""

    def __init__(
        self,
        chunk_bytes: int,
        capacity: int | None,
        *,
        low_water: float,
        touch_after_s: float,
        clock: Callable[[], float],
        fraction_of: tuple[float, RefObjectGhost] | None = None,
    ) -> None:
        self.chunk_bytes = max(1, chunk_bytes)
        self.capacity = capacity
        self.low_water = low_water
        self.touch_after_s = touch_after_s
        self.clock = clock
        self.fraction_of = fraction_of
        self._lru: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def keys(self) -> list[bytes]:
        return list(self._lru)

    @property
    def total_bytes(self) -> int:
        return len(self._lru) * self.chunk_bytes

    def put(self, key: bytes, now: float | None = None) -> None:
        if key in self._lru:
            return
        self._lru[key] = self.clock() if now is None else now
        if self.fraction_of is not None:
            share, of = self.fraction_of
            self._evict_to(int(share * of.total_bytes))
        elif self.capacity is not None and self.total_bytes > self.capacity:
            self._evict_to(int(self.capacity * self.low_water), keep=1)

    def read_run(
        self, keys: Sequence[bytes], start: int, stop: int, now: float | None = None
    ) -> int:
        now = self.clock() if now is None else now
        lru = self._lru
        i = start
        while i < stop:
            t = lru.get(keys[i])
            if t is None:
                break
            if now - t > self.touch_after_s:
                lru[keys[i]] = now
                lru.move_to_end(keys[i])
            i += 1
        return i

    def _evict_to(self, target: int, keep: int = 0) -> None:
        lru = self._lru
        while len(lru) > keep and len(lru) * self.chunk_bytes > target:
            lru.popitem(last=False)


def ref_tiers(
    chunk_bytes: int, max_bytes: int | None, low_water: float, clock: Clock
) -> ObjectGhostTiers:
    """The same tiers, their ghosts the model's (:class:`RefObjectGhost`)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ghosts_mod, "ObjectGhost", RefObjectGhost)
        ref = ObjectGhostTiers(
            chunk_bytes, max_bytes, low_water=low_water, touch_after_s=30.0, clock=clock
        )
    assert all(isinstance(g, RefObjectGhost) for g in ref.ghosts)
    return ref


def ref_keys(ghost: object) -> list[bytes]:
    assert isinstance(ghost, RefObjectGhost)
    return ghost.keys()


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
        sub, name = place(key.hex())
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
            # the directory's objects, as the fingerprints of their keys: those the ghost holds
            names = dirs[s].keys()
            on_disk = [k for k in keys if place(k.hex())[1] in names]
            assert len(on_disk) == len(names), (step, s)
            got = ghosts.ghost(s).fingerprints()
            assert len(got) == len(ghosts.ghost(s)), (step, s)
            assert sorted(got) == sorted(fingerprint(k) for k in on_disk), (step, s)
        evicted = evicted or len(ghosts.ghost("1")) < len({*ghosts.ghost("8").fingerprints()})
    assert evicted  # the bound was reached: the sweep's order was exercised
    assert list(hits.values()) == sorted(hits.values()) and hits["8"] > hits["0.5"], hits


def test_a_young_object_is_not_made_young_by_a_read() -> None:
    clock = Clock()
    g = ObjectGhost(1, None, low_water=0.9, touch_after_s=TOUCH, clock=clock)
    g.put(b"a")
    g.put(b"b")
    g.read_run([b"a"], 0, 1)  # younger than TOUCH: the real tier leaves its mtime
    assert held(g, [b"a", b"b"]) == [b"a", b"b"]
    clock.t += TOUCH + 1
    g.read_run([b"a"], 0, 1)
    assert held(g, [b"a", b"b"]) == [b"b", b"a"]


def test_unbounded_tier_scales() -> None:
    ghosts = ObjectGhostTiers(10, None, clock=Clock())
    keys = [bytes([i]) for i in range(40)]
    ghosts.uploaded(keys)
    # scales >= 1 are the tier itself (one ghost, never evicting); 0.5 keeps half, LRU
    assert len(ghosts.ghosts) == 2
    assert all(len(ghosts.ghost(s)) == 40 for s in ("1", "2", "4", "8"))
    assert held(ghosts.ghost("0.5"), keys) == keys[20:]
    assert ghosts.lookup(keys, 0, 40) == (0, 40, 40, 40, 40)
    assert ghosts.lookup(keys, 30, 40) == (40, 40, 40, 40, 40)


_POOL = [f"chunk-{i}".encode() for i in range(24)]
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.lists(st.integers(0, len(_POOL) - 1), max_size=6)),
        st.tuples(
            st.just("read"),
            st.lists(st.integers(0, len(_POOL) - 1), min_size=1, max_size=8),
            st.integers(0, 8),
            st.integers(0, 8),
        ),
        st.tuples(st.just("tick"), st.sampled_from((0.0, 0.5, 1.0, 29.0, 30.0, 31.0, 100.0))),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(
    chunk_bytes=st.sampled_from((1, 7, 10)),
    max_bytes=st.one_of(st.none(), st.integers(1, 120)),
    low_water=st.sampled_from((0.0, 0.5, 0.9, 1.0)),
    ops=_OPS,
)
def test_ghosts_equal_the_ordered_dict_model(
    chunk_bytes: int, max_bytes: int | None, low_water: float, ops: list[tuple[Any, ...]]
) -> None:
    """Random uploads, lookups (duplicates in a run too) and clock steps (around
    ``touch_after_s``): every scale's ghost holds the model's keys in its order, and the
    lookups answer alike (every ghost: the model built by the same ObjectGhostTiers)."""
    clock = Clock()
    new = ObjectGhostTiers(
        chunk_bytes, max_bytes, low_water=low_water, touch_after_s=30.0, clock=clock
    )
    ref = ref_tiers(chunk_bytes, max_bytes, low_water, clock)
    assert [g.capacity for g in new.ghosts] == [g.capacity for g in ref.ghosts]
    for op in ops:
        if op[0] == "put":
            batch = [_POOL[i] for i in op[1]]
            new.uploaded(batch)
            ref.uploaded(batch)
        elif op[0] == "read":
            run = [_POOL[i] for i in op[1]]
            start, stop = min(op[2], len(run)), min(op[3], len(run))
            assert new.lookup(run, start, stop) == ref.lookup(run, start, stop)
        else:
            clock.t += op[1]
        for g, r in zip(new.ghosts, ref.ghosts, strict=True):
            assert g.fingerprints() == [fingerprint(k) for k in ref_keys(r)]
            assert len(g) == len(r) and g.total_bytes == r.total_bytes
        held_ref = set(ref_keys(ref.ghosts[-1]))
        assert all((k in new.ghosts[-1]) == (k in held_ref) for k in _POOL)


def _churned_bytes_per_entry(make: Callable[[Callable[[], float]], ObjectGhost], n: int) -> float:
    """tracemalloc bytes per entry of the ghost ``make`` builds, after at least ``n``
    uploads of fresh keys (each dropped by the test at once: only what the ghost keeps
    counts), with reads of recent ones made young across the clock's steps, stopped where
    it keeps the most per entry: at the upload that made it evict (down to its low water)
    or grow its table."""
    clock = Clock()
    rng = random.Random(3)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        ghost = make(clock)
        i = 0
        while True:
            held, size = len(ghost), ghost.memory_bytes()
            ghost.put(f"chunk-{i}".encode())
            if i >= n and (len(ghost) <= held or ghost.memory_bytes() > size):
                break
            if i % 4 == 0:
                recent = [f"chunk-{i - rng.randrange(min(i + 1, 500))}".encode()]
                ghost.read_run(recent, 0, 1)
            clock.t += 1.0
            i += 1
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    entries = len(ghost)
    assert entries > 0 and ghost.memory_bytes() <= used
    print(f"{used / entries:.1f} B per entry ({entries} entries, {used} B, {i + 1} puts)")
    return used / entries


@pytest.mark.parametrize("keys", [1000, 5000, 6000, 8192])
def test_a_bounded_ghost_entry_costs_at_most_64_bytes(keys: int) -> None:
    """A full bounded ghost, churned well past its bound (it evicted to its low water
    many times) and measured as it just evicted, at several sizes (its table's size
    follows the bound)."""

    def make(clock: Callable[[], float]) -> ObjectGhost:
        return ObjectGhost(OBJ, keys * OBJ, low_water=0.9, touch_after_s=10.0, clock=clock)

    per_entry = _churned_bytes_per_entry(make, keys * 4)
    assert per_entry <= 64, per_entry


@pytest.mark.parametrize("n", [4000, 20000])
def test_an_unbounded_ghost_entry_costs_at_most_64_bytes(n: int) -> None:
    """Measured as its table just grew (the fewest keys per slot)."""

    def make(clock: Callable[[], float]) -> ObjectGhost:
        return ObjectGhost(OBJ, None, low_water=0.9, touch_after_s=10.0, clock=clock)

    per_entry = _churned_bytes_per_entry(make, n)
    assert per_entry <= 64, per_entry


@pytest.mark.parametrize("max_bytes", [None, 700 * OBJ, 2500 * OBJ])
def test_large_ghosts_equal_the_ordered_dict_model(max_bytes: int | None) -> None:
    """As above with thousands of keys: tables that grow many times, long probe runs."""
    clock = Clock()
    new = ObjectGhostTiers(OBJ, max_bytes, low_water=0.9, touch_after_s=30.0, clock=clock)
    ref = ref_tiers(OBJ, max_bytes, 0.9, clock)
    rng = random.Random(11)
    pool = [rng.randbytes(16) for _ in range(4000)]
    for step in range(20000):
        clock.t += rng.choice((0.0, 1.0, 10.0))
        if rng.random() < 0.4:
            k = rng.randrange(len(pool) - 8)
            assert new.lookup(pool, k, k + 8) == ref.lookup(pool, k, k + 8), step
        else:
            batch = [pool[min(int(rng.paretovariate(0.5)), len(pool)) - 1] for _ in range(3)]
            new.uploaded(batch)
            ref.uploaded(batch)
    for g, r in zip(new.ghosts, ref.ghosts, strict=True):
        assert g.fingerprints() == [fingerprint(k) for k in ref_keys(r)]
    sizes = [len(g) for g in new.ghosts]
    assert max(sizes) > 1000 and min(sizes) < max(sizes)  # grown, and evicted


@pytest.mark.parametrize("max_bytes", [None, 30 * 1000])
def test_queued_ghosts_count_what_applying_at_once_counts(max_bytes: int | None) -> None:
    """The scheduler's object ghosts only queue each upload, lookup and count with the
    time it happened; their thread applies them later, while the clock has moved on:
    every lookup's run ends and every total equal those of the same calls applied at
    once."""
    from kvtier import metrics
    from kvtier.stats import StatsRecorder, Totals, total_name

    names = [total_name(metrics.WHATIF_HIT_TOKENS, ("remote", s)) for s in metrics.WHATIF_SCALES]
    clock = Clock()
    now_totals, queued_totals = Totals(names), Totals(names)
    now = ObjectGhostTiers(
        1000, max_bytes, StatsRecorder(now_totals), touch_after_s=TOUCH, clock=lambda: clock.t
    )
    queued = ObjectGhostTiers(
        1000,
        max_bytes,
        StatsRecorder(queued_totals),
        touch_after_s=TOUCH,
        clock=lambda: clock.t,
        background=True,
    )
    rng = random.Random(4)
    keys = [bytes([i]) * 8 for i in range(80)]
    runs: list[tuple[Sequence[int], Sequence[int]]] = []
    try:
        for step in range(600):
            clock.t += rng.choice((1.0, 30.0, 90.0))
            doc = int(rng.paretovariate(1.0)) % 20
            prompt = keys[doc * 4 : doc * 4 + 4]
            a, b = now.lookup(prompt, 0, 4), queued.lookup(prompt, 0, 4)
            runs.append((a, b))
            for g, end in ((now, a), (queued, b)):
                g.count_run(end, held=16, lo=0, cap=64, chunk_size=16)
            if rng.random() < 0.5:
                now.uploaded(prompt)
                queued.uploaded(prompt)
            if step % 50 == 0:
                queued.count([1] * len(names))
                now.count([1] * len(names))
        clock.t += 10_000  # later still when the rest is applied
        queued.drain()
    finally:
        queued.close()
    assert all(list(a) == list(b) for a, b in runs)
    assert dict(queued_totals) == dict(now_totals)
    assert now_totals[names[-1]] > now_totals[names[0]] > 0
