"""Asynchronous object-tier I/O that never blocks vLLM's scheduler or worker: RemoteIO.

The worker submits fetches into host slots (a lookup's run of them) and uploads from
host slots, and later polls for their :class:`kvtier.ops.OpResult`: RemoteIO is a
:class:`kvtier.ops.Mover` of :data:`kvtier.ops.ObjectIO`. It is a thin front wiring two
parts, each with one job and its own state:

- :class:`~kvtier.objects.io_queue.OpQueue` (:attr:`RemoteIO.queue`): queues, I/O
  threads, deadlines, stuck ops, the tier's health, the counters
  (:mod:`kvtier.objects.io_counts`), and the exactly-once report of every op (when a
  slot may be written, when an op is over), under its own lock;
- :class:`~kvtier.objects.chunk_io.ChunkIO` (:attr:`RemoteIO.work`): one op's work
  against the tier (read and verify into the slot; compress, encode and put), which
  returns an :class:`~kvtier.objects.chunk_io.Outcome` and holds no queue state;
- here: the configuration, the Mover protocol, flush's warning and a bounded close.

``close`` returns within its bound even when an I/O thread is stuck in a backend
call: the threads are daemons and every join is bounded. Nothing is raised to the
caller for data or tier problems: every accepted op yields exactly one
:class:`~kvtier.ops.OpResult` with an ``error_kind`` that is a label of
``kvtier:errors`` (see :mod:`kvtier.metrics`), or :data:`~kvtier.ops.DROPPED` for an
upload refused at submit (a full write queue).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvtier.objects import codec, compress
from kvtier.objects.chunk_io import MAX_FRAME, REWRITE_KEYS, ChunkIO
from kvtier.objects.health import Backoff, ExponentialBackoff, TierHealth
from kvtier.objects.io_counts import ERROR_KINDS, FlushReport
from kvtier.objects.io_queue import OpQueue
from kvtier.objects.tiers.base import ObjectTier
from kvtier.objects.tiers.policy import Timeouts
from kvtier.ops import DROPPED, GetRun, Mover, ObjectIO, OpKind, OpResult, Put
from kvtier.threads import FetchSwitches, run_within

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig

__all__ = ["ERROR_KINDS", "MAX_FRAME", "REWRITE_KEYS", "FlushReport", "RemoteIO"]

log = logging.getLogger("kvtier.remote")


class RemoteIO:
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
        self.tier = tier
        self.work = ChunkIO(tier, signer=signer, compressor=compressor)
        self.queue = OpQueue(
            tier,
            self.work,
            threads=threads,
            queue_depth=queue_depth,
            timeout_s=timeout_s,
            write_stall_s=Timeouts(timeout_s).stall_s if write_stall_s is None else write_stall_s,
            backoff=backoff if backoff is not None else ExponentialBackoff(),
        )
        self.last_flush: FlushReport | None = None
        # the checksum's piece for as many threads as read (fewer: smaller, in L2)
        tier.hash_piece = codec.hash_piece(self.queue.read_threads)

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
        :class:`~kvtier.ops.Put` (all of them together, :meth:`OpQueue.submit_puts`: the
        write threads woken once); returns the uploads refused now (a
        full write queue: :data:`~kvtier.ops.DROPPED`, counted, never attempted). Every
        other result comes from :meth:`poll`."""
        puts: list[Put] = []
        for op in ops:
            if isinstance(op, GetRun):
                self.submit_get_run(
                    op.gets, dtype=op.dtype, shape=op.shape, inline_until=op.inline_until
                )
            else:
                puts.append(op)
        if not puts:
            return []
        refused = self.queue.submit_puts(puts)
        return [OpResult(op_id, OpKind.UPLOAD, False, error_kind=DROPPED) for op_id in refused]

    def submit_get_run(
        self,
        gets: Sequence[tuple[int, str, memoryview]],
        *,
        dtype: str,
        shape: Sequence[int],
        inline_until: float = 0.0,
    ) -> None:
        """Queue fetches of one prompt's consecutive chunks (:meth:`OpQueue.submit_get_run`)."""
        self.queue.submit_get_run(gets, dtype=dtype, shape=shape, inline_until=inline_until)

    def submit_get_into(
        self, op_id: int, key: str, dest: memoryview, *, dtype: str, shape: Sequence[int]
    ) -> None:
        """Queue a fetch of ``key``, verified, copied into ``dest`` (whose size must match)."""
        self.queue.submit_get_run([(op_id, key, dest)], dtype=dtype, shape=shape)

    def submit_put(
        self,
        op_id: int,
        key: str,
        payload: memoryview,
        *,
        dtype: str,
        shape: Sequence[int],
        first: bool = False,
    ) -> bool:
        """Queue an upload (``first``: ahead of the queued ones); False when the write queue
        is full (dropped, counted, not reported)."""
        return self.queue.submit_put(op_id, key, payload, dtype=dtype, shape=shape, first=first)

    def poll(self) -> list[OpResult]:
        """Results completed since the last poll (:meth:`OpQueue.poll`)."""
        return self.queue.poll()

    def wait_for_fetch(self, timeout_s: float) -> bool:
        """Wait until a fetch's result is ready to poll (:meth:`OpQueue.wait_for_fetch`)."""
        return self.queue.wait_for_fetch(timeout_s)

    # -- what it tells -------------------------------------------------------------------

    @property
    def signer(self) -> codec.Signer | None:
        return self.work.signer

    @property
    def seals(self) -> int:
        """Chunks sealed (encrypted, one random nonce each) with this engine's key."""
        sealer = self.signer.sealer if self.signer is not None else None
        return sealer.seals if sealer is not None else 0

    @property
    def health(self) -> TierHealth:
        return self.queue.health

    @property
    def switches(self) -> FetchSwitches:
        return self.queue.switches

    @property
    def timeout_s(self) -> float:
        return self.queue.timeout_s

    @property
    def write_stall_s(self) -> float:
        return self.queue.write_stall_s

    @property
    def read_threads(self) -> int:
        return self.queue.read_threads

    @property
    def write_threads(self) -> int:
        return self.queue.write_threads

    @property
    def is_down(self) -> bool:
        """True while reads or writes fail fast after a tier failure."""
        return self.queue.is_down

    @property
    def reads_down(self) -> bool:
        return self.queue.reads_down

    @property
    def writes_down(self) -> bool:
        return self.queue.writes_down

    @property
    def reads_down_s(self) -> float:
        return self.queue.reads_down_s

    @property
    def stuck_reads(self) -> int:
        return self.queue.stuck_reads

    @property
    def stuck_writes(self) -> int:
        return self.queue.stuck_writes

    @property
    def pending_writes(self) -> int:
        return self.queue.pending_writes

    def counters(self) -> dict[str, int]:
        """Cumulative counters since start."""
        return self.queue.counts.counters()

    def take_counters(self) -> dict[str, int]:
        """Counter increments since the previous call (for per-interval stats)."""
        return self.queue.counts.take_counters()

    def take_compression(self) -> dict[str, tuple[int, int, float]]:
        """Per direction, since the previous call: KV bytes moved, their bytes in the
        object tier, seconds spent (de)compressing (:meth:`IOCounts.take_compression`)."""
        return self.queue.counts.take_compression()

    # -- the end ---------------------------------------------------------------------------

    def flush(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the pending uploads; returns how many were not
        written. What became of each is in :attr:`last_flush` and, when any was not
        written, in one warning (failed by kind, still queued, still being written)."""
        report = self.last_flush = self.queue.flush(timeout_s)
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
        if not self.queue.close(deadline):
            return
        if not run_within(self.tier.close, deadline, "close"):
            log.warning("closing the object tier %s did not finish in time", self.tier.name)


if TYPE_CHECKING:

    def _remote_io_is_a_mover(r: RemoteIO) -> Mover[ObjectIO]:
        return r  # mypy checks that RemoteIO answers the worker's protocol
