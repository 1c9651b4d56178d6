"""Ghost host tiers (kvtier.whatif.host): the fingerprint table is a dict, the shared
recency log is a textbook LRU at every capacity at once, the modelled scale-1 ghost is
the real ChunkIndex wherever nothing is busy when it evicts, the queue applied on a
thread counts what applying it in place counts, and a tracked chunk costs at most 64
bytes."""

from __future__ import annotations

import logging
import random
import threading
import time
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.host.index import STORED, ChunkIndex, State
from kvtier.stats import StatsRecorder, Totals
from kvtier.whatif.host import FingerprintTable, GhostTiers, StackLRU
from kvtier.whatif.queue import fingerprint

SCALES = ("0.5", "1", "2", "4", "8")


class BruteLRU:
    """The textbook LRU every ghost must equal."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: list[int] = []

    def use(self, key: int) -> None:
        if key in self.keys:
            self.keys.remove(key)
        elif len(self.keys) >= self.capacity:
            self.keys.pop(0)
        self.keys.append(key)

    def remove(self, key: int) -> None:
        if key in self.keys:
            self.keys.remove(key)


def _both(stack: StackLRU, brutes: list[BruteLRU], remove: bool, key: int) -> None:
    """One use (or removal) of ``key``, in the stack and in every textbook LRU."""
    if remove:
        stack.remove(key)
        for b in brutes:
            b.remove(key)
    else:
        stack.use(key, 1)
        for b in brutes:
            b.use(key)


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(1, 40),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 60)), max_size=300),
)
def test_fingerprint_table_is_a_dict(size: int, ops: list[tuple[bool, int]]) -> None:
    """Adds and removes (backward-shift deletion, wrap-around, growth) agree with a dict;
    keys collide on purpose (multiples of the table size share a home slot)."""
    table = FingerprintTable(size)
    want: dict[int, int] = {}
    for n, (add, k) in enumerate(ops):
        fp = k * 16 if k % 3 else k  # many share a home slot
        slot = table.find(fp)
        assert (slot >= 0) == (fp in want)
        if add and fp not in want:
            table.add(fp, n)
            want[fp] = n
        elif not add and fp in want:
            table.remove(slot)
            del want[fp]
        assert len(table) == len(want)
        for f, pos in want.items():
            assert table.pos[table.find(f)] == pos


@settings(max_examples=200, deadline=None)
@given(
    caps=st.lists(st.integers(1, 12), min_size=1, max_size=5).map(sorted),
    ops=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 30)), max_size=300),
)
def test_stack_is_a_plain_lru_at_every_capacity(
    caps: list[int], ops: list[tuple[int, int]]
) -> None:
    stack = StackLRU(caps)
    brutes = [BruteLRU(c) for c in caps]
    for op, key in ops:
        _both(stack, brutes, op == 0, key)
        for g, b in enumerate(brutes):
            assert [fp for fp, _ in stack.keys(g)] == b.keys
        assert len(stack) == len(brutes[-1].keys)


def test_the_log_is_compacted_and_keeps_every_ghost() -> None:
    """Far more uses than the log's slack (4,096): it is compacted many times over, and
    every ghost still equals its textbook LRU; the log stays within twice the keys."""
    rng = random.Random(3)
    caps = [50, 100, 400, 800]
    stack = StackLRU(caps)
    brutes = [BruteLRU(c) for c in caps]
    longest = 0
    for _ in range(60_000):
        key = int(rng.paretovariate(0.8)) % 3000 + 1
        _both(stack, brutes, rng.random() < 0.02, key)
        longest = max(longest, len(stack.log))
    for g, b in enumerate(brutes):
        assert [fp for fp, _ in stack.keys(g)] == b.keys
    assert longest <= 2 * caps[-1] + 4096 + 1


class Harness:
    """A real ChunkIndex feeding the modelled ghosts (scale 1 modelled too), driven so
    that nothing is busy when the index evicts and nothing fails: a store settles before
    the next begins, a lookup's pins are released before the next store."""

    def __init__(self, slots: int) -> None:
        self.idx = ChunkIndex(slots)
        names = ["whatif_hit_tokens_host_" + s for s in SCALES]
        self.totals = Totals(names)
        self.model = GhostTiers(slots, self.idx.get, StatsRecorder(self.totals), mirror=False)
        self.idx.ghost_events = self.model.record

    def step(self, rng: random.Random, keys: list[bytes]) -> None:
        idx = self.idx
        op = rng.randrange(10)
        key = rng.choice(keys)
        if op <= 3:
            state = State.FETCHING if op == 3 else State.STORING
            if idx.begin(key, state) is not None:
                idx.commit(key, True)
            else:
                idx.touch(key)
        elif op <= 7:
            self.lookup(rng, keys)
        elif op == 8:
            if rng.random() < 0.1:
                idx.clear()
            else:
                idx.evict(key)
        else:
            e = idx.get(key)
            if e is not None and e.state is State.FETCHING:
                idx.supersede(key)

    def lookup(self, rng: random.Random, keys: list[bytes]) -> None:
        prompt = rng.sample(keys, 4)
        end = self.idx.ready_run(prompt, 0, 4)
        self.model.lookup(prompt, 0, 4, chunk_size=16, computed=0, cap=64)
        (counts,) = self.model.drain()
        host = sum(16 for k in prompt[:end] if not self.idx.get(k).fetched)  # type: ignore[union-attr]
        assert counts[1] == host, (counts, host)
        for k in prompt[:end]:
            self.idx.pin(k)
        for k in prompt[:end]:
            self.idx.unpin(k)

    def check(self) -> None:
        self.model.drain()
        self.idx.check()
        ghost = self.model.ghost_keys("1")
        real = {fingerprint(k): e for k, e in self.idx._entries.items()}
        assert [fp for fp, _ in ghost] == list(real)  # the same keys, in the same LRU order
        assert all(e.state is State.READY for e in real.values())
        assert [fetched for _, fetched in ghost] == [e.fetched for e in real.values()]


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32), slots=st.integers(1, 8), n_keys=st.integers(4, 24))
def test_modelled_scale_one_is_the_real_index_when_nothing_is_busy(
    seed: int, slots: int, n_keys: int
) -> None:
    """Stores, fetches, hits (pins), touches, evictions and resets: the modelled scale-1
    ghost holds the index's keys, in its order, fetched or stored as there, and counts
    the same host tokens on every lookup."""
    rng = random.Random(seed)
    h = Harness(slots)
    keys = [bytes([i]) * 8 for i in range(n_keys)]
    for _ in range(300):
        h.step(rng, keys)
        h.check()


