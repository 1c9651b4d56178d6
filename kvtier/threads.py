"""Threads that can never hang vLLM: kvtier's I/O threads are daemons, stopped with a
bound, and anything that may block on a dead backend runs where it can be left behind."""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("kvtier.remote")


def stop_within(threads: Sequence[threading.Thread], queues: Sequence[queue.Queue[Any]],
                deadline: float) -> int:
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


def _cpu_list(text: str) -> set[int]:
    """CPUs of a kernel list (``0-3,8``) or a libgomp ``GOMP_CPU_AFFINITY`` list (``0 1``,
    ``0-7:2``); what does not parse is left out."""
    cpus: set[int] = set()
    for part in text.replace(",", " ").split():
        span, _, stride = part.partition(":")
        lo, _, hi = span.partition("-")
        try:
            first, last, step = int(lo), int(hi or lo), int(stride or 1)
        except ValueError:
            continue
        if 0 <= first <= last and step > 0:
            cpus.update(range(first, last + 1, step))
    return cpus


def engine_cpus() -> set[int]:
    """Every CPU some thread of this process may run on, and those libgomp's
    ``GOMP_CPU_AFFINITY`` binds the engine's OpenMP threads to: the CPUs this engine was
    given. (vLLM's CPU build binds each OpenMP thread to one of them, the main thread
    included, so a thread the main thread starts inherits that one CPU.)"""
    cpus = _cpu_list(os.environ.get("GOMP_CPU_AFFINITY", ""))
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return cpus
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/status") as f:
                for line in f:
                    if line.startswith("Cpus_allowed_list:"):
                        cpus |= _cpu_list(line.split(":", 1)[1])
        except OSError:  # the thread ended meanwhile
            continue
    return cpus


def spread_over_engine_cpus() -> None:
    """Let the calling thread run on every CPU of :func:`engine_cpus`, not only the one it
    inherited.

    Called by each object-tier I/O thread as it starts: a thread started by vLLM's
    pinned main thread would otherwise share that thread's one core with it and with
    every other I/O thread, while the engine's other cores sit idle during a restart
    hit's fetches. Nothing happens where affinity cannot be set.
    """
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        mine = os.sched_getaffinity(0)
        want = engine_cpus() | mine
        if want != mine:
            os.sched_setaffinity(0, want)
    except OSError as exc:  # CPUs outside this process's cpuset, or no permission
        log.debug("kvtier I/O thread keeps its CPU affinity: %s", exc)
