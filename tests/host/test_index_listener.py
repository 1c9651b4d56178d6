"""ChunkIndex's listener (what KV events are built from) and a reset that is complete."""

from __future__ import annotations

from kvtier.host.index import ChunkIndex, Entry, State


class Log:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def chunk_ready(self, entry: Entry) -> None:
        self.calls.append(("ready", entry.key))

    def chunk_dropped(self, entry: Entry) -> None:
        self.calls.append(("dropped", entry.key))


def make(n: int) -> tuple[ChunkIndex, Log]:
    idx = ChunkIndex(n)
    log = Log()
    idx.listener = log
    return idx, log


def test_commit_ok_is_ready_and_a_failure_is_a_drop() -> None:
    idx, log = make(3)
    idx.begin("a", State.STORING)
    idx.begin("b", State.FETCHING)
    idx.commit("a", True)
    idx.commit("b", False)
    assert log.calls == [("ready", "a"), ("dropped", "b")]


def test_a_failed_store_held_by_an_upload_drops_when_released() -> None:
    idx, log = make(2)
    e = idx.begin("a", State.STORING)
    assert e is not None
    idx.hold(e)
    idx.commit("a", False)
    assert log.calls == []
    idx.unpin("a")
    assert log.calls == [("dropped", "a")]


def test_lru_eviction_is_a_drop() -> None:
    idx, log = make(1)
    idx.begin("a", State.STORING)
    idx.commit("a", True)
    idx.begin("b", State.STORING)
    assert log.calls == [("ready", "a"), ("dropped", "a")]
    assert idx.evictions == 1


def test_write_back_victim_drops_when_its_upload_is_done() -> None:
    began: list[str] = []
    idx = ChunkIndex(
        1, write_back_needed=lambda e: True, begin_write_back=lambda e: began.append(e.key)
    )
    log = Log()
    idx.listener = log
    idx.begin("a", State.STORING)
    idx.commit("a", True)
    assert idx.begin("b", State.STORING) is None  # a is being written back first
    assert began == ["a"] and log.calls == [("ready", "a")]
    idx.unpin("a")  # the upload finished
    assert log.calls == [("ready", "a"), ("dropped", "a")]


def test_clear_drops_idle_chunks_now_and_the_rest_when_they_settle() -> None:
    idx, log = make(4)
    for k in ("idle", "pinned", "storing"):
        idx.begin(k, State.STORING)
    idx.commit("idle", True)
    idx.commit("pinned", True)
    idx.pin("pinned")
    idx.begin("fetching", State.FETCHING)
    log.calls.clear()
    assert idx.clear() == 1
    assert log.calls == [("dropped", "idle")]
    # nothing from before the reset is a hit again, even once it settles
    assert not any(idx.is_ready(k) for k in ("pinned", "storing", "fetching"))
    idx.commit("storing", True)
    idx.commit("fetching", True)
    idx.unpin("pinned")
    assert sorted(log.calls[1:]) == [
        ("dropped", "fetching"),
        ("dropped", "pinned"),
        ("dropped", "storing"),
    ]
    assert len(idx) == 0 and idx.free_slots == 4
    idx.check()


def test_no_listener_no_calls() -> None:
    idx = ChunkIndex(1)
    idx.begin("a", State.STORING)
    idx.commit("a", True)
    idx.begin("b", State.STORING)
    assert idx.evictions == 1 and "a" not in idx