def test_a_chunk_enters_the_ghosts_when_its_store_settles() -> None:
    """The real tier (2 slots) stores a chunk again that only the larger ghosts still
    hold: it stays a hit in those while it is stored, and in no smaller one; a failed
    store leaves them as they were; a settled one makes it the most recent in all."""
    idx = ChunkIndex(2)
    ghosts = GhostTiers(2, idx.get, scales=("0.5", "1", "2", "4"))
    idx.ghost_events = ghosts.record
    keys = [bytes([i]) * 8 for i in range(6)]
    for k in keys:  # a, b, c, d, e, f: the 4x ghost (8) holds all, the 2x ghost (4) c..f
        idx.begin(k, State.STORING)
        idx.commit(k, True)
    assert idx.begin(keys[2], State.STORING) is not None  # c again: the real tier lost it
    ghosts.lookup(keys, 2, 3, chunk_size=16, computed=32, cap=48)
    assert ghosts.drain() == [[0, 0, 16, 16]]
    idx.commit(keys[2], False)  # failed: the ghosts that held c still do
    ghosts.lookup(keys, 2, 3, chunk_size=16, computed=32, cap=48)
    assert ghosts.drain() == [[0, 0, 16, 16]]
    assert idx.begin(keys[2], State.STORING) is not None
    idx.commit(keys[2], True)  # settled: c is the most recent chunk of every ghost
    ghosts.lookup(keys, 2, 3, chunk_size=16, computed=32, cap=48)
    assert ghosts.drain() == [[16, 16, 16, 16]]


