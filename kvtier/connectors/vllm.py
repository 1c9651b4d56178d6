"""``KVTierConnector``: the vLLM KV connector facade.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
                           "kv_connector_module_path": "kvtier.connectors.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"cpu_bytes": "8GiB"}}'

A thin facade: the scheduler process gets a :class:`SchedulerSide` (keys,
index, plans), each worker a :class:`WorkerSide` (bytes). Config errors raise
:class:`kvtier.errors.ConfigError` here, so a wrong key stops the engine at
startup; each is logged first as one ERROR line of its own (:func:`config_errors_logged`),
since vLLM shows it only deep in a traceback.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.config import load_config, secret_in_config
from kvtier.errors import config_errors_logged
from kvtier.host.layout import KVGroup
from kvtier.sizing.validate import ATTENTION_FREE_REASON, SSM_REASON, model_refused

from .engine_shape import EngineShape
from .groups import Refused, kv_groups
from .identity import check_parallel, namespace_for, workers_on_node
from .metadata import KVTierMetadata, WorkerKeys
from .scheduler.side import SchedulerSide
from .scheduler.weights import engine_core_on_stack, follow_weight_changes, watch_written_weights
from .startup import check_config_being_built
from .stats import KVTierPromMetrics, KVTierStats
from .worker.shutdown import shutdown_window_warning
from .worker.side import WorkerSide

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvtier")


def log_where_vllm_logs() -> None:
    """kvtier's log lines go where vLLM's go. vLLM configures its own ``vllm`` logger only,
    so without this kvtier's INFO lines (its config, which way lookups go) reach no one.
    Idempotent; the records still propagate (a root handler, pytest's, sees them too)."""
    ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())


_P = ParamSpec("_P")
_R = TypeVar("_R")


def logs_config_errors(func: Callable[_P, _R]) -> Callable[_P, _R]:
    """Where vLLM calls kvtier at startup: a ConfigError leaving ``func`` is logged first,
    one ERROR line each, in vLLM's log (:func:`~kvtier.errors.config_errors_logged`)."""

    @functools.wraps(func)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        log_where_vllm_logs()
        with config_errors_logged():
            return func(*args, **kwargs)

    return wrapper


@logs_config_errors
def check_config_at_import() -> None:
    """:func:`check_config_being_built`, its refusal logged by kvtier: vLLM 0.32 runs it
    inside its pydantic config, which buries the error under its own traceback."""
    check_config_being_built()


def worker_position() -> tuple[int, int]:
    """This worker's (TP rank, pipeline stage); (0, 0) where vLLM's groups are not set up
    (a single process). Both go into the worker's object keys."""
    from vllm.distributed import parallel_state

    try:
        rank = parallel_state.get_tensor_model_parallel_rank()
    except Exception:  # not initialised (single process)
        rank = 0
    try:
        stage = parallel_state.get_pp_group().rank_in_group
    except Exception:
        stage = 0
    return rank, stage


