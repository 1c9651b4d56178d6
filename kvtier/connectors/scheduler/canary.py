"""The scheduler's side of the canary (:mod:`kvtier.canary`): which chunks are checked,
and what a check's result does to the engine's trust in its generation.

The scheduler only plans: while the generation is untrusted its lookups answer 0, so vLLM
computes the prefix and the normal store path copies it into a host slot; each such
stored chunk a request may share is checked in the same step (a
:class:`~kvtier.ops.CheckOp` per chunk: the worker reads the stored object into scratch
memory and compares it with the slot, :meth:`kvtier.connectors.worker.side.WorkerSide._check`),
its slot held until every worker's result is in, as many at once as the budget
(``canary_check_tokens``) still needs; the generation is trusted once that many tokens
matched (one chunk is thin evidence: weights that differ on some tokens only match on
others). A sampled request (``canary_rate``) is answered 0 and one of its chunks checked
the same way once the generation is trusted. A checked chunk is never uploaded (its
upload would overwrite the object the check reads with this engine's own).

On a mismatch the engine forks: the scheduler draws it an identity no other engine
shares (the weight-change salt, :meth:`SchedulerSide._new_identity`), whose generation it
writes first and so trusts at once (:meth:`CanaryChecks.new_generation`). It keeps
getting hits from its own traffic and never mixes with the engines of the refused
generation, which keep using it.

A generation can hold nothing to check against: its first writer stopped before storing,
or every chunk expired or was deleted. Then every check finds the chunk absent, and an
engine would check for as long as it runs. The workers' rank 0 counts requests whose
first checked chunk was absent (:attr:`~kvtier.ops.CheckOp.first`: a request's other
chunks are absent with it) and, after :data:`~kvtier.canary.RECLAIM_AFTER` in a row
with no chunk found between them, claims the generation afresh if no
engine that trusts it is alive and it holds no chunk
(:func:`kvtier.objects.manifest.reclaim_generation`); a win is reported as a fresh
generation (:meth:`CanaryChecks.first_writer`). A checking engine says once what it waits
for, and never refreshes the manifest, so it does not keep a dead generation alive.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier import canary, metrics
from kvtier.canary import GenerationTrust, Trust
from kvtier.config import KVTierConfig
from kvtier.host.index import ChunkIndex, Entry
from kvtier.keys import Namespace
from kvtier.objects import manifest
from kvtier.ops import CheckOp, StoreOp
from kvtier.stats import StatsRecorder

if TYPE_CHECKING:
    from ..metadata import KVTierWorkerMeta, StepPlan
    from .ledger import OpLedger
    from .requests import ChunkKeys, RequestState

logger = logging.getLogger("kvtier.canary")


@dataclass(slots=True)
class _Check:
    entry: Entry
    results: list[str] = field(default_factory=list)
    #: begun before a weight change: its chunk is of the old generation (only unpinned)
    stale: bool = False


class CanaryChecks:
    """One engine's trust in its generation, and the checks that decide it.

    ``changed`` is told each change of state (the scheduler turns uploads on once trusted,
    and empties the host tier and forks once refused)."""

    def __init__(
        self,
        cfg: KVTierConfig,
        index: ChunkIndex,
        ledger: OpLedger,
        keys: ChunkKeys,
        plan: StepPlan,
        stats: StatsRecorder,
        *,
        world_size: int,
        namespace: Namespace,
        changed: Callable[[Trust], None] = lambda state: None,
        trust: GenerationTrust | None = None,
    ) -> None:
        self.cfg = cfg
        self.index = index
        self.ledger = ledger
        self.keys = keys
        self.plan = plan
        self.stats = stats
        self.world_size = world_size
        self.namespace = namespace
        self.changed = changed
        self.trust = trust or GenerationTrust(
            first_hit=cfg.canary_first_hit,
            rate=cfg.canary_rate,
            check_tokens=cfg.canary_check_tokens,
            chunk_tokens=cfg.chunk_size,
        )
        #: requests recomputed as canaries (no kvtier hit), until one of their chunks is
        #: checked; every request's draw, made once (request id -> sampled)
        self._sampled: dict[str, bool] = {}
        #: requests with a chunk checked already (their later checks' absence is not
        #: counted toward RECLAIM_AFTER: CheckOp.first)
        self._checked_requests: set[str] = set()
        #: chunks matched while untrusted: each counts once toward the budget (a chunk
        #: evicted and computed again is the same evidence)
        self._matched: set[bytes] = set()
        self._pending: dict[int, _Check] = {}
        #: the forks this engine made after mismatches: (fork id, refused generation, new
        #: generation), logged; the fork id is the salt's first 8 bytes in hex
        self.forks: list[tuple[str, str, str]] = []

    @property
    def trusted(self) -> bool:
        return self.trust.trusted

    @property
    def pending(self) -> int:
        """Checks sent to the workers and not yet reported by all of them."""
        return len(self._pending)

    def recompute(self, st: RequestState) -> bool:
        """Whether this request gets no kvtier hit at all: drawn once per request as a
        canary (``canary_rate``) of a trusted generation, among the requests whose
        recompute can be checked (:meth:`_checkable`)."""
        rid = st.request.request_id
        sampled = self._sampled.get(rid)
        if sampled is None:
            sampled = self._sampled[rid] = (
                self.trust.rate > 0.0 and self._checkable(st) and self.trust.sample()
            )
        return sampled

    def _checkable(self, st: RequestState) -> bool:
        """Whether a chunk of ``st`` that it may share is not in the host tier: only such
        a chunk is stored when vLLM computes it, and so checked against the object tier.
        A request the host tier serves in full is its own KV or chunks fetched and checked
        already: recomputing it would cost its prefill and check nothing."""
        shared = min(st.shared_chunks, len(st.chunk_hashes))
        return any(self.index.get(self.keys.key(st, c)) is None for c in range(shared))

    def may_upload(self, st: RequestState) -> bool:
        """Whether this request's stored chunks may be uploaded: only into a trusted
        generation, never a canary's (its check reads the object an upload would overwrite)."""
        return self.trust.trusted and not self._sampled.get(st.request.request_id, False)

    def stores_planned(self, st: RequestState, stores: list[StoreOp]) -> None:
        """This step's stores of ``st``: check those it may share while checks are wanted
        (the generation untrusted: as many as the budget still needs; ``st`` a canary:
        its first one)."""
        rid = st.request.request_id
        sampled = self._sampled.get(rid, False)
        if sampled:
            for op in stores:  # a canary's chunks are this engine's: never written back
                entry = self.index.get(self._index_key(st, op))
                if entry is not None:
                    entry.remote = True
        wanted = self.trust.checks_wanted(sampled) if stores else 0
        for op in stores:
            if wanted <= 0:
                return
            try:
                c = st.chunk_hashes.index(op.block_hash)
            except ValueError:
                continue
            if c >= st.shared_chunks or op.upload_op_id is not None:
                continue  # host-only (not under object keys), or being uploaded
            entry = self.index.get(self.keys.key(st, c))
            if entry is None or entry.slot != op.slot or entry.key in self._matched:
                continue
            entry.remote = True  # write-back never uploads it over the object it reads
            self.index.hold(entry)  # the slot keeps the computed chunk until checked
            op_id = self.ledger.new_id()
            first = rid not in self._checked_requests
            self._checked_requests.add(rid)
            self.plan.checks.append(CheckOp(op_id, op.slot, op.block_hash, op.op_id, first))
            self._pending[op_id] = _Check(entry)
            self.trust.began()
            wanted -= 1
            if sampled:
                self._sampled[rid] = False  # one check per canary request
                return

    def _index_key(self, st: RequestState, op: StoreOp) -> bytes:
        try:
            return self.keys.key(st, st.chunk_hashes.index(op.block_hash))
        except ValueError:
            return op.block_hash

    def report(self, meta: KVTierWorkerMeta) -> None:
        """The workers' report: whether the generation is new (once, at startup), and the
        results of checks."""
        if meta.layers is not None:
            self.workers_layers(meta.layers)
        if meta.fresh_generation is not None:
            self.first_writer(meta.fresh_generation)
        for op_id, results in meta.checks.items():
            check = self._pending.get(op_id)
            if check is None:
                continue
            check.results.extend(results)
            if len(check.results) < self.world_size:
                continue
            del self._pending[op_id]
            entry = check.entry
            if self.index.get(entry.key) is entry and entry.refs > 0:
                self.index.unpin(entry.key)
            if not check.stale:
                result = canary.combine(check.results)
                if result == canary.MATCH and not self.trust.trusted:
                    self._matched.add(entry.key)
                self._settle(result, meta.check_worst.get(op_id))

    def workers_layers(self, layers: str) -> None:
        """Rank 0 of stage 0's layers (``Namespace.layers``), which the generation id
        covers: from now on this side names the generation the workers' keys do."""
        if self.namespace.layers != layers:
            self.namespace = dataclasses.replace(self.namespace, layers=layers)

    def first_writer(self, fresh: bool) -> None:
        """The workers said whether this engine's claim of the generation won at startup
        (vLLM's handshake, else their first report; the first answer counts), or later
        that a re-claim won (a checking engine's, once the generation held nothing to
        check). Logs what a checking engine waits for, once: the state is never silent."""
        before = self.trust.state
        state = self.trust.first_writer(fresh)
        if state is before:
            return
        if state is Trust.TRUSTED:
            self._matched.clear()
        gen = self.namespace.generation()
        if state is Trust.CHECKING:
            logger.warning(
                "kvtier: generation %s (model_fingerprint %r) is in the object tier, written "
                "by another engine: this engine loads nothing from it and stores nothing "
                "into it until chunks it computes, %d tokens in all (canary_check_tokens: "
                "%d chunks), are found there and match (its first hits, checked). It waits "
                "for a prompt whose chunks the generation holds; if the generation holds no "
                "chunk and no engine that trusts it refreshed its manifest for %.0f s, this "
                "engine claims it afresh after %d prompts whose chunks were found absent "
                'in a row (kvtier:canary_checks_total{outcome="absent"} counts the '
                "chunks)",
                gen,
                self.cfg.model_fingerprint,
                self.trust.check_tokens,
                self.trust.check_chunks,
                manifest.STALE_S,
                canary.RECLAIM_AFTER,
            )
        elif state is Trust.TRUSTED and before is Trust.CHECKING:
            logger.warning(
                "kvtier: generation %s claimed afresh: it held no chunk and no engine that "
                "trusted it was alive, so this engine is its writer now; loads and stores "
                "there begin",
                gen,
            )
        self.changed(state)

    def _settle(self, result: str, worst: tuple[str, float] | None) -> None:
        self.stats.inc(metrics.CANARY, 1, (result,))
        before = self.trust.state
        state = self.trust.checked(result)
        if state is before:
            return
        gen = self.namespace.generation()
        if state is Trust.TRUSTED:
            logger.info(
                "kvtier: generation %s checked: %d chunks vLLM computed (%d tokens, "
                "canary_check_tokens %d) match the stored ones; loads and stores "
                "there begin",
                gen,
                len(self._matched),
                self.trust.matched,
                self.trust.check_tokens,
            )
            self._matched.clear()
        elif state is Trust.REFUSED:
            layer, err = worst if worst is not None else ("?", float("nan"))
            logger.error(
                "kvtier: generation %s (model_fingerprint %r) holds KV of other weights: "
                "the KV vLLM computed for a stored chunk differs in layer %s by %.3g of the "
                "layer's range (tolerance %.3g). This engine never loads from nor stores "
                "into that generation from now on: it carries on under a generation of its "
                "own (a fork, logged next). Likely cause: model_fingerprint is "
                "pinned and was not changed when the weights changed (or vLLM, a kernel or "
                "the KV layout changed under the same name). Give these weights their own "
                "model_fingerprint (or remove the setting), and delete the stale generation "
                "with `kvtier store gc` if no engine serves its weights any more",
                gen,
                self.cfg.model_fingerprint,
                layer,
                err,
                canary.TOLERANCE,
            )
        self.changed(state)

    def new_generation(self, salt: bytes, *, fork: bool = False) -> None:
        """The engine's keys now carry ``salt`` (a weight change, or a fork after a
        mismatch: ``fork``): a generation no one else has, trusted as its first writer."""
        before = self.namespace.generation()
        self.namespace = self.namespace.after_weight_change(salt)
        self.trust.new_generation()
        self._matched.clear()
        for check in self._pending.values():  # their slots are released as they report
            check.stale = True
        if fork:
            fork_id, gen = self.namespace.fork_id, self.namespace.generation()
            self.forks.append((fork_id, before, gen))
            logger.warning(
                "kvtier: fork %s: this engine carries on under generation %s, its own, "
                "instead of generation %s (model_fingerprint %r), which holds other "
                "weights' KV: it is that generation's first writer and trusts it at once, "
                "so it gets hits from its own traffic only, and never mixes with the "
                "engines whose KV %s holds (they keep using it). Its chunks are dead once it "
                "stops: a restart checks %s again",
                fork_id,
                gen,
                before,
                self.cfg.model_fingerprint,
                before,
                before,
            )

    def forget(self, request_id: str) -> None:
        self._sampled.pop(request_id, None)
        self._checked_requests.discard(request_id)
