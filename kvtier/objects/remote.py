"""Asynchronous object-tier I/O that never blocks vLLM's scheduler or worker: RemoteIO.

The worker submits fetches into host slots (a lookup's run of them) and uploads from
host slots, and later polls for their :class:`kvtier.ops.OpResult`: RemoteIO is a
:class:`kvtier.ops.Mover` of :data:`kvtier.ops.ObjectIO`. It is built in layers, one
job each:

- :mod:`kvtier.objects.io_counts`: the counters, the compression tallies, FlushReport;
- :mod:`kvtier.objects.io_queue`: queues, I/O threads, deadlines, stuck ops, and the
  exactly-once report of every op (when a slot may be written, when an op is over);
- :mod:`kvtier.objects.chunk_io`: one op against the tier (read and verify into the
  slot; compress, encode and put), its failures mapped to error kinds and health;
- here: the configuration, the Mover protocol, flush and a bounded close.

``close`` returns within its bound even when an I/O thread is stuck in a backend
call: the threads are daemons and every join is bounded. Nothing is raised to the
caller for data or tier problems: every accepted op yields exactly one
:class:`~kvtier.ops.OpResult` with an ``error_kind`` that is a label of
``kvtier:errors`` (see :mod:`kvtier.metrics`), or :data:`~kvtier.ops.DROPPED` for an
upload refused at submit (a full write queue).
"""

from __future__ import annotations

import collections
import logging
import queue
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvtier.objects import codec, compress
from kvtier.objects.chunk_io import MAX_FRAME, REWRITE_KEYS, ChunkIO
from kvtier.objects.health import Backoff, ExponentialBackoff
from kvtier.objects.io_counts import ERROR_KINDS, FlushReport
from kvtier.objects.tiers.base import ObjectTier
from kvtier.objects.tiers.policy import Timeouts
from kvtier.ops import DROPPED, GetRun, Mover, ObjectIO, OpKind, OpResult
from kvtier.threads import run_within, stop_within

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig

__all__ = ["ERROR_KINDS", "MAX_FRAME", "REWRITE_KEYS", "FlushReport", "RemoteIO"]

log = logging.getLogger("kvtier.remote")


