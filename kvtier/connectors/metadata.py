"""What the scheduler side tells the workers each step, and what they answer; and what
each worker tells the scheduler once, at startup (vLLM's connector handshake:
:class:`WorkerKeys`, with its :class:`WarmReport`). The only messages between
:mod:`kvtier.connectors.scheduler` and :mod:`kvtier.connectors.worker`.

Plain dataclasses of ints and bytes: vLLM pickles them across processes. The ops
themselves are :mod:`kvtier.ops` (the transfer contract).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.hotset import HotList
from kvtier.keys import KeySpace, Namespace
from kvtier.ops import CheckOp, FetchOp, LoadOp, StoreOp, UploadOp

__all__ = [
    "CheckOp",
    "FetchOp",
    "KVTierMetadata",
    "KVTierWorkerMeta",
    "LoadOp",
    "StepPlan",
    "StoreOp",
    "UploadOp",
    "WarmReport",
    "WorkerKeys",
]


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    step: int = 0
    #: host tier size per worker, bytes; the slab is allocated on first use
    host_bytes: int = 0
    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)
    #: object tier -> host slots: one list per lookup, a prompt's chunks in order
    fetches: list[list[FetchOp]] = field(default_factory=list)
    #: one-step lookups' runs (the same shape): read before this step's loads, which
    #: copy their slots (``LoadOp.fetch_op``)
    fetches_now: list[list[FetchOp]] = field(default_factory=list)
    #: seconds the workers may read ``fetches_now`` before the step's loads give up on what
    #: is still being read (the least deadline of their priced lookups, kvtier.costs; the
    #: late chunks still land in their slots); 0: lookup_timeout_ms
    fetches_now_s: float = 0.0
    uploads: list[UploadOp] = field(default_factory=list)
    #: vLLM's null block (stands for blocks a request no longer needs: a sliding-window
    #: layer's outside its window); loads skip it. None until a KV cache manager is bound
    null_block: int | None = None
    #: how many times the weights changed while the engine ran, and the salt of the
    #: object keys' identity since the last change (SchedulerSide.weights_changed)
    weights_epoch: int = 0
    weights_salt: bytes = b""
    #: canaries: stored chunks compared with the object tier's (kvtier.canary)
    checks: list[CheckOp] = field(default_factory=list)
    #: the engine trusts its generation (kvtier.canary): its manifest is refreshed only then
    trusted: bool = True
    #: every kvtier.hotset.SEND_S (connectors/scheduler/hot.py): the hits since the last send, for
    #: rank 0's manifest writer (None: none this step)
    heat: HotList | None = None
    #: the hot chunks the object tier lacks, (key, slot) hottest first, written first at
    #: drain (None: unchanged)
    handoff: tuple[tuple[bytes, int], ...] | None = None
    #: with tenants (kvtier.host.tenants): the chunk keys this step uploads per tenant
    #: label, for rank 0's manifest writer (kvtier.objects.tenant_keys; None: none)
    tenant_uploads: dict[str, list[bytes]] | None = None
    #: every kvtier.hotset.SEND_S with pin_tenants: the host tier's pinned chunks and the
    #: seconds each pin has left, for rank 0's manifest (gc keeps them; None: not sent)
    pins: dict[bytes, float] | None = None


class StepPlan:
    """The ops of the step being planned: the one place the scheduler side's parts write
    them as they decide them (loads when vLLM allocates a request, a lookup's fetch run,
    stores in ``build_connector_meta``, a write-back upload whenever an eviction or the
    cleaning of the oldest chunks begins one), and what the scheduler hands to vLLM as
    the step's :class:`KVTierMetadata` (:meth:`take`), starting the next step's empty."""

    __slots__ = ("checks", "fetches", "fetches_now", "fetches_now_s", "loads", "stores", "uploads")

    def __init__(self) -> None:
        self.loads: list[LoadOp] = []
        self.stores: list[StoreOp] = []
        #: one run per lookup, a prompt's chunks in order
        self.fetches: list[list[FetchOp]] = []
        #: one-step lookups' runs, read before the step's loads
        self.fetches_now: list[list[FetchOp]] = []
        #: how long the workers may read them (KVTierMetadata.fetches_now_s; 0: no bound of
        #: the step's own)
        self.fetches_now_s = 0.0
        self.uploads: list[UploadOp] = []
        #: canaries of this step's stores (read and compared after them)
        self.checks: list[CheckOp] = []

    def __len__(self) -> int:
        """Ops planned and not yet handed to vLLM (a fetch run counts its fetches)."""
        fetches = sum(len(run) for run in self.fetches + self.fetches_now)
        return len(self.loads) + len(self.stores) + fetches + len(self.uploads) + len(self.checks)

    def take(
        self,
        *,
        step: int,
        host_bytes: int,
        null_block: int | None,
        weights_epoch: int = 0,
        weights_salt: bytes = b"",
        trusted: bool = True,
    ) -> KVTierMetadata:
        """The step's metadata: every op planned since the last call, in the order planned."""
        meta = KVTierMetadata(
            step=step,
            host_bytes=host_bytes,
            loads=self.loads,
            stores=self.stores,
            fetches=self.fetches,
            fetches_now=self.fetches_now,
            uploads=self.uploads,
            fetches_now_s=self.fetches_now_s,
            null_block=null_block,
            weights_epoch=weights_epoch,
            weights_salt=weights_salt,
            checks=self.checks,
            trusted=trusted,
        )
        self.loads, self.stores, self.fetches, self.uploads = [], [], [], []
        self.fetches_now, self.checks = [], []
        self.fetches_now_s = 0.0
        return meta


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """Per-op outcomes from each worker; aggregated across TP ranks by vLLM."""

    steps: list[int] = field(default_factory=list)
    #: op id -> one ``OpResult.ok`` per worker that reported it (vLLM merges the
    #: workers' metadata with :meth:`aggregate`; the scheduler settles an op once
    #: every worker's flag is in)
    results: dict[int, list[bool]] = field(default_factory=dict)
    #: error kind -> count, for ops that failed in a way worth counting
    errors: dict[str, int] = field(default_factory=dict)
    #: seconds this worker's object-tier reads still fail fast after a failure to reach
    #: the tier (0: up); merged as the longest, for a lookup needs every worker's read
    reads_down_s: float = 0.0
    #: canaries: op id -> one result per worker that finished it (kvtier.canary.RESULTS)
    checks: dict[int, list[str]] = field(default_factory=dict)
    #: whether the engine's claim of its generation won at startup (rank 0 of stage 0
    #: claims once, before its manifest writer starts; None: not said in this report)
    fresh_generation: bool | None = None
    #: a mismatch's worst layer and error, for the scheduler's log: op id -> (layer, error)
    check_worst: dict[int, tuple[str, float]] = field(default_factory=dict)
    #: rank 0 of stage 0's ``Namespace.layers``, sent with ``fresh_generation``: the
    #: generation id covers them, and the scheduler names the workers' generation
    layers: str | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVTierWorkerMeta)
        merged = {k: list(v) for k, v in self.results.items()}
        for op_id, oks in other.results.items():
            merged.setdefault(op_id, []).extend(oks)
        errors = dict(self.errors)
        for kind, n in other.errors.items():
            errors[kind] = errors.get(kind, 0) + n
        checks = {k: list(v) for k, v in self.checks.items()}
        for op_id, found in other.checks.items():
            checks.setdefault(op_id, []).extend(found)
        fresh = (
            self.fresh_generation
            if other.fresh_generation is None
            else (
                other.fresh_generation
                if self.fresh_generation is None
                else self.fresh_generation and other.fresh_generation
            )
        )
        return KVTierWorkerMeta(
            steps=sorted(set(self.steps) | set(other.steps)),
            results=merged,
            errors=errors,
            reads_down_s=max(self.reads_down_s, other.reads_down_s),
            checks=checks,
            fresh_generation=fresh,
            check_worst={**self.check_worst, **other.check_worst},
            layers=self.layers if self.layers is not None else other.layers,
        )


