"""Scheduler side of the connector: chunk keys, the host-tier index, and the plan.

Runs in vLLM's scheduler process. It decides which chunk lives in which host
slot, which chunks a request may load, which chunks to store and when to talk
to the object tier; the workers only execute the ops it puts into the step's
metadata and report back through the worker metadata. It never touches KV
bytes and never waits on the network.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier import metrics
from kvtier.config import KVTierConfig, format_size
from kvtier.index import ChunkIndex, Entry, State
from kvtier.keys import ANY_RANK, Namespace, chunk_block_hashes, chunk_key
from kvtier.layout import slot_bytes_for
from kvtier.stats import StatsRecorder

from .metadata import KVTierMetadata, KVTierWorkerMeta, LoadOp, RemoteOp, StoreOp

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvtier.scheduler")

#: write_back: after a failed upload, cleaning ahead of eviction waits this long (seconds)
_CLEAN_PAUSE_S = 5.0


@dataclass(slots=True)
class _Lookup:
    """An object-tier lookup in flight for one request: its chunks from the first one
    the host tier lacked, in order (fetched for it, or already there or being fetched
    for another request)."""

    started: float
    first_chunk: int
    chunks: list[Entry] = field(default_factory=list)
    done: bool = False


@dataclass(slots=True)
class _ReqState:
    request: Request
    #: the last block hash of each full chunk so far
    chunk_hashes: list[bytes] = field(default_factory=list)
    #: host-index keys of the first chunks, made on first use (SchedulerSide._key)
    keys: list[str] = field(default_factory=list)
    #: chunks below this index are stored (or were skipped on purpose)
    next_store: int = 0
    #: (start, end) token range get_num_new_matched_tokens offered
    plan: tuple[int, int] | None = None
    #: tokens vLLM's own prefix cache had, as last passed to get_num_new_matched_tokens
    local_hit: int = 0
    lookup: _Lookup | None = None
    hit_sources: dict[str, int] = field(default_factory=dict)
    outcome: str = "miss"
    prefill_done: bool = False


@dataclass(slots=True)
class _Pending:
    kind: str  # "store" | "load" | "fetch" | "upload"
    entry: Entry | None
    started: float
    reports: list[bool] = field(default_factory=list)
    nbytes: int = 0


class SchedulerSide:
    def __init__(
        self,
        cfg: KVTierConfig,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        namespace: Namespace,
    ) -> None:
        self.cfg = cfg
        cache = vllm_config.cache_config
        self.block_size = cache.block_size
        cfg.check_block_size(self.block_size)
        self.chunk_size = cfg.chunk_size
        self.blocks_per_chunk = cfg.chunk_size // self.block_size
        par = vllm_config.parallel_config
        self.world_size = par.tensor_parallel_size * par.pipeline_parallel_size

        group = kv_cache_config.kv_cache_groups[0]
        per_block = [group.kv_cache_spec.page_size_bytes] * len(group.layer_names)
        self.slot_bytes = slot_bytes_for(per_block, self.blocks_per_chunk)
        self.host_bytes = resolve_host_bytes(cfg, vllm_config, self.world_size)
        num_slots = self.host_bytes // self.slot_bytes
        if num_slots < 1:
            from kvtier.errors import ConfigError

            raise ConfigError(
                "cpu_bytes",
                cfg.cpu_bytes,
                f"at least one chunk per worker: {format_size(self.slot_bytes * self.world_size)}"
                f" for chunk_size={cfg.chunk_size} on this model",
            )
        self.namespace = namespace
        self._index_ns = self.namespace.digest(ANY_RANK)
        #: the object tier is read and written by the workers, each under its own keys;
        #: the scheduler only plans (a lookup is a read: no existence checks from here)
        self.remote = bool(cfg.remote_url)
        self.write_through = self.remote and cfg.write_policy == "write_through"
        self.write_back = self.remote and cfg.write_policy == "write_back"
        self._op_ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._uploads: list[RemoteOp] = []
        #: write_back keeps this many of the oldest chunks uploaded ahead of eviction, so
        #: one step's stores find clean victims: what a step can store, up to half the tier
        step_chunks = -(-vllm_config.scheduler_config.max_num_batched_tokens // self.chunk_size)
        self._clean_reserve = max(1, min(num_slots // 2, step_chunks))
        self._clean_paused_until = 0.0  # after a failed upload: the object tier may be down
        self.index = ChunkIndex(
            num_slots,
            write_back_needed=self._write_back_needed,
            begin_write_back=self._begin_write_back,
        )
        self.remote_source = (
            CacheHitSource.DISK
            if (cfg.remote_url or "").startswith("file:")
            else CacheHitSource.EXTERNAL_UNSPECIFIED
        )
        self.stats = StatsRecorder()
        #: running totals since start, for tests and `kvtier doctor`-style introspection
        self.totals: collections.Counter[str] = collections.Counter()
        # every name present from the start: a reader asking for one that is not is told
        self.totals.update({f"hit_tokens_{tier}": 0 for tier in ("host", "remote")})
        self.totals.update({f"{kind}_{end}": 0 for kind in ("store", "load", "fetch", "upload")
                            for end in ("ok", "failed")})
        self.stats.set(metrics.HOST_BYTES_CAPACITY, num_slots * self.slot_bytes * self.world_size)
        self._kv_cache_manager: KVCacheManager | None = None
        self._reqs: dict[str, _ReqState] = {}
        self._step = 0
        self._loads: list[LoadOp] = []
        self._fetches: list[list[RemoteOp]] = []
        self._ttft_by_step: dict[int, list[tuple[float, str]]] = {}
        self._last_evictions = 0
        logger.info(
            "kvtier scheduler: %d host slots of %s (chunk %d tokens), %s per worker, remote=%s",
            num_slots,
            format_size(self.slot_bytes),
            cfg.chunk_size,
            format_size(self.host_bytes),
            cfg.redacted()["remote_url"],
        )

    # ---- vLLM hooks -------------------------------------------------------------------
    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._kv_cache_manager = manager

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        t0 = time.perf_counter()
        st = self._state(request)
        st.local_hit = num_computed_tokens
        self._refresh_keys(st)
        cap = self._max_loadable(request)
        first = num_computed_tokens // self.chunk_size
        end_chunk = self._ready_run(st, first, cap)
        if self.remote and self._wants_remote(st, end_chunk, cap):
            if self._remote_lookup(st, end_chunk, cap):
                self.stats.observe(metrics.LOOKUP_DELAY, time.perf_counter() - t0, ("sync",))
                # vLLM re-asks at once in a tight loop; yield the GIL so the I/O threads
                # that are fetching this request's chunks get to run (no sleep, no wait)
                time.sleep(0)
                return None, False
            end_chunk = self._ready_run(st, first, cap)
        end = min(end_chunk * self.chunk_size, cap)
        n = max(0, end - num_computed_tokens)
        st.plan = (num_computed_tokens, num_computed_tokens + n) if n else None
        self.stats.observe(metrics.LOOKUP_DELAY, time.perf_counter() - t0, ("sync",))
        return n, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        cap = self._max_loadable(request)
        local = st.local_hit  # request.num_computed_tokens is not updated yet here
        plan, st.plan = st.plan, None
        st.hit_sources = {}
        if num_external_tokens > 0 and plan is not None:
            start, end = plan[0], plan[0] + num_external_tokens
            self._plan_loads(st, request, start, end)
        lookup = max(0, cap - local)
        self.stats.inc(metrics.LOOKUP_TOKENS, lookup)
        self.totals["lookup_tokens"] += lookup
        # "hit": everything kvtier could ever hold for this prompt (its full chunks, up to
        # the last token vLLM must compute) was there; the tail is always recomputed
        reusable = min(cap, len(st.chunk_hashes) * self.chunk_size)
        total = local + num_external_tokens
        if total and total >= reusable:
            st.outcome = "hit"
        else:
            st.outcome = "partial" if total else "miss"

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens == 0:
            return {}
        out: dict[CacheHitSource, int] = {}
        if st.hit_sources.get("host"):
            out[CacheHitSource.HOST] = st.hit_sources["host"]
        if st.hit_sources.get("remote"):
            out[self.remote_source] = st.hit_sources["remote"]
        return out

    def build_connector_meta(self, so: SchedulerOutput) -> KVTierMetadata:
        self._step += 1
        meta = KVTierMetadata(step=self._step, host_bytes=self.host_bytes)
        meta.loads, self._loads = self._loads, []
        meta.fetches, self._fetches = self._fetches, []
        scheduled: list[tuple[str, int]] = [
            (r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs
        ]
        cached = so.scheduled_cached_reqs
        scheduled += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, computed_before in scheduled:
            st = self._reqs.get(req_id)
            if st is None:
                continue
            n_sched = so.num_scheduled_tokens.get(req_id, 0)
            n_spec = len(so.scheduled_spec_decode_tokens.get(req_id, ()))
            computed_after = computed_before + n_sched - n_spec
            if not st.prefill_done and computed_after >= st.request.num_prompt_tokens:
                st.prefill_done = True
                self._ttft_by_step.setdefault(self._step, []).append(
                    (st.request.arrival_time, st.outcome)
                )
            if computed_after // self.chunk_size > st.next_store:
                # a decode step completes a chunk once in chunk_size steps: the other
                # steps cost this comparison, not a key refresh per running request
                self._plan_stores(st, req_id, computed_after, meta.stores)
        self._clean_oldest()
        meta.uploads, self._uploads = self._uploads, []
        used = (self.index.used_slots) * self.slot_bytes * self.world_size
        self.stats.set(metrics.HOST_BYTES_USED, used)
        self.totals["evictions"] = self.index.evictions
        if self.index.evictions != self._last_evictions:
            self.stats.inc(metrics.EVICTIONS, self.index.evictions - self._last_evictions)
            self._last_evictions = self.index.evictions
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVTierWorkerMeta):
            for op_id in sorted(meta.results):
                self._report(op_id, meta.results[op_id])
            for kind, n in meta.errors.items():
                self.totals[f"error_{kind}"] += n
            now = time.time()
            for step in meta.steps:
                for arrival, outcome in self._ttft_by_step.pop(step, ()):
                    self.stats.observe(metrics.TTFT, max(0.0, now - arrival), (outcome,))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        st = self._reqs.pop(request.request_id, None)
        if st is not None and st.lookup is not None and not st.lookup.done:
            self._finish_lookup(st)
        # Stores run inside the step that computes a chunk, before vLLM frees its blocks,
        # so nothing is left to copy here and the blocks can be freed at once.
        return False, None

    def pending_ops(self) -> int:
        """Ops sent to workers and not yet reported (0 when the engine is idle)."""
        return len(self._pending)

    def open_requests(self) -> int:
        return len(self._reqs)

    def get_stats(self) -> dict[str, Any]:
        return self.stats.take()

    def reset_cache(self) -> bool:
        dropped = self.index.clear()
        logger.info("kvtier: host tier reset, %d chunks dropped", dropped)
        return True

    def shutdown(self) -> None:
        pass  # the scheduler holds no connection: the workers own the object tier

    # ---- keys and plans ---------------------------------------------------------------
    def _state(self, request: Request) -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = _ReqState(request=request)
            self._reqs[request.request_id] = st
        return st

    def _refresh_keys(self, st: _ReqState) -> None:
        """The last block hash of every full chunk vLLM has hashed so far (cheap); keys
        are made from them on first use (:meth:`_key`): a miss computes one."""
        hashes = st.request.block_hashes
        if len(hashes) // self.blocks_per_chunk > len(st.chunk_hashes):
            new = chunk_block_hashes(hashes, self.blocks_per_chunk)[len(st.chunk_hashes) :]
            st.chunk_hashes.extend(new)

    def _key(self, st: _ReqState, c: int) -> str:
        """Host-index key of chunk ``c`` (any rank's: the index is one for all workers)."""
        keys = st.keys
        while len(keys) <= c:
            keys.append(chunk_key(self._index_ns, st.chunk_hashes[len(keys)]))
        return keys[c]

    def _max_loadable(self, request: Request) -> int:
        """vLLM must compute at least the last prompt token itself."""
        return (request.num_tokens - 1) // self.block_size * self.block_size

    def _ready_run(self, st: _ReqState, first: int, cap: int) -> int:
        i, n = first, len(st.chunk_hashes)
        while i < n and i * self.chunk_size < cap and self.index.is_ready(self._key(st, i)):
            i += 1
        return i

    def _plan_loads(self, st: _ReqState, request: Request, start: int, end: int) -> None:
        assert self._kv_cache_manager is not None
        block_ids = self._kv_cache_manager.get_block_ids(request.request_id)[0]
        bs, bpc, cs = self.block_size, self.blocks_per_chunk, self.chunk_size
        for c in range(start // cs, math.ceil(end / cs)):
            entry = self.index.pin(self._key(st, c))
            b_from = max(start, c * cs) // bs
            b_to = min(end, (c + 1) * cs) // bs
            op_id = next(self._op_ids)
            self._loads.append(
                LoadOp(op_id, entry.slot, b_from - c * bpc, list(block_ids[b_from:b_to]))
            )
            tokens = (b_to - b_from) * bs
            self._pending[op_id] = _Pending(
                "load", entry, time.perf_counter(), nbytes=self.slot_bytes * (b_to - b_from) // bpc
            )
            tier = "remote" if entry.fetched else "host"
            st.hit_sources[tier] = st.hit_sources.get(tier, 0) + tokens
            self.stats.inc(metrics.HIT_TOKENS, tokens, (tier,))
            self.totals[f"hit_tokens_{tier}"] += tokens

    def _plan_stores(
        self, st: _ReqState, req_id: str, computed_after: int, out: list[StoreOp]
    ) -> None:
        self._refresh_keys(st)
        n_complete = min(computed_after // self.chunk_size, len(st.chunk_hashes))
        # newer vLLM may hash blocks before their KV is final (EAGLE drafts); only
        # publishable hashes may key a stored chunk
        publishable = getattr(st.request, "num_publishable_block_hashes", None)
        if isinstance(publishable, int):
            n_complete = min(n_complete, publishable // self.blocks_per_chunk)
        if n_complete <= st.next_store:
            return
        assert self._kv_cache_manager is not None
        block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
        bpc = self.blocks_per_chunk
        for c in range(st.next_store, n_complete):
            key = self._key(st, c)
            held = self.index.get(key)
            if held is not None and held.state is State.FETCHING:
                # a lookup's fetch may still fail (a miss behind the prefix this request
                # loaded): store from here on in a later step, once it was reported
                n_complete = c
                break
            if held is not None:
                self.index.touch(key)
                continue
            entry = self.index.begin(key, State.STORING)
            if entry is None:  # every slot is busy loading or uploading: skip this chunk
                self.totals["store_skipped"] += 1
                self.stats.inc(metrics.STORES_SKIPPED)
                continue
            entry.block_hash = st.chunk_hashes[c]
            op_id = next(self._op_ids)
            upload_id = None
            if self.write_through:
                upload_id = next(self._op_ids)
                self.index.hold(entry)  # until the upload is reported
                self._pending[upload_id] = _Pending("upload", entry, time.perf_counter())
            out.append(
                StoreOp(op_id, entry.slot, list(block_ids[c * bpc : (c + 1) * bpc]),
                        st.chunk_hashes[c], upload_id)
            )
            self._pending[op_id] = _Pending(
                "store", entry, time.perf_counter(), nbytes=self.slot_bytes
            )
        st.next_store = n_complete

    def _write_back_needed(self, entry: Entry) -> bool:
        """write_back: a chunk leaving the host tier goes to the object tier first."""
        return self.write_back and not entry.remote and bool(entry.block_hash)

    def _begin_write_back(self, entry: Entry) -> None:
        """Upload a chunk the index holds for it (evicting, or being cleaned)."""
        op_id = next(self._op_ids)
        entry.uploading = True
        self._uploads.append(RemoteOp(op_id, entry.slot, entry.block_hash))
        self._pending[op_id] = _Pending("upload", entry, time.perf_counter())
        self.totals["write_back"] += 1

    def _clean_oldest(self) -> None:
        """write_back: keep ``_clean_reserve`` slots free or holding uploaded chunks, by
        uploading the oldest chunks before they are needed as victims. They stay hits
        meanwhile; once uploaded they are evicted at once, so a burst of stores neither
        waits for uploads nor is skipped (only a burst larger than the reserve is)."""
        if not self.write_back or time.monotonic() < self._clean_paused_until:
            return
        ready = self.index.free_slots
        for entry in self.index.ready_oldest_first():
            if ready >= self._clean_reserve:
                break
            ready += 1
            if self._write_back_needed(entry) and not entry.uploading:
                self.index.hold(entry)  # released when the upload is reported
                self._begin_write_back(entry)

    # ---- worker reports ----------------------------------------------------------------
    def _report(self, op_id: int, oks: list[bool]) -> None:
        pending = self._pending.get(op_id)
        if pending is None:
            return
        pending.reports.extend(oks)
        if len(pending.reports) < self.world_size:
            return
        del self._pending[op_id]
        ok = all(pending.reports)
        self.totals[f"{pending.kind}_{'ok' if ok else 'failed'}"] += 1
        entry = pending.entry
        assert entry is not None
        live = self.index.get(entry.key) is entry
        if pending.kind in ("store", "fetch"):
            if live:
                self.index.commit(entry.key, ok)
            if ok:
                tier = "host" if pending.kind == "store" else "remote"
                self.stats.inc(metrics.BYTES, pending.nbytes, (tier, "write" if tier == "host"
                                                                  else "read"))
        elif pending.kind in ("load", "upload"):
            if pending.kind == "upload":
                entry.uploading = False
                if not ok and self.write_back:
                    self._clean_paused_until = time.monotonic() + _CLEAN_PAUSE_S
            if live and entry.refs > 0:
                self.index.unpin(entry.key)
            if pending.kind == "upload" and ok and live:
                entry.remote = True
            if pending.kind == "load":
                if ok:
                    self.stats.inc(metrics.BYTES, pending.nbytes, ("host", "read"))

    # ---- object tier ----------------------------------------------------------------------
    def _wants_remote(self, st: _ReqState, end_chunk: int, cap: int) -> bool:
        if st.lookup is not None and st.lookup.done:
            return False
        return end_chunk < len(st.chunk_hashes) and end_chunk * self.chunk_size < cap

    def _remote_lookup(self, st: _ReqState, first: int, cap: int) -> bool:
        """Advance this request's object-tier lookup; True while it should wait.

        A lookup is a read: it claims host slots for the prompt's chunks from
        ``first`` on and sends their fetches to the workers as one run (the first
        chunk alone, the rest once it was found, none after a miss), then waits
        until the stored prefix is known: every chunk up to the first one that
        failed or is missing has landed. Chunks another request is fetching are
        waited on, not fetched twice.
        """
        now = time.monotonic()
        lk = st.lookup
        if lk is None:
            lk = st.lookup = _Lookup(started=now, first_chunk=first)
            self._start_fetches(st, lk, first, cap)
            if not lk.chunks:
                self._finish_lookup(st)
                return False
            return True
        if now - lk.started > self.cfg.lookup_timeout_ms / 1000:
            self.stats.inc(metrics.ERRORS, 1, ("timeout",))
            self._finish_lookup(st)
            return False
        for entry in lk.chunks:
            if self.index.get(entry.key) is not entry:
                break  # missing, failed or evicted: the usable prefix ends here
            if entry.state is State.FETCHING:
                return True
        self._finish_lookup(st)
        return False

    def _start_fetches(self, st: _ReqState, lk: _Lookup, first: int, cap: int) -> None:
        """Claim slots for chunks ``first``.. and queue their fetches as one run."""
        # the host tier's part of this prompt stays: claims below must not evict it
        for c in range(st.local_hit // self.chunk_size, first):
            key = self._key(st, c)
            if self.index.is_ready(key):
                self.index.touch(key)
        run: list[RemoteOp] = []
        last = min(len(st.chunk_hashes), math.ceil(cap / self.chunk_size))
        for c in range(first, last):
            key = self._key(st, c)
            entry = self.index.get(key)
            if entry is None:
                entry = self.index.begin(key, State.FETCHING)
                if entry is None:  # every slot is busy: fetch what fits
                    break
                entry.block_hash = st.chunk_hashes[c]
                op_id = next(self._op_ids)
                run.append(RemoteOp(op_id, entry.slot, st.chunk_hashes[c]))
                self._pending[op_id] = _Pending(
                    "fetch", entry, time.perf_counter(), nbytes=self.slot_bytes
                )
            lk.chunks.append(entry)
        if run:
            self._fetches.append(run)

    def _finish_lookup(self, st: _ReqState) -> None:
        lk = st.lookup
        if lk is None or lk.done:
            return
        lk.done = True
        self.stats.observe(metrics.LOOKUP_DELAY, time.monotonic() - lk.started, ("async",))


def resolve_host_bytes(cfg: KVTierConfig, vllm_config: VllmConfig, world_size: int) -> int:
    """Host tier bytes per worker: ``cpu_bytes`` is per worker (TP rank), like vLLM's
    per-rank KV; "auto" splits what the planner finds free between the workers."""
    from kvtier.sizing.autosize import resolve_cpu_bytes

    offload = getattr(vllm_config, "offload_config", None)
    cpu_offload_gb = float(getattr(getattr(offload, "uva", None), "cpu_offload_gb", 0.0) or 0.0)
    if not cpu_offload_gb:
        cpu_offload_gb = float(getattr(vllm_config.cache_config, "cpu_offload_gb", 0.0) or 0.0)
    model_dir = str(vllm_config.model_config.model)
    requested = cfg.cpu_bytes if cfg.cpu_bytes == "auto" else cfg.cpu_bytes * world_size
    total = resolve_cpu_bytes(
        requested,
        headroom_bytes=cfg.cpu_headroom_bytes,
        cpu_offload_gb=cpu_offload_gb * world_size,
        model_dir=model_dir if os.path.isdir(model_dir) else None,
    )
    return total // world_size