def check_kv_cache_groups(shape: EngineShape, chunk_size: int | None = None) -> tuple[KVGroup, ...]:
    """Refuse at startup a KV cache kvtier cannot store and restore whole; return its
    groups as kvtier stores them (``()``: one group, stored whole).

    kvtier subclasses vLLM's ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager:
    a model with full and sliding-window attention gets a group of each, and kvtier
    stores every group of a chunk in one slot (:mod:`.groups`). Refused here, naming the
    model and why, rather than served with a wrong load: Mamba/SSM state (one state per
    request, not per token, so a chunk of tokens cannot be stored or restored; hybrid SSM
    models such as Jamba or Bamba included), any group that is neither full nor
    sliding-window attention, groups of different block sizes, or no KV cache at all.
    """
    kv_cache = shape.allocated_kv_cache()
    groups = kv_cache.groups
    block_size = shape.kv_block_size()
    if not groups:
        reason = ATTENTION_FREE_REASON
    elif len(groups) == 1 and not all(s.attention for s in groups[0].specs):
        reason = f"its KV cache is {groups[0].describe()}, {SSM_REASON}"
    else:
        try:
            return kv_groups(kv_cache, block_size, chunk_size or block_size)
        except Refused as why:
            reason = str(why)
    # the same error kvtier size gives for the model's config.json (kvtier.sizing.validate)
    raise model_refused(shape.model, reason)


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """Host-RAM and object-store KV tiers for vLLM (``kv_role: kv_both``).

    ``SupportsHMA``: vLLM keeps its hybrid KV cache manager with kvtier, and kvtier
    stores and loads every KV cache group (:mod:`.groups`)."""

    @logs_config_errors
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        log_where_vllm_logs()
        ktc = vllm_config.kv_transfer_config  # vLLM's base refused a config without one
        assert ktc is not None
        extra = ktc.kv_connector_extra_config or {}
        self.cfg = load_config(extra)
        warning = secret_in_config(extra)
        if role == KVConnectorRole.SCHEDULER and warning is not None:
            logger.warning("kvtier: %s", warning)
        #: vLLM's config, read once: what the rest of kvtier's vLLM layer takes
        self._shape = shape = EngineShape.from_vllm(vllm_config, kv_cache_config)
        self.cfg.check_block_size(shape.kv_block_size())
        check_parallel(shape)
        groups = check_kv_cache_groups(shape, self.cfg.chunk_size)
        if self.cfg.remote_url:
            from kvtier.objects.codec import Signer

            Signer.from_config(self.cfg)  # a missing or empty key stops startup here
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        #: sleep mode (vLLM >= 0.33): the KV tensors' memory is unmapped until wake-up
        self._asleep = False
        #: a weight change was followed and no step has been scheduled since
        self._weights_change_open = False
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._kv_ptrs: dict[str, int] = {}
        if role == KVConnectorRole.SCHEDULER:
            # vLLM builds the scheduler after the workers loaded the weights
            ns = namespace_for(self.cfg, shape)
            self._scheduler = SchedulerSide(self.cfg, shape, ns)
            # weights replaced while the engine runs reach _kvtier_weights_changed: by a
            # call (collective_rpc), or seen at reset_prefix_cache (written without one)
            follow_weight_changes()
            watch_written_weights(engine_core_on_stack())
            logger.info("kvtier config: %s", json.dumps(self.cfg.redacted()))
            short = shutdown_window_warning(self.cfg, shape, os.environ)
            if short is not None:
                logger.warning("kvtier: %s", short)
        else:
            # a worker's connector comes before the weights (a hub model may not be
            # downloaded yet): its keys are made in register_kv_caches
            ns = namespace_for(self.cfg, shape, read_weights=False)
            from kvtier.objects.remote import RemoteIO

            self._worker = WorkerSide(
                self.cfg,
                ns,
                shape.allocated_kv_cache().num_blocks,
                RemoteIO.from_config,
                groups=groups,
                workers_on_node=workers_on_node(shape),
            )
            # with micro-batches a layer's attention runs once per ubatch: its KV is only
            # complete after the forward, so stores then start in wait_for_save
            self._worker.layerwise_saves = not shape.ubatching

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """On CUDA, loads and saves are layer-wise (wait_for_layer_load / save_kv_layer).

        Those calls cannot be captured in a full CUDA graph (replay would skip
        them and race the copies), so vLLM must use PIECEWISE graphs. The CPU
        backend has no CUDA graphs, so the answer only matters on CUDA.
        """
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        """No: a best-effort cache. Stores are copied inside the step that computed the
        chunk and nothing is handed off after it (``request_finished`` frees at once), so a
        preempted request has nothing pending; a dropped store is only a future miss."""
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: KVTransferConfig) -> Any:
        """vLLM >= 0.34: ``KVCacheAccess.IN_PROCESS``. kvtier's workers reach vLLM's KV
        only with torch copies in their own process (views of each layer's tensor, index
        copies, ``cudaMemcpyAsync`` through torch); nothing registers it with an RDMA or
        UCX engine or exports it to another process (``cudaHostRegister`` pins kvtier's
        own host slab only). So any allocation of the KV cache works, the extensible one
        included."""
        from vllm.config import kv_transfer  # KVCacheAccess exists from 0.34 on

        return kv_transfer.KVCacheAccess.IN_PROCESS  # type: ignore[attr-defined,unused-ignore]

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """vLLM >= 0.34, with EAGLE-style drafting: no. Lookahead hashing folds the tokens
        after a block into its hash and publishes it only once they exist; kvtier keys its
        chunks by vLLM's block hashes as they appear and stores a chunk in the step that
        computed it, so with lookahead hashes the chunk's last hash would be missing then
        and the store skipped. Answering no keeps vLLM's plain block hashes (vLLM then
        drops the drafter's volatile last block from prefix hits its own way)."""
        return False

    @classmethod
    @logs_config_errors
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """vLLM >= 0.33 asks before it starts with ``enable_sleep_mode``.

        Without an object tier: yes. Sleep (level 1 or 2) first resets the connector
        (``reset_cache``), so the host tier holds nothing from before the sleep when
        the engine wakes, even if the weights changed meanwhile (RL weight syncs sleep
        at level 2 and load new weights); while asleep kvtier touches no KV tensor
        (see :meth:`unregister_kv_caches`). The host slab itself is kvtier's own
        memory and survives.

        With an object tier: no. Its chunks are named by a fingerprint of the weights
        read at startup; weights replaced in memory while asleep do not change it, so
        the chunks this engine wrote after waking would carry the old weights' name into
        a tier shared with replicas still serving those weights, and it would load
        theirs. vLLM then refuses to start with sleep mode and names the connector.
        """
        extra = kv_transfer_config.kv_connector_extra_config or {}
        return not load_config(extra).remote_url

    # ---- worker side ------------------------------------------------------------------------
    @logs_config_errors  # a host slab that does not fit is a ConfigError (slots.allocate_slab)
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        # the weights are loaded now: the worker's keys carry their fingerprint
        self._worker.namespace = namespace_for(self.cfg, self._shape)
        rank, stage = worker_position()
        self._worker.register_kv_caches(kv_caches, rank, stage)
        self._kv_ptrs = {name: kv.data_ptr() for name, kv in kv_caches.items()}
        self._kv_caches = kv_caches

    def unregister_kv_caches(self) -> None:
        """vLLM >= 0.33, before sleep (and before it discards the KV cache): the KV
        tensors' memory is about to be unmapped; vLLM has drained the transfers.

        kvtier holds no registration of that memory (no RDMA, no ``cudaHostRegister``
        of vLLM's KV: only of its own host slab), and copies between it and the host
        tier only inside a step, for the step's loads and stores. So sleeping is this
        flag: a step that asked for a copy before :meth:`restore_kv_caches` fails loudly
        instead of reading or writing unmapped memory. Fetches and uploads work on the
        host slab only and may go on. Idempotent.
        """
        self._asleep = True

    def restore_kv_caches(self) -> None:
        """vLLM >= 0.33, after wake-up: take the KV tensors again. vLLM's sleep backend
        maps the KV cache back at the same addresses, so kvtier's views of each layer are
        valid again; a layer found elsewhere stops the engine (kvtier would copy into
        memory vLLM no longer uses for it) rather than corrupt KV. Idempotent."""
        if not self._asleep:
            return
        moved = [
            name for name, kv in self._kv_caches.items() if kv.data_ptr() != self._kv_ptrs[name]
        ]
        if moved:
            raise RuntimeError(
                f"kvtier: vLLM's KV cache of {len(moved)} layers (first {moved[0]!r}) "
                "moved across sleep mode; kvtier cannot follow a remapped KV cache"
            )
        self._asleep = False

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Called before every forward: the step's stores, fetches and uploads start here,
        since vLLM may call ``start_load_kv`` only after the forward."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVTierMetadata):
            if self._asleep and (connector_metadata.loads or connector_metadata.stores):
                raise RuntimeError(
                    "kvtier: a step asked for KV copies while vLLM's KV cache is unmapped "
                    "(sleep mode, before restore_kv_caches)"
                )
            self._worker.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """CUDA: compute waits for this layer's host->GPU copy only (CPU: loads are done)."""
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """CUDA: start this layer's GPU->host copy now (CPU: all stores run in wait_for_save)."""
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save(self._meta())

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """This worker's object keys, for the scheduler's one-step lookups
        (:mod:`.scheduler.one_step_lookups`), and what its warm-up read
        (:mod:`.worker.warmup`); None without an object tier. vLLM collects it once the
        KV caches are registered."""
        w = self._worker
        if w is None or not self.cfg.remote_url:
            return None
        return WorkerKeys(w.namespace, w.rank, w.stage, w.weights_epoch, w.fresh_generation, w.warm)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.build_worker_meta() if self._worker is not None else None

    def _meta(self) -> KVTierMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        return meta

    # ---- scheduler side ---------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.bind_kv_cache_manager(kv_cache_manager)

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self._take_worker_keys(metadata.values())

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """Every worker's keys, pipeline stages included (vLLM's default refuses stage > 0)."""
        self._take_worker_keys(metadata.values())

    def _take_worker_keys(self, metadata: Iterable[KVConnectorHandshakeMetadata]) -> None:
        if self._scheduler is not None:
            self._scheduler.set_worker_keys([m for m in metadata if isinstance(m, WorkerKeys)])

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def may_load_async(self, request: Request) -> bool:
        """vLLM >= 0.34: true exactly when this request's lookup may go to the object tier
        (tier configured and reading, host tier lacking the prompt's last chunk): see
        :meth:`SchedulerSide.may_load_async`. vLLM then starts its lookup even while the
        running batch is full; kvtier answers "ask again" until the fetched chunks are in
        the host tier and loads them from there, never ``load_kv_async=True``."""
        assert self._scheduler is not None
        return self._scheduler.may_load_async(request)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        assert self._scheduler is not None
        return self._scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        self._weights_change_open = False
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: vLLM calls this instead of :meth:`request_finished`, once, for
        every model (one group too). Stores are copied inside the step that computed their
        chunk, every group's blocks of it, so nothing is pending here and vLLM frees the
        blocks at once."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids[0] if block_ids else [])

    def _kvtier_weights_changed(self, why: str) -> None:
        """The engine core ran ``why`` (``reload_weights``, ``apply_model(fn)``, an
        extension's method, a function...) on the workers, which may have changed the
        weights (:func:`kvtier.connectors.scheduler.weights.follow_weight_changes`). The host tier
        is emptied and the object keys get a new identity before the next step. Calls
        with no step between them are one change (a trainer's sync sends one tensor per
        call): nothing was stored or loaded in between."""
        if self._scheduler is not None and not self._weights_change_open:
            self._weights_change_open = True
            self._scheduler.weights_changed(why)

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` (and sleep mode, in vLLM >=
        0.33) also empties the host tier: with KV events on, one ``BlockRemoved``."""
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV events of kvtier's tiers since the last call (vLLM asks every step and
        publishes them with its own when started with ``--kv-events-config``)."""
        return self._scheduler.take_events() if self._scheduler is not None else ()

    # ---- both ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._worker or self._scheduler
        if side is None:
            return None
        data = side.get_stats()
        stats = KVTierStats(data=data)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVTierStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def scheduler_side(connector: KVTierConnector) -> SchedulerSide | None:
    """``connector``'s scheduler side, in the scheduler process (None in a worker's): what
    ``kvtier demo`` reads its totals from. A function, not a property: the connector's
    public names are vLLM's hooks (tests/connectors/test_vllm_conformance.py)."""
    return connector._scheduler


# vLLM 0.32 imports this module while it builds its config, before any engine process
# starts: a config kvtier refuses stops startup there, once (kvtier.connectors.startup)
check_config_at_import()
