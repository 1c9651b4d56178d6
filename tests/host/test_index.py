"""The host tier's index: two-phase stores, LRU eviction, ref counts, rollback."""

from __future__ import annotations

import pytest

from kvtier.host.index import ChunkIndex, Entry, State


def ready(idx: ChunkIndex, key: str) -> int:
    entry = idx.begin(key, State.STORING)
    assert entry is not None
    idx.commit(key, True)
    return entry.slot


def test_only_ready_chunks_are_hits() -> None:
    idx = ChunkIndex(2)
    idx.begin("a", State.STORING)
    assert "a" in idx and not idx.is_ready("a")
    idx.commit("a", True)
    assert idx.is_ready("a")


def test_failed_store_rolls_back_and_frees_the_slot() -> None:
    idx = ChunkIndex(1)
    idx.begin("a", State.STORING)
    idx.commit("a", False)
    assert "a" not in idx and idx.used_slots == 0
    idx.check()


def test_lru_evicts_oldest_unpinned() -> None:
    idx = ChunkIndex(2)
    ready(idx, "a")
    ready(idx, "b")
    idx.touch("a")  # b is now the oldest
    ready(idx, "c")
    assert "b" not in idx and idx.is_ready("a") and idx.is_ready("c")
    assert idx.evictions == 1
    idx.check()


def test_pinned_chunk_is_never_evicted() -> None:
    idx = ChunkIndex(1)
    ready(idx, "a")
    idx.pin("a")
    assert idx.begin("b", State.STORING) is None  # nothing evictable
    idx.unpin("a")
    assert idx.begin("b", State.STORING) is not None
    assert "a" not in idx
    idx.check()


def test_storing_and_fetching_chunks_are_not_evicted() -> None:
    idx = ChunkIndex(2)
    idx.begin("a", State.STORING)
    idx.begin("b", State.FETCHING)
    assert idx.begin("c", State.STORING) is None
    idx.commit("b", True)
    assert idx.get("b").fetched and idx.get("b").remote  # came from the object tier
    assert idx.begin("c", State.STORING) is not None
    idx.check()


def test_held_chunk_whose_store_failed_is_freed_when_released() -> None:
    idx = ChunkIndex(1)
    entry = idx.begin("a", State.STORING)
    idx.hold(entry)  # an upload was queued with the store
    idx.commit("a", False)
    assert idx.get("a").state is State.EVICTING and idx.used_slots == 1
    idx.unpin("a")
    assert "a" not in idx and idx.used_slots == 0
    idx.check()


def test_evict_while_pinned_waits_for_unpin() -> None:
    idx = ChunkIndex(1)
    ready(idx, "a")
    idx.pin("a")
    assert idx.evict("a")
    assert not idx.is_ready("a") and idx.used_slots == 1
    idx.unpin("a")
    assert idx.used_slots == 0


def test_unbalanced_unpin_is_an_error() -> None:
    idx = ChunkIndex(1)
    ready(idx, "a")
    with pytest.raises(ValueError):
        idx.unpin("a")
    with pytest.raises(KeyError):
        idx.pin("zzz")  # absent


def test_duplicate_begin_is_refused() -> None:
    idx = ChunkIndex(2)
    assert idx.begin("a", State.STORING) is not None
    assert idx.begin("a", State.STORING) is None


def test_clear_drops_unpinned_ready_only() -> None:
    idx = ChunkIndex(3)
    ready(idx, "a")
    ready(idx, "b")
    idx.pin("b")
    idx.begin("c", State.STORING)
    assert idx.clear() == 1
    assert "a" not in idx and "b" in idx and "c" in idx
    idx.check()


