"""Copies between vLLM's paged KV tensors and host slots, per layer.

Two copiers share one small interface (ops and results from :mod:`kvtier.ops`),
so the worker does not care which one runs: it drives them as a
:class:`kvtier.ops.Mover` (``submit``, ``poll``, ``close``), plus the layer-wise
hooks (``wait_layer``, ``save_layer``) that are the copier's own.

- :class:`CpuCopier` — synchronous, the CPU backend's path: loads finish in
  ``begin_loads``, stores run in ``finish_saves`` (all layers written by then).
- :class:`kvtier.host.cuda_copier.CudaCopier` — asynchronous, per layer, on its own
  streams (see there; it builds on this module, which never imports it).

:func:`kvtier.host.copiers.make_copier` picks one for the KV's device.

The index math both use (which slot blocks an op touches, rounds that fit the
staging buffer, contiguous pieces of a slot) is pure and unit-tested on the CPU.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.ops import CopyOp, LoadOp, Mover, OpKind, OpResult, StoreOp

from .layout import HostSlab, SlotLayout, block_runs, gather_blocks, scatter_blocks

logger = logging.getLogger("kvtier.transfer")


#: op id -> seconds its copy took, or None when it failed (the copiers' own tally,
#: turned into OpResults at their interface by copy_results)
CopyTimes = dict[int, float | None]


def copy_results(kind: OpKind, times: CopyTimes) -> list[OpResult]:
    return [
        OpResult(op_id, kind, False) if t is None else OpResult(op_id, kind, True, seconds=t)
        for op_id, t in times.items()
    ]


# ---- index math (pure; unit-tested on the CPU) -----------------------------------------------
def job_range(job: CopyOp) -> tuple[int, int]:
    """(first slot block, count) that ``job`` touches."""
    first = job.first if isinstance(job, LoadOp) else 0
    return first, len(job.gpu_blocks)


def check_job(job: CopyOp, num_blocks: int, num_slots: int, blocks_per_chunk: int) -> str | None:
    """Why ``job`` must not be submitted, or None.

    On CUDA an out-of-range index is a device-side assert that kills the
    engine, so every op is checked on the host before anything is enqueued.
    """
    first, count = job_range(job)
    if not 0 <= job.slot < num_slots:
        return f"slot {job.slot} outside 0..{num_slots - 1}"
    if count == 0:
        return "no blocks"
    if first < 0 or first + count > blocks_per_chunk:
        return f"slot blocks {first}..{first + count - 1} outside a chunk of {blocks_per_chunk}"
    bad = [b for b in job.gpu_blocks if not 0 <= b < num_blocks]
    if bad:
        return f"GPU blocks {bad[:4]} outside 0..{num_blocks - 1}"
    return None


def group_jobs(jobs: Sequence[CopyOp], max_blocks: int) -> list[list[CopyOp]]:
    """Split ``jobs`` (in order) into rounds of at most ``max_blocks`` blocks each.

    A job is never split; one larger than ``max_blocks`` is a round of its own.
    """
    rounds: list[list[CopyOp]] = []
    cur: list[CopyOp] = []
    n = 0
    for job in jobs:
        k = len(job.gpu_blocks)
        if cur and n + k > max_blocks:
            rounds.append(cur)
            cur, n = [], 0
        cur.append(job)
        n += k
    if cur:
        rounds.append(cur)
    return rounds


def contiguous_pieces(t: torch.Tensor, dim: int, start: int, count: int) -> list[torch.Tensor]:
    """``t.narrow(dim, start, count)`` as contiguous views (one for dim 0, ``t.shape[0]`` for 1).

    Cross-device ``copy_`` of a non-contiguous host view would first make a
    pageable temporary and copy synchronously; copying these pieces keeps each
    transfer one asynchronous ``cudaMemcpyAsync`` on pinned memory.
    """
    if dim == 0:
        return [t.narrow(0, start, count)]
    return [p for sub in t.unbind(0) for p in contiguous_pieces(sub, dim - 1, start, count)]


def staging_shape(slot_shape: Sequence[int], dim: int, blocks: int) -> tuple[int, ...]:
    shape = list(slot_shape)
    shape[dim] = blocks
    return tuple(shape)


def round_plan(jobs: Sequence[CopyOp]) -> tuple[list[int], list[tuple[CopyOp, int]]]:
    """The batched index for one round and where each job sits in staging.

    Returns ``(gpu_blocks, [(job, staging_offset), ...])``: staging block
    ``staging_offset + j`` holds the job's ``j``-th block, which is GPU block
    ``gpu_blocks[staging_offset + j]``.
    """
    index: list[int] = []
    places: list[tuple[CopyOp, int]] = []
    for job in jobs:
        places.append((job, len(index)))
        index.extend(job.gpu_blocks)
    return index, places


def indexable(t: torch.Tensor) -> torch.Tensor:
    """``t``, or its bytes for 1-byte float types (fp8 KV) that index kernels may lack."""
    if t.dtype.is_floating_point and t.element_size() == 1:
        return t.view(torch.uint8)
    return t


_FOREACH_OK = True


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``d.copy_(s, non_blocking=True)`` for each pair, dispatched from C++ in one call.

    Per-chunk copies are small (hundreds of KiB); a Python loop of ``copy_``
    would make the enqueue, not the bus, the bottleneck.
    """
    global _FOREACH_OK
    if not dsts:
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None and _FOREACH_OK:
        try:
            foreach(dsts, srcs, non_blocking=True)
            return
        except (RuntimeError, TypeError, NotImplementedError):  # mixed devices refused
            logger.info("kvtier: torch._foreach_copy_ refused host<->device lists; looping")
            _FOREACH_OK = False
    for d, s in zip(dsts, srcs, strict=True):  # copies are idempotent: a redo is harmless
        d.copy_(s, non_blocking=True)


