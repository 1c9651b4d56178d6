"""KV-cache events: what kvtier's tiers hold, for cache-aware routers.

vLLM publishes its own KV-cache events (``--kv-events-config``: ZMQ, msgpack
``KVEventBatch``) and, every step, adds the connector's (``take_events``). A router
that reads them (llm-d's KV-cache indexer, Dynamo's KV router, production-stack)
learns which replica holds which prefix. :class:`ChunkEvents` turns the host
index's changes into vLLM's own event types, keyed by vLLM's own block hashes, so a
router that already follows a replica's GPU blocks follows its kvtier chunks too:

==============================================  ====================================
what happened                                    event
==============================================  ====================================
a chunk turned ready in the host tier (stored    ``BlockStored`` medium ``"CPU"``,
from the GPU, or fetched from the object tier)   locality ``"LOCAL"``
a ready chunk left the host tier (LRU eviction,  ``BlockRemoved`` medium ``"CPU"``,
written back and evicted, ``reset_cache``)       locality ``"LOCAL"``
a chunk's upload to the object tier succeeded    ``BlockStored`` medium ``"STORAGE"``,
                                                 locality ``"REMOTE"``
a store or fetch that failed                     nothing (it never was a hit)
==============================================  ====================================

**One event per chunk.** A chunk spans ``chunk_size / block_size`` vLLM blocks and
is stored, loaded and evicted as a whole, so its ``BlockStored`` lists all of their
hashes (in prompt order), with ``parent_block_hash`` the hash of the block before the
chunk (``None`` for a prompt's first chunk), ``token_ids`` the chunk's tokens,
``block_size`` vLLM's block size and the per-block ``extra_keys`` (LoRA, multimodal,
``cache_salt``) exactly as vLLM's GPU events carry them. This is the shape of vLLM's
own ``OffloadingConnector`` "self-describing" events. Its ``BlockRemoved`` lists the
same hashes; removals that follow each other in a step are merged into one event.
The hashes are the very values vLLM publishes for the GPU blocks (its
``maybe_convert_block_hash``: 64-bit ints unless
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).

**Order.** Events follow the order chunks turn ready. A store's chunks turn ready in
prompt order; fetched and uploaded chunks in the order their I/O threads finish, so
one chunk's ``BlockStored`` can precede its parent's. A router that keys blocks by
hash (llm-d's indexer) is unaffected; one that builds a prefix tree must accept a
child before its parent (the parent's event follows in the same or a later batch,
unless its fetch or upload failed).

**reset_cache** emits one ``BlockRemoved`` (medium ``"CPU"``) for the chunks it
dropped, not ``AllBlocksCleared``: that event names no medium, so a router would
forget the replica's GPU blocks too (vLLM emits its own on a prefix-cache reset),
and chunks that a request is loading survive a reset.

**The object tier** is shared by every replica with the same ``remote_url`` and
``namespace``: a chunk there is a hit for any of them (at object-tier cost, after a
fetch), not a reason to route to the replica that wrote it. Its ``BlockStored``
therefore says ``locality="REMOTE"`` (vLLM: relative to the publisher). kvtier never
deletes from the object tier (expiry is the backend's: S3 lifecycle rules,
``remote_ttl_s``, the ``file_max_bytes`` sweep), so no ``BlockRemoved`` ever follows
one: read ``STORAGE`` events as "was written at this time", to age out after the
tier's retention. A chunk fetched from the object tier emits only its ``CPU`` event
(it is now in this replica's RAM); its ``STORAGE`` event came from the replica that
wrote it.

**Cost.** Nothing when vLLM publishes no events (the scheduler side then makes no
:class:`ChunkEvents`). Otherwise, per chunk that begins a store or fetch, a slice of
the request's block hashes and tokens; per chunk that turns ready or leaves, one
event. Nothing per decode token. The queue is bounded: past ``max_events`` not yet
taken (vLLM takes them every step), the oldest are dropped and counted
(``dropped``), and a warning is logged.
"""

from __future__ import annotations

import logging
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from kvtier.host.gc_untrack import untrack
from kvtier.host.index import Entry
from kvtier.host.layout import STATE, KVGroup

if TYPE_CHECKING:
    from collections.abc import Iterable

    from kvtier.ops import StoreOp

    from ..engine_shape import EngineShape
    from ..metadata import KVTierMetadata, KVTierWorkerMeta
    from .requests import RequestState

logger = logging.getLogger("kvtier.events")

#: vLLM's ``locality`` values (``vllm.v1.kv_offload.base.Locality``)
LOCAL = "LOCAL"
REMOTE = "REMOTE"