def test_a_store_supersedes_an_unreported_fetch_without_reusing_its_slot() -> None:
    """The fetch's read may still be writing its slot: the store gets another one, the
    fetch's slot is freed only when that fetch is reported, and the key is the store's."""
    heard: list[tuple[str, str]] = []
    idx = ChunkIndex(3)
    idx.listener = type(
        "L",
        (),
        {
            "chunk_ready": lambda self, e: heard.append(("ready", e.key)),
            "chunk_dropped": lambda self, e: heard.append(("dropped", e.key)),
        },
    )()
    fetch = idx.begin("a", State.FETCHING)
    assert fetch is not None
    assert idx.supersede("b") is None, "only a fetching chunk is superseded"
    store = idx.supersede("a")
    assert store is not None and store.slot != fetch.slot and store.state is State.STORING
    assert idx.get("a") is store and idx.superseded == 1 and idx.used_slots == 2
    idx.check()
    assert idx.commit("a", True) is store and idx.is_ready("a")
    assert idx.begin("b", State.STORING) is not None  # the third slot
    assert idx.begin("c", State.STORING, evict_ok=False) is None, "the fetch's slot is taken"
    assert idx.release_superseded(fetch) and not idx.release_superseded(fetch)
    assert not idx.release_superseded(store), "a live entry is not superseded"
    assert idx.is_ready("a") and idx.used_slots == 2 and idx.superseded == 0
    assert heard == [("ready", "a")], "the superseded fetch was never a chunk anyone heard of"
    idx.check()


def test_a_store_that_finds_no_slot_leaves_the_fetch_as_it_was() -> None:
    idx = ChunkIndex(1)
    fetch = idx.begin("a", State.FETCHING)
    assert idx.supersede("a") is None
    assert idx.get("a") is fetch and fetch.state is State.FETCHING and idx.superseded == 0
    idx.check()


def test_random_workload_keeps_invariants() -> None:
    import random

    rnd = random.Random(7)
    idx = ChunkIndex(5)
    pinned: list[str] = []
    superseded: list[Entry] = []
    for _ in range(3000):
        key = f"k{rnd.randrange(20)}"
        op = rnd.random()
        if op < 0.4:
            e = idx.begin(key, rnd.choice([State.STORING, State.FETCHING]))
            if e is not None and e.state is State.FETCHING and rnd.random() < 0.5:
                store = idx.supersede(key)  # a store while the fetch is unreported
                if store is not None:
                    superseded.append(e)
                    idx.commit(key, rnd.random() < 0.9)
            elif e is not None:
                idx.commit(key, rnd.random() < 0.9)
        elif op < 0.45 and superseded:
            assert idx.release_superseded(superseded.pop(0))
        elif op < 0.6 and idx.is_ready(key):
            idx.pin(key)
            pinned.append(key)
        elif op < 0.8 and pinned:
            idx.unpin(pinned.pop(rnd.randrange(len(pinned))))
        else:
            idx.touch(key)
        idx.check()
    for key in pinned:
        idx.unpin(key)
    for entry in superseded:
        assert idx.release_superseded(entry)
    assert idx.total_refs() == 0 and idx.superseded == 0
    idx.check()


def _write_back_index(num_slots: int, uploads: list[str]) -> ChunkIndex:
    return ChunkIndex(
        num_slots,
        write_back_needed=lambda e: not e.remote,
        begin_write_back=lambda e: uploads.append(e.key),
    )


def test_write_back_claims_a_victim_until_released() -> None:
    uploads: list[str] = []
    idx = _write_back_index(2, uploads)
    ready(idx, "a")
    ready(idx, "b")
    idx.get("b").remote = True  # already in the object tier: evicted at once
    assert idx.begin("c", State.STORING) is not None
    assert uploads == ["a"] and idx.get("a").state is State.EVICTING
    assert "b" not in idx
    assert idx.begin("d", State.STORING) is None  # a is uploading, c is storing
    idx.unpin("a")  # upload finished: the slot is free again
    assert "a" not in idx and idx.begin("d", State.STORING) is not None
    idx.check()


