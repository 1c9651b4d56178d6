"""Ghost host tiers (kvtier.host.ghosts): a plain LRU of chunk keys where nothing is busy,
and exactly the real ChunkIndex at scale 1 under any sequence of its operations
(stores, fetches, failures, pins, upload holds, supersedes, write-back, resets)."""

from __future__ import annotations

import random
import tracemalloc
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.host.ghosts import Ghost, GhostTiers, RealTier
from kvtier.host.index import ChunkIndex, Entry, State
from kvtier.stats import StatsRecorder, Totals


def _no_real(key: bytes) -> Entry | None:
    return None


class BruteLRU:
    """The textbook LRU the ghost must equal when nothing is ever busy."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: list[bytes] = []

    def store(self, key: bytes) -> None:
        if key in self.keys:
            self.keys.remove(key)
        elif len(self.keys) >= self.capacity:
            self.keys.pop(0)
        self.keys.append(key)

    def hit(self, key: bytes) -> bool:
        if key in self.keys:
            self.keys.remove(key)
            self.keys.append(key)
            return True
        return False


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(1, 8),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 20)), max_size=200),
)
def test_ghost_is_plain_lru_when_nothing_is_busy(
    capacity: int, ops: list[tuple[bool, int]]
) -> None:
    ghost = Ghost(capacity, _no_real)
    brute = BruteLRU(capacity)
    for is_store, k in ops:
        key = bytes([k])
        if is_store:
            ghost.begin(key, False, True)
            ghost.commit(key, True, False)
            brute.store(key)
        else:
            end, _ = ghost.ready_run([key], 0, 1)
            if end:
                ghost.touch(key)
            assert bool(end) == brute.hit(key)
        assert list(ghost._lru) == brute.keys
        assert ghost.ready_keys() == set(brute.keys)


class PerGhost:
    """Feeds each ghost of ``tiers`` through :class:`Ghost`'s own methods, one ghost at a
    time: what :class:`GhostTiers`' inline hooks must do."""

    def __init__(self, tiers: GhostTiers) -> None:
        self.ghosts = tiers.ghosts

    def __getattr__(self, hook: str) -> Callable[..., None]:
        def call(*args: Any) -> None:
            for g in self.ghosts:
                getattr(g, hook)(*args)

        return call


class FanOut:
    """One index feeding several ghost sets (the index has one ``ghosts`` slot)."""

    def __init__(self, *targets: object) -> None:
        self.targets = targets

    def __getattr__(self, hook: str) -> Callable[..., None]:
        def call(*args: Any) -> None:
            for t in self.targets:
                getattr(t, hook)(*args)

        return call


class Harness:
    """A real ChunkIndex with ghosts, driven like the scheduler drives it."""

    def __init__(self, slots: int, write_back: bool) -> None:
        self.uploads: list[Entry] = []  # write-back uploads in flight (one ref each)
        self.idx = ChunkIndex(
            slots,
            write_back_needed=(lambda e: not e.remote) if write_back else None,
            begin_write_back=self.uploads.append,
        )
        self.totals = Totals(["whatif_hit_tokens_host_" + s for s in ("0.5", "1", "2", "4", "8")])
        needed = (lambda e: not e.remote) if write_back else None
        # the modelled scale-1 ghost (mirror=False), checked against the index below
        self.ghosts = GhostTiers(slots, self.idx.get, StatsRecorder(self.totals),
                                 write_back_needed=needed, mirror=False)  # fmt: skip
        # what the scheduler runs: scale 1 read from the index itself
        self.mirrored = GhostTiers(slots, self.idx.get, write_back_needed=needed)
        # every ghost fed through its own methods, one by one (the inline hooks' reference)
        self.reference = GhostTiers(slots, self.idx.get, write_back_needed=needed, mirror=False)
        self.idx.ghosts = FanOut(self.ghosts, self.mirrored, PerGhost(self.reference))
        self.inflight: list[bytes] = []  # begun, not committed
        self.pinned: list[bytes] = []
        self.held: list[Entry] = []  # upload holds (write-through, cleaning)
        self.superseded: list[Entry] = []

    def step(self, rng: random.Random, keys: list[bytes]) -> None:
        idx = self.idx
        op = rng.randrange(11)
        key = rng.choice(keys)
        if op <= 2:
            state = State.FETCHING if op == 2 else State.STORING
            if idx.begin(key, state, evict_ok=rng.random() < 0.9) is not None:
                self.inflight.append(key)
            else:
                idx.touch(key)
        elif op == 3 and self.inflight:
            k = self.inflight.pop(rng.randrange(len(self.inflight)))
            idx.commit(k, rng.random() < 0.85)
        elif op == 4:
            if idx.is_ready(key):
                idx.pin(key)
                self.pinned.append(key)
        elif op == 5 and self.pinned:
            idx.unpin(self.pinned.pop(rng.randrange(len(self.pinned))))
        elif op == 6:
            e = idx.get(key)
            if e is not None and e.state is State.READY:
                idx.hold(e)
                self.held.append(e)
        elif op == 7 and (self.held or self.uploads):
            pool = (
                self.held
                if self.held and (not self.uploads or rng.random() < 0.5)
                else self.uploads
            )
            e = pool.pop(rng.randrange(len(pool)))
            e.remote = e.remote or rng.random() < 0.8
            idx.unpin(e.key)
        elif op == 8:
            e = idx.get(key)
            if e is not None and e.state is State.FETCHING:
                new = idx.supersede(key)
                if new is not None:
                    self.superseded.append(e)
        elif op == 9 and self.superseded:
            idx.release_superseded(self.superseded.pop(0))
        elif op == 10:
            r = rng.random()
            if r < 0.03:
                idx.clear()
                self.inflight = [k for k in self.inflight if k in idx]
            elif r < 0.1:
                idx.evict(key)
                self.inflight = [k for k in self.inflight if k in idx]
            else:
                self.lookup(rng, keys)

    def lookup(self, rng: random.Random, keys: list[bytes]) -> None:
        prompt = rng.sample(keys, 4)
        end = self.idx.ready_run(prompt, 0, 4)
        whatif = self.ghosts.lookup(prompt, 0, 4, chunk_size=16, computed=0, cap=4 * 16)
        host = sum(16 for k in prompt[:end] if not self.idx._entries[k].fetched)
        assert whatif[1] == host
        assert self.mirrored.lookup(prompt, 0, 4, chunk_size=16, computed=0, cap=64) == whatif
        assert self.reference.lookup(prompt, 0, 4, chunk_size=16, computed=0, cap=64) == whatif
        for k in prompt[:end]:
            self.idx.pin(k)
            self.pinned.append(k)

    def check(self) -> None:
        self.idx.check()
        one = self.ghosts.ghost("1")
        assert isinstance(one, Ghost) and isinstance(self.mirrored.ghost("1"), RealTier)
        assert set(one._lru) == set(self.idx._entries)
        assert one.ready_keys() == self.idx._ready
        assert one.used <= one.capacity
        for s, g in zip(self.ghosts.scales, self.ghosts.ghosts, strict=True):
            ref = self.reference.ghost(s)
            assert isinstance(g, Ghost) and isinstance(ref, Ghost)
            assert list(g._lru.items()) == list(ref._lru.items()), s
            assert g._evicting == ref._evicting and g._superseded == ref._superseded
            mirrored = self.mirrored.ghost(s)
            if g.capacity == self.idx.num_slots:  # the real tier's size: read from it
                assert isinstance(mirrored, RealTier)
            else:
                assert isinstance(mirrored, Ghost)
                assert list(mirrored._lru.items()) == list(g._lru.items()), s