_INT64 = (1 << 64) - 1


def _int_hash(block_hash: bytes) -> int:
    return int.from_bytes(block_hash, "big") & _INT64


def _same_hash(block_hash: bytes) -> bytes:
    return block_hash


def hash_converter() -> Callable[[bytes], Any]:
    """vLLM's ``maybe_convert_block_hash``, decided once: vLLM's reads the environment on
    every call (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), the costliest part of an
    event. Checked against vLLM's own function, so both always agree."""
    probe = bytes(range(32))
    converted = maybe_convert_block_hash(probe)  # type: ignore[arg-type]
    if converted == probe:
        return _same_hash
    if converted == _int_hash(probe):
        return _int_hash
    return maybe_convert_block_hash  # type: ignore[return-value]  # a format kvtier lacks


@dataclass(slots=True)
class _Chunk:
    """What a chunk's events say, captured while its request is at hand and kept while
    the chunk is in the host tier (its upload's event may come much later). One per
    host slot, so compact and out of the garbage collector's lists
    (:mod:`kvtier.host.gc_untrack`): only atomic values and tuples; the token ids as int64
    bytes (a list of them kept 256 int objects a chunk alive: 11 KB and 4 objects a full
    collection walked per chunk; now about 3 KB and none)."""

    block_hashes: tuple[Any, ...]  # vLLM's ExternalBlockHash: int or bytes
    parent_block_hash: Any
    token_ids: bytes  # int64s
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None
    lora_id: int | None
    lora_name: str | None
    session_id: str | None
    announced: bool = False


@dataclass(frozen=True, slots=True)
class GroupEvents:
    """What one KV cache group's events of a chunk say: vLLM's group index and spec
    (kind, sliding window), and the chunk's last ``blocks`` blocks, the ones kvtier
    stores of it (all of a full-attention group, a sliding window's last blocks, one block
    of recurrent state). A state group's event carries no token ids: it announces the
    state at the chunk's end, as vLLM's own offloading events do."""

    group_idx: int = 0
    kind: str | None = None
    sliding_window: int | None = None
    #: the chunk's last blocks kvtier stores of this group (None: all of them)
    blocks: int | None = None
    state: bool = False


@dataclass(slots=True)
class _Upload:
    block_hash: bytes
    reports: int = 0
    ok: bool = True