class RemoteIO(ChunkIO):
    """Bounded, non-blocking object-tier I/O; see the module docstring.

    RemoteIO owns ``tier`` and closes it in :meth:`close`. The caller keeps a
    put's ``payload`` and a get's ``dest`` valid and unchanged until that op's
    result was polled, or until :meth:`flush` / :meth:`close` returned.
    """

    def __init__(
        self,
        tier: ObjectTier,
        *,
        threads: int,
        queue_depth: int,
        timeout_s: float,
        signer: codec.Signer | None,
        backoff: Backoff | None = None,
        write_stall_s: float | None = None,
        compressor: compress.ChunkCompressor | None = None,
    ) -> None:
        super().__init__(
            tier,
            threads=threads,
            queue_depth=queue_depth,
            timeout_s=timeout_s,
            write_stall_s=Timeouts(timeout_s).stall_s if write_stall_s is None else write_stall_s,
            backoff=backoff if backoff is not None else ExponentialBackoff(),
            signer=signer,
            compressor=compressor,
        )
        self.last_flush: FlushReport | None = None
        self._start_threads()

    @classmethod
    def from_config(
        cls,
        cfg: KVTierConfig,
        *,
        tier: ObjectTier | None = None,
        environ: Mapping[str, str] | None = None,
        backoff: Backoff | None = None,
    ) -> RemoteIO:
        """RemoteIO for ``cfg``: its tier (opened here unless given), signer and limits."""
        from kvtier.objects.tiers import open_tier

        signer = codec.Signer.from_config(cfg, environ)
        rio = cls(
            tier if tier is not None else open_tier(cfg),
            threads=cfg.io_thread_count(),
            queue_depth=cfg.io_queue_depth,
            timeout_s=Timeouts.from_ms(cfg.lookup_timeout_ms).lookup_s,
            signer=signer,
            backoff=backoff,
            compressor=compress.from_config(cfg),
        )
        rio.switches.interval_s = cfg.fetch_switch_us / 1e6
        return rio

    def __repr__(self) -> str:
        return f"RemoteIO({self.tier!r}, down={self.is_down})"

    # -- the Mover protocol --------------------------------------------------------------

    def submit(self, ops: Sequence[ObjectIO]) -> list[OpResult]:
        """Queue each :class:`~kvtier.ops.GetRun` (:meth:`submit_get_run`) and
        :class:`~kvtier.ops.Put` (:meth:`submit_put`); returns the uploads refused now (a
        full write queue: :data:`~kvtier.ops.DROPPED`, counted, never attempted). Every
        other result comes from :meth:`poll`."""
        refused: list[OpResult] = []
        for op in ops:
            if isinstance(op, GetRun):
                self.submit_get_run(op.gets, dtype=op.dtype, shape=op.shape,
                                    inline_until=op.inline_until)  # fmt: skip
            elif not self.submit_put(op.op_id, op.key, op.payload, dtype=op.dtype,
                                     shape=op.shape):  # fmt: skip
                refused.append(OpResult(op.op_id, OpKind.UPLOAD, False, error_kind=DROPPED))
        return refused

    def submit_get_into(
        self, op_id: int, key: str, dest: memoryview, *, dtype: str, shape: Sequence[int]
    ) -> None:
        """Queue a fetch of ``key``, verified, copied into ``dest`` (whose size must match)."""
        self.submit_get_run([(op_id, key, dest)], dtype=dtype, shape=shape)

    @property
    def seals(self) -> int:
        """Chunks sealed (encrypted, one random nonce each) with this engine's key."""
        sealer = self.signer.sealer if self.signer is not None else None
        return sealer.seals if sealer is not None else 0

    # -- the end ---------------------------------------------------------------------------

    def flush(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the pending uploads; returns how many were not
        written. What became of each is in :attr:`last_flush` and, when any was not
        written, in one warning (failed by kind, still queued, still being written)."""
        deadline = time.monotonic() + timeout_s
        with self._writes_idle:
            pending = self._pending_writes
            written0, failed0 = self._puts_written, collections.Counter(self._put_failed_kinds)
            while self._pending_writes > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._writes_idle.wait(remaining)
            writing = len(self._writing)
            failed = self._put_failed_kinds - failed0
            report = FlushReport(
                pending=pending,
                written=self._puts_written - written0,
                failed=dict(failed),
                queued=self._pending_writes - writing,
                writing=writing,
                timeout_s=timeout_s,
            )
        self.last_flush = report
        if report.missing:
            log.warning("object-tier writes not written by the flush: %s", report.describe())
        return report.missing

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the threads, drop what is still queued (counted), close the tier.

        Returns within ``timeout_s`` (default: the read timeout, at most 5 s)
        even when an I/O thread is stuck in a backend call (a hung mount, a
        server that stopped answering): the engine's shutdown must not hang on
        a cache. A stuck thread is a daemon and is left behind, and the tier is
        closed on a daemon thread so that a lock the stuck call holds cannot
        block this one.
        """
        bound = min(self.timeout_s, 5.0) if timeout_s is None else max(0.0, timeout_s)
        deadline = time.monotonic() + bound
        with self._lock:
            if self._closed:
                return
            self._closed = True
        dropped = 0
        for q in (self._rq, self._wq):
            while True:
                try:
                    op = q.get_nowait()
                except queue.Empty:
                    break
                if op is None:
                    continue
                with op.lock:
                    op.done = True
                    op.buf = None
                if op.kind is OpKind.UPLOAD:
                    dropped += 1
        with self._lock:
            self._totals["writes_dropped"] += dropped
            self._pending_writes -= dropped
            self._writes_idle.notify_all()
            inflight = list(self._inflight.values())
            self._inflight.clear()
            self.switches.hold(False)
            writing = len(self._writing)
        for op in inflight:  # a fetch not yet started never will
            with op.lock:
                op.done = True
                op.buf = None
        if dropped:
            log.warning("closing object-tier I/O: %d queued writes dropped", dropped)
        if writing:
            log.warning(
                "closing object-tier I/O: %d writes still in a %s call, left behind "
                "(they may or may not land)", writing, self.tier.name,
            )  # fmt: skip
        queues = [self._rq if "-read-" in t.name else self._wq for t in self._threads]
        stuck = stop_within(self._threads, queues, deadline)
        if stuck:
            log.warning(
                "closing object-tier I/O: %d I/O threads are still in a %s call; not waiting",
                stuck, self.tier.name,
            )  # fmt: skip
        if not run_within(self.tier.close, deadline, "close"):
            log.warning("closing the object tier %s did not finish in time", self.tier.name)


if TYPE_CHECKING:

    def _remote_io_is_a_mover(r: RemoteIO) -> Mover[ObjectIO]:
        return r  # mypy checks that RemoteIO answers the worker's protocol