def test_write_back_begins_one_upload_per_slot_asked_for() -> None:
    """A full host tier of chunks not yet uploaded: each store that needs a slot starts the
    write-back of the oldest chunk only; the rest stay ready (hits), not all queued."""
    uploads: list[str] = []
    idx = _write_back_index(8, uploads)
    for i in range(8):
        ready(idx, f"k{i}")
    assert idx.begin("new0", State.STORING) is None  # skipped: k0 is being written back
    assert uploads == ["k0"]
    assert [k for k in (f"k{i}" for i in range(8)) if idx.is_ready(k)] == [
        f"k{i}" for i in range(1, 8)
    ]
    assert idx.begin("new1", State.STORING) is None
    assert uploads == ["k0", "k1"]
    idx.unpin("k0")  # k0's upload is done: its slot serves the next store
    assert idx.begin("new2", State.STORING) is not None
    assert uploads == ["k0", "k1"] and idx.evictions == 2
    idx.check()


def test_ready_run_stops_at_the_first_chunk_that_is_not_a_hit() -> None:
    """A lookup's fast probe must give what probing each key in turn gives: a run with
    a gap (a middle chunk evicted, or still storing/fetching) ends at the gap, never
    past it (loading past a gap would load a slot holding another chunk's KV)."""
    import random

    rnd = random.Random(3)
    keys = [f"c{i}" for i in range(12)]
    for _ in range(400):
        idx = ChunkIndex(8)
        for key in keys:
            if rnd.random() < 0.8:
                state = rnd.choice([State.STORING, State.FETCHING, State.STORING])
                if idx.begin(key, state) is not None and rnd.random() < 0.85:
                    idx.commit(key, True)
        start, stop = rnd.randrange(len(keys)), rnd.randrange(len(keys) + 2)
        naive = start
        while naive < min(stop, len(keys)) and idx.is_ready(keys[naive]):
            naive += 1
        assert idx.ready_run(keys, start, stop) == naive
    idx = ChunkIndex(4)
    for key in ("a", "b", "c"):
        ready(idx, key)
    idx.evict("b")
    assert idx.ready_run(["a", "b", "c"], 0, 3) == 1
    assert idx.ready_run(["a", "b", "c"], 2, 3) == 3
    assert idx.ready_run(["a", "b", "c"], 2, 2) == 2


def test_entry_flags_are_independent() -> None:
    idx = ChunkIndex(1)
    e = idx.begin("a", State.FETCHING)
    assert e is not None and not (e.remote or e.fetched or e.uploading)
    e.uploading = True
    idx.commit("a", True)  # a fetch: it came from the object tier, so it is there
    assert (e.remote, e.fetched, e.uploading) == (True, True, True)
    e.uploading = False
    assert (e.remote, e.fetched, e.uploading) == (True, True, False)
    e.remote = False
    assert (e.remote, e.fetched, e.uploading) == (False, True, False)
    assert e.block_hash == e.key == "a"


def test_a_full_collection_never_walks_the_index() -> None:
    """vLLM freezes its heap after start-up (``gc.freeze``), the index's containers with
    it; the entries made later are kept out of the collector's lists, so a full
    collection's work does not grow with the chunks held (0.13 s at 1M chunks
    otherwise). Entries can be left out only because they hold no container."""
    import gc

    idx = ChunkIndex(20_000)
    gc.collect()
    gc.freeze()
    try:
        before = len(gc.get_objects())
        for i in range(10_000):
            ready(idx, f"k{i}")
        idx.begin("storing", State.STORING)
        idx.pin("k0")
        grown = len(gc.get_objects()) - before
        assert grown < 100, f"{grown} new objects for the collector to walk"
        entries = [idx.get(f"k{i}") for i in range(10_000)] + [idx.get("storing")]
        assert not any(gc.is_tracked(e) for e in entries)
        atomic = (bytes, str, int, State)
        for e in entries:
            assert e is not None
            assert all(isinstance(getattr(e, f), atomic) for f in Entry.__slots__), e
    finally:
        gc.unfreeze()
    idx.unpin("k0")
    for i in range(10_000):
        idx.evict(f"k{i}")
    idx.check()
    assert len(idx) == 1
