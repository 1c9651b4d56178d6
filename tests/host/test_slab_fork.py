"""A child vLLM forks does not inherit the host slab (``MADV_DONTFORK``): shared with it
copy-on-write, every later write into a committed slot faults and copies its page (a
restart hit's fetches took 2x as long), and pinned pages would be copied at the fork."""

from __future__ import annotations

import mmap
import os
import resource

import pytest
import torch

from kvtier.host.cuda import alloc_host
from kvtier.host.layout import HostSlab, SlotLayout


def _mapped_in_child(addr: int) -> bool:
    """Whether a forked child maps ``addr`` (it reads its own /proc/self/maps)."""
    pid = os.fork()
    if pid == 0:  # the child: no Python cleanup, one answer in the exit code
        code = 1
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                    if lo <= addr < hi:
                        code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _faults_writing(buf: torch.Tensor) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf.fill_(3)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.fixture
def slab() -> HostSlab:
    layout = SlotLayout.from_kv_caches({"l0": torch.zeros(8, 2, 16, 64)}, 8, 2)
    s = HostSlab(2048 * layout.slot_bytes, layout, commit=True)  # 32 MiB
    assert s.committed
    return s


def test_a_forked_child_does_not_map_the_slab(slab: HostSlab) -> None:
    addr = slab.buffer.data_ptr()
    assert not _mapped_in_child(addr)
    other = torch.zeros(1 << 20, dtype=torch.uint8)  # an ordinary allocation is inherited
    assert _mapped_in_child(other.data_ptr())


def test_writing_the_slab_after_a_fork_costs_no_page_fault(slab: HostSlab) -> None:
    pages = 4096
    region = slab.buffer[: pages * 4096]
    assert _faults_writing(region) < pages // 16  # committed: no faults before the fork
    _mapped_in_child(region.data_ptr())
    # shared copy-on-write, each page would fault (and be copied) on its first write
    assert _faults_writing(region) < pages // 16


def test_a_slab_committed_at_startup_has_every_page(slab: HostSlab) -> None:
    """Committed on several threads, each its part: writing all of it faults nowhere."""
    assert _faults_writing(slab.buffer) < slab.nbytes // 4096 // 16


def test_a_slab_not_committed_faults_on_first_write() -> None:
    """(What the test above would see without the commit: a fault per page.)"""
    layout = SlotLayout.from_kv_caches({"l0": torch.zeros(8, 2, 16, 64)}, 8, 2)
    buf = torch.frombuffer(
        mmap.mmap(-1, 1024 * layout.slot_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
        dtype=torch.uint8,
    )
    assert _faults_writing(buf) >= buf.numel() // 4096 // 2


def test_pinnable_host_memory_is_not_inherited_either() -> None:
    buf = alloc_host(1 << 20)
    buf.fill_(1)
    assert not _mapped_in_child(buf.data_ptr())
