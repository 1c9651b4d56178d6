"""The host slab commits its pages in the background without holding the GIL: the
engine's first steps after a restart (its restart hits among them) run beside it."""

from __future__ import annotations

import mmap
import os
import threading
import time

import torch

from kvtier.host.layout import HostSlab, SlotLayout, populate


def _longest_stall_while(fn) -> tuple[float, float]:
    """(longest gap between two iterations of a Python loop on this thread, how long
    ``fn`` ran on another thread)."""
    done = threading.Event()
    took = [0.0]

    def run() -> None:
        t0 = time.perf_counter()
        fn()
        took[0] = time.perf_counter() - t0
        done.set()

    t = threading.Thread(target=run)
    last = time.perf_counter()
    longest = 0.0
    t.start()
    while not done.is_set():
        now = time.perf_counter()
        longest = max(longest, now - last)
        last = now
    t.join()
    return longest, took[0]


def test_populate_lets_other_threads_run() -> None:
    nbytes = 256 << 20
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    # one call for all of it: holding the GIL, it would stall this thread throughout
    longest, took = _longest_stall_while(lambda: populate(buf, addr, nbytes, step=nbytes))
    assert took > 0
    assert longest < took / 2, (longest, took)


def test_populated_slab_reads_back_zeros_and_what_was_written() -> None:
    layout = SlotLayout.from_kv_caches({"l0": torch.zeros(4, 2, 16, 8)}, 4, 2)
    slab = HostSlab(8 * layout.slot_bytes, layout)
    slab._populating.join(10)
    assert not slab._populating.is_alive()
    assert int(slab.buffer.count_nonzero()) == 0
    slab.slot_bytes(3).fill_(7)
    assert int(slab.slot_bytes(3).sum()) == 7 * layout.slot_bytes


def test_populate_runs_at_the_lowest_priority() -> None:
    """It competes with the engine's first steps for the CPU: it yields to them."""
    nbytes = 4 << 20
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    seen: list[int] = []
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def run() -> None:
        populate(buf, addr, nbytes)
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert seen == [19]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # its own only