def test_larger_ghosts_hit_at_least_as_often_on_plain_traffic() -> None:
    """Stores and lookups alone (Zipf-like documents): more slots never serve less, and
    scale 1 (read from the index) equals the modelled scale 1."""
    rng = random.Random(7)
    idx = ChunkIndex(16)
    totals = Totals(["whatif_hit_tokens_host_" + s for s in SCALES])
    ghosts = GhostTiers(16, idx.get, StatsRecorder(totals))
    model = GhostTiers(16, idx.get, mirror=False)

    def both(event: tuple[int, bytes]) -> None:
        ghosts.record(event)
        model.record(event)

    idx.ghost_events = both
    keys = [bytes([i, j]) for i in range(40) for j in range(4)]  # 40 documents of 4 chunks
    weights = [1 / (i + 1) for i in range(40)]
    for _ in range(2000):
        doc = rng.choices(range(40), weights)[0]
        prompt = keys[doc * 4 : doc * 4 + 4]
        ghosts.lookup(prompt, 0, 4, chunk_size=16, computed=0, cap=64)
        model.lookup(prompt, 0, 4, chunk_size=16, computed=0, cap=64)
        assert ghosts.drain() == model.drain()
        for k in prompt:
            if idx.is_ready(k):
                idx.touch(k)
            elif idx.begin(k, State.STORING) is not None:
                idx.commit(k, True)
    got = [totals["whatif_hit_tokens_host_" + s] for s in SCALES]
    assert got == sorted(got) and got[0] < got[-1], got


def test_the_thread_counts_what_draining_in_place_counts() -> None:
    """The scheduler's ghosts apply the queue on their thread while the index keeps
    appending from another: the totals equal those of the same events applied in
    place, in order."""
    rng = random.Random(11)
    names = ["whatif_hit_tokens_host_" + s for s in SCALES]
    threaded_totals, inline_totals = Totals(names), Totals(names)
    idx = ChunkIndex(32)
    threaded = GhostTiers(32, idx.get, StatsRecorder(threaded_totals), background=True)
    inline = GhostTiers(32, idx.get, StatsRecorder(inline_totals))

    def both(event: tuple[int, bytes]) -> None:
        threaded.record(event)
        inline.record(event)

    idx.ghost_events = both
    keys = [bytes([i, j]) for i in range(60) for j in range(4)]
    weights = [1 / (i + 1) for i in range(60)]
    try:
        for step in range(3000):
            doc = rng.choices(range(60), weights)[0]
            prompt = keys[doc * 4 : doc * 4 + 4]
            for g in (threaded, inline):
                g.lookup(prompt, 0, 4, chunk_size=16, computed=0, cap=64)
            for k in prompt:
                if idx.is_ready(k):
                    idx.touch(k)
                elif idx.begin(k, State.STORING) is not None:
                    idx.commit(k, True)
            if step % 7 == 0:
                time.sleep(0.001)  # the thread applies part of the queue meanwhile
        inline.drain()
        threaded.drain()
    finally:
        threaded.close()
    assert threaded.queue.thread is not None and not threaded.queue.thread.is_alive()
    assert dict(threaded_totals) == dict(inline_totals)
    assert threaded_totals["whatif_hit_tokens_host_8"] > threaded_totals["whatif_hit_tokens_host_1"]