def layer_block_bytes(layout: SlotLayout) -> list[int]:
    return [ll.nbytes // layout.blocks_per_chunk for ll in layout.layers]


# ---- copiers -------------------------------------------------------------------------------
class Copier(ABC):
    """Moves one step's loads and stores; every op accepted yields one OpResult.

    The worker drives it as a :class:`~kvtier.ops.Mover` of :data:`~kvtier.ops.CopyOp`:
    ``submit`` starts loads and declares stores, ``poll`` finishes the step's copies.
    """

    #: True when wait_layer / save_layer do real work (the facade then needs
    #: PIECEWISE CUDA graphs, and the worker forwards the per-layer calls)
    layerwise: bool = False

    def __init__(self, kv: Sequence[torch.Tensor], layout: SlotLayout, slab: HostSlab) -> None:
        if len(kv) != len(layout.layers):
            raise ValueError(f"{len(kv)} KV tensors for {len(layout.layers)} layout layers")
        self.kv = list(kv)
        self.layout = layout
        self.slab = slab
        self.num_blocks = kv[0].shape[layout.layers[0].block_dim]

    def check(self, job: CopyOp) -> str | None:
        return check_job(job, self.num_blocks, self.slab.num_slots, self.layout.blocks_per_chunk)

    # -- the Mover protocol --
    def submit(self, ops: Sequence[CopyOp]) -> list[OpResult]:
        """Declare the step's stores (``begin_saves``: copied by ``save_layer`` / ``poll``)
        and start its loads (``begin_loads``); returns the loads' results known now."""
        stores = [op for op in ops if isinstance(op, StoreOp)]
        loads = [op for op in ops if isinstance(op, LoadOp)]
        if stores:
            self.begin_saves(stores)
        return self.begin_loads(loads) if loads else []

    def poll(self) -> list[OpResult]:
        """Finish the step: wait (host side) for its loads, then save what is left of its
        stores and wait for them; the results not returned yet, loads first."""
        return self.finish_loads() + self.finish_saves()

    def close(self) -> None:
        """Nothing to release: the KV tensors are vLLM's, the slab is the worker's."""
        return None

    @abstractmethod
    def begin_loads(self, jobs: Sequence[LoadOp]) -> list[OpResult]:
        """Start every layer's loads; returns the results known now (all, when synchronous)."""

    @abstractmethod
    def finish_loads(self) -> list[OpResult]:
        """Wait (host side) until this step's loads are done; results not yet returned."""

    def wait_layer(self, layer: int) -> None:
        """Make compute wait for ``layer``'s loads (no-op when loads are synchronous)."""
        return None

    @abstractmethod
    def begin_saves(self, jobs: Sequence[StoreOp]) -> None:
        """Declare this step's stores; layers are saved by save_layer / finish_saves."""

    def save_layer(self, layer: int) -> None:
        """``layer``'s KV for this step is written: start saving it (no-op when synchronous)."""
        return None

    @abstractmethod
    def finish_saves(self) -> list[OpResult]:
        """Save what is left and wait (host side) until every store is in the slab."""


class CpuCopier(Copier):
    """Today's synchronous path: per layer and op, one slice copy per run of blocks
    (:func:`block_runs`: ascending or descending, at most a few for a load, one for a
    store), else one ``index_select`` / ``index_copy_``."""

    def __init__(self, kv: Sequence[torch.Tensor], layout: SlotLayout, slab: HostSlab) -> None:
        super().__init__(kv, layout, slab)
        self._stores: list[StoreOp] = []

    def begin_loads(self, jobs: Sequence[LoadOp]) -> list[OpResult]:
        return copy_results(OpKind.LOAD, self._copy_jobs(jobs, to_host=False))

    def finish_loads(self) -> list[OpResult]:
        return []

    def begin_saves(self, jobs: Sequence[StoreOp]) -> None:
        self._stores = list(jobs)

    def finish_saves(self) -> list[OpResult]:
        jobs, self._stores = self._stores, []
        return copy_results(OpKind.STORE, self._copy_jobs(jobs, to_host=True))

    def _copy_jobs(self, jobs: Sequence[CopyOp], to_host: bool) -> CopyTimes:
        """Each job in turn, every layer with one slice copy per run of its blocks or one
        ``index_select`` / ``index_copy_``."""
        out: CopyTimes = {}
        for job in jobs:
            t0 = time.perf_counter()
            try:
                first, count = job_range(job)
                runs = block_runs(job.gpu_blocks)  # slices, not an index copy
                if to_host and runs is not None and len(runs) > 1:
                    # a store's index_select into its slot (contiguous) is as fast as the
                    # slices of one run and beats those of several (bench/block_runs.py)
                    runs = None
                idx = (
                    None
                    if runs
                    else torch.tensor(job.gpu_blocks, dtype=torch.long, device=self.kv[0].device)
                )
                for li, kv in enumerate(self.kv):
                    dim = self.layout.layers[li].block_dim
                    region = self.slab.layer_view(job.slot, li).narrow(dim, first, count)
                    if to_host:
                        gather_blocks(kv, dim, idx, region, runs)
                    else:
                        scatter_blocks(kv, dim, idx, region, runs)
                out[job.op_id] = time.perf_counter() - t0
            except Exception:  # a failed copy must never crash the engine
                what = "store into" if to_host else "load of"
                logger.exception("kvtier: %s slot %d failed", what, job.slot)
                out[job.op_id] = None
        return out


if TYPE_CHECKING:

    def _a_copier_is_a_mover(c: Copier) -> Mover[CopyOp]:
        return c  # mypy checks that every copier answers the worker's protocol
