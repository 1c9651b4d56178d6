"""What the what-if ghost tiers of both kinds share (:mod:`kvtier.whatif.host`,
:mod:`kvtier.whatif.objects`): chunk keys kept as 8-byte fingerprints, and the queue
their events wait in, applied in order on a thread of its own.

The scheduler step only appends an event; the thread applies what was queued every
:data:`APPLY_EVERY_S`, in short slices that let the engine's other threads run between
them (in a real engine mostly while the scheduler's thread waits for the model). What is
counted does not depend on when that happens: the order is kept. The queue is bounded: a
thread starved of CPU that far behind makes the ghosts start again empty, with a warning,
instead of counting from a history with holes or growing without bound. A fault while
applying (a bug) is logged once and ends the counting: a metric never fails a request.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: how often the thread applies what was queued (the counters' lag, at most)
APPLY_EVERY_S = 0.05
#: events queued at most (about 15 MB): seconds of a busy engine's stores
MAX_QUEUED = 1 << 18

Event = tuple[Any, ...]


def fingerprint(key: bytes) -> int:
    """A chunk key's 8-byte fingerprint: its hash (cached in the bytes object, so free).
    Two keys sharing one (one in 2**64 a pair) would share a ghost entry: a what-if count
    off by a chunk, never KV served."""
    return hash(key) or 1  # 0 marks an empty table slot


class GhostQueue:
    """Events for ``apply``, in order. ``reset`` empties the ghosts (after an overflow).
    With ``background``, a daemon thread (``kvtier-`` and ``name``, as py-spy shows it)
    applies them; without, only :meth:`drain` does (tests, benchmarks)."""

    def __init__(
        self,
        apply: Callable[[Event], Any],
        reset: Callable[[], None],
        *,
        name: str,
        background: bool,
    ) -> None:
        self._apply = apply
        self._reset = reset
        self.name = name
        self.events: deque[Event] = deque(maxlen=MAX_QUEUED)
        #: one event onto the queue: all the scheduler's thread ever does here
        self.append: Callable[[Event], None] = self.events.append
        self.lock = threading.Lock()
        self.broken = False
        self.closed = False
        self._wake = threading.Event()
        self.thread: threading.Thread | None = None
        if background:
            self.thread = threading.Thread(
                target=_apply_in_background,
                args=(weakref.ref(self), self._wake),
                name="kvtier-" + name.replace(" ", "-"),
                daemon=True,
            )
            self.thread.start()

    def drain(self, limit: int | None = None) -> list[Any]:
        """Apply every queued event (at most ``limit``), in order; returns what ``apply``
        returned for each, where not None."""
        out: list[Any] = []
        with self.lock:
            events = self.events
            left = -1 if limit is None else limit
            while events and left != 0:
                left -= 1
                ev = events.popleft()
                if self.broken:
                    continue
                try:
                    got = self._apply(ev)
                except Exception:  # a what-if count must never fail a request
                    self.broken = True
                    log.exception("kvtier: the what-if %s stopped counting", self.name)
                    continue
                if got is not None:
                    out.append(got)
        return out

    def overflowed(self) -> None:
        """The queue filled (its oldest events were dropped): the ghosts no longer see
        what the real tier saw, so they start again empty, and say so."""
        with self.lock:
            self.events.clear()
            self._reset()
        log.warning(
            "kvtier: the what-if %s fell %d events behind (their thread was starved of "
            "CPU) and start again empty: kvtier:whatif_hit_tokens undercounts until they "
            "fill",
            self.name,
            MAX_QUEUED,
        )

    def close(self) -> None:
        self.closed = True
        self._wake.set()
        if self.thread is not None:
            self.thread.join(timeout=5)


def _apply_in_background(ref: weakref.ref[GhostQueue], wake: threading.Event) -> None:
    """The queue's thread: applies it every :data:`APPLY_EVERY_S`, in slices; ends with
    it (``close``, or once nothing else refers to it). Nobody wakes it on the step."""
    while True:
        wake.wait(APPLY_EVERY_S)
        queue = ref()
        if queue is None or queue.closed:
            return
        if len(queue.events) >= MAX_QUEUED:
            queue.overflowed()
        while queue.events:
            queue.drain(64)
            time.sleep(0)
        del queue
