"""Which chunks move between vLLM's paged KV and the host tier, and what goes up.

:class:`Planner` turns a request's state into the step's ops: loads of the
chunks ``get_num_new_matched_tokens`` offered, stores of the chunks a step
completed (planned in ``build_connector_meta``, copied by the workers in
``wait_for_save``, before vLLM may free the blocks), and the object-tier writes
of the write policy: ``write_through`` uploads every stored chunk,
``write_back`` uploads a chunk only before it leaves the host tier, cleaning the
oldest ones ahead of eviction (:class:`WriteBack`). A chunk the request may not
share (``RequestState.shared_chunks``) is stored and never uploaded. Every op goes
into the step's :class:`~.metadata.StepPlan`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from kvtier import metrics
from kvtier.host.index import ChunkIndex, Entry, State
from kvtier.host.layout import STATE, KVGroup
from kvtier.ops import LoadOp, OpKind, StoreOp, UploadOp
from kvtier.stats import StatsRecorder, Totals

from ..metadata import StepPlan
from .ledger import OpLedger
from .requests import ChunkKeys, RequestState

#: write_back: after a failed upload, cleaning ahead of eviction waits this long (seconds)
CLEAN_PAUSE_S = 5.0

#: a request id -> the vLLM block ids of its KV, one list per KV cache group
BlockIds = Callable[[str], tuple[list[int], ...]]

logger = logging.getLogger("kvtier.scheduler")

#: logged once per engine: a model with recurrent state whose chunks are not stored
STATE_STEP_HINT = (
    "kvtier: chunk %d of a request with recurrent state (Mamba/SSM) was not stored: it ends "
    "at token %d, but the step that completed it ran on to token %d, so the state at its "
    "end, which kvtier stores with it, was not kept. Every chunk end must end a prefill "
    "step: run chunked prefill with --max-num-batched-tokens equal to vLLM's block size "
    "(logged as 'kv lcm block sizes'; what vLLM's CPU build needs anyway) or to "
    "chunk_size. Counted in stores_state_gone; logged once"
)


class WriteBack:
    r"""``write_back``: a chunk leaving the host tier goes to the object tier first.

    The index asks :meth:`needed` of each eviction victim and :meth:`begin`\ s the
    upload of one that needs it; :meth:`clean_oldest` uploads the oldest chunks ahead
    of eviction each step; the ledger tells :meth:`upload_settled` (an
    :class:`~.ledger.UploadObserver`) every upload's outcome. The index and the ledger
    point at each other through it (an eviction begins an upload the ledger records and
    settles into the index), so it is made before the index and given the ledger once
    that exists (:meth:`record_in`). Without ``write_back`` (no object tier, or
    ``write_through``) nothing needs it and it never uploads."""

    def __init__(
        self, plan: StepPlan, totals: Totals, *, enabled: bool, clean_reserve: int
    ) -> None:
        self.plan = plan
        self.totals = totals
        self.enabled = enabled
        #: keeps this many of the oldest chunks uploaded ahead of eviction
        self.clean_reserve = clean_reserve
        self._clean_paused_until = 0.0  # after a failed upload: the object tier may be down
        self._ledger: OpLedger | None = None

    def record_in(self, ledger: OpLedger) -> None:
        """The ledger that records the uploads begun here (and the index it settles)."""
        self._ledger = ledger

    def needed(self, entry: Entry) -> bool:
        """A chunk leaving the host tier goes to the object tier first."""
        return self.enabled and not entry.remote and bool(entry.block_hash)

    def begin(self, entry: Entry) -> None:
        """Upload a chunk the index holds for it (evicting, or being cleaned)."""
        assert self._ledger is not None, "WriteBack.record_in was not called"
        entry.uploading = True
        op_id = self._ledger.add(OpKind.UPLOAD, entry)
        self.plan.uploads.append(UploadOp(op_id, entry.slot, entry.block_hash))
        self.totals["write_back"] += 1

    def upload_settled(self, ok: bool) -> None:
        if not ok and self.enabled:
            self._clean_paused_until = time.monotonic() + CLEAN_PAUSE_S

    def clean_oldest(self) -> None:
        """Keep ``clean_reserve`` slots free or holding uploaded chunks, by uploading the
        oldest chunks before they are needed as victims. They stay hits meanwhile; once
        uploaded they are evicted at once, so a burst of stores neither waits for uploads
        nor is skipped (only a burst larger than the reserve is)."""
        if not self.enabled or time.monotonic() < self._clean_paused_until:
            return
        assert self._ledger is not None, "WriteBack.record_in was not called"
        index = self._ledger.index
        ready = index.free_slots
        for entry in index.ready_oldest_first():
            if ready >= self.clean_reserve:
                break
            ready += 1
            if self.needed(entry) and not entry.uploading:
                index.hold(entry)  # released when the upload is reported
                self.begin(entry)


class Planner:
    def __init__(
        self,
        ledger: OpLedger,
        keys: ChunkKeys,
        stats: StatsRecorder,
        totals: Totals,
        plan: StepPlan,
        *,
        block_size: int,
        chunk_size: int,
        slot_bytes: int,
        write_through: bool,
        groups: tuple[KVGroup, ...] = (),
        hit: Callable[[bytes], None] | None = None,
    ) -> None:
        self.ledger = ledger
        self.keys = keys
        self.stats = stats
        self.totals = totals
        #: the step being planned: loads and stores go there
        self.plan = plan
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.blocks_per_chunk = chunk_size // block_size
        self.slot_bytes = slot_bytes
        #: every stored chunk is uploaded as well
        self.write_through = write_through
        #: a hybrid model's KV cache groups (empty: one group, every block of a chunk)
        self.groups = groups
        #: vLLM's null block id (set when the KV cache manager is bound)
        self.null_block: int | None = None
        #: a group of recurrent state (Mamba/SSM, gated delta-net, short conv)
        self.has_state = any(g.kind == STATE for g in groups)
        #: told the key of every chunk a load is planned of (scheduler/hot.py: what is hot)
        self.hit = hit

    @property
    def index(self) -> ChunkIndex:
        return self.ledger.index

    # ---- loads ------------------------------------------------------------------------
    def plan_loads(
        self, st: RequestState, block_ids: tuple[list[int], ...], start: int, end: int
    ) -> None:
        """Loads of tokens ``start..end`` (offered by the lookup) into ``block_ids`` (one
        list per KV cache group). A chunk of a one-step lookup (``st.fetching_now``) is
        still being fetched: its load is held to its fetch (``LoadOp.fetch_op``), and the
        slot is held, not pinned (only a ready chunk can be)."""
        bs, bpc, cs = self.block_size, self.blocks_per_chunk, self.chunk_size
        for c in range(start // cs, math.ceil(end / cs)):
            b_from = max(start, c * cs) // bs
            b_to = min(end, (c + 1) * cs) // bs
            parts = self._load_parts(block_ids, c, b_from, b_to) if self.groups else None
            fetch_op = st.fetching_now.get(c, 0)
            entry = self._hold_fetching(st, c) if fetch_op else self.index.pin(self.keys.key(st, c))
            if self.hit is not None:
                self.hit(entry.key)
            nbytes = self.slot_bytes * (b_to - b_from) // bpc
            tokens = (b_to - b_from) * bs
            tier = "remote" if entry.fetched or fetch_op else "host"
            if entry.warmed:  # a chunk a starting engine's warm-up brought in
                self.stats.inc(metrics.WARMUP_HIT_TOKENS, tokens)
            # counted as hits once the load is reported (OpLedger): a load that fails (a
            # one-step lookup's fetch that failed, a copy error) served nothing
            op_id = self.ledger.add(OpKind.LOAD, entry, nbytes=nbytes, hit=(tier, tokens))
            if parts is None:
                op = LoadOp(
                    op_id,
                    entry.slot,
                    b_from - c * bpc,
                    list(block_ids[0][b_from:b_to]),
                    fetch_op=fetch_op,
                )
            else:
                op = LoadOp(op_id, entry.slot, *parts[0], more=tuple(parts[1:]), fetch_op=fetch_op)
            self.plan.loads.append(op)
            st.step_loads.append(op_id)
            st.hit_sources[tier] = st.hit_sources.get(tier, 0) + tokens
            if self.has_state and c == math.ceil(end / cs) - 1:
                self._load_running_state(st, block_ids, c, fetch_op)

    def _load_running_state(
        self, st: RequestState, block_ids: tuple[list[int], ...], c: int, fetch_op: int
    ) -> None:
        """A hit's last chunk ``c`` of a model with recurrent state: its state also goes to
        the blocks the request runs on in this step, every block of a state group past the
        hit's (the running one, and with speculative decoding its lookahead ones, which
        the step overwrites). vLLM copies the state of the hit's last block into the
        running block before the step's forward, which is before any connector load: the
        state loaded into the hit's block alone would be read only by later hits of vLLM's
        own prefix cache, the running one would start from whatever that block held.
        One load per block (a load maps each slot block to one block)."""
        hit_block = (c + 1) * self.blocks_per_chunk - 1
        past = [
            [b for b in block_ids[g][hit_block + 1 :] if b != self.null_block]
            if group.kind == STATE
            else []
            for g, group in enumerate(self.groups)
        ]
        for i in range(max(map(len, past), default=0)):
            parts = [(0, blocks[i : i + 1]) for blocks in past]
            entry = self._hold_fetching(st, c) if fetch_op else self.index.pin(self.keys.key(st, c))
            op_id = self.ledger.add(OpKind.LOAD, entry)
            self.plan.loads.append(
                LoadOp(op_id, entry.slot, *parts[0], more=tuple(parts[1:]), fetch_op=fetch_op)
            )
            st.step_loads.append(op_id)

    def _hold_fetching(self, st: RequestState, c: int) -> Entry:
        """The entry a one-step lookup claimed for chunk ``c`` of ``st``, held for its load."""
        entry = self.index.get(self.keys.key(st, c))
        if entry is None or entry.state is not State.FETCHING:
            state = "gone" if entry is None else entry.state.value
            raise RuntimeError(f"kvtier: chunk {c} of a one-step lookup is {state} at its load")
        self.index.hold(entry)
        return entry

    def _load_parts(
        self, block_ids: tuple[list[int], ...], c: int, b_from: int, b_to: int
    ) -> list[tuple[int, list[int]]]:
        """Hybrid: each group's ``(first slot block, gpu blocks)`` for request blocks
        ``b_from..b_to`` of chunk ``c``: every block vLLM backs (its null block stands for
        a sliding-window group's blocks before the window; they lead the range), all of
        them inside what the group's region holds, the chunk's last ``blocks`` blocks.

        One that is not stops the engine: vLLM cannot recompute per block with several
        groups, and a block left unloaded would be computed on (and cached) with another
        request's KV. The lookup offers only whole chunks for this reason, and a window's
        blocks are the chunk's last ones, so this does not happen."""
        parts: list[tuple[int, list[int]]] = []
        for g, group in enumerate(self.groups):
            blocks = list(block_ids[g][b_from:b_to])
            k = 0
            while k < len(blocks) and blocks[k] == self.null_block:
                k += 1
            if k == len(blocks):
                parts.append((0, []))
                continue
            stored_from = (c + 1) * self.blocks_per_chunk - group.blocks
            if b_from + k < stored_from or len(blocks) < b_to - b_from:
                raise RuntimeError(
                    f"kvtier: a load of chunk {c} needs blocks {b_from + k}..{b_to - 1} of KV "
                    f"cache group {g} ({group.kind}, window {group.window}); its slot holds "
                    f"blocks {stored_from}..{(c + 1) * self.blocks_per_chunk - 1} only"
                )
            parts.append((b_from + k - stored_from, blocks[k:]))
        return parts

    def _store_parts(self, blocks: tuple[list[int], ...], c: int) -> list[list[int]] | None:
        """Each group's blocks of chunk ``c`` its region of the slot stores (one group: the
        whole chunk; a hybrid model's sliding-window group: the chunk's last ones), or
        None when vLLM already dropped one of them: the chunk is not stored rather than
        stored with a hole.

        vLLM puts its null block (all zeros) in place of a sliding window's blocks once
        they leave the window: on a model whose only group is sliding-window attention as
        on a hybrid one, and whether the chunk completes in a prefill split off a block
        boundary, in a decode step, or after vLLM's own prefix cache served its start. A
        chunk stored with it would load zeros into a block a later hit attends to."""
        bpc = self.blocks_per_chunk
        sizes = [g.blocks for g in self.groups] or [bpc]
        parts: list[list[int]] = []
        for g, n in enumerate(sizes):
            part = list(blocks[g][(c + 1) * bpc - n : (c + 1) * bpc])
            if len(part) != n or self.null_block in part:
                return None
            parts.append(part)
        return parts

    # ---- stores -----------------------------------------------------------------------
    def plan_stores(
        self, st: RequestState, block_ids: BlockIds, computed_after: int
    ) -> list[StoreOp]:
        """Stores of the chunks of ``st`` complete after this step, from ``st.next_store``,
        into the step's plan; returns them (in prompt order)."""
        self.keys.refresh(st)
        bpc = self.blocks_per_chunk
        n_complete = min(computed_after // self.chunk_size, len(st.chunk_hashes))
        # newer vLLM may hash blocks before their KV is final (EAGLE drafts); only
        # publishable hashes may key a stored chunk
        publishable = getattr(st.request, "num_publishable_block_hashes", None)
        if isinstance(publishable, int):
            n_complete = min(n_complete, publishable // bpc)
        if n_complete <= st.next_store:
            return []
        out = self.plan.stores
        n_before = len(out)
        blocks = block_ids(st.request.request_id)
        for c in range(st.next_store, n_complete):
            key = self.keys.key(st, c)
            held = self.index.get(key)
            if held is not None and (held.state is not State.FETCHING or held.refs):
                # ready, being stored, or fetched for a load in this step (a one-step
                # lookup's chunk, held by its load: the fetch fills the slot)
                self.index.touch(key)
                continue
            if self.has_state and (c + 1) * self.chunk_size != computed_after:
                # recurrent state: the chunk's last block holds the state at its end only
                # in the step that ends there (a step running past it goes on updating
                # the state in its running block; whether vLLM kept a checkpoint at the
                # boundary is not said): stored then or never, never with another state
                if not self.totals["stores_state_gone"]:
                    logger.warning(STATE_STEP_HINT, c, (c + 1) * self.chunk_size, computed_after)
                self.totals["stores_state_gone"] += 1
                continue
            parts = self._store_parts(blocks, c)
            if parts is None:
                self.totals["stores_window_gone"] += 1
                continue
            if held is not None:
                # a fetch not reported yet (behind a lookup's miss, or past its timeout):
                # this request computed the chunk, so it is stored now, into a new slot;
                # waiting for the fetch would lose it when the request has no later step
                entry = self.index.supersede(key, st.tenant)
            else:
                entry = self.index.begin(key, State.STORING, tenant=st.tenant)
            if entry is None:  # every slot is busy loading or uploading: skip this chunk
                self.stats.inc(metrics.STORES_SKIPPED)  # (and its total)
                continue
            op_id = self.ledger.new_id()
            upload_id = None
            if c >= st.shared_chunks:
                # host-only (RequestState.shared_chunks): marked as if it were in the object
                # tier, so write-back never uploads it either
                entry.remote = True
            elif self.write_through:
                self.index.hold(entry)  # until the upload is reported
                upload_id = self.ledger.add(OpKind.UPLOAD, entry)
            op = StoreOp(
                op_id,
                entry.slot,
                parts[0],
                st.chunk_hashes[c],
                upload_id,
                more=tuple(parts[1:]),
                after_loads=tuple(st.step_loads),
            )
            out.append(op)
            self.ledger.add(OpKind.STORE, entry, nbytes=self.slot_bytes, op_id=op_id)
        st.next_store = n_complete
        return out[n_before:]
