"""Scheduler side of the connector: vLLM's scheduler hooks, in one place.

Runs in vLLM's scheduler process. It decides which chunk lives in which host
slot, which chunks a request may load, which chunks to store and when to read
the object tier; the workers only execute the ops it puts into the step's
metadata and report back through the worker metadata. It never touches KV
bytes and never waits on the network.

The work is in parts, each its own module: :mod:`.requests` (per-request state
and chunk keys), :mod:`.lookup` (the object-tier lookup state machine),
:mod:`.plans` (loads, stores, write-back) and :mod:`.ledger` (ops in flight and
how their reports settle the index), and, when vLLM publishes KV events,
:mod:`.events` (the index's listener). This class wires them to vLLM's calls and
keeps the step's metrics. The parts write the step's ops into one
:class:`~.metadata.StepPlan`, handed to vLLM by :meth:`SchedulerSide.build_connector_meta`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier import metrics
from kvtier.canary import Trust
from kvtier.config import KVTierConfig, format_size
from kvtier.errors import TierError
from kvtier.host.index import ChunkIndex
from kvtier.host.tenants import Tenancy
from kvtier.keys import Namespace
from kvtier.objects.tiers import FileTier, file_tier_root
from kvtier.objects.tiers.policy import Timeouts
from kvtier.stats import StatsRecorder, Totals, total_name
from kvtier.whatif.host import GhostTiers
from kvtier.whatif.objects import ObjectGhostTiers

from ..engine_shape import EngineShape
from ..groups import has_sliding_window, kv_groups
from ..metadata import KVTierMetadata, KVTierWorkerMeta, StepPlan, WorkerKeys
from ..slots import host_slots, resolve_host_bytes, slot_size
from .canary import CanaryChecks
from .events import ChunkEvents
from .hot import HotChunks
from .ledger import SETTLED_TOTALS, OpLedger
from .lookup import RemoteLookups
from .one_step_lookups import LocalProbe, one_step_refusal
from .plans import Planner, WriteBack
from .requests import (
    HOST_ONLY_REASONS,
    AdapterFingerprints,
    ChunkKeys,
    RequestIdentity,
    RequestState,
    loadable_chunks,
)
from .tenants import RequestTenants, uploads_by_tenant
from .waits_and_misses import StoreWaits, count_misses
from .warm_chunks import WarmChunks

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvtier.scheduler")

#: SchedulerSide.totals: the counters' own (hit tokens by tier, lookup tokens, miss tokens
#: by reason, evictions, skipped stores: fed by the increments that go to Prometheus), settled
#: ops by kind and result, write-back uploads begun, and the errors workers reported
SCHEDULER_TOTALS: tuple[str, ...] = (
    total_name(metrics.LOOKUP_TOKENS),
    *(total_name(metrics.HIT_TOKENS, (tier,)) for tier in metrics.TIERS),
    # what a host or object tier of each scale would have served (kvtier.whatif.host,
    # kvtier.whatif.objects)
    *(
        total_name(metrics.WHATIF_HIT_TOKENS, (tier, s))
        for tier in metrics.TIERS
        for s in metrics.WHATIF_SCALES
    ),
    total_name(metrics.EVICTIONS),  # every reason (kept by the scheduler side itself)
    *(total_name(metrics.EVICTIONS, (r,)) for r in metrics.EVICTION_REASONS),
    total_name(metrics.STORES_SKIPPED),
    # hybrid models: chunks not stored because vLLM had already dropped blocks of a
    # sliding-window group the slot needs (a chunk served by vLLM's own prefix cache)
    "stores_window_gone",
    # recurrent state: chunks not stored because the step that completed them ran past
    # their end (the state block no longer holds the state at the chunk's end)
    "stores_state_gone",
    *(total_name(metrics.MISS_TOKENS, (reason,)) for reason in metrics.MISS_REASONS),
    # priced lookups (load_policy: cost, kvtier.costs): tokens not asked for, fetches cut
    *(
        total_name(metrics.LOADS_DECLINED, (tier, r))
        for tier in metrics.TIERS
        for r in metrics.DECLINE_REASONS
    ),
    *(total_name(metrics.FETCH_DEADLINE_MISSED, (tier,)) for tier in metrics.TIERS),
    "write_back",
    # warm-up (warm_chunks.py, worker/warmup.py): bytes read at startup, loads of warmed chunks
    total_name(metrics.WARMUP_BYTES),
    total_name(metrics.WARMUP_HIT_TOKENS),
    "weights_changes",  # weights replaced while the engine ran (weights_changed)
    # lookups answered in their own step that found chunks to load (one_step_lookups.py)
    "one_step_lookups",
    # canaries by result (kvtier.canary): computed chunks compared with the stored ones
    *(total_name(metrics.CANARY, (r,)) for r in metrics.CANARY_RESULTS),
    *SETTLED_TOTALS.values(),
    *(f"error_{kind}" for kind in metrics.ERROR_KINDS),
    # requests whose chunks (from some point on) stay out of the object tier, by reason
    *(f"host_only_{reason}" for reason in HOST_ONLY_REASONS),
)

#: RequestState.next_store of a request none of whose chunks may be stored any more
NEVER_STORE = 1 << 62


class SchedulerSide:
    def __init__(
        self,
        cfg: KVTierConfig,
        shape: EngineShape,
        namespace: Namespace,
    ) -> None:
        """``shape``: the engine as vLLM configured it, its KV cache included."""
        self.cfg = cfg
        self.block_size = shape.kv_block_size()
        cfg.check_block_size(self.block_size)
        self.chunk_size = cfg.chunk_size
        self.blocks_per_chunk = cfg.chunk_size // self.block_size
        self.world_size = shape.world_size
        kv_cache = shape.allocated_kv_cache()

        #: a hybrid model's KV cache groups as kvtier stores them (() for one group)
        self.groups = kv_groups(kv_cache, self.block_size, self.chunk_size)
        self.slot_bytes = slot_size(kv_cache, self.groups, self.blocks_per_chunk)
        #: a sliding-window group stores only the last blocks of a chunk, the window before
        #: the chunk's end: loads then end on a chunk boundary (a hit ending inside a chunk
        #: would need window blocks the slot does not hold)
        self.whole_chunks = any(g.blocks < self.blocks_per_chunk for g in self.groups)
        self.host_bytes = resolve_host_bytes(cfg, shape, self.world_size)
        num_slots = host_slots(cfg, self.host_bytes, self.slot_bytes, self.world_size)
        self.namespace = namespace
        #: a request's key tag (its LoRA adapter's version) and what it may share
        self.identity = RequestIdentity(
            chunk_size=self.chunk_size,
            trust_multimodal_ids=cfg.trust_multimodal_ids,
            adapters=AdapterFingerprints(remote=bool(cfg.remote_url)),
        )
        self.keys = ChunkKeys(self.blocks_per_chunk, self.identity)
        #: the object tier is read and written by the workers, each under its own keys;
        #: the scheduler only plans (a lookup is a read: no existence checks from here)
        self.remote = bool(cfg.remote_url)
        #: running totals since start, for tests and introspection (SCHEDULER_TOTALS)
        self.totals = Totals(SCHEDULER_TOTALS)
        self.stats = StatsRecorder(self.totals)
        #: the step being planned: every part writes its ops here (build_connector_meta)
        self.plan = StepPlan()
        #: write_back keeps this many of the oldest chunks uploaded ahead of eviction, so
        #: one step's stores find clean victims: what a step can store, up to half the tier
        step_chunks = -(-shape.max_num_batched_tokens // self.chunk_size)
        self.write_back = WriteBack(
            self.plan,
            self.totals,
            enabled=self.remote and cfg.write_policy == "write_back",
            clean_reserve=max(1, min(num_slots // 2, step_chunks)),
        )
        self.index = ChunkIndex(
            num_slots,
            write_back_needed=self.write_back.needed,
            begin_write_back=self.write_back.begin,
        )
        #: who keeps the host tier (kvtier.host.tenants): quotas and soft pins, when
        #: configured; requests tagged from their kv_transfer_params (.tenants)
        self.tenancy: Tenancy | None = None
        self.tenants: RequestTenants | None = None
        #: the slots per tenant label (and pinned) last exported as gauges
        self._tenant_usage: dict[str, int] = {}
        if cfg.tenants:
            self.tenancy = Tenancy(
                num_slots,
                quotas={n: max(1, b // self.slot_bytes) for n, b in cfg.tenant_quotas},
                pin_tenants=frozenset(cfg.pin_tenants),
                pin_max_fraction=cfg.pin_max_fraction,
                metrics_max=cfg.tenant_metrics_max,
            )
            self.index.tenancy = self.tenancy
            self.tenants = RequestTenants(cfg, self.tenancy)
        #: what more (or less) memory would serve (kvtier.whatif.host), fed by the index
        self.ghosts: GhostTiers | None = None
        if cfg.whatif:
            # applied on a thread of their own (kvtier.whatif.host)
            self.ghosts = GhostTiers(num_slots, self.index.get, self.stats, background=True)
            self.index.ghost_events = self.ghosts.record
        self.remote_source = (
            CacheHitSource.DISK
            if cfg.remote and cfg.remote.is_local
            else CacheHitSource.EXTERNAL_UNSPECIFIED
        )
        self.ledger = OpLedger(
            self.index, self.world_size, self.stats, self.totals, uploads=self.write_back
        )
        self.write_back.record_in(self.ledger)  # the index and the ledger, wired both ways
        #: hits per chunk key, for the generation's hot list and the hand-off at drain
        self.hot = HotChunks(self.index, self.write_back.needed)
        self.planner = Planner(
            self.ledger,
            self.keys,
            self.stats,
            self.totals,
            self.plan,
            block_size=self.block_size,
            chunk_size=self.chunk_size,
            slot_bytes=self.slot_bytes,
            write_through=self.remote and cfg.write_policy == "write_through",
            groups=self.groups,
            hit=self.hot.hit if self.remote else None,
        )
        #: a warm-up's chunks (warmup: true), held until the generation is trusted
        self.warm = WarmChunks(
            self.index, self.stats, world_size=self.world_size, host_bytes=self.host_bytes
        )
        #: whether this engine trusts its generation yet (kvtier.canary): until then no
        #: object-tier lookups and no uploads (the flags below follow its state)
        self._write_through = self.planner.write_through
        self._write_back = self.write_back.enabled
        self.canary = CanaryChecks(
            cfg,
            self.index,
            self.ledger,
            self.keys,
            self.plan,
            self.stats,
            world_size=self.world_size,
            namespace=namespace,
            changed=self._trust_changed,
        )
        self._trust_changed(self.canary.trust.state)
        self.lookups = RemoteLookups(
            self.index,
            self.ledger,
            self.keys,
            self.stats,
            chunk_size=self.chunk_size,
            slot_bytes=self.slot_bytes,
            timeout_s=Timeouts.from_ms(cfg.lookup_timeout_ms).lookup_s,
            world_size=self.world_size,
            load_policy=cfg.load_policy,
            load_margin=cfg.load_margin,
        )
        if cfg.whatif and self.remote:  # the object tier's ghosts (kvtier.whatif.objects)
            self.lookups.ghosts = ObjectGhostTiers(
                self.slot_bytes * self.world_size,
                cfg.file_max_bytes,
                self.stats,
                background=True,
            )
        #: vLLM recomputes the blocks a load fails on (else it fails the request)
        self.recompute_failed_loads = shape.kv_load_failure_policy == "recompute"
        self.num_kv_groups = len(kv_cache.groups)
        #: a KV cache group with a sliding window: no one-step lookups (a failed load of
        #: the window cannot be recomputed right: groups.has_sliding_window)
        self.sliding_window = has_sliding_window(kv_cache)
        self.stats.set(metrics.HOST_BYTES_CAPACITY, num_slots * self.slot_bytes * self.world_size)
        self._kv_cache_manager: KVCacheManager | None = None
        #: vLLM blocks kvtier has loaded into, since start or the last canary mismatch:
        #: after a mismatch they leave vLLM's prefix cache (:meth:`_forget_loaded_blocks`).
        #: Block ids, so at most the pool's size
        self._loaded_blocks: set[int] = set()
        self._reqs: dict[str, RequestState] = {}
        #: a lookup that reaches a chunk still being stored waits for its store
        self.store_waits = StoreWaits(
            self.index,
            self.keys,
            chunk_size=self.chunk_size,
            wait_s=Timeouts.from_ms(cfg.lookup_timeout_ms).lookup_s,
        )
        #: weights replaced while the engine ran (weights_changed): how many times, and
        #: the salt the workers' object keys carry since the last time (b"": none yet)
        self.weights_epoch = 0
        self.weights_salt = b""
        #: until when (time.monotonic) the workers' object-tier reads fail fast, as their
        #: last report said (may_load_async expects no lookup to go out before)
        self.reads_down_until = 0.0
        #: vLLM's null block id (bind_kv_cache_manager), sent with the loads (metadata)
        self.null_block: int | None = None
        #: this hook's own latency per call, moved into the stats when they are taken: a
        #: list append is what a lookup can afford (a recorder call cost it 15 µs of cold
        #: memory reads at 1M chunks, a tenth of the whole lookup)
        self._sync_lookup_s: list[float] = []
        self._step = 0
        self._ttft_by_step: dict[int, list[tuple[float, str]]] = {}
        self._last_evicted = dict(self.index.evicted_by)
        #: KV events for routers (.events), when vLLM publishes them (--kv-events-config)
        self.events: ChunkEvents | None = None
        if shape.kv_events:
            self.attach_events(
                ChunkEvents.for_engine(
                    shape,
                    chunk_size=self.chunk_size,
                    num_slots=num_slots,
                    stored=self.groups,
                )
            )
        for g in self.groups:
            logger.info(
                "kvtier: KV cache group %s (window %d, %d layers): %d of %d blocks "
                "of a chunk stored",
                g.kind,
                g.window,
                len(g.layers),
                g.blocks,
                self.blocks_per_chunk,
            )
        logger.info(
            "kvtier scheduler: %d host slots of %s (chunk %d tokens), %s per worker, remote=%s",
            num_slots,
            format_size(self.slot_bytes),
            cfg.chunk_size,
            format_size(self.host_bytes),
            cfg.redacted()["remote_url"],
        )

    def _trust_changed(self, state: Trust) -> None:
        """The engine's trust in its generation changed (kvtier.canary): uploads only into
        a trusted generation; once refused, the host tier's chunks of it are dropped (a
        sampled check can refuse a generation chunks were loaded from)."""
        trusted = state is Trust.TRUSTED
        self.planner.write_through = self._write_through and trusted
        self.write_back.enabled = self._write_back and trusted
        if trusted and self.warm.held:
            self._warm_trusted()
        if state is Trust.REFUSED:
            dropped = self.index.clear()
            logger.error(
                "kvtier: host tier emptied (%d chunks dropped) after a canary mismatch", dropped
            )
            self._forget_loaded_blocks()
            self._new_identity(fork=True)  # carries on under a generation of its own

    def _warm_trusted(self) -> None:
        """The generation is trusted: the warmed chunks become hits if the trust rests on
        checks of this generation's chunks (or the canary is off), else they are dropped:
        a generation re-claimed as empty (its first writer now this engine) never had its
        stored chunks checked (connectors/worker/warmup.py, the canary rule)."""
        trust = self.canary.trust
        if not self.cfg.canary_first_hit or trust.matched >= trust.check_tokens:
            self.warm.adopt()
        else:
            self.warm.drop("the generation was trusted without a check of its chunks")

    def _forget_loaded_blocks(self) -> None:
        """After a mismatch, vLLM's own prefix cache must not serve what kvtier loaded:
        every block kvtier loaded into since start (or the last mismatch) leaves it, and
        the next request with that prefix computes it. Conservative, as the host tier's
        emptying is: a block that vLLM has since reused for KV it computed is dropped too
        (one recompute). A request running on such blocks now finishes on them."""
        blocks, self._loaded_blocks = self._loaded_blocks, set()
        manager = self._kv_cache_manager
        if not blocks or manager is None:
            return
        null = self.null_block
        manager.evict_blocks({b for b in blocks if b != null})
        logger.error(
            "kvtier: %d blocks kvtier loaded left vLLM's prefix cache after the canary mismatch",
            len(blocks),
        )

    def attach_events(self, events: ChunkEvents) -> None:
        """Turn the host tier's changes into vLLM KV events: ``events`` listens to the
        index, is told each chunk that begins a store or a fetch, and each upload."""
        self.events = events
        self.index.listener = events

    # ---- vLLM hooks -------------------------------------------------------------------
    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._kv_cache_manager = manager
        null = getattr(getattr(manager, "block_pool", None), "null_block", None)
        self.null_block = getattr(null, "block_id", None)
        self.planner.null_block = self.null_block

    def set_worker_keys(self, workers: list[WorkerKeys]) -> None:
        """Each worker's object keys (vLLM's connector handshake, once at startup): with
        them, a directory tier's lookups can be answered in their own step
        (:mod:`.one_step_lookups`) where that is safe. Logs which way lookups go, and
        why."""
        if not self.remote:
            return
        for w in workers:
            if w.rank == 0 and w.stage == 0:  # the generation id covers its layers
                self.canary.workers_layers(w.namespace.layers)
        said = [w.fresh_generation for w in workers if w.fresh_generation is not None]
        if said:  # before the first step: a first writer uploads from its first request on
            self.canary.first_writer(all(said))
        self.warm.take([w.warm for w in workers if w.warm is not None])
        if self.warm.held and self.canary.trusted:
            self._warm_trusted()
        self.lookups.probe, refusal = self._one_step_probe(workers)
        if self.lookups.probe is None:
            logger.info("kvtier: object-tier lookups take a step of their own (%s)", refusal)
        else:
            logger.info(
                "kvtier: object-tier lookups answer in their own step: a local "
                "directory tier, read before each load; a chunk that fails its check "
                "is recomputed (kv_load_failure_policy: recompute)"
            )

    def _one_step_probe(self, workers: list[WorkerKeys]) -> tuple[LocalProbe | None, str]:
        """The probe of one-step lookups for these workers, or None and why not."""
        refusal = one_step_refusal(
            self.cfg,
            recompute=self.recompute_failed_loads,
            groups=self.num_kv_groups,
            reads_local=True,
            sliding_window=self.sliding_window,
        )
        if refusal is None and len(workers) != self.world_size:
            refusal = f"{len(workers)} of {self.world_size} workers sent their keys"
        if refusal is None and any(w.weights_epoch != self.weights_epoch for w in workers):
            refusal = "the workers' keys are of other weights than the scheduler's"
        if refusal is not None:
            return None, refusal
        try:
            tier = FileTier(file_tier_root(self.cfg), background_sweep=False)
        except TierError as exc:  # the workers' reads meet (and count) the same
            return None, f"the directory cannot be opened: {exc}"
        refusal = one_step_refusal(self.cfg, recompute=True, groups=1, reads_local=tier.reads_local)
        if refusal is not None:
            return None, refusal
        return LocalProbe(tier, workers), ""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        t0 = time.perf_counter()
        st = self._state(request)
        st.local_hit = num_computed_tokens
        st.fetching_now = {}  # an earlier answer's, which vLLM did not allocate
        if self.weights_epoch:
            # vLLM's own prefix cache may still hold blocks computed before a weight
            # change (it is not reset by one): after a change, what it served is not stored
            st.next_store = max(st.next_store, num_computed_tokens // self.chunk_size)
        self.keys.refresh(st)
        cap = self._max_loadable(request)
        first = num_computed_tokens // self.chunk_size
        if self.ghosts is not None and st.ghost_peek_step != self._step:
            # what the ghosts hold before this lookup touches, fetches or loads a chunk
            stop = loadable_chunks(st, cap, self.chunk_size)
            st.ghost_peek = self.ghosts.peek(st.chunk_hashes, first, stop)
            st.ghost_peek_step = self._step
        end_chunk = self._ready_run(st, first, cap)
        if self.store_waits.should_wait(st, end_chunk, cap):
            self._sync_lookup_s.append(time.perf_counter() - t0)
            return None, False  # "ask again": the store settles in a step or two
        if self.remote and self.canary.recompute(st):
            self._sync_lookup_s.append(time.perf_counter() - t0)
            return 0, False  # a canary (canary_rate): vLLM computes it, its chunk is checked
        if self.remote and self.canary.trusted and self.lookups.wants(st, end_chunk, cap):
            waiting = self.lookups.advance(st, end_chunk, cap)
            if self.events is not None:
                self.events.record_lookup(st)  # the chunks the lookup claimed
            if waiting:
                self._sync_lookup_s.append(time.perf_counter() - t0)
                # vLLM re-asks at once in a tight loop; yield the GIL so the I/O threads
                # that are fetching this request's chunks get to run (no sleep, no wait)
                time.sleep(0)
                return None, False
            end_chunk = self._ready_run(st, first, cap)
            if st.fetching_now:  # a one-step lookup: its run follows the ready one
                end_chunk = max(st.fetching_now) + 1
                self.totals["one_step_lookups"] += 1
        end = min(end_chunk * self.chunk_size, cap)
        n = max(0, end - num_computed_tokens)
        st.offer = (num_computed_tokens, num_computed_tokens + n) if n else None
        self._sync_lookup_s.append(time.perf_counter() - t0)
        return n, False

    def may_load_async(self, request: Request) -> bool:
        """vLLM >= 0.34, as a request enters the waiting queues: whether its lookup may go to
        the object tier. With ``--max-num-inflight-kv-loads`` vLLM then asks
        :meth:`get_num_new_matched_tokens` for it even while the running batch is full, so
        the lookup's fetches start (the answer is "ask again" meanwhile) and the chunks are
        in the host tier by the time a slot frees.

        True when an object tier is configured, the workers' last report did not say its
        reads fail fast, no lookup of this request has finished yet, and the host tier does
        not hold the request's last loadable chunk. That last probe stands for the whole
        prefix (a chunk is stored after the ones before it, so a host tier holding the last
        almost always holds the rest; a gap LRU left only means no early start). One dict
        lookup and one set probe: no hashing, nothing per chunk.
        """
        if not self.remote or not self.canary.trusted or time.monotonic() < self.reads_down_until:
            return False
        st = self._reqs.get(request.request_id)
        if st is None and (
            getattr(request, "lora_request", None) is not None
            or getattr(request, "mm_features", None)
            or getattr(request, "prompt_embeds", None) is not None
        ):
            st = self._state(request)  # its keys may be tagged, its chunks host-only
        if st is not None and st.lookup is not None and st.lookup.done:
            return False
        cap = -(-self._max_loadable(request) // self.chunk_size)
        if st is not None and (st.key_tag or st.shared_chunks < cap):
            # keyed by the request's own chunk keys, up to the chunks it may share
            self.keys.refresh(st)
            n = min(len(st.chunk_hashes), st.shared_chunks, cap)
            return n > 0 and not self.index.is_ready(st.chunk_hashes[n - 1])
        hashes = request.block_hashes
        bpc = self.blocks_per_chunk
        n = min(len(hashes) // bpc, cap)
        return n > 0 and not self.index.is_ready(hashes[n * bpc - 1])

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        cap = self._max_loadable(request)
        local = st.local_hit  # request.num_computed_tokens is not updated yet here
        offer, st.offer = st.offer, None
        st.hit_sources = {}
        if num_external_tokens > 0 and offer is not None:
            start, end = offer[0], offer[0] + num_external_tokens
            planned = len(self.plan.loads)
            self.planner.plan_loads(st, self._block_ids(request.request_id), start, end)
            for op in self.plan.loads[planned:]:
                self._loaded_blocks.update(op.all_gpu_blocks())
            if st.fetching_now:  # a one-step lookup's answer, allocated: it is done
                self.lookups.finish(st)
            if st.pin_ttl_s:  # a pinning request's hits are pinned (renewed) too
                cs = self.chunk_size
                for c in range(start // cs, -(-end // cs)):
                    self.index.soft_pin(self.keys.key(st, c), st.pin_ttl_s, st.tenant)
        st.fetching_now = {}
        lookup = max(0, cap - local)
        self.stats.inc(metrics.LOOKUP_TOKENS, lookup)
        if self.tenancy is not None:
            label = (self.tenancy.label(st.tenant),)
            self.stats.inc(metrics.TENANT_LOOKUP_TOKENS, lookup, label)
            self.stats.inc(metrics.TENANT_HIT_TOKENS, num_external_tokens, label)
        # a canary request (canary_rate) gets no hit from the real tier: nor from the ghosts
        if self.ghosts is not None and not (self.remote and self.canary.recompute(st)):
            self.ghosts.lookup(
                st.chunk_hashes,
                local // self.chunk_size,
                loadable_chunks(st, cap, self.chunk_size),
                chunk_size=self.chunk_size,
                computed=local,
                cap=cap,
                peek=st.ghost_peek,
            )
        st.ghost_peek, st.ghost_peek_step = None, -1
        if self.lookups.ghosts is not None and not self.canary.recompute(st):
            self.lookups.count_whatif(st, local, num_external_tokens, cap)
        # "hit": everything kvtier could ever hold for this prompt (its full chunks, up to
        # the last token vLLM must compute) was there; the tail is always recomputed
        reusable = min(cap, len(st.chunk_hashes) * self.chunk_size)
        total = local + num_external_tokens
        tier_down = self.remote and time.monotonic() < self.reads_down_until
        count_misses(
            self.stats,
            self.index,
            self.keys,
            st,
            chunk_size=self.chunk_size,
            served_end=total,
            reusable=reusable,
            cap=cap,
            tier_down=tier_down,
        )
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
        if self.remote:  # the prefill's cost per token, timed to the step's report
            tokens = getattr(so, "total_num_scheduled_tokens", None)
            if tokens is None:  # (a test's fake output)
                tokens = sum(so.num_scheduled_tokens.values())
            self.lookups.steps.began(self._step, tokens, self.lookups.clock())
        self.plan.fetches.extend(self.lookups.take_runs())
        now, later = self.lookups.take_runs_now({op.fetch_op for op in self.plan.loads})
        self.plan.fetches_now.extend(now)
        self.plan.fetches_now_s = self.lookups.now_deadline_s
        self.plan.fetches.extend(later)
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
            if st.next_store != NEVER_STORE and computed_before < st.next_store * self.chunk_size:
                # vLLM recomputes from here (a load failed and it rewound the request):
                # the chunks it computes again in full are stored, the corrupt ones replaced
                st.next_store = -(-computed_before // self.chunk_size)
            if computed_after // self.chunk_size > st.next_store:
                # a decode step completes a chunk once in chunk_size steps: the other
                # steps cost this comparison, not a key refresh per running request
                self.planner.write_through = self._write_through and self.canary.may_upload(st)
                stores = self.planner.plan_stores(st, self._block_ids, computed_after)
                if st.pin_ttl_s:  # pinned as they turn ready (kvtier.host.tenants)
                    for op in stores:
                        self.index.soft_pin(op.block_hash, st.pin_ttl_s, st.tenant)
                self.canary.stores_planned(st, stores)
                if self.events is not None:
                    self.events.record_stores(st, stores)
            st.step_loads.clear()
        self.write_back.clean_oldest()
        meta = self.plan.take(
            step=self._step,
            host_bytes=self.host_bytes,
            null_block=self.null_block,
            weights_epoch=self.weights_epoch,
            weights_salt=self.weights_salt,
            trusted=self.canary.trusted,
        )
        if self.remote:
            meta.heat, meta.handoff = self.hot.report()
            if self.tenancy is not None:  # who uploaded what, for the manifest (#60)
                meta.tenant_uploads = uploads_by_tenant(self.index, self.tenancy, meta)
                if self.tenants is not None:  # and what is pinned, which gc keeps
                    meta.pins = self.tenants.pins_to_send()
        if self.lookups.ghosts is not None:
            self.lookups.ghosts.uploaded(
                [op.block_hash for op in meta.stores if op.upload_op_id is not None]
                + [op.block_hash for op in meta.uploads]
            )
        if self.events is not None:
            self.events.watch_uploads(meta)
        used = (self.index.used_slots) * self.slot_bytes * self.world_size
        self.stats.set(metrics.HOST_BYTES_USED, used)
        if self.index.evicted_by != self._last_evicted:
            for reason, n in self.index.evicted_by.items():
                if n != self._last_evicted[reason]:
                    self.stats.inc(metrics.EVICTIONS, n - self._last_evicted[reason], (reason,))
                    self.totals["evictions"] += n - self._last_evicted[reason]
            self._last_evicted = dict(self.index.evicted_by)
        if self.tenancy is not None:
            self._tenant_gauges(self.tenancy)
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVTierWorkerMeta):
            # the events see the uploads' reports before the ledger settles them (a
            # write-back eviction may drop the chunk then) and announce them after (the
            # stores of the same reports have settled: a failed store's chunk has no event)
            uploaded = self.events.settle_uploads(meta) if self.events is not None else []
            for op_id in sorted(meta.results):
                self.ledger.report(op_id, meta.results[op_id])
            self.canary.report(meta)
            for kind, n in meta.errors.items():
                self.totals[f"error_{metrics.error_kind_label(kind)}"] += n
            down_s = meta.reads_down_s
            self.reads_down_until = time.monotonic() + down_s if down_s else 0.0
            if self.remote:
                clock = self.lookups.clock()
                for step in meta.steps:
                    self.lookups.steps.reported(step, clock)
            now = time.time()
            for step in meta.steps:
                for arrival, outcome in self._ttft_by_step.pop(step, ()):
                    self.stats.observe(metrics.TTFT, max(0.0, now - arrival), (outcome,))
            if self.events is not None:
                self.events.announce_uploads(uploaded)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV events of kvtier's tiers since the last call (none without ``events``)."""
        return self.events.take_events() if self.events is not None else ()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        st = self._reqs.pop(request.request_id, None)
        self.store_waits.forget(request.request_id)
        if st is not None:
            self.lookups.finish(st)
        self.canary.forget(request.request_id)
        # Stores run inside the step that computes a chunk, before vLLM frees its blocks,
        # so nothing is left to copy here and the blocks can be freed at once.
        return False, None

    def pending_ops(self) -> int:
        """Ops sent to workers and not yet reported (0 when the engine is idle)."""
        return len(self.ledger) + self.canary.pending

    def open_requests(self) -> int:
        return len(self._reqs)

    def get_stats(self) -> dict[str, Any]:
        if self._sync_lookup_s:
            delays, self._sync_lookup_s = self._sync_lookup_s, []
            self.stats.observe_many(metrics.LOOKUP_DELAY, delays, ("sync",))
        if self.remote:
            self.lookups.export_costs()
        return self.stats.take()

    def reset_cache(self) -> bool:
        dropped = self.index.clear()
        self.warm.drop("the host tier was reset")
        logger.info("kvtier: host tier reset, %d chunks dropped", dropped)
        return True

    def weights_changed(self, why: str) -> None:
        """vLLM replaced the weights while the engine ran (``why``: the worker method,
        e.g. ``reload_weights``). Nothing stored before may be served: the host tier is
        emptied (chunks being stored, fetched or loaded are dropped as they settle:
        :meth:`ChunkIndex.clear`), requests already begun store nothing more (their KV
        is the old weights'), nor does any request store what vLLM's own prefix cache
        served it from then on (vLLM does not reset that cache on a weight change), and
        from the next step on the workers key their objects
        under a new identity drawn here (``weights_salt``), so they neither read the
        chunks of the old weights nor write the new weights' KV under the old name; no
        other engine shares that identity (none can know it holds the same weights)."""
        dropped = self._new_identity()
        self.totals["weights_changes"] += 1
        logger.warning(
            "kvtier: the weights changed (%s): host tier emptied (%d chunks dropped); "
            "object-tier keys now name this engine's weights alone until it restarts. "
            "vLLM's own prefix cache is not reset by a weight change: reset it "
            "(reset_prefix_cache) before serving, as vLLM requires",
            why,
            dropped,
        )

    def _new_identity(self, *, fork: bool = False) -> int:
        """From the next step on the workers key their objects under an identity drawn
        here that no other engine shares (``weights_salt``, followed as a weight change
        is): after a weight change, or a canary mismatch (``fork``). This engine is that
        generation's first writer and trusts it at once. The host tier is emptied, and
        requests already begun store nothing more (their KV may hold what was loaded
        under the old name). Returns the chunks dropped."""
        self.warm.drop("a new identity (weights changed, or the generation was refused)")
        self.weights_epoch += 1
        self.weights_salt = os.urandom(16)
        self.canary.new_generation(self.weights_salt, fork=fork)  # its first writer
        self._trust_changed(self.canary.trust.state)
        if self.lookups.probe is not None:
            self.lookups.probe.after_weight_change(self.weights_salt)
        dropped = self.index.clear()
        for st in self._reqs.values():
            st.next_store = NEVER_STORE
        return dropped

    def shutdown(self) -> None:
        # the scheduler holds no connection (the workers own the object tier): only the
        # ghosts' thread
        if self.ghosts is not None:
            self.ghosts.close()
        if self.lookups.ghosts is not None:
            self.lookups.ghosts.close()

    # ---- helpers ----------------------------------------------------------------------
    def _tenant_gauges(self, tenancy: Tenancy) -> None:
        """kvtier:tenant_bytes per tenant label and kvtier:pinned_bytes, those that changed
        since the last step (at most tenant_metrics_max + 2 labels, never per chunk)."""
        tenancy.expire()
        per_slot = self.slot_bytes * self.world_size
        usage = tenancy.usage_by_label()
        usage["\0pinned"] = tenancy.pinned
        if usage == self._tenant_usage:
            return
        for label, slots in usage.items():
            if self._tenant_usage.get(label) == slots:
                continue
            if label == "\0pinned":
                self.stats.set(metrics.PINNED_BYTES, slots * per_slot)
            else:
                self.stats.set(metrics.TENANT_BYTES, slots * per_slot, ("host", label))
        self._tenant_usage = usage

    def _state(self, request: Request) -> RequestState:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = self.keys.new_state(request)
            if self.tenants is not None:
                self.tenants.tag(st)
            if st.host_only is not None and self.remote:
                self.totals[f"host_only_{st.host_only}"] += 1
            self._reqs[request.request_id] = st
        return st

    def _block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per KV cache group."""
        assert self._kv_cache_manager is not None, "bind_kv_cache_manager was not called"
        return tuple(self._kv_cache_manager.get_block_ids(req_id))

    def _max_loadable(self, request: Request) -> int:
        """vLLM must compute at least the last prompt token itself (with a sliding-window
        group stored in part, loads end on a chunk boundary: ``whole_chunks``)."""
        step = self.chunk_size if self.whole_chunks else self.block_size
        return (request.num_tokens - 1) // step * step

    def _ready_run(self, st: RequestState, first: int, cap: int) -> int:
        """End of the run of READY chunks from ``first`` (within ``cap`` tokens)."""
        stop = loadable_chunks(st, cap, self.chunk_size)
        return self.index.ready_run(st.chunk_hashes, first, stop)
