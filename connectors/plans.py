"""Which chunks move between vLLM's paged KV and the host tier, and what goes up.

:class:`Planner` turns a request's state into the step's ops: loads of the
chunks ``get_num_new_matched_tokens`` offered, stores of the chunks a step
completed (planned in ``build_connector_meta``, copied by the workers in
``wait_for_save``, before vLLM may free the blocks), and the object-tier writes
of the write policy: ``write_through`` uploads every stored chunk,
``write_back`` uploads a chunk only before it leaves the host tier, cleaning the
oldest ones ahead of eviction. A chunk the request may not share
(``RequestState.shared_chunks``) is stored and never uploaded.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from kvtier import metrics
from kvtier.index import ChunkIndex, Entry, State
from kvtier.ops import LoadOp, OpKind, StoreOp, UploadOp
from kvtier.stats import StatsRecorder, Totals

from .ledger import OpLedger
from .requests import ChunkKeys, RequestState

#: write_back: after a failed upload, cleaning ahead of eviction waits this long (seconds)
CLEAN_PAUSE_S = 5.0

#: a request id -> the vLLM block ids of its KV (the first KV cache group's)
BlockIds = Callable[[str], list[int]]


class Planner:
    def __init__(
        self,
        ledger: OpLedger,
        keys: ChunkKeys,
        stats: StatsRecorder,
        totals: Totals,
        *,
        block_size: int,
        chunk_size: int,
        slot_bytes: int,
        write_policy: str | None,
        clean_reserve: int,
    ) -> None:
        self.ledger = ledger
        self.keys = keys
        self.stats = stats
        self.totals = totals
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.blocks_per_chunk = chunk_size // block_size
        self.slot_bytes = slot_bytes
        #: None: no object tier
        self.write_through = write_policy == "write_through"
        self.write_back = write_policy == "write_back"
        #: write_back keeps this many of the oldest chunks uploaded ahead of eviction
        self.clean_reserve = clean_reserve
        self._clean_paused_until = 0.0  # after a failed upload: the object tier may be down
        self.loads: list[LoadOp] = []
        self.uploads: list[UploadOp] = []

    @property
    def index(self) -> ChunkIndex:
        return self.ledger.index

    # ---- loads ------------------------------------------------------------------------
    def plan_loads(self, st: RequestState, block_ids: list[int], start: int, end: int) -> None:
        """Loads of tokens ``start..end`` (offered by the lookup) into ``block_ids``."""
        bs, bpc, cs = self.block_size, self.blocks_per_chunk, self.chunk_size
        for c in range(start // cs, math.ceil(end / cs)):
            entry = self.index.pin(self.keys.key(st, c))
            b_from = max(start, c * cs) // bs
            b_to = min(end, (c + 1) * cs) // bs
            nbytes = self.slot_bytes * (b_to - b_from) // bpc
            op_id = self.ledger.add(OpKind.LOAD, entry, nbytes=nbytes)
            self.loads.append(
                LoadOp(op_id, entry.slot, b_from - c * bpc, list(block_ids[b_from:b_to]))
            )
            tokens = (b_to - b_from) * bs
            tier = "remote" if entry.fetched else "host"
            st.hit_sources[tier] = st.hit_sources.get(tier, 0) + tokens
            self.stats.inc(metrics.HIT_TOKENS, tokens, (tier,))  # (and its total)

    # ---- stores -----------------------------------------------------------------------
    def plan_stores(
        self, st: RequestState, block_ids: BlockIds, computed_after: int, out: list[StoreOp]
    ) -> None:
        """Stores of the chunks of ``st`` complete after this step, from ``st.next_store``."""
        self.keys.refresh(st)
        bpc = self.blocks_per_chunk
        n_complete = min(computed_after // self.chunk_size, len(st.chunk_hashes))
        # newer vLLM may hash blocks before their KV is final (EAGLE drafts); only
        # publishable hashes may key a stored chunk
        publishable = getattr(st.request, "num_publishable_block_hashes", None)
        if isinstance(publishable, int):
            n_complete = min(n_complete, publishable // bpc)
        if n_complete <= st.next_store:
            return
        blocks = block_ids(st.request.request_id)
        for c in range(st.next_store, n_complete):
            key = self.keys.key(st, c)
            held = self.index.get(key)
            if held is not None and held.state is not State.FETCHING:
                self.index.touch(key)
                continue
            if held is not None:
                # a fetch not reported yet (behind a lookup's miss, or past its timeout):
                # this request computed the chunk, so it is stored now, into a new slot;
                # waiting for the fetch would lose it when the request has no later step
                entry = self.index.supersede(key)
            else:
                entry = self.index.begin(key, State.STORING)
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
            out.append(
                StoreOp(op_id, entry.slot, list(blocks[c * bpc : (c + 1) * bpc]),
                        st.chunk_hashes[c], upload_id)
            )  # fmt: skip
            self.ledger.add(OpKind.STORE, entry, nbytes=self.slot_bytes, op_id=op_id)
        st.next_store = n_complete

    # ---- write_back -------------------------------------------------------------------
    def write_back_needed(self, entry: Entry) -> bool:
        """write_back: a chunk leaving the host tier goes to the object tier first."""
        return self.write_back and not entry.remote and bool(entry.block_hash)

    def begin_write_back(self, entry: Entry) -> None:
        """Upload a chunk the index holds for it (evicting, or being cleaned)."""
        entry.uploading = True
        op_id = self.ledger.add(OpKind.UPLOAD, entry)
        self.uploads.append(UploadOp(op_id, entry.slot, entry.block_hash))
        self.totals["write_back"] += 1

    def upload_settled(self, ok: bool) -> None:
        if not ok and self.write_back:
            self._clean_paused_until = time.monotonic() + CLEAN_PAUSE_S

    def clean_oldest(self) -> None:
        """write_back: keep ``clean_reserve`` slots free or holding uploaded chunks, by
        uploading the oldest chunks before they are needed as victims. They stay hits
        meanwhile; once uploaded they are evicted at once, so a burst of stores neither
        waits for uploads nor is skipped (only a burst larger than the reserve is)."""
        if not self.write_back or time.monotonic() < self._clean_paused_until:
            return
        ready = self.index.free_slots
        for entry in self.index.ready_oldest_first():
            if ready >= self.clean_reserve:
                break
            ready += 1
            if self.write_back_needed(entry) and not entry.uploading:
                self.index.hold(entry)  # released when the upload is reported
                self.begin_write_back(entry)
