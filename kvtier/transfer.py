"""Copies between vLLM's paged KV tensors and host slots, per layer.

Two copiers share one small interface (ops and results from :mod:`kvtier.ops`),
so the worker does not care which one runs:

- :class:`CpuCopier` — synchronous, the CPU backend's path: loads finish in
  ``begin_loads``, stores run in ``finish_saves`` (all layers written by then).
- :class:`CudaCopier` — asynchronous. Loads are enqueued for every layer on a
  load stream in ``begin_loads`` with one event per layer; ``wait_layer(i)``
  makes the compute stream wait for layer ``i`` only, so later layers' copies
  overlap earlier layers' compute. Saves start in ``save_layer(i)`` right
  after layer ``i``'s attention, on a save stream that first waits for the
  compute stream, and ``finish_saves`` waits (host side) for the last one.

Every layer moves all of a step's blocks in one batched kernel: loads copy each
slot region host->device into a staging buffer (one ``cudaMemcpyAsync`` per
contiguous piece, i.e. per chunk, never per block) and scatter it with a single
``index_copy_``; saves gather with a single ``index_select`` into staging and
copy each chunk's piece device->host. The CUDA runtime calls sit behind
:class:`StreamOps`, so the bookkeeping runs on the CPU with a fake in tests.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .layout import HostSlab, SlotLayout, gather_blocks, scatter_blocks
from .ops import CopyOp, LoadOp, OpKind, OpResult, StoreOp

logger = logging.getLogger("kvtier.transfer")

#: staging buffers are capped at this; larger steps run in several rounds per layer
STAGING_BYTES = 64 << 20


#: op id -> seconds its copy took, or None when it failed (the copiers' own tally,
#: turned into OpResults at their interface by _results)
_Times = dict[int, float | None]


def _results(kind: OpKind, times: _Times) -> list[OpResult]:
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


# ---- the runtime interface ------------------------------------------------------------------
class StreamOps(Protocol):
    """The CUDA runtime calls the copier makes (a fake implements them in tests)."""

    def new_stream(self) -> Any: ...
    def new_event(self, timing: bool = False) -> Any: ...
    def current_stream(self) -> Any: ...
    def use_stream(self, stream: Any) -> AbstractContextManager[Any]: ...
    def record(self, event: Any, stream: Any) -> None: ...
    def wait_event(self, stream: Any, event: Any) -> None: ...
    def synchronize(self, event: Any) -> None: ...
    def elapsed_s(self, start: Any, end: Any) -> float: ...


class TorchCudaOps:
    """:class:`StreamOps` on ``torch.cuda``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def new_event(self, timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream: torch.cuda.Stream) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def elapsed_s(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1000.0


# ---- copiers -------------------------------------------------------------------------------
class Copier(ABC):
    """Moves one step's loads and stores; every op accepted yields one OpResult."""

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
    """Today's synchronous path: one ``index_select`` / ``index_copy_`` per layer and op."""

    def __init__(self, kv: Sequence[torch.Tensor], layout: SlotLayout, slab: HostSlab) -> None:
        super().__init__(kv, layout, slab)
        self._stores: list[StoreOp] = []

    def begin_loads(self, jobs: Sequence[LoadOp]) -> list[OpResult]:
        return _results(OpKind.LOAD, self._copy_jobs(jobs, to_host=False))

    def finish_loads(self) -> list[OpResult]:
        return []

    def begin_saves(self, jobs: Sequence[StoreOp]) -> None:
        self._stores = list(jobs)

    def finish_saves(self) -> list[OpResult]:
        jobs, self._stores = self._stores, []
        return _results(OpKind.STORE, self._copy_jobs(jobs, to_host=True))

    def _copy_jobs(self, jobs: Sequence[CopyOp], to_host: bool) -> _Times:
        """Each job in turn, every layer with one ``index_select`` or ``index_copy_``."""
        out: _Times = {}
        for job in jobs:
            t0 = time.perf_counter()
            try:
                idx = torch.tensor(job.gpu_blocks, dtype=torch.long, device=self.kv[0].device)
                first, count = job_range(job)
                for li, kv in enumerate(self.kv):
                    dim = self.layout.layers[li].block_dim
                    region = self.slab.layer_view(job.slot, li).narrow(dim, first, count)
                    if to_host:
                        gather_blocks(kv, dim, idx, region)
                    else:
                        scatter_blocks(kv, dim, idx, region)
                out[job.op_id] = time.perf_counter() - t0
            except Exception:  # a failed copy must never crash the engine
                what = "store into" if to_host else "load of"
                logger.exception("kvtier: %s slot %d failed", what, job.slot)
                out[job.op_id] = None
        return out


@dataclass
class _Round:
    index: torch.Tensor  # GPU block ids, on the KV device
    places: list[tuple[CopyOp, int]]
    blocks: int


class _Batch:
    """One direction's work for one step: checked jobs in rounds, per-layer events."""

    def __init__(self) -> None:
        self.rounds: list[_Round] = []
        self.events: dict[int, Any] = {}
        self.pending: set[int] = set()  # layers not enqueued yet (saves)
        self.op_ids: list[int] = []
        self.failed: set[int] = set()
        self.last_event: Any = None
        #: (start, end) timing events of each layer's copies, for the transfer-time metric
        self.spans: list[tuple[Any, Any]] = []
        self.blocks: dict[int, int] = {}  # op id -> blocks moved


class CudaCopier(Copier):
    """Asynchronous copies on a load stream and a save stream, ordered by events."""

    layerwise = True

    def __init__(
        self,
        kv: Sequence[torch.Tensor],
        layout: SlotLayout,
        slab: HostSlab,
        ops: StreamOps | None = None,
        staging_bytes: int = STAGING_BYTES,
    ) -> None:
        super().__init__(kv, layout, slab)
        self.device = self.kv[0].device
        self.ops: StreamOps = ops if ops is not None else TorchCudaOps(self.device)
        self.load_stream = self.ops.new_stream()
        self.save_stream = self.ops.new_stream()
        per_block = max(layer_block_bytes(layout))
        self.max_round_blocks = max(layout.blocks_per_chunk, staging_bytes // per_block)
        self._staging: dict[str, torch.Tensor] = {}  # per stream, grown on demand
        self._loads: _Batch | None = None
        self._saves: _Batch | None = None
        self._save_jobs: list[CopyOp] = []
        #: (slot, layer) -> the slot region's contiguous pieces, whole chunk (views, no copy)
        self._slot_pieces: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._carry: _Times = {}  # outcomes of a step whose saves were never finished

    # -- shared helpers --
    def _checked(self, jobs: Sequence[CopyOp], batch: _Batch, out: _Times) -> list[CopyOp]:
        ok = []
        for job in jobs:
            why = self.check(job)
            if why is None:
                ok.append(job)
                batch.op_ids.append(job.op_id)
                batch.blocks[job.op_id] = len(job.gpu_blocks)
            else:
                logger.error("kvtier: op %d refused before copying: %s", job.op_id, why)
                out[job.op_id] = None
        return ok

    def _rounds(self, jobs: Sequence[CopyOp]) -> list[_Round]:
        rounds = []
        for group in group_jobs(jobs, self.max_round_blocks):
            index, places = round_plan(group)
            # pageable host -> device: the runtime stages it before returning, so the
            # list may go; allocated on the copy stream that alone uses it
            idx = torch.tensor(index, dtype=torch.long).to(self.device, non_blocking=True)
            rounds.append(_Round(idx, places, len(index)))
        return rounds

    def _staging_for(self, which: str, layer: int, blocks: int) -> torch.Tensor:
        """A ``blocks``-block staging view for ``layer``, from one buffer per stream.

        Reused by every layer and round of that stream: stream order alone keeps
        a round from overwriting staging the previous one still reads.
        """
        ll = self.layout.layers[layer]
        shape = staging_shape(ll.slot_shape, ll.block_dim, blocks)
        nbytes = ll.nbytes // self.layout.blocks_per_chunk * blocks
        buf = self._staging.get(which)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._staging[which] = buf
        return indexable(buf[:nbytes].view(ll.dtype)).view(shape)

    def _host_pieces(self, slot: int, li: int) -> list[torch.Tensor]:
        key = (slot, li)
        pieces = self._slot_pieces.get(key)
        if pieces is None:
            ll = self.layout.layers[li]
            view = indexable(self.slab.layer_view(slot, li))
            pieces = contiguous_pieces(view, ll.block_dim, 0, self.layout.blocks_per_chunk)
            self._slot_pieces[key] = pieces
        return pieces

    def _pairs(
        self, rnd: _Round, li: int, staging: torch.Tensor, to_host: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(dsts, srcs): one contiguous pair per job and piece, host <-> staging."""
        dim = self.layout.layers[li].block_dim
        stage = contiguous_pieces(staging, dim, 0, rnd.blocks)
        host_side: list[torch.Tensor] = []
        stage_side: list[torch.Tensor] = []
        for job, at in rnd.places:
            first, count = job_range(job)
            for h, st in zip(self._host_pieces(job.slot, li), stage, strict=True):
                host_side.append(h.narrow(0, first, count))
                stage_side.append(st.narrow(0, at, count))
        return (host_side, stage_side) if to_host else (stage_side, host_side)

    def _copy_layer(self, batch: _Batch, li: int, to_host: bool) -> None:
        """Enqueue every round of one layer on its stream, between two timing events.

        Saves gather the GPU blocks into staging, then copy staging to the slots;
        loads copy the slots into staging, then scatter it into the GPU blocks.
        """
        stream, which = (self.save_stream, "save") if to_host else (self.load_stream, "load")
        dim = self.layout.layers[li].block_dim
        kv = indexable(self.kv[li])
        start = self.ops.new_event(timing=True)
        self.ops.record(start, stream)
        for rnd in batch.rounds:
            staging = self._staging_for(which, li, rnd.blocks)
            if to_host:
                torch.index_select(kv, dim, rnd.index, out=staging)
            copy_all(*self._pairs(rnd, li, staging, to_host=to_host))
            if not to_host:
                kv.index_copy_(dim, rnd.index, staging)
        ev = self.ops.new_event(timing=True)
        self.ops.record(ev, stream)
        batch.events[li] = ev
        batch.last_event = ev
        batch.spans.append((start, ev))

    def _settle(self, batch: _Batch, what: str) -> _Times:
        """Wait (host side) for the batch's last copy; every op fails if the wait does."""
        try:
            if batch.last_event is not None:
                self.ops.synchronize(batch.last_event)
        except Exception:
            logger.exception("kvtier: waiting for %s failed", what)
            batch.failed.update(batch.op_ids)
        return self._outcome(batch)

    def _outcome(self, batch: _Batch) -> _Times:
        """Per op: its share (by blocks) of the GPU time this step's copies took."""
        try:
            busy = sum(self.ops.elapsed_s(a, b) for a, b in batch.spans)
        except Exception:  # timing is only for the metric
            busy = 0.0
        total = sum(batch.blocks.values()) or 1
        return {
            op: (None if op in batch.failed else busy * batch.blocks.get(op, 0) / total)
            for op in batch.op_ids
        }

    # -- loads --
    def begin_loads(self, jobs: Sequence[LoadOp]) -> list[OpResult]:
        return _results(OpKind.LOAD, self._begin_loads(jobs))

    def _begin_loads(self, jobs: Sequence[LoadOp]) -> _Times:
        out: _Times = {}
        if self._loads is not None:  # the previous step was never finished
            out.update(self._finish_loads())
        if not jobs:
            return out
        batch = _Batch()
        ok = self._checked(jobs, batch, out)
        if not ok:
            return out
        self._loads = batch
        compute = self.ops.current_stream()
        try:
            with self.ops.use_stream(self.load_stream):
                # blocks being loaded may still be read by the previous step's kernels
                ready = self.ops.new_event()
                self.ops.record(ready, compute)
                self.ops.wait_event(self.load_stream, ready)
                batch.rounds = self._rounds(ok)
                for li in range(len(self.kv)):
                    self._copy_layer(batch, li, to_host=False)
        except Exception:
            logger.exception("kvtier: enqueueing %d loads failed", len(ok))
            batch.failed.update(batch.op_ids)
            # layers never enqueued must not be waited for: wait for what was
            for li in range(len(self.kv)):
                batch.events.setdefault(li, batch.last_event)
        return out

    def wait_layer(self, layer: int) -> None:
        batch = self._loads
        if batch is None:
            return
        ev = batch.events.get(layer)
        if ev is not None:
            self.ops.wait_event(self.ops.current_stream(), ev)

    def finish_loads(self) -> list[OpResult]:
        return _results(OpKind.LOAD, self._finish_loads())

    def _finish_loads(self) -> _Times:
        batch, self._loads = self._loads, None
        if batch is None:
            return {}
        # the slots may be rewritten (fetch, store) once the results are reported
        return self._settle(batch, "loads")

    # -- saves --
    def begin_saves(self, jobs: Sequence[StoreOp]) -> None:
        if self._saves is not None:
            logger.warning("kvtier: saves of the previous step were not finished; finishing")
            done = self._finish_saves()  # (it resets self._carry: evaluate it first)
            self._carry.update(done)
        batch = _Batch()
        out: _Times = {}
        ok = self._checked(jobs, batch, out)
        batch.failed.update(out)
        batch.op_ids.extend(out)
        batch.pending = set(range(len(self.kv))) if ok else set()
        self._save_jobs = ok
        self._saves = batch

    def save_layer(self, layer: int) -> None:
        batch = self._saves
        if batch is None or layer not in batch.pending:
            return
        batch.pending.discard(layer)
        if batch.failed.issuperset(batch.op_ids):
            return
        try:
            compute = self.ops.current_stream()
            with self.ops.use_stream(self.save_stream):
                written = self.ops.new_event()
                self.ops.record(written, compute)  # layer's KV for this step is written
                self.ops.wait_event(self.save_stream, written)
                if not batch.rounds:
                    batch.rounds = self._rounds(self._save_jobs)
                self._copy_layer(batch, layer, to_host=True)
        except Exception:
            logger.exception("kvtier: enqueueing saves of layer %d failed", layer)
            batch.failed.update(batch.op_ids)

    def finish_saves(self) -> list[OpResult]:
        return _results(OpKind.STORE, self._finish_saves())

    def _finish_saves(self) -> _Times:
        batch = self._saves
        carry, self._carry = self._carry, {}
        if batch is None:
            return carry
        # layers whose save_kv_layer never came (e.g. an attention type that skips it)
        for li in sorted(batch.pending):
            self.save_layer(li)
        self._saves = None
        return {**carry, **self._settle(batch, "saves")}


def make_copier(
    kv: Sequence[torch.Tensor],
    layout: SlotLayout,
    slab: HostSlab,
    ops_factory: Callable[[torch.device], StreamOps] | None = None,
) -> Copier:
    """:class:`CudaCopier` when the KV tensors live on CUDA, else :class:`CpuCopier`."""
    if kv[0].device.type == "cuda":
        ops = ops_factory(kv[0].device) if ops_factory is not None else None
        return CudaCopier(kv, layout, slab, ops=ops)
    return CpuCopier(kv, layout, slab)

