"""The scheduler side's ledger of ops sent to the workers and not yet settled.

An op is settled once every worker reported it (each worker moves its own part
of a chunk: its heads, its layers); it succeeded only if all of them did.
Settling updates the host-tier index: a stored or fetched chunk becomes READY
(or its slot is freed), a load or upload releases the pin it held, and a fetch a
store superseded frees the slot it was reading into.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvtier import metrics
from kvtier.host.index import ChunkIndex, Entry
from kvtier.ops import OpKind
from kvtier.stats import StatsRecorder, Totals

#: the running total each settled op counts into, by kind and outcome ("store_ok", ...)
SETTLED_TOTALS: dict[tuple[OpKind, bool], str] = {
    (kind, ok): f"{kind.value}_{'ok' if ok else 'failed'}"
    for kind in OpKind
    for ok in (True, False)
}


class UploadObserver(Protocol):
    """Told every settled upload's outcome (write-back pauses cleaning after a failure)."""

    def upload_settled(self, ok: bool) -> None: ...


@dataclass(slots=True)
class Pending:
    kind: OpKind
    entry: Entry
    reports: list[bool] = field(default_factory=list)
    nbytes: int = 0
    #: a load's (tier, prompt tokens): counted in hit_tokens when it succeeds, else in
    #: miss_tokens{reason="load_failed"} (vLLM recomputes them)
    hit: tuple[str, int] | None = None


class OpLedger:
    def __init__(
        self,
        index: ChunkIndex,
        world_size: int,
        stats: StatsRecorder,
        totals: Totals,
        uploads: UploadObserver | None = None,
    ) -> None:
        self.index = index
        self.world_size = world_size
        self.stats = stats
        self.totals = totals
        #: told every settled upload's outcome (write_back pauses after a failure)
        self.uploads = uploads
        self._ids = itertools.count(1)
        self._pending: dict[int, Pending] = {}
        #: told every settled fetch (op id, ok): its timing feeds the tier's cost model
        #: (kvtier.costs, through RemoteLookups)
        self.fetch_settled: Callable[[int, bool], None] | None = None

    def __len__(self) -> int:
        return len(self._pending)

    def new_id(self) -> int:
        return next(self._ids)

    def add(
        self,
        kind: OpKind,
        entry: Entry,
        nbytes: int = 0,
        op_id: int | None = None,
        hit: tuple[str, int] | None = None,
    ) -> int:
        """Record an op about ``entry``; returns its id (a new one unless given). A load
        gives the ``hit`` it serves: (tier, prompt tokens), counted once it is settled."""
        op_id = self.new_id() if op_id is None else op_id
        self._pending[op_id] = Pending(kind, entry, nbytes=nbytes, hit=hit)
        return op_id

    def report(self, op_id: int, oks: list[bool]) -> None:
        """Some workers' flags for ``op_id``; settles it once all of them are in."""
        pending = self._pending.get(op_id)
        if pending is None:
            return
        pending.reports.extend(oks)
        if len(pending.reports) < self.world_size:
            return
        del self._pending[op_id]
        ok = all(pending.reports)
        self._settle(pending, ok)
        if pending.kind is OpKind.FETCH and self.fetch_settled is not None:
            self.fetch_settled(op_id, ok)

    def _settle(self, pending: Pending, ok: bool) -> None:
        kind, entry = pending.kind, pending.entry
        self.totals[SETTLED_TOTALS[kind, ok]] += 1
        live = self.index.get(entry.key) is entry
        if kind in (OpKind.STORE, OpKind.FETCH):
            if live:
                self.index.commit(entry.key, ok)
            elif kind is OpKind.FETCH:
                # a store superseded this fetch: its read is over, its slot free now
                self.index.release_superseded(entry)
            if ok:
                tier, direction = ("host", "write") if kind is OpKind.STORE else ("remote", "read")
                self.stats.inc(metrics.BYTES, pending.nbytes, (tier, direction))
            return
        if kind is OpKind.UPLOAD:
            entry.uploading = False
            if self.uploads is not None:
                self.uploads.upload_settled(ok)
        if live and entry.refs > 0:
            self.index.unpin(entry.key)
        if kind is OpKind.UPLOAD and ok and live:
            entry.remote = True
        if kind is OpKind.LOAD and ok:
            self.stats.inc(metrics.BYTES, pending.nbytes, ("host", "read"))
        if pending.hit is not None:
            tier, tokens = pending.hit
            if ok:
                self.stats.inc(metrics.HIT_TOKENS, tokens, (tier,))  # (and its total)
            else:
                self.stats.inc(metrics.MISS_TOKENS, tokens, ("load_failed",))
