"""Keeping long-lived per-chunk records out of Python's cyclic garbage collector.

vLLM freezes its heap once the engine is built (``gc.freeze``), so a full collection
walks only what was made since. The host index and the KV-event payloads make a record
per chunk as chunks arrive: a million chunks, a million objects walked by every full
collection, on the scheduler's thread (0.13 s for the index's entries alone). A record
that holds only atomic values (bytes, str, int, None, an enum member, tuples and arrays
of them) can never be part of a reference cycle, so refcounting frees it and the
collector has nothing to find in it: :func:`untrack` takes it out of the collector's lists.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable


def _gc_untracker() -> Callable[[object], None]:
    """CPython's ``PyObject_GC_UnTrack``; elsewhere a no-op."""
    try:
        untrack = ctypes.pythonapi.PyObject_GC_UnTrack
    except AttributeError:
        return lambda obj: None
    untrack.argtypes = [ctypes.py_object]
    untrack.restype = None
    return untrack


#: ``untrack(obj)``: only for objects that hold atomic values and nothing else (above)
untrack: Callable[[object], None] = _gc_untracker()