@dataclass(frozen=True)
class WarmReport:
    """What one worker's warm-up read (vLLM's handshake carries it to the scheduler)."""

    #: (chunk key, host slot) of every chunk read and verified, hottest first
    chunks: tuple[tuple[bytes, int], ...] = ()
    #: slots a read may still be writing (begun, unreported at the timeout)
    busy: tuple[int, ...] = ()
    #: bytes read from the object tier
    nbytes: int = 0
    seconds: float = 0.0
    #: chunks planned (the hot list within the budget)
    planned: int = 0
    #: the size of the slab the chunks are in (the scheduler takes them only for its size)
    host_bytes: int = 0
    #: "done", "timeout", "stopped" (the tier's reads failed: down), "cold" (nothing to
    #: warm, or it failed: the log says why)
    outcome: str = "cold"


@dataclass(frozen=True)
class WorkerKeys(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler at startup: the namespace its object keys are
    made from (its layers included), its TP rank, its pipeline stage, and the count of
    weight changes its keys follow (``WorkerSide.weights_epoch``)."""

    namespace: Namespace
    rank: int
    stage: int
    weights_epoch: int = 0
    #: rank 0 of stage 0: whether its claim of its generation won at startup
    #: (kvtier.canary: its first writer is trusted at once); None: not this worker's to say
    fresh_generation: bool | None = None
    #: what the worker's warm-up read into its host slab (``warmup: true``,
    #: :mod:`kvtier.connectors.worker.warmup`); None: no warm-up ran
    warm: WarmReport | None = None

    @property
    def space(self) -> KeySpace:
        return KeySpace.worker(self.namespace, self.rank, self.stage)
