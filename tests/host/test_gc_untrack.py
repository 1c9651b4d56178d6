"""kvtier.host.gc_untrack: an untracked record leaves the collector's lists and is still freed."""

from __future__ import annotations

import gc
import weakref

from kvtier.host.gc_untrack import untrack


class Record:
    __slots__ = ("key", "n", "__weakref__")

    def __init__(self, key: bytes, n: int) -> None:
        self.key, self.n = key, n


def test_an_untracked_record_is_invisible_to_the_collector_and_freed_by_refcount() -> None:
    rec = Record(b"k", 1)
    assert gc.is_tracked(rec)
    untrack(rec)
    assert not gc.is_tracked(rec)
    assert not any(o is rec for o in gc.get_objects())
    freed = []
    ref = weakref.ref(rec, lambda _: freed.append(True))
    del rec
    assert freed == [True] and ref() is None  # no collection needed


def test_untracking_twice_or_an_untracked_object_is_harmless() -> None:
    rec = Record(b"k", 2)
    untrack(rec)
    untrack(rec)
    untrack(b"bytes are never tracked")
    gc.collect()
    assert rec.n == 2 and not gc.is_tracked(rec)
