"""Keeping long-lived per-chunk records out of Python's cyclic garbage collector.

vLLM freezes its heap once the engine is built (``gc.freeze``), so a full collection
walks only what was made since. The host index and the KV-event payloads make a record
per chunk as chunks arrive: a million chunks, a million objects walked by every full
collection, on the scheduler's thread (0.13 s for the index's entries alone). A record
that holds only atomic values (bytes, str, int, None, an enum member, tuples of them)
can never be part of a reference cycle, so refcounting frees it and the
collector has nothing to find in it: :func:`untrack` takes it out of the collector's lists.
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable


def _gc_untracker() -> Callable[[object], None] | None:
    """CPython's ``PyObject_GC_UnTrack``; None elsewhere."""
    try:
        raw = ctypes.pythonapi.PyObject_GC_UnTrack
    except AttributeError:
        return None
    raw.argtypes = [ctypes.py_object]
    raw.restype = None
    return raw


_raw_untrack = _gc_untracker()


def untrack(obj: object) -> None:
    """Take ``obj`` out of the collector's lists: only for an object that holds atomic
    values and nothing else (above). An object the collector does not track is left
    alone (CPython's call reads a header only tracked objects have)."""
    if _raw_untrack is not None and gc.is_tracked(obj):
        _raw_untrack(obj)