def test_a_broken_ghost_stops_counting_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    """A fault while applying the queue (a bug) is logged once and ends the what-if
    counts; the hooks and drain keep working, so no request fails for a metric."""
    idx = ChunkIndex(4)
    ghosts = GhostTiers(4, idx.get)
    idx.ghost_events = ghosts.record

    def boom(*args: object) -> None:
        raise RuntimeError("ghost bug")

    ghosts.queue._apply = boom
    with caplog.at_level(logging.ERROR, logger="kvtier.whatif.queue"):
        for k in (b"a", b"b"):
            idx.begin(k, State.STORING)
            idx.commit(k, True)
        ghosts.lookup([b"a"], 0, 1, chunk_size=16, computed=0, cap=16)
        assert ghosts.drain() == []
    assert ghosts.queue.broken and "stopped counting" in caplog.text
    assert caplog.text.count("stopped counting") == 1
    assert not ghosts.queue.events  # the queue keeps emptying


def test_memory_per_tracked_chunk_at_most_64_bytes() -> None:
    """Everything the ghosts keep (tracemalloc: table, log, flags; the keys are not
    kept, only their fingerprints), every ghost full and churned, per chunk the largest
    ghost tracks; and per ghost entry (each of the four modelled ghosts holds its own
    share of them)."""
    slots = 4096
    rng = random.Random(5)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    ghosts = GhostTiers(slots, lambda k: None)
    for n in range(slots * 12):
        ghosts.record((STORED, rng.randbytes(32)))
        if n % 1000 == 0:
            ghosts.drain()
    ghosts.drain()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    tracked = len(ghosts.stack)
    entries = sum(ghosts.stack.held)
    assert tracked == slots * 8 and entries == slots * (8 + 4 + 2) + slots // 2
    print(f"{used / tracked:.1f} B per tracked chunk, {used / entries:.1f} B per ghost entry")
    assert used / tracked <= 64, used / tracked
    assert ghosts.stack.memory_bytes() <= used


def test_hooks_do_not_wait_for_the_thread() -> None:
    """While the thread applies a long queue, a hook appends at once (the lock is the
    thread's only: the scheduler step never waits for it except in drain)."""
    idx = ChunkIndex(64)
    ghosts = GhostTiers(64, idx.get, background=True)
    try:
        with ghosts.queue.lock:  # the thread busy applying
            done = threading.Event()

            def hooks() -> None:
                for i in range(1000):
                    ghosts.record((STORED, i.to_bytes(4, "big")))
                done.set()

            t = threading.Thread(target=hooks)
            t.start()
            assert done.wait(5)
            t.join()
    finally:
        ghosts.close()


def test_the_thread_ends_with_its_ghosts() -> None:
    """A scheduler side dropped without ``shutdown`` (tests, a failed start) leaves no
    thread behind: it holds its ghosts weakly."""
    import gc

    ghosts = GhostTiers(8, lambda k: None, background=True)
    thread = ghosts.queue.thread
    assert thread is not None and thread.is_alive()
    del ghosts
    gc.collect()
    thread.join(timeout=3)
    assert not thread.is_alive()


def test_a_starved_thread_resets_the_ghosts_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The queue is bounded: when the thread falls that far behind (its oldest events
    dropped), the ghosts start again empty, with a warning, instead of counting from a
    history with holes or growing without bound."""
    from kvtier.whatif import queue as ghosts_mod

    monkeypatch.setattr(ghosts_mod, "MAX_QUEUED", 64)
    idx = ChunkIndex(8)
    ghosts = GhostTiers(8, idx.get)
    idx.ghost_events = ghosts.record
    for i in range(40):  # 40 stores: the ghosts hold them
        idx.begin(bytes([i]), State.STORING)
        idx.commit(bytes([i]), True)
    ghosts.drain()
    assert len(ghosts.stack) == 40
    for i in range(100):  # more than the queue holds, nothing applied meanwhile
        ghosts.record((STORED, bytes([100 + i])))
    assert len(ghosts.queue.events) == 64
    with caplog.at_level(logging.WARNING, logger="kvtier.whatif.queue"):
        ghosts.queue.overflowed()
    assert len(ghosts.stack) == 0 and not ghosts.queue.events
    assert "fell 64 events behind" in caplog.text