def _run(seed: int, slots: int, write_back: bool, n_keys: int, steps: int) -> Harness:
    rng = random.Random(seed)
    h = Harness(slots, write_back)
    keys = [bytes([i]) * 8 for i in range(n_keys)]
    for _ in range(steps):
        h.step(rng, keys)
        h.check()
    return h


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    slots=st.integers(1, 8),
    write_back=st.booleans(),
    n_keys=st.integers(4, 24),
)
def test_scale_one_ghost_is_the_real_index(
    seed: int, slots: int, write_back: bool, n_keys: int
) -> None:
    """Every op of the real index, in any order: the scale-1 ghost holds the same keys,
    the same ones ready, and counts the same host hit tokens on every lookup."""
    _run(seed, slots, write_back, n_keys, 300)


def test_larger_ghosts_hit_at_least_as_often_on_plain_traffic() -> None:
    """Stores and lookups alone (Zipf-like keys): more slots never serve less."""
    rng = random.Random(7)
    idx = ChunkIndex(16)
    totals = Totals(["whatif_hit_tokens_host_" + s for s in ("0.5", "1", "2", "4", "8")])
    idx.ghosts = GhostTiers(16, idx.get, StatsRecorder(totals))
    keys = [bytes([i, j]) for i in range(40) for j in range(4)]  # 40 documents of 4 chunks
    weights = [1 / (i + 1) for i in range(40)]
    for _ in range(2000):
        doc = rng.choices(range(40), weights)[0]
        prompt = keys[doc * 4 : doc * 4 + 4]
        idx.ghosts.lookup(prompt, 0, 4, chunk_size=16, computed=0, cap=64)
        for k in prompt:
            if idx.is_ready(k):
                idx.touch(k)
            elif idx.begin(k, State.STORING) is not None:
                idx.commit(k, True)
    got = [totals["whatif_hit_tokens_host_" + s] for s in ("0.5", "1", "2", "4", "8")]
    assert got == sorted(got) and got[0] < got[-1], got


def test_memory_per_ghost_entry() -> None:
    """What one chunk key costs a ghost, measured (the key's own bytes object, shared
    with the real index while it holds the chunk, included)."""
    n = 50_000
    keys = [random.randbytes(32) for _ in range(n)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    ghost = Ghost(n, _no_real)
    for k in keys:
        ghost.begin(k, False, True)
        ghost.commit(k, True, False)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    per_entry = (after - before) / n
    print(f"ghost entry: {per_entry:.1f} bytes (key object not counted)")
    assert isinstance(ghost._lru, OrderedDict) and len(ghost) == n
    assert per_entry <= 160, per_entry


def test_scale_one_reads_the_real_index() -> None:
    """The scheduler's ghosts keep no keys of their own at scale 1: the real tier is that
    ghost (the harness above checks the modelled one equals it), so its memory and its
    work per hook are none; the four other scales keep theirs."""
    idx = ChunkIndex(8)
    idx.ghosts = ghosts = GhostTiers(8, idx.get)
    keys = [bytes([i]) * 8 for i in range(40)]
    for k in keys:
        assert idx.begin(k, State.FETCHING if k[0] % 3 == 0 else State.STORING) is not None
        idx.commit(k, True)
    one = ghosts.ghost("1")
    assert isinstance(one, RealTier) and one.capacity == 8
    assert [len(g) for g in ghosts.ghosts if isinstance(g, Ghost)] == [4, 16, 32, 40]
    got = ghosts.lookup(keys, 32, 40, chunk_size=16, computed=32 * 16, cap=40 * 16)
    stored = [k for k in keys[32:] if k[0] % 3]  # the last 8 are held; fetched are not host's
    assert got[1] == 16 * len(stored)
