"""Pinning the host slab with ``cudaHostRegister``, and measuring what it costs.

``Tensor.pin_memory()`` goes through torch's caching host allocator, which
rounds every request up to a power of two: a 40 GiB host tier would pin 64 GiB.
kvtier instead maps exactly the requested bytes (page-aligned, untouched until
used) and registers that range with the CUDA runtime, so host RSS ÷ requested
stays at 1.0 plus one page. Nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import mmap
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("kvtier.cuda")

#: cudaHostRegisterPortable: pinned for every CUDA context, as torch's own helper does
HOST_REGISTER_PORTABLE = 1
PAGE = mmap.PAGESIZE


def alloc_host(nbytes: int) -> torch.Tensor:
    """A page-aligned uint8 tensor of exactly ``nbytes`` from an anonymous mapping.

    Pages are committed lazily (on first touch or on registration), so RSS
    grows by ``nbytes`` rounded up to one page and never more.
    """
    if nbytes <= 0:
        raise ValueError(f"host allocation of {nbytes} bytes")
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # a forked child does not inherit it: a pinned page shared copy-on-write would be
    # copied at the fork (or, on kernels before 5.8, left to the device while the parent
    # writes a copy), and no child of vLLM's has any use for the host tier
    buf.madvise(mmap.MADV_DONTFORK)
    # torch.frombuffer keeps a reference to ``buf`` for the tensor's lifetime
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)


def register_host(tensor: torch.Tensor, cudart: Any = None) -> Callable[[], None] | None:
    """Pin ``tensor``'s exact bytes with ``cudaHostRegister``.

    Returns an idempotent ``unregister`` callable, or None when the runtime
    refused (the copies still work, as slower pageable transfers). ``cudart``
    defaults to ``torch.cuda.cudart()``; tests pass a fake.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("only a contiguous CPU tensor can be registered")
    nbytes = tensor.numel() * tensor.element_size()
    ptr = tensor.data_ptr()
    try:
        rt = cudart if cudart is not None else torch.cuda.cudart()  # type: ignore[no-untyped-call]
        err = int(rt.cudaHostRegister(ptr, nbytes, HOST_REGISTER_PORTABLE))
    except Exception as exc:  # no runtime (or no such call): pageable, never a crash
        logger.warning("kvtier: cannot pin the host tier (%s); copies are synchronous", exc)
        return None
    if err != 0:
        logger.warning(
            "kvtier: cudaHostRegister of %d bytes failed (cudaError %d); the host tier "
            "stays pageable and copies are synchronous",
            nbytes,
            err,
        )
        return None
    done = False

    def unregister() -> None:
        nonlocal done
        if done:
            return
        done = True
        err = int(rt.cudaHostUnregister(ptr))
        if err != 0:
            logger.warning("kvtier: cudaHostUnregister failed (cudaError %d)", err)

    return unregister


class PinnedBuffer:
    """Exactly ``nbytes`` of host memory, pinned for as long as this object lives."""

    def __init__(self, nbytes: int, cudart: Any = None) -> None:
        self.tensor = alloc_host(nbytes)
        unregister = register_host(self.tensor, cudart)
        self.pinned = unregister is not None
        # unregister before the mapping can be released: runs when self is collected,
        # while self.tensor is still referenced, or on close()
        self._finalizer = weakref.finalize(self, unregister) if unregister else None

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; psutil elsewhere)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except OSError:
        import psutil

        return int(psutil.Process().memory_info().rss)


def rss_ratio(allocate: Callable[[int], Any], nbytes: int) -> tuple[float, Any]:
    """Host RSS growth ÷ ``nbytes`` for one allocation (kept alive: returned)."""
    before = rss_bytes()
    obj = allocate(nbytes)
    after = rss_bytes()
    return (after - before) / nbytes, obj
