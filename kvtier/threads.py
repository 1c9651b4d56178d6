"""Threads that can never hang vLLM: kvtier's I/O threads are daemons, stopped with a
bound, and anything that may block on a dead backend runs where it can be left behind."""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("kvtier.remote")


def stop_within(
    threads: Sequence[threading.Thread], queues: Sequence[queue.Queue[Any]], deadline: float
) -> int:
    """Ask each thread to stop (``None`` into its queue, ``queues[i]`` for ``threads[i]``)
    and wait for them until ``deadline`` (``time.monotonic()``); returns how many are
    still running (stuck in a backend call: daemons, left behind)."""
    for q in queues:
        try:
            q.put_nowait(None)
        except queue.Full:  # a racing submit filled it; the thread is a daemon anyway
            pass
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return sum(t.is_alive() for t in threads)


def run_within(fn: Callable[[], None], deadline: float, name: str) -> bool:
    """Run ``fn`` on a daemon thread and wait for it until ``deadline``; False if it is
    still running then (a lock a stuck call holds cannot block the caller)."""

    def guarded() -> None:
        try:
            fn()
        except Exception:  # closing must not fail the engine's shutdown
            log.warning("%s failed", name, exc_info=True)

    t = threading.Thread(target=guarded, name=f"kvtier-{name}", daemon=True)
    t.start()
    t.join(max(0.0, deadline - time.monotonic()))
    return not t.is_alive()


def faster_thread_switches(interval_s: float = 0.001) -> None:
    """Let kvtier's I/O threads get the GIL within 1 ms instead of Python's default 5 ms.

    While a request waits for an object-tier fetch, vLLM's engine loop re-asks in a
    tight loop and holds the GIL almost all the time; each hand-off to an I/O thread
    then waits a full switch interval. Measured on the file tier: fetch of six 4 MiB
    chunks 150 ms -> 30 ms.
    """
    if sys.getswitchinterval() > interval_s:
        sys.setswitchinterval(interval_s)


#: Python's switch interval while object-tier fetches are in flight (``fetch_switch_us``)
FETCH_SWITCH_S = 50e-6


class FetchSwitches:
    """Python's switch interval while fetches are in flight: short, then back.

    A read thread gives the GIL up for every system call and hash of a chunk and then
    waits to get it back. While the engine's thread runs Python (vLLM's loop re-asking
    a waiting lookup, other requests' steps) each of those waits lasts up to a switch
    interval: 64 waits a 32 MiB chunk read in 1 MiB pieces. Measured (2 cores, 32 chunks
    of 4 MiB, two read threads, the main thread busy in Python): 299 ms at 1 ms, 31-50
    ms at 20-50 µs, 24 ms with the main thread idle. A short interval costs the engine's
    thread GIL hand-offs, so it holds only while a read is in flight. Process-wide, like
    the interval itself: the first queue with a fetch in flight shortens it, the last to
    finish restores what was there before.
    """

    _lock = threading.Lock()
    _holders = 0  # queues with a read in flight, process-wide
    _saved = 0.0  # the interval before the first of them

    def __init__(self, interval_s: float = FETCH_SWITCH_S) -> None:
        #: the short interval (0: leave the interval as it is)
        self.interval_s = interval_s
        self.held = False

    def hold(self, on: bool) -> None:
        """This queue has a read in flight (``on``) or none; the caller serializes calls."""
        if on == self.held:
            return
        self.held = on
        cls = FetchSwitches
        with cls._lock:
            cls._holders += 1 if on else -1
            if on and cls._holders == 1:
                cls._saved = sys.getswitchinterval()
                if 0 < self.interval_s < cls._saved:
                    sys.setswitchinterval(self.interval_s)
            elif not on and cls._holders == 0:
                sys.setswitchinterval(cls._saved)
