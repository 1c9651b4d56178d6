"""Worker side of the connector: moves bytes as the scheduler's metadata says.

Runs in each vLLM worker process (one per TP rank). It owns the host slab and
this rank's object-tier I/O; it knows nothing about requests or prefixes, only
slot numbers, block ids and block hashes. Every op's outcome goes back to the
scheduler through the worker metadata.

It drives both movers through one protocol (:class:`kvtier.ops.Mover`: submit ops,
collect their results, close): the copier (paged KV <-> host slots; its layer-wise
hooks ``wait_layer`` / ``save_layer`` are its own) and RemoteIO (host slots <-> the
object tier; its health and counters are read for the stats).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvtier import canary, metrics
from kvtier.config import KVTierConfig
from kvtier.host.copiers import make_copier
from kvtier.host.layout import STATE, HostSlab, KVGroup, SlotLayout
from kvtier.host.transfer import Copier
from kvtier.keys import KeySpace, Namespace
from kvtier.objects import manifest
from kvtier.objects.tenant_keys import Pins, TenantKeys
from kvtier.objects.tiers.policy import Timeouts
from kvtier.ops import (
    DROPPED,
    CheckOp,
    FetchOp,
    GetRun,
    LoadOp,
    OpKind,
    OpResult,
    Put,
    StoreOp,
    UploadOp,
    all_blocks,
    by_op,
)
from kvtier.stats import StatsRecorder

from ..groups import flatten_states
from ..metadata import KVTierMetadata, KVTierWorkerMeta, WarmReport
from ..slots import allocate_slab
from .shutdown import HandoffReport, hand_off
from .warmup import is_warmup_result, warm_host_tier

if TYPE_CHECKING:
    from kvtier.objects.remote import RemoteIO

logger = logging.getLogger("kvtier.worker")

#: opens this worker's object-tier I/O for a config naming a tier (RemoteIO.from_config)
RemoteFactory = Callable[[KVTierConfig], "RemoteIO"]


class WorkerSide:
    def __init__(
        self,
        cfg: KVTierConfig,
        namespace: Namespace,
        num_blocks: int,
        remote_factory: RemoteFactory | None = None,
        groups: Sequence[KVGroup] = (),
        workers_on_node: int = 1,
    ) -> None:
        self.cfg = cfg
        #: this engine's workers on this host, sharing its CPUs (``io_threads: auto``)
        self.workers_on_node = workers_on_node
        #: a hybrid model's KV cache groups as kvtier stores them (empty: one group)
        self.groups = tuple(groups)
        self.namespace = namespace
        self.num_blocks = num_blocks
        self.blocks_per_chunk = cfg.chunk_size // namespace.block_size
        self.rank = 0
        self.stage = 0
        self._remote_factory = remote_factory
        self.remote: RemoteIO | None = None
        self.manifests: manifest.ManifestWriter | None = None  # rank 0: its generation's
        self.layout: SlotLayout | None = None
        self.slab: HostSlab | None = None
        self._kv: list[torch.Tensor] = []
        #: every registered layer name -> index of the layout layer holding its KV
        self._layer_index: dict[str, int] = {}
        self._state_layers: list[int] = []
        self.copier: Copier | None = None
        #: save each layer right after its attention; False when one layer's attention
        #: runs in several calls per step (micro-batching), where only the end is safe
        self.layerwise_saves = True
        self._begun_step: int | None = None
        #: copy results the copier returned at submit, settled with the step's poll
        self._copied: list[OpResult] = []
        self._results: dict[int, list[bool]] = {}
        self._steps: list[int] = []
        self._failed_blocks: set[int] = set()
        #: the ids of this step's loads that failed (stores after them are not kept)
        self._failed_loads: set[int] = set()
        #: this step's loads as submitted to the copier (trimmed to the blocks vLLM backs):
        #: a failed one reports these blocks, never vLLM's null block
        self._loads: dict[int, LoadOp] = {}
        #: vLLM's null block id, from the step's metadata (None: not known)
        self._null: int | None = None
        self._errors: dict[str, int] = {}
        self._keys: KeySpace | None = None  # set by register_kv_caches (rank and stage)
        #: the scheduler's count of weight changes this worker's keys follow (the step's
        #: metadata carries it, and the salt of the identity since: _follow_weights)
        self.weights_epoch = 0
        #: how long a step may read its lookups' chunks on this thread before the I/O
        #: threads take the rest (``inline_read_ms``; only where the tier's reads are local:
        #: then the lookup answers on the next step, and no read thread competes with
        #: vLLM's for the cores meanwhile); 0: all on the I/O threads
        self.inline_read_s = 0.0
        #: how long a step may read the runs of one-step lookups (``fetches_now``) before
        #: its loads give up on what is still being read: the lookup's own deadline
        self.fetch_now_s = Timeouts.from_ms(cfg.lookup_timeout_ms).lookup_s
        #: this rank writes its chunks to the object tier (MLA: only rank 0 does)
        self.uploads = True
        self.stats = StatsRecorder()
        self._seals_counted = 0  # the RemoteIO's seals already added to the stats
        #: canaries being read: op id -> (the slot vLLM's KV was stored into, the scratch
        #: buffer the stored object is read into, CheckOp.first); their results for the
        #: scheduler
        self._pending_checks: dict[int, tuple[int, torch.Tensor, bool]] = {}
        self._checks: dict[int, list[str]] = {}
        self._check_worst: dict[int, tuple[str, float]] = {}
        #: rank 0 of stage 0: whether its claim of this generation won at startup,
        #: sent once with the next report (None: not this worker's to say, or said)
        self._fresh: bool | None = None
        #: the same answer, kept for vLLM's handshake (WorkerKeys), which may come later
        self.fresh_generation: bool | None = None
        #: the engine trusts its generation (the scheduler says so every step): rank 0
        #: refreshes its manifest only then, and re-claims it only while it does not
        self.trusted = not cfg.canary_first_hit
        #: rank 0's requests whose first checked chunk was absent, in a row (checking)
        self.absent_streak = 0
        #: rank 0's re-claim in flight (a listing), when the last began, its win to report
        self.reclaim_every_s = manifest.REFRESH_S
        self._reclaim: threading.Thread | None = None
        self._reclaim_at = -float("inf")
        self._reclaimed: list[str] = []
        self._reclaim_said = ""
        #: slot -> the key of the chunk its last store wrote, while no fetch, failed store
        #: or upload of the slot came since: what a hand-off may write from it
        self._stored_keys: dict[int, bytes] = {}
        #: the scheduler's last hand-off list (connectors/scheduler/hot.py): written first at drain
        self.handoff: tuple[tuple[bytes, int], ...] = ()
        #: what the last drain's hand-off wrote (None: it had nothing to write)
        self.last_handoff: HandoffReport | None = None
        #: what this worker's warm-up read at startup (``warmup: true``; None: none ran),
        #: for vLLM's handshake (connectors/worker/warmup.py)
        self.warm: WarmReport | None = None

    # ---- setup ------------------------------------------------------------------------------
    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], rank: int, stage: int = 0
    ) -> None:
        """``rank``: this worker's TP rank, ``stage``: its pipeline stage; both go into its
        object keys (each worker stores and loads only its own layers' and heads' KV;
        KV that every rank holds whole, MLA's, is stored once, by rank 0)."""
        self.rank = rank
        self.stage = stage
        kv_caches, self.groups = flatten_states(kv_caches, self.groups)
        self.layout = SlotLayout.from_kv_caches(
            kv_caches, self.num_blocks, self.blocks_per_chunk, self.groups
        )
        # the keys name this worker's layers and their KV dtypes (another pipeline
        # partition, or other layers kept out of an fp8 KV cache, is another namespace)
        self.namespace = dataclasses.replace(self.namespace, layers=self.layout.identity())
        self._keys = KeySpace.worker(self.namespace, rank, stage)
        self.uploads = KeySpace.writes(self.namespace, rank)
        by_name = dict(kv_caches)
        self._kv = [by_name[layer.name] for layer in self.layout.layers]
        self._layer_index = dict(self.layout.names)
        #: the layers of recurrent-state groups (no per-layer wait from vLLM for them)
        self._state_layers = [
            i
            for i, layer in enumerate(self.layout.layers)
            if self.groups and self.groups[layer.group].kind == STATE
        ]
        logger.info(
            "kvtier worker rank %d stage %d: %d KV layers, chunk slot %d bytes, block dim %d",
            rank,
            stage,
            len(self._kv),
            self.layout.slot_bytes,
            self.layout.layers[0].block_dim,
        )
        for g in self.groups:
            logger.info(
                "kvtier worker rank %d: KV cache group %s (window %d): %d layers, "
                "%d of %d blocks per chunk stored",
                rank,
                g.kind,
                g.window,
                len(g.layers),
                g.blocks,
                self.blocks_per_chunk,
            )
        if self._remote_factory is not None and self.cfg.remote_url:
            from kvtier.threads import faster_thread_switches

            # "auto" resolved here: vLLM may have bound this process to its CPUs by now
            threads = self.cfg.io_thread_count(self.workers_on_node)
            self.remote = self._remote_factory(dataclasses.replace(self.cfg, io_threads=threads))
            logger.info(
                "kvtier worker rank %d: %d object-tier I/O threads (io_threads: %s)",
                rank,
                threads,
                self.cfg.io_threads,
            )
            faster_thread_switches()
            if rank == 0 and stage == 0 and self.cfg.canary_first_hit:
                # claimed before its manifest writer starts; told in the handshake and first report
                self._fresh = self.fresh_generation = self._generation_is_fresh()
                self.trusted = self._fresh
            self.manifests = manifest.for_worker(
                self.remote, lambda: self.namespace, rank, stage, active=lambda: self.trusted
            )
            if self.remote.tier.reads_local and self.cfg.inline_read_ms:
                self.inline_read_s = self.cfg.inline_read_ms / 1e3
                logger.info(
                    "kvtier worker rank %d: %s tier on a local filesystem: a lookup's "
                    "first chunks are read in its step, for up to %d ms",
                    rank,
                    self.remote.tier.name,
                    self.cfg.inline_read_ms,
                )
        if isinstance(self.cfg.cpu_bytes, int):  # the size the scheduler resolves it to
            self._allocate_slab(self.cfg.cpu_bytes, at_startup=True)
        if self.cfg.warmup and self.remote is not None:
            self.warm_up()

    def warm_up(self) -> WarmReport | None:
        """``warmup: true``: read the generation's hottest chunks into the slab now, before
        vLLM reports ready (:mod:`.warmup`); the report goes to the scheduler in vLLM's
        handshake. Needs the slab now: with ``cpu_bytes: auto`` it comes with the first
        step, sized by the scheduler, and there is no warm-up."""
        if self.remote is None:
            return None
        if self.slab is None:
            logger.warning(
                "kvtier worker rank %d: warmup needs cpu_bytes as a size (with "
                '"auto" the host tier is sized on the first request): the '
                "engine starts cold",
                self.rank,
            )
            return None
        self.warm = warm_host_tier(
            self.remote,
            self.namespace.generation(),
            self._object_key,
            self.slab,
            self.cfg,
            rank=self.rank,
        )
        return self.warm

    def _generation_is_fresh(self) -> bool:
        """Whether this engine is its generation's first writer: its claim, the
        generation's manifest created only if none is stored (atomically on every tier,
        :func:`kvtier.objects.manifest.claim_generation`), won. Every engine that trusts
        its generation writes its manifest at start and every minute, so a stored manifest
        means another engine wrote the generation (its first hit is checked); of engines
        starting at once on an empty generation exactly one wins, and its own KV defines
        it. A missing manifest of a generation in use (a liveness record, or a chunk: one
        listing, only when the manifest is missing) is lost, not new. A tier that cannot
        answer is not fresh (the first hit is checked instead)."""
        from kvtier.objects import store_admin

        assert self.remote is not None
        tier = self.remote.tier
        gen = self.namespace.generation()
        try:
            fresh = manifest.claim_generation(
                tier,
                self.namespace,
                self.remote.signer,
                holds_chunks=lambda: store_admin.holds_chunks(tier, gen),
            )
        except Exception as exc:  # noqa: BLE001  any failure: check the first hit instead
            logger.warning(
                "kvtier: could not claim generation %s in the object tier (%s): "
                "its first hit is checked",
                gen,
                exc,
            )
            return False
        logger.info(
            "kvtier worker: generation %s %s",
            gen,
            "is new: this engine writes it first"
            if fresh
            else "is in the object tier: its first hit is checked before it is trusted",
        )
        return fresh

    def _ensure_slab(self, meta: KVTierMetadata) -> HostSlab:
        """The slab of the size the scheduler sent (``host_bytes``): the one allocated at
        startup when it has that size, else one allocated now."""
        if self.slab is not None and self.slab.nbytes != meta.host_bytes:
            logger.warning(
                "kvtier worker rank %d: host slab of %d bytes allocated at startup, "
                "the scheduler sized it %d: allocated again",
                self.rank,
                self.slab.nbytes,
                meta.host_bytes,
            )
            self._drop_slab()
        return self.slab if self.slab is not None else self._allocate_slab(meta.host_bytes)

    def _allocate_slab(self, nbytes: int, at_startup: bool = False) -> HostSlab:
        """The host slab and its copier. At startup when ``cpu_bytes`` gives the size: its
        memory is committed (CPU) or pinned (CUDA) before the engine serves, not while a
        restarted engine's first requests wait; else on the first step, with the size the
        scheduler resolved (committed in the background)."""
        assert self.layout is not None, "register_kv_caches was not called"
        on_cuda = self._kv[0].device.type == "cuda"
        t0 = time.perf_counter()
        self.slab = allocate_slab(
            self.cfg, nbytes, self.layout, pin=on_cuda, commit=at_startup, rank=self.rank
        )  # checked against the memory left first
        self.copier = make_copier(self._kv, self.layout, self.slab)
        logger.info(
            "kvtier worker rank %d: host slab %d bytes (pinned: %s, committed: %s) in %.1f s, %s",
            self.rank,
            self.slab.nbytes,
            self.slab.pinned,
            self.slab.committed,
            time.perf_counter() - t0,
            type(self.copier).__name__,
        )
        return self.slab

    def _drop_slab(self) -> None:
        if self.copier is not None:
            self.copier.close()
        if self.slab is not None:
            self.slab.close()
        self.slab, self.copier = None, None

    # ---- per step ---------------------------------------------------------------------------
    def begin_step(self, meta: KVTierMetadata) -> None:
        """Start the step's host-side work: declare its stores, submit fetches and uploads.

        Called when vLLM binds the step's metadata, before the forward. vLLM
        calls ``start_load_kv`` before the forward only when the step has
        synchronous loads and after it otherwise, so stores must be declared
        here for ``save_kv_layer`` to start them layer by layer, and fetches
        start one forward earlier. None of this touches the KV tensors.
        Idempotent per step.
        """
        if self._begun_step == meta.step:
            return
        self._begun_step = meta.step
        self._failed_loads = set()
        self._loads = {}
        self._null = meta.null_block
        if meta.weights_epoch != self.weights_epoch:
            self._follow_weights(meta.weights_epoch, meta.weights_salt)
        self.trusted = meta.trusted
        if meta.heat is not None and self.manifests is not None:
            self.manifests.add_heat(meta.heat)  # rank 0: into its generation's hot list
        if meta.tenant_uploads and self.manifests is not None:  # rank 0: who uploaded what
            self.manifests.add_tenants(
                TenantKeys.of(
                    {
                        label: [self._object_key(k) for k in keys]
                        for label, keys in meta.tenant_uploads.items()
                    }
                )
            )
        if meta.pins and self.manifests is not None:  # rank 0: pinned until when
            now = time.time()
            self.manifests.add_pins(
                Pins.of({self._object_key(k): now + left for k, left in meta.pins.items()})
            )
        if meta.handoff is not None:
            self.handoff = meta.handoff
        self._steps.append(meta.step)
        slab = self._ensure_slab(meta)
        assert self.copier is not None
        # copied by save_layer / poll; a store refused here is reported failed (wait_for_save)
        self._copied += self.copier.submit(self._storable(meta))
        # the step's budget for reading lookups' chunks here (all of its runs together)
        inline_until = time.monotonic() + self.inline_read_s if self.inline_read_s else 0.0
        for run in meta.fetches:
            self._fetch_run(slab, run, inline_until)
        # the step's loads copy these slots: read them now, at most until the least deadline
        # of their priced lookups (kvtier.costs), else lookup_timeout_ms
        now_s = self.fetch_now_s
        if meta.fetches_now_s > 0:
            now_s = min(now_s, meta.fetches_now_s)
        for run in meta.fetches_now:
            self._fetch_run(slab, run, time.monotonic() + now_s)
        self._upload(slab, meta.uploads)

    def _follow_weights(self, epoch: int, salt: bytes) -> None:
        """The weights changed while the engine ran (SchedulerSide.weights_changed): from
        this step on, this worker's object keys carry the new identity. Fetches and
        uploads already queued keep the keys they were made with, which match their
        bytes (the scheduler drops what they bring back)."""
        assert self._keys is not None, "register_kv_caches was not called"
        self.weights_epoch = epoch
        self.namespace = self.namespace.after_weight_change(salt)
        self._keys = KeySpace.worker(self.namespace, self.rank, self.stage)
        self.absent_streak = 0
        self._stored_keys.clear()  # the bytes in the slots are the old identity's
        self.handoff = ()
        logger.info("kvtier worker rank %d: object keys follow weight change %d", self.rank, epoch)

    def start_load_kv(self, meta: KVTierMetadata) -> None:
        """Start this step's loads (on CUDA: every layer enqueued, each waited for by its
        own layer in ``wait_for_layer_load``; on the CPU: done on return)."""
        self.begin_step(meta)
        assert self.copier is not None
        loads = self._backed_loads(meta)
        if any(op.fetch_op for op in loads):
            loads = self._fetched_loads(loads)
        self._loads.update((op.op_id, op) for op in loads)
        self._record_loads(self.copier.submit(loads))
        if self.copier.layerwise:
            # vLLM waits per layer only in its attention layers: the compute stream waits
            # for the state layers' loads here, before the step's forward (nothing reads
            # them before: vLLM's own copy of the hit's state ran when it prepared the step)
            for li in self._state_layers:
                self.copier.wait_layer(li)

    def _storable(self, meta: KVTierMetadata) -> list[StoreOp]:
        """The step's stores that may be copied: none whose blocks include vLLM's null
        block. vLLM puts it in place of a sliding window's blocks once they leave the
        window; a chunk stored with it holds zeros where its KV was, which a later hit
        ending inside the chunk would load into a block it attends to. The scheduler
        plans no such store (:meth:`.plans.Planner.plan_stores`); this is the worker's
        own check on every store path. A refused store is reported failed."""
        null = meta.null_block
        if null is None:
            return meta.stores
        out: list[StoreOp] = []
        for op in meta.stores:
            if null in all_blocks(op):
                logger.error(
                    "kvtier: a store of slot %d names vLLM's null block (blocks %s): not stored",
                    op.slot,
                    all_blocks(op),
                )
                continue
            out.append(op)
        return out

    def _fetched_loads(self, loads: list[LoadOp]) -> list[LoadOp]:
        """The loads that may copy their slots: a one-step lookup's (``LoadOp.fetch_op``)
        only once its fetch, read in this step, succeeded. Any other (a miss, a chunk that
        failed its check, a read still running, a fetch this step did not carry) copies
        nothing: its blocks go to vLLM as load errors and are recomputed. Its fetch's own
        result counted the miss."""
        self._poll_remote()  # the fetches read in begin_step have reported
        out: list[LoadOp] = []
        for op in loads:
            if op.fetch_op and self._results.get(op.fetch_op) != [True]:
                self._fail_load(op)
            else:
                out.append(op)
        return out

    def _fail_load(self, op: LoadOp) -> None:
        """A load that copies nothing: reported failed, its blocks (those it was to write,
        never vLLM's null block) to vLLM as load errors."""
        self._results[op.op_id] = [False]
        self._failed_loads.add(op.op_id)
        self._failed_blocks.update(b for b in all_blocks(op) if b != self._null)

    def _backed_loads(self, meta: KVTierMetadata) -> list[LoadOp]:
        """The step's loads without the blocks vLLM backs with its null block.

        With sliding-window layers (one ``SlidingWindowSpec`` group) vLLM gives a hit's
        blocks outside the window of its next token the null block: nothing reads them,
        so only the window is copied. They lead an op's blocks (the window is the end of
        the hit); an op left with none is done without a copy. The trim keeps every other
        field of the op (:meth:`LoadOp.without_lead`): a one-step lookup's load still
        waits for its fetch. A load that would write the null block anywhere else (the
        block every sliding-window table shares) copies nothing and fails."""
        null = meta.null_block
        if null is None:
            return meta.loads
        out: list[LoadOp] = []
        for op in meta.loads:
            if op.more:  # hybrid: the scheduler planned each group's backed blocks only
                out.append(op)
                continue
            blocks = op.gpu_blocks
            k = 0
            while k < len(blocks) and blocks[k] == null:
                k += 1
            if k == len(blocks):
                self._results[op.op_id] = [True]
                continue
            op = op.without_lead(k)
            if null in op.gpu_blocks:
                logger.error(
                    "kvtier: a load of slot %d names vLLM's null block inside its "
                    "blocks %s: not loaded",
                    op.slot,
                    op.gpu_blocks,
                )
                self._fail_load(op)
                continue
            out.append(op)
        return out

    def _record_loads(self, results: list[OpResult]) -> None:
        """Record load results; a failed load's blocks go to vLLM as load errors: the
        blocks of the op as the copier got it (:attr:`_loads`, without vLLM's null block)."""
        for res in results:
            self._record(res)
            if not res.ok:
                self._failed_loads.add(res.op_id)
                op = self._loads.get(res.op_id)
                if op is None:
                    continue
                if op.more:
                    # vLLM cannot map block ids of several groups back to requests: it
                    # stops the engine on this report (never computes on a wrong load)
                    logger.error(
                        "kvtier: load of slot %d into a hybrid model's KV failed; "
                        "vLLM cannot recompute per block with several KV cache "
                        "groups",
                        op.slot,
                    )
                self._failed_blocks.update(b for b in all_blocks(op) if b != self._null)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Compute waits for this layer's loads only (no-op on the synchronous path)."""
        if self.copier is not None and self.copier.layerwise:
            li = self._layer_index.get(layer_name)
            if li is not None:
                self.copier.wait_layer(li)

    def save_kv_layer(self, layer_name: str) -> None:
        """This layer's KV for the step is written: start its stores (CUDA path)."""
        if self.copier is not None and self.copier.layerwise and self.layerwise_saves:
            li = self._layer_index.get(layer_name)
            if li is not None:
                self.copier.save_layer(li)

    def wait_for_save(self, meta: KVTierMetadata) -> None:
        self.begin_step(meta)  # a no-op: vLLM binds every step's metadata first
        copier, slab = self.copier, self.slab
        assert copier is not None and slab is not None
        # the step's copies, finished: slots read by its loads may be rewritten once
        # their results are reported
        done, self._copied = self._copied + copier.poll(), []
        self._record_loads([r for r in done if r.kind is OpKind.LOAD])
        saved = by_op(r for r in done if r.kind is OpKind.STORE)
        uploads: list[UploadOp] = []  # queued together: the write threads woken once
        for op in meta.stores:
            res = saved.get(op.op_id) or OpResult(op.op_id, OpKind.STORE, False)
            if res.ok and self._failed_loads.intersection(op.after_loads):
                # computed over blocks a load left unwritten: vLLM recomputes them, and
                # this chunk's bytes in the slot are not its KV
                res = OpResult(op.op_id, OpKind.STORE, False)
            self._record(res)
            if res.ok and op.block_hash:
                self._stored_keys[op.slot] = op.block_hash
            else:
                self._stored_keys.pop(op.slot, None)
            if op.upload_op_id is not None:
                if res.ok:
                    uploads.append(UploadOp(op.upload_op_id, op.slot, op.block_hash))
                else:
                    self._results[op.upload_op_id] = [False]
        self._upload(slab, uploads)
        for check in meta.checks:  # after the stores: their slots hold what vLLM computed
            self._check(slab, check)

    def _check(self, slab: HostSlab, op: CheckOp) -> None:
        """A canary: read the stored object of the chunk just computed into scratch memory
        (verified as any fetch), then compare it with the slot (:meth:`_checked`)."""
        if self.remote is None or (op.store_op_id and self._results.get(op.store_op_id) != [True]):
            self._checks[op.op_id] = [canary.ERROR]
            return
        assert self.layout is not None
        dtype, shape = self.layout.describe()
        scratch = torch.empty(self.layout.slot_bytes, dtype=torch.uint8)
        self._pending_checks[op.op_id] = (op.slot, scratch, op.first)
        dest = memoryview(scratch.numpy())  # type: ignore[arg-type]  # a buffer
        run = GetRun([(op.op_id, self._object_key(op.block_hash), dest)], dtype, shape)
        for res in self.remote.submit([run]):
            self._remote_result(res)

    def _checked(self, res: OpResult) -> None:
        """A canary's read is over: compare what it read with the slot, layer by layer."""
        slot, scratch, first = self._pending_checks.pop(res.op_id)
        if not res.ok:
            if res.error_kind:
                self._error(res.error_kind)
            elif first:
                self._absent()
            self._checks[res.op_id] = [canary.ERROR if res.error_kind else canary.ABSENT]
            return
        self.absent_streak = 0
        assert self.layout is not None and self.slab is not None
        computed, stored = [], []
        for li, ll in enumerate(self.layout.layers):
            computed.append(self.slab.layer_view(slot, li))
            raw = scratch[ll.offset : ll.offset + ll.nbytes]
            stored.append(raw.view(ll.dtype).view(ll.slot_shape))
        cmp = canary.compare_chunk(computed, stored)
        self._checks[res.op_id] = [cmp.result]
        worst = cmp.worst_layer
        name = self.layout.layers[worst].name if worst >= 0 else ""
        self._check_worst[res.op_id] = (name, cmp.worst)
        logger.info(
            "kvtier worker rank %d: canary of slot %d: %s (largest error %.3g, layer %s)",
            self.rank,
            slot,
            cmp.result,
            cmp.worst,
            name,
        )

    def _absent(self) -> None:
        """A request's first canary found no stored chunk (its other chunks' absence says
        nothing more: CheckOp.first). Rank 0 of a checking engine counts them: after
        :data:`~kvtier.canary.RECLAIM_AFTER` in a row, no chunk found between them (at most
        once per ``reclaim_every_s``) it tries to claim the generation afresh in the
        background, won only when it holds no chunk and no engine that trusts it is alive
        (:func:`kvtier.objects.manifest.reclaim_generation`); a win is reported as a fresh
        generation. Else a generation whose chunks are all gone stays locked for good."""
        if self.manifests is None or self.trusted or self.remote is None:
            return
        self.absent_streak += 1
        now = time.monotonic()
        busy = self._reclaim is not None and self._reclaim.is_alive()
        if (
            busy
            or self.absent_streak < canary.RECLAIM_AFTER
            or now - self._reclaim_at < self.reclaim_every_s
        ):
            return
        self._reclaim_at = now
        ns = self.namespace
        self._reclaim = threading.Thread(
            target=self._try_reclaim, args=(ns,), name="kvtier-reclaim", daemon=True
        )
        self._reclaim.start()

    def _try_reclaim(self, ns: Namespace) -> None:
        from kvtier.objects import store_admin

        remote = self.remote
        if remote is None:
            return
        gen = ns.generation()
        try:
            got = manifest.reclaim_generation(
                remote.tier, ns, remote.signer, lambda: store_admin.holds_chunks(remote.tier, gen)
            )
        except Exception as exc:  # noqa: BLE001  no answer: keep checking, try again later
            got = manifest.Reclaim(False, f"the object tier could not tell ({exc})")
        if got.won:
            logger.warning("kvtier worker: generation %s: %s", gen, got.reason)
            self._reclaimed.append(gen)
        elif got.reason != self._reclaim_said:  # each new reason once, then quieter
            logger.warning(
                "kvtier worker: generation %s stays checked before it is trusted: "
                "its stored chunks were absent for %d requests in a row, and it "
                "is not claimed afresh: %s",
                gen,
                self.absent_streak,
                got.reason,
            )
        else:
            logger.info("kvtier worker: generation %s not claimed afresh: %s", gen, got.reason)
        self._reclaim_said = got.reason

    def _remote_result(self, res: OpResult) -> None:
        """An object-tier op's result: a canary's read, or a fetch's or upload's (a
        warm-up read reported after the warm-up ended is no one's)."""
        if is_warmup_result(res):
            return
        if res.op_id in self._pending_checks:
            self._checked(res)
        else:
            self._record(res)

    def _record(self, res: OpResult) -> None:
        """One op's result: its flag for the scheduler, its time or its error for the stats.

        The one place every mover's result lands (copies here, object-tier I/O from
        :meth:`_poll_remote`)."""
        self._results[res.op_id] = [res.ok]
        if res.error_kind == DROPPED:  # refused at submit (backpressure): not an error
            self.stats.inc(metrics.WRITES_DROPPED)
        elif res.ok:
            self.stats.observe(metrics.TRANSFER_SECONDS, res.seconds, (res.kind.value,))
            if res.kind is OpKind.UPLOAD:
                self.stats.inc(metrics.BYTES, res.nbytes, ("remote", "write"))
        elif res.kind is OpKind.LOAD:
            self._error("load")  # vLLM recomputes its blocks: counted as a load error
        elif res.error_kind:
            self._error(res.error_kind)

    def _object_key(self, block_hash: bytes) -> str:
        assert self._keys is not None, "register_kv_caches was not called"
        return self._keys.key(block_hash)

    def _fetch_run(self, slab: HostSlab, run: list[FetchOp], inline_until: float) -> None:
        """Fetch one prompt's chunks into their slots: the first alone, the rest once it
        was found, none after a miss (a :class:`~kvtier.ops.GetRun`); until
        ``inline_until``, on this thread (:attr:`inline_read_s`)."""
        if self.remote is None:
            for op in run:
                self._results[op.op_id] = [False]
            return
        assert self.layout is not None
        dtype, shape = self.layout.describe()
        for op in run:  # the slot holds the object tier's copy from now on
            self._stored_keys.pop(op.slot, None)
        gets = [
            (op.op_id, self._object_key(op.block_hash), slab.slot_memoryview(op.slot)) for op in run
        ]
        for res in self.remote.submit([GetRun(gets, dtype, shape, inline_until)]):
            self._remote_result(res)

    def _upload(self, slab: HostSlab, ops: Sequence[UploadOp]) -> None:
        """Queue a step's uploads together (one wake-up of the write threads)."""
        puts = []
        for op in ops:
            self._stored_keys.pop(op.slot, None)  # on its way to the object tier
            if self.remote is None:
                self._results[op.op_id] = [False]
            elif not self.uploads:
                # rank 0 writes the one copy; the op succeeds when (and only when) its
                # does, for the scheduler settles an op once every worker's flag is in
                self._results[op.op_id] = [True]
            else:
                assert self.layout is not None
                dtype, shape = self.layout.describe()
                key = self._object_key(op.block_hash)
                puts.append(Put(op.op_id, key, slab.slot_memoryview(op.slot), dtype, shape))
        if self.remote is not None and puts:
            # backpressure: a DROPPED result, counted; the slot is released at once
            for res in self.remote.submit(puts):
                self._record(res)

    def build_worker_meta(self) -> KVTierWorkerMeta:
        self._poll_remote()
        fresh = self._fresh
        while self._reclaimed:  # a re-claim won: the engine is the generation's writer now
            if self._reclaimed.pop() == self.namespace.generation():
                fresh = True
        meta = KVTierWorkerMeta(
            steps=self._steps,
            results=self._results,
            errors=self._errors,
            reads_down_s=self.reads_down_s(),
            checks=self._checks,
            fresh_generation=fresh,
            check_worst=self._check_worst,
            layers=None if fresh is None else self.namespace.layers,
        )
        self._steps, self._results, self._errors = [], {}, {}
        self._checks, self._check_worst, self._fresh = {}, {}, None
        return meta

    def reads_down_s(self) -> float:
        """How long this worker's object-tier reads still fail fast (0: up, or no tier):
        the scheduler's ``may_load_async`` does not expect a lookup to go out meanwhile."""
        if self.remote is None:
            return 0.0
        return self.remote.reads_down_s  # (every read thread stuck counts as down)

    def _poll_remote(self) -> None:
        if self.remote is None:
            return
        for res in self.remote.poll():
            self._remote_result(res)
        # stuck calls (each holds an I/O thread) and the encryption key's nonces spent
        self.stats.set(metrics.STUCK_OPS, self.remote.stuck_reads, ("read",))
        self.stats.set(metrics.STUCK_OPS, self.remote.stuck_writes, ("write",))
        seals = self.remote.seals
        self.stats.inc(metrics.SEALS, seals - self._seals_counted)
        self._seals_counted = seals
        # bytes before and after compression, and the time spent on it, by direction
        for direction, (raw, stored, secs) in self.remote.take_compression().items():
            if raw:
                self.stats.inc(metrics.COMPRESS_RAW_BYTES, raw, (direction,))
                self.stats.inc(metrics.COMPRESS_STORED_BYTES, stored, (direction,))
            if secs:
                self.stats.inc(metrics.COMPRESS_SECONDS, secs, (direction,))
        # a Redis Cluster's unreachable nodes, by address (bounded by the tier)
        take_node_errors = getattr(self.remote.tier, "take_node_errors", None)
        if take_node_errors is not None:
            for node, n in take_node_errors().items():
                self.stats.inc(metrics.NODE_ERRORS, n, (node,))

    def _error(self, kind: str) -> None:
        kind = metrics.error_kind_label(kind)
        self.stats.inc(metrics.ERRORS, 1, (kind,))
        self._errors[kind] = self._errors.get(kind, 0) + 1

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_stats(self) -> dict[str, Any]:
        return self.stats.take()

    def handoff_puts(self) -> list[Put]:
        """The scheduler's hand-off list, hottest first, as uploads of the slots that
        still hold those chunks as stored (a slot fetched, uploaded or stored into
        since is not its chunk's to write); op ids below 0, never the scheduler's."""
        if self.slab is None or self.layout is None or not self.uploads:
            return []
        dtype, shape = self.layout.describe()
        puts: list[Put] = []
        for key, slot in self.handoff:
            if self._stored_keys.get(slot) == key:
                puts.append(
                    Put(
                        -1 - len(puts),
                        self._object_key(key),
                        self.slab.slot_memoryview(slot),
                        dtype,
                        shape,
                    )
                )
        return puts

    def _hand_off(self, deadline: float) -> None:
        """At drain, before the queued writes' flush: the hot chunks the object tier
        lacks, hottest first (:func:`.shutdown.hand_off`), counted and logged."""
        assert self.remote is not None
        puts = self.handoff_puts()
        if not puts:
            if self.handoff:  # listed, but every slot was since reused or uploaded
                logger.info(
                    "kvtier worker rank %d: hand-off: none of the %d chunks last "
                    "listed is still only here",
                    self.rank,
                    len(self.handoff),
                )
            return
        report = hand_off(self.remote, puts, deadline)
        self.stats.inc(metrics.HANDOFF_CHUNKS, report.written, ("written",))
        self.stats.inc(metrics.HANDOFF_CHUNKS, report.left, ("left",))
        self.last_handoff = report
        log = logger.warning if report.left else logger.info
        log(
            "kvtier worker rank %d: %s (shutdown_flush_s=%g)",
            self.rank,
            report.describe(),
            self.cfg.shutdown_flush_s,
        )

    def shutdown(self) -> None:
        if self.copier is not None:
            self.copier.close()
        if self.remote is None:
            return
        if self._reclaim is not None:
            self._reclaim.join(2.0)
        if self.manifests is not None:  # last_seen once more, before the tier closes
            self.manifests.close()
        deadline = time.monotonic() + self.cfg.shutdown_flush_s
        self._hand_off(deadline)
        left = self.remote.flush(max(0.0, deadline - time.monotonic()))
        if left:
            logger.warning(
                "kvtier: %d queued object-tier writes were not written at shutdown "
                "(shutdown_flush_s=%.1f)",
                left,
                self.cfg.shutdown_flush_s,
            )
        self.remote.close()
        self.remote = None
