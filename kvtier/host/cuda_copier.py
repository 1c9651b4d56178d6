"""The asynchronous copier for KV on CUDA.

Loads are enqueued for every layer on a load stream in ``begin_loads`` with one
event per layer; ``wait_layer(i)`` makes the compute stream wait for layer ``i``
only, so later layers' copies overlap earlier layers' compute. Saves start in
``save_layer(i)`` right after layer ``i``'s attention, on a save stream that
first waits for the compute stream, and ``finish_saves`` waits (host side) for
the last one.

Every layer moves all of a step's blocks in one batched kernel: loads copy each
slot region host->device into a staging buffer (one ``cudaMemcpyAsync`` per
chunk and layer when whole chunks load, else per contiguous piece, never per
block) and scatter it with one kernel; saves gather with a single
``index_select`` into staging and copy each chunk's piece device->host.

A load's scatter runs on a scatter stream of its own, after its copy's event:
kept on the copy stream it would hold the copy engine while it waits for the SMs
the forward keeps busy (on one H200 that halved the loads' bandwidth and hid 0.07
of them behind compute). Loads rotate through ``STAGING_RING`` staging buffers; a
copy into one waits only for the scatter that last read it. The CUDA runtime
calls sit behind :class:`StreamOps`, so the bookkeeping runs on the CPU with a
fake in tests.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvtier.ops import CopyOp, LoadOp, OpKind, OpResult, StoreOp

from .layout import HostSlab, SlotLayout
from .transfer import (
    Copier,
    CopyTimes,
    contiguous_pieces,
    copy_all,
    copy_results,
    group_jobs,
    indexable,
    job_range,
    layer_block_bytes,
    round_plan,
    staging_shape,
)

logger = logging.getLogger("kvtier.transfer")

#: a stream's staging is capped at this; larger steps run in several rounds per layer
STAGING_BYTES = 64 << 20
#: staging buffers the loads rotate through (each a share of STAGING_BYTES), so that the
#: copy of one round overlaps the scatter of the one before
STAGING_RING = 2
#: chunks whose slot views (every layer's) stay cached: more than a step moves. Unbounded,
#: the cache grew to every slot x layer the tier ever used (a pair's views cost ~1.4 KB of
#: host memory and 3 objects the garbage collector walks: 77 ms a collection at 200k)
PIECES_CACHED_CHUNKS = 256


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
        return torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]

    def new_event(self, timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]

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
        return float(start.elapsed_time(end)) / 1000.0


@dataclass
class _Round:
    index: torch.Tensor  # GPU block ids, on the KV device
    places: list[tuple[CopyOp, int]]
    blocks: int
    whole: bool  # every job moves a whole chunk (loads: one copy per chunk and layer)


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
        self.scatter_stream = self.ops.new_stream()
        per_block = max(layer_block_bytes(layout))
        self.max_round_blocks = max(
            layout.blocks_per_chunk, staging_bytes // STAGING_RING // per_block
        )
        #: "save", and "load0".."load{STAGING_RING - 1}"; grown on demand
        self._staging: dict[str, torch.Tensor] = {}
        self._ring_next = 0  # the load staging buffer the next round uses
        #: per load staging buffer, the event of the scatter that last read it
        self._ring_read: list[Any] = [None] * STAGING_RING
        self._loads: _Batch | None = None
        self._saves: _Batch | None = None
        self._save_jobs: list[CopyOp] = []
        #: (slot, layer) -> the slot region's contiguous pieces, whole chunk (views, no
        #: copy), least recently used first; at most PIECES_CACHED_CHUNKS chunks' worth
        self._slot_pieces: OrderedDict[tuple[int, int], list[torch.Tensor]] = OrderedDict()
        self._pieces_cap = PIECES_CACHED_CHUNKS * len(layout.layers)
        self._carry: CopyTimes = {}  # outcomes of a step whose saves were never finished

    # -- shared helpers --
    def _checked(self, jobs: Sequence[CopyOp], batch: _Batch, out: CopyTimes) -> list[CopyOp]:
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
        """The jobs in rounds, each with its block ids on the device. Called on the copy
        stream before that stream waits for the compute stream: a copy from pageable host
        memory may synchronize with its stream (CUDA's documented behaviour), and after the
        wait that would hold the host until the compute stream's queued work is done."""
        rounds = []
        for group in group_jobs(jobs, self.max_round_blocks):
            index, places = round_plan(group)
            # pageable host -> device: the runtime stages it before returning, so the
            # list may go; allocated on the copy stream that alone uses it
            idx = torch.tensor(index, dtype=torch.long).to(self.device, non_blocking=True)
            bpc = self.layout.blocks_per_chunk
            whole = all(job_range(job) == (0, bpc) for job in group)
            rounds.append(_Round(idx, places, len(index), whole))
        return rounds

    def _staging_for(self, which: str, layer: int, blocks: int, chunks: int = 0) -> torch.Tensor:
        """A ``blocks``-block staging view for ``layer`` from the buffer ``which``, grown on
        demand; with ``chunks``, shaped ``[chunks, *slot_shape]`` (whole chunks, each as
        its slot holds it), else like the layer with ``blocks`` blocks.

        Reused by every layer and round that uses ``which``: the stream order, and for
        loads the wait for the scatter that last read it, keep a round from overwriting
        staging still being read (and a buffer grown from being freed while read).
        """
        ll = self.layout.layers[layer]
        shape = (
            (chunks, *ll.slot_shape)
            if chunks
            else staging_shape(ll.slot_shape, ll.block_dim, blocks)
        )
        nbytes = ll.nbytes // self.layout.blocks_per_chunk * blocks
        buf = self._staging.get(which)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._staging[which] = buf
        return indexable(buf[:nbytes].view(ll.dtype)).view(shape)

    def _host_pieces(self, slot: int, li: int) -> list[torch.Tensor]:
        key = (slot, li)
        cache = self._slot_pieces
        pieces = cache.get(key)
        if pieces is not None:
            cache.move_to_end(key)
            return pieces
        ll = self.layout.layers[li]
        view = indexable(self.slab.layer_view(slot, li))
        pieces = cache[key] = contiguous_pieces(view, ll.block_dim, 0, self.layout.blocks_per_chunk)
        if len(cache) > self._pieces_cap:
            cache.popitem(last=False)
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
        """Enqueue every round of one layer, between two timing events.

        Saves gather the GPU blocks into staging, then copy staging to the slots (on
        the save stream); loads copy the slots into staging on the load stream and
        scatter it into the GPU blocks on the scatter stream (:meth:`_load_round`).
        """
        stream = self.save_stream if to_host else self.load_stream
        dim = self.layout.layers[li].block_dim
        kv = indexable(self.kv[li])
        start = self.ops.new_event(timing=True)
        self.ops.record(start, stream)
        ev = None
        for rnd in batch.rounds:
            if to_host:
                staging = self._staging_for("save", li, rnd.blocks)
                torch.index_select(kv, dim, rnd.index, out=staging)
                copy_all(*self._pairs(rnd, li, staging, to_host=True))
            else:
                ev = self._load_round(rnd, li, kv)
        if ev is None:
            ev = self.ops.new_event(timing=True)
            self.ops.record(ev, stream)
        batch.events[li] = ev
        batch.last_event = ev
        batch.spans.append((start, ev))

    def _load_round(self, rnd: _Round, li: int, kv: torch.Tensor) -> Any:
        """One round of one layer's loads: copies into the next staging buffer of the
        ring (load stream), then the scatter (scatter stream); the scatter's event."""
        ring = self._ring_next
        self._ring_next = (ring + 1) % STAGING_RING
        if self._ring_read[ring] is not None:  # the scatter that last read this buffer
            self.ops.wait_event(self.load_stream, self._ring_read[ring])
        ll = self.layout.layers[li]
        whole, bpc = rnd.whole, self.layout.blocks_per_chunk
        staging = self._staging_for(
            f"load{ring}", li, rnd.blocks, chunks=len(rnd.places) if whole else 0
        )
        if whole:  # one copy per chunk: its layer region, K and V together
            copy_all(
                list(staging.unbind(0)),
                [indexable(self.slab.layer_view(job.slot, li)) for job, _ in rnd.places],
            )
        else:
            copy_all(*self._pairs(rnd, li, staging, to_host=False))
        copied = self.ops.new_event()
        self.ops.record(copied, self.load_stream)
        with self.ops.use_stream(self.scatter_stream):
            self.ops.wait_event(self.scatter_stream, copied)
            if whole:  # [chunks, *slot_shape] -> the blocks of [..., chunks, bpc, ...]
                at = (slice(None),) * ll.block_dim + (rnd.index.view(len(rnd.places), bpc),)
                kv[at] = staging.movedim(0, ll.block_dim)
            else:
                kv.index_copy_(ll.block_dim, rnd.index, staging)
            scattered = self.ops.new_event(timing=True)
            self.ops.record(scattered, self.scatter_stream)
        self._ring_read[ring] = scattered
        return scattered

    def _settle(self, batch: _Batch, what: str) -> CopyTimes:
        """Wait (host side) for the batch's last copy; every op fails if the wait does."""
        try:
            if batch.last_event is not None:
                self.ops.synchronize(batch.last_event)
        except Exception:
            logger.exception("kvtier: waiting for %s failed", what)
            batch.failed.update(batch.op_ids)
        return self._outcome(batch)

    def _outcome(self, batch: _Batch) -> CopyTimes:
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
        return copy_results(OpKind.LOAD, self._begin_loads(jobs))

    def _begin_loads(self, jobs: Sequence[LoadOp]) -> CopyTimes:
        out: CopyTimes = {}
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
                batch.rounds = self._rounds(ok)  # before the wait (see _rounds)
                # blocks being loaded may still be read by the previous step's kernels
                ready = self.ops.new_event()
                self.ops.record(ready, compute)
                self.ops.wait_event(self.load_stream, ready)
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
        return copy_results(OpKind.LOAD, self._finish_loads())

    def _finish_loads(self) -> CopyTimes:
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
        out: CopyTimes = {}
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
                if not batch.rounds:  # before the wait (see _rounds)
                    batch.rounds = self._rounds(self._save_jobs)
                written = self.ops.new_event()
                self.ops.record(written, compute)  # layer's KV for this step is written
                self.ops.wait_event(self.save_stream, written)
                self._copy_layer(batch, layer, to_host=True)
        except Exception:
            logger.exception("kvtier: enqueueing saves of layer %d failed", layer)
            batch.failed.update(batch.op_ids)

    def finish_saves(self) -> list[OpResult]:
        return copy_results(OpKind.STORE, self._finish_saves())

    def _finish_saves(self) -> CopyTimes:
        batch = self._saves
        carry, self._carry = self._carry, {}
        if batch is None:
            return carry
        # layers whose save_kv_layer never came (e.g. an attention type that skips it)
        for li in sorted(batch.pending):
            self.save_layer(li)
        self._saves = None
        return {**carry, **self._settle(batch, "saves")}