class ChunkEvents:
    """Builds vLLM KV events from the host index (an :class:`kvtier.host.index.IndexListener`).

    The scheduler side builds it, attaches it as the index's listener
    (``SchedulerSide.attach_events``) and calls :meth:`record_stores` and
    :meth:`record_lookup` when chunks begin a store or a fetch (the request is at hand
    then); it passes each step's metadata to :meth:`watch_uploads`, and the workers'
    reports to :meth:`settle_uploads` before its ledger settles them and
    :meth:`announce_uploads` after; the index calls
    :meth:`chunk_ready` and :meth:`chunk_dropped`; vLLM calls :meth:`take_events`
    every step. All on the scheduler's thread. Chunks are named by vLLM's hash of
    their last block (``Entry.block_hash``), as in the ops.
    """

    def __init__(
        self,
        *,
        block_size: int,
        blocks_per_chunk: int,
        max_events: int,
        world_size: int = 1,
        group_idx: int = 0,
        kv_cache_spec_kind: str | None = None,
        kv_cache_spec_sliding_window: int | None = None,
        groups: tuple[GroupEvents, ...] = (),
    ) -> None:
        if blocks_per_chunk < 1 or max_events < 1 or world_size < 1:
            raise ValueError("blocks_per_chunk, max_events and world_size must be positive")
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.max_events = max_events
        self.world_size = world_size
        #: every KV cache group's events (a hybrid model: one event per group and chunk)
        self.groups = groups or (
            GroupEvents(group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window),
        )
        self._convert = hash_converter()
        #: last block hash -> the chunk's event payload, from its store or fetch until it
        #: leaves the index (so at most one per host slot)
        self._chunks: dict[bytes, _Chunk] = {}
        #: upload op id -> its chunk and the workers' flags so far (bounded like the queue)
        self._uploads: dict[int, _Upload] = {}
        self._queue: deque[KVCacheEvent] = deque()
        #: per group, hashes of ready chunks that left since the last event, merged into one
        self._removed: list[list[Any]] = [[] for _ in self.groups]
        self.dropped = 0
        self.emitted = 0

    @classmethod
    def for_engine(
        cls,
        shape: EngineShape,
        *,
        chunk_size: int,
        num_slots: int,
        stored: tuple[KVGroup, ...] = (),
    ) -> ChunkEvents:
        """Events for every KV cache group of the engine; ``stored``: kvtier's view of a
        hybrid model's groups (:func:`kvtier.connectors.groups.kv_groups`; empty for one group)."""
        block_size = shape.kv_block_size()
        groups = shape.allocated_kv_cache().groups
        specs = tuple(
            GroupEvents(
                g,
                group.event_kind,
                group.event_window,
                blocks=stored[g].blocks if stored else None,
                state=bool(stored) and stored[g].kind == STATE,
            )
            for g, group in enumerate(groups[: max(1, len(stored))])
        )
        return cls(
            block_size=block_size,
            blocks_per_chunk=chunk_size // block_size,
            # a step changes at most a few events per slot (store, upload, eviction):
            # vLLM takes them every step, so only a stalled consumer loop fills this
            max_events=max(4096, 4 * num_slots),
            world_size=shape.world_size,
            groups=specs,
        )

    # ---- from the scheduler side ------------------------------------------------------
    def record_stores(self, st: RequestState, ops: Iterable[StoreOp]) -> None:
        """``ops`` were just planned for request ``st`` (chunks in prompt order)."""
        c = 0
        for op in ops:
            try:
                c = st.chunk_hashes.index(op.block_hash, c)
            except ValueError:
                continue  # not one of this request's chunks: nothing to describe
            self.record(st, c, op.block_hash)

    def record_lookup(self, st: RequestState) -> None:
        """Describe the chunks ``st``'s object-tier lookup claimed (idempotent: vLLM
        re-asks while the lookup runs)."""
        lk = st.lookup
        if lk is None:
            return
        for i, entry in enumerate(lk.chunks):
            if entry.block_hash and entry.block_hash not in self._chunks:
                self.record(st, lk.first_chunk + i, entry.block_hash)

    def record(self, st: RequestState, chunk: int, block_hash: bytes) -> None:
        """Chunk ``chunk`` of ``st``'s request (index key ``block_hash``) begins a store
        or a fetch: keep what its events will say. The index key is the request's chunk
        key (vLLM's hash, tagged with a LoRA adapter's fingerprint), so the chunk is
        matched by that key and described by vLLM's own block hashes."""
        request = st.request
        bpc, bs = self.blocks_per_chunk, self.block_size
        first = chunk * bpc
        hashes = request.block_hashes[first : first + bpc]
        keys = st.chunk_hashes
        if len(hashes) < bpc or chunk >= len(keys) or keys[chunk] != block_hash:
            return  # not this request's full chunk: kvtier stores whole chunks only
        start = first * bs
        lora = request.lora_request
        extra: list[tuple[Any, ...] | None] = [None] * bpc
        if (
            getattr(request, "mm_features", None)
            or lora is not None
            or getattr(request, "prompt_embeds", None) is not None
            or (start == 0 and request.cache_salt)
        ):
            mm_idx = 0  # vLLM's own per-block extra keys, as in its GPU events
            for b in range(bpc):
                extra[b], mm_idx = generate_block_hash_extra_keys(
                    request, start + b * bs, start + (b + 1) * bs, mm_idx
                )
        convert = self._convert
        extra_keys = to_event_extra_keys(extra)
        payload = _Chunk(
            block_hashes=tuple(convert(h) for h in hashes),
            parent_block_hash=convert(request.block_hashes[first - 1]) if first else None,
            token_ids=array("q", request.all_token_ids[start : start + bpc * bs]).tobytes(),
            extra_keys=tuple(extra_keys) if extra_keys is not None else None,
            lora_id=lora.adapter_id if lora is not None else None,
            lora_name=lora.name if lora is not None else None,
            session_id=getattr(request, "session_id", None),
        )
        untrack(payload)
        self._chunks[block_hash] = payload

    # ---- uploads (from the scheduler side, around its ledger) ------------------------------
    def watch_uploads(self, meta: KVTierMetadata) -> None:
        """Note the step's uploads (write-through ones ride on their stores)."""
        for op in meta.stores:
            if op.upload_op_id is not None:
                self._watch(op.upload_op_id, op.block_hash)
        for up in meta.uploads:
            self._watch(up.op_id, up.block_hash)

    def settle_uploads(self, worker_meta: KVTierWorkerMeta) -> list[_Chunk]:
        """Workers' reports, *before* the scheduler side settles them (a write-back
        eviction may drop the chunk then): the chunks every worker uploaded. Pass them
        to :meth:`announce_uploads` once the scheduler side has settled the reports."""
        done: list[_Chunk] = []
        for op_id, oks in worker_meta.results.items():
            up = self._uploads.get(op_id)
            if up is None:
                continue
            up.reports += len(oks)
            up.ok = up.ok and all(oks)
            if up.reports < self.world_size:
                continue
            del self._uploads[op_id]
            chunk = self._chunks.get(up.block_hash)
            if up.ok and chunk is not None:
                done.append(chunk)
        return done

    def announce_uploads(self, done: list[_Chunk]) -> None:
        """A ``STORAGE`` store for each uploaded chunk that is (or was) a host-tier hit:
        a write-through chunk whose store failed has no event, even if its bytes went
        up (its store's report settles in the same batch as its upload's, or before)."""
        for chunk in done:
            if chunk.announced:
                # ahead of the host-tier removals this settling caused (a write-back
                # eviction): a router never sees a moment where nobody holds the chunk
                for event in self._stored(chunk, MEDIUM_STORAGE, REMOTE):
                    self._append(event)

    def _watch(self, op_id: int, block_hash: bytes) -> None:
        if len(self._uploads) >= self.max_events:  # reports that never came: forget one
            del self._uploads[next(iter(self._uploads))]
        self._uploads[op_id] = _Upload(block_hash)

    # ---- from the index (IndexListener) ------------------------------------------------
    def chunk_ready(self, entry: Entry) -> None:
        chunk = self._chunks.get(entry.block_hash)
        if chunk is None or chunk.announced:
            return
        chunk.announced = True
        self._flush_removed()  # keep the order: a chunk may leave and come back
        for event in self._stored(chunk, MEDIUM_CPU, LOCAL):
            self._append(event)

    def chunk_dropped(self, entry: Entry) -> None:
        chunk = self._chunks.pop(entry.block_hash, None)
        if chunk is not None and chunk.announced:
            for removed, group in zip(self._removed, self.groups, strict=True):
                removed.extend(chunk.block_hashes[-(group.blocks or self.blocks_per_chunk) :])

    # ---- to vLLM ------------------------------------------------------------------------
    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first."""
        self._flush_removed()
        if not self._queue:
            return []
        out = list(self._queue)
        self._queue.clear()
        return out

    def tracked(self) -> int:
        """Chunks with a payload held (at most the host index's size)."""
        return len(self._chunks)

    # ---- internals ------------------------------------------------------------------------
    def _stored(self, chunk: _Chunk, medium: str, locality: str) -> list[BlockStored]:
        """One event per KV cache group: the chunk's blocks kvtier stores of it (a state
        group's with no token ids: the state at the chunk's end)."""
        out: list[BlockStored] = []
        bpc, bs = self.blocks_per_chunk, self.block_size
        for group in self.groups:
            k = group.blocks or bpc
            hashes = chunk.block_hashes[bpc - k :]
            parent = chunk.parent_block_hash if k == bpc else chunk.block_hashes[bpc - k - 1]
            tokens = (
                []
                if group.state
                else memoryview(chunk.token_ids).cast("q")[(bpc - k) * bs :].tolist()
            )
            extra = (
                list(chunk.extra_keys[bpc - k :])
                if chunk.extra_keys is not None and not group.state
                else None
            )
            out.append(
                BlockStored(
                    block_hashes=list(hashes),
                    parent_block_hash=parent,
                    token_ids=tokens,
                    block_size=bs,
                    lora_id=chunk.lora_id,
                    medium=medium,
                    lora_name=chunk.lora_name,
                    extra_keys=extra,
                    group_idx=group.group_idx,
                    kv_cache_spec_kind=group.kind,
                    kv_cache_spec_sliding_window=group.sliding_window,
                    locality=locality,
                    session_id=chunk.session_id,
                )
            )
        return out

    def _flush_removed(self) -> None:
        for g, group in enumerate(self.groups):
            if self._removed[g]:
                hashes, self._removed[g] = self._removed[g], []
                self._append(
                    BlockRemoved(
                        block_hashes=hashes,
                        medium=MEDIUM_CPU,
                        group_idx=group.group_idx,
                        locality=LOCAL,
                    )
                )

    def _append(self, event: KVCacheEvent) -> None:
        if len(self._queue) >= self.max_events:
            self._queue.popleft()
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 10_000 == 0:
                logger.warning(
                    "kvtier: %d KV events dropped: nobody took them (queue of %d)",
                    self.dropped,
                    self.max_events,
                )
        self._queue.append(event)
        self.emitted += 1
