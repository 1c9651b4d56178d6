"""Asynchronous object-tier I/O that never blocks vLLM's scheduler or worker.

The worker submits fetches into host slots (a lookup's run of them) and
uploads from host slots, and later polls for their :class:`kvtier.ops.OpResult`.
Behind that:

- Reads (fetches) and writes (uploads) have their own bounded queues and their
  own threads (``threads`` is split: ceil(n/2) read, max(1, n//2) write), so
  a backlog of uploads never delays a lookup. A full read queue reports the
  lookup at once as ``"timeout"`` (counted in ``reads_dropped``).
- A full write queue drops the upload and counts it (``writes_dropped``); a
  chunk that never reaches the object tier only costs a future recompute,
  whereas blocking would stall the engine.
- A lookup is a read (:meth:`RemoteIO.submit_get_run`): a prompt's chunks are
  fetched in order, the first alone, the rest in parallel once it was found;
  after a miss the chunks behind it are not asked for, so a prompt the tier lacks
  costs one request, and a rejected chunk (a forgery) ends its run unread.
- A read still queued at its deadline (``timeout_s`` from submit) is reported
  as ``"timeout"`` at the next poll. Whether a read starts (its thread begins
  writing into the destination) or times out is one decision, taken under the
  op's lock, so a slot reported free is never written afterwards.
- A read that has begun is reported only when its backend call is over: its
  destination is the caller's host slot, which must not be reused under a late
  write. Past its deadline it is *stuck*: counted (``reads_stuck``, and
  :attr:`RemoteIO.stuck_reads` while it lasts) and a timeout against the
  tier's health, so a tier that keeps timing out goes down and lookups then
  fail fast. The caller's own lookup deadline stops waiting for it (the
  scheduler's lookup is over); its slot stays claimed until the read returns.
  Stuck reads are bounded by the read threads: while every read thread is
  stuck, reads fail fast (nothing could serve them) and queued ones are
  reported at once. A read that returns after its deadline counts as a
  timeout, never as the tier's recovery.
- Uploads have no deadline of their own (the tier's socket timeouts bound
  them): the caller's payload must stay untouched until the put is reported,
  so it is never reported early. One still in its backend call after
  ``write_stall_s`` is stuck in the same way (``writes_stuck``; writes go
  down; while every write thread is stuck, queued uploads are reported failed
  at once, which releases their slots).
- An upload whose object already exists under its key is not written again
  (``puts_existing``): the key names the chunk's content, and with an
  encryption key every write spends one of the key's random nonces. A key
  whose last fetch was rejected (corrupt, forged, sealed for another key,
  oversize) is written again, which repairs it.
- A connection-level failure (``TierUnavailable``) marks that direction
  (reads: fetches; writes: uploads) down for ``backoff.compute(n)``
  seconds; until then its ops fail fast as ``"unreachable"`` without touching
  the network. After that the next op is a real attempt, and its success
  clears the state. Reads and writes back off separately: a store that
  refuses writes must not stop hits.
- A failure of one object (``ObjectError``: a full disk on write, a Redis key
  of the wrong type, a planted FIFO) is that op's miss, counted as
  ``"object"``; the tier stays up. A fetch never reads more than the codec's
  largest header plus the slot: a bigger object is refused unread, counted as
  ``"oversize"``.
- ``close`` returns within its bound even when an I/O thread is stuck in a
  backend call: the threads are daemons and every join is bounded.
- With a compressor (``compression: lossless``) an upload is compressed, then
  framed, sealed and signed, all on its write thread; a fetch reads the whole
  object (one bounded ``get``) into a per-read-thread scratch buffer, verifies it
  there and decompresses it into the slot. Without one a fetch reads straight into
  the slot; an object too short for that (a compressed chunk another engine wrote)
  is read again whole and decompressed the same way, so every engine reads both.
  Bytes before and after compression and the seconds spent are counted
  (:meth:`RemoteIO.take_compression`).
- Nothing is raised to the caller for data or tier problems: every accepted
  op yields exactly one :class:`~kvtier.ops.OpResult` with an ``error_kind`` that is a
  label of ``kvtier:errors`` (see :mod:`kvtier.metrics`).
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier import metrics
from kvtier.errors import CodecError, ObjectError, TierError, TierUnavailable, TruncatedError
from kvtier.objects import codec, compress
from kvtier.objects.backoff import Backoff, ExponentialBackoff
from kvtier.objects.tier_health import RateLimitedLog, TierHealth
from kvtier.objects.tiers.base import ObjectTier
from kvtier.objects.tiers.policy import Timeouts
from kvtier.ops import OpKind, OpResult
from kvtier.stats import Totals
from kvtier.threads import run_within, stop_within

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig

__all__ = ["ERROR_KINDS", "FlushReport", "RemoteIO"]

log = logging.getLogger("kvtier.remote")

#: error kinds RemoteIO reports and counts: every kind but a failed copy's ("load")
ERROR_KINDS = tuple(k for k in metrics.ERROR_KINDS if k != "load")
#: what a stored chunk may add to its slot's bytes: magic, header length, the largest header
MAX_FRAME = len(codec.MAGIC) + 4 + codec.MAX_HEADER
_COUNTERS = (
    "writes_dropped", "reads_dropped", "bytes_read", "bytes_written",
    "ops_fetch", "ops_upload", "gets_skipped", "reads_stuck", "writes_stuck",
    "puts_existing", "seals",
) + tuple("errors_" + k for k in ERROR_KINDS)  # fmt: skip
#: per direction: KV bytes, their bytes as stored (compressed or not), microseconds spent
#: compressing (write) or decompressing (read)
_ZCOUNTERS = tuple(f"z_{what}_{d}" for d in ("read", "write") for what in ("raw", "stored", "us"))
#: keys whose last fetch was rejected, remembered so that their next upload rewrites them
REWRITE_KEYS = 4096


@dataclass(frozen=True, slots=True)
class FlushReport:
    """What became of the uploads pending when :meth:`RemoteIO.flush` began (every one
    is in exactly one of: written, failed, still queued, still in a backend call)."""

    pending: int
    written: int
    failed: dict[str, int]
    queued: int
    writing: int
    timeout_s: float

    @property
    def missing(self) -> int:
        """Uploads that were not written (failed, or not finished within the flush)."""
        return sum(self.failed.values()) + self.queued + self.writing

    def describe(self) -> str:
        failed = ", ".join(f"{k}: {n}" for k, n in sorted(self.failed.items()))
        return (
            f"{self.pending} pending: {self.written} written, "
            f"{sum(self.failed.values())} failed ({failed or 'none'}), "
            f"{self.queued} still queued after {self.timeout_s:.1f} s (dropped at close), "
            f"{self.writing} still in a backend call (left behind, may or may not land)"
        )


class _Op:
    """One queued op. ``lock`` + ``done`` make reporting happen exactly once."""

    __slots__ = ("op_id", "kind", "key", "buf", "dtype", "shape", "t0", "deadline", "lock",
                 "done", "seq", "started", "stall_at", "stuck", "run", "pos",
                 "queued")  # fmt: skip

    def __init__(
        self,
        seq: int,
        op_id: int,
        kind: OpKind,
        key: str,
        timeout_s: float,
        buf: memoryview | None = None,
        dtype: str = "",
        shape: Sequence[int] = (),
    ) -> None:
        self.seq = seq
        self.op_id = op_id
        self.kind = kind
        self.key = key
        self.buf = buf
        self.dtype = dtype
        self.shape = list(shape)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + timeout_s
        self.lock = threading.Lock()
        self.done = False
        #: its backend call has begun (a get: its bytes are being read into ``buf``, the
        #: caller's slot); set under ``lock``, only while not ``done``: from then on the
        #: op is reported only when the call is over
        self.started = False
        #: when a started op counts as stuck (a get: its deadline)
        self.stall_at = self.deadline
        #: counted as stuck (poll() saw it started and past ``stall_at``)
        self.stuck = False
        #: the run of gets (one prompt's consecutive chunks) this get is ``pos`` in
        self.run: list[_Op] | None = None
        self.pos = 0
        #: put on the read queue already (never twice: a get read twice at once would
        #: write its slot twice)
        self.queued = False


def _byte_view(buf: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


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
        compressor: compress.Compressor | compress.Fp8Compressor | None = None,
    ) -> None:
        if threads < 1 or queue_depth < 1 or timeout_s <= 0:
            raise ValueError("RemoteIO needs threads >= 1, queue_depth >= 1, timeout_s > 0")
        self.tier = tier
        self.timeout_s = timeout_s
        #: an upload still in its backend call after this long is stuck
        self.write_stall_s = Timeouts(timeout_s).stall_s if write_stall_s is None else write_stall_s
        self.signer = signer
        self.backoff = backoff if backoff is not None else ExponentialBackoff()
        self._rq: queue.Queue[_Op | None] = queue.Queue(maxsize=queue_depth)
        self._wq: queue.Queue[_Op | None] = queue.Queue(maxsize=queue_depth)
        self._results: collections.deque[OpResult] = collections.deque()
        self._lock = threading.Lock()
        self._writes_idle = threading.Condition(self._lock)
        self._inflight: dict[int, _Op] = {}  # reads, watched by poll() for timeouts
        self._seq = itertools.count()
        self._totals = Totals(_COUNTERS + _ZCOUNTERS)  # guarded by self._lock
        self._taken = dict.fromkeys(_COUNTERS + _ZCOUNTERS, 0)
        self._z_taken = dict.fromkeys(_ZCOUNTERS, 0)
        #: compresses uploads (``compression: lossless``); None: stored raw
        self.compressor = compressor
        #: fp8 chunks are read only by an engine that chose them: other engines' hits
        #: stay exact
        self.reads_lossy = isinstance(compressor, compress.Fp8Compressor)
        #: a read thread's buffer for compressed objects, reused (compress.ThreadScratch)
        self._scratch = compress.ThreadScratch()
        self._pending_writes = 0
        self._puts_written = 0
        self._put_failed_kinds: collections.Counter[str] = collections.Counter()
        self._writing: dict[int, _Op] = {}  # uploads in their backend call
        self._stuck = {OpKind.FETCH: 0, OpKind.UPLOAD: 0}  # started, past stall_at, not over
        #: keys whose last fetch was rejected: their next upload rewrites the object
        self._rewrite: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.last_flush: FlushReport | None = None
        self.health = TierHealth(tier.name, self.backoff)
        self._closed = False
        self._data_log = RateLimitedLog()
        self._object_log = RateLimitedLog()
        # reads get the larger half: lookups are latency-critical, uploads are not
        self.read_threads, self.write_threads = max(1, (threads + 1) // 2), max(1, threads // 2)
        n_read, n_write = self.read_threads, self.write_threads
        self._threads = [
            threading.Thread(target=self._worker, args=(q,), name=f"kvtier-{role}-{i}", daemon=True)
            for q, role, n in ((self._rq, "read", n_read), (self._wq, "write", n_write))
            for i in range(n)
        ]
        for t in self._threads:
            t.start()

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
        return cls(
            tier if tier is not None else open_tier(cfg),
            threads=cfg.io_threads,
            queue_depth=cfg.io_queue_depth,
            timeout_s=Timeouts.from_ms(cfg.lookup_timeout_ms).lookup_s,
            signer=signer,
            backoff=backoff,
            compressor=compress.Compressor.from_config(cfg),
        )

    def __repr__(self) -> str:
        return f"RemoteIO({self.tier!r}, down={self.is_down})"

    # -- submitting ----------------------------------------------------------------------

    def submit_get_into(
        self, op_id: int, key: str, dest: memoryview, *, dtype: str, shape: Sequence[int]
    ) -> None:
        """Queue a fetch of ``key``, verified, copied into ``dest`` (whose size must match)."""
        self.submit_get_run([(op_id, key, dest)], dtype=dtype, shape=shape)

    def submit_get_run(
        self,
        gets: Sequence[tuple[int, str, memoryview]],
        *,
        dtype: str,
        shape: Sequence[int],
    ) -> None:
        """Queue fetches of one prompt's consecutive chunks ``(op_id, key, dest)``, in order.

        A lookup is a read: the first chunk is fetched at once (a missing object is a
        miss, one request for a prompt the tier does not hold); once it was found the
        rest are queued and read in parallel. A prompt can only use its chunks up to
        the first gap, so when one is missing or fails, those after it that have not
        started are reported as misses without asking (counted in ``gets_skipped``).
        Every get yields one result.
        """
        run = []
        for op_id, key, dest in gets:
            view = _byte_view(dest)
            if view.readonly:
                raise ValueError("submit_get_run needs writable destinations")
            run.append(_Op(next(self._seq), op_id, OpKind.FETCH, key, self.timeout_s, view,
                           dtype, shape))  # fmt: skip
        for pos, op in enumerate(run):
            op.run, op.pos = run, pos
        if not run:
            return
        if self._closed or self.reads_down:
            self._finish(run[0], False, "unreachable")  # and the rest as misses
            return
        with self._lock:
            for op in run:  # every get's deadline counts from now, queued or not
                self._inflight[op.seq] = op
        self._queue_once(run[0])

    def submit_put(
        self, op_id: int, key: str, payload: memoryview, *, dtype: str, shape: Sequence[int]
    ) -> bool:
        """Queue an upload; False when the write queue is full (dropped, counted, not reported)."""
        op = _Op(
            next(self._seq), op_id, OpKind.UPLOAD, key, self.timeout_s, _byte_view(payload), dtype,
            shape,
        )
        with self._lock:
            if self._closed:
                self._totals["writes_dropped"] += 1
                return False
            self._pending_writes += 1
        if self.writes_down:
            self._finish(op, False, "unreachable")
            return True
        try:
            self._wq.put_nowait(op)
        except queue.Full:
            with self._lock:
                self._totals["writes_dropped"] += 1
                self._pending_writes -= 1
            return False
        return True

    def _queue_once(self, op: _Op) -> None:
        """Queue a get of a run unless it was queued already or reported (a miss before
        it skipped it): the submitter and the thread that found the run's first chunk
        may both try, and a get read twice at once would write its slot twice."""
        with op.lock:
            if op.done or op.queued:
                return
            op.queued = True
        self._enqueue_read(op)

    def _enqueue_read(self, op: _Op) -> None:
        try:
            self._rq.put_nowait(op)
        except queue.Full:
            # more lookups queued than can finish in time: this one would time out anyway
            with self._lock:
                self._totals["reads_dropped"] += 1
            self._finish(op, False, "timeout")

    # -- results -------------------------------------------------------------------------

    def poll(self) -> list[OpResult]:
        """Results completed since the last poll; reads still queued past their deadline
        as timeouts; started ops past theirs counted as stuck (reported when over)."""
        now = time.monotonic()
        with self._lock:
            blocked = self._stuck[OpKind.FETCH] >= self.read_threads
            # a read that has not started may time out; whether it has is decided below,
            # under its own lock, where the I/O thread decides to start it
            late = [op for op in self._inflight.values() if blocked or now > op.stall_at]
            late += [op for op in self._writing.values() if now > op.stall_at]
        for op in late:
            with op.lock:
                if op.done or op.stuck:
                    continue
                if not op.started:  # queued: it can never write into its slot now
                    # (not the tier's fault by itself: a burst, or threads held by slow
                    # reads, which count as they become stuck)
                    self._report(op, False, "timeout" if now > op.deadline else "unreachable", 0)
                    continue
                op.stuck = True  # in its backend call: reported when that is over
                with self._lock:
                    self._stuck[op.kind] += 1
                    self._totals["reads_stuck" if op.kind is OpKind.FETCH else "writes_stuck"] += 1
            self._stalled(op)
        if self.stuck_writes >= self.write_threads and not self._closed:
            self._fail_queued_writes()
        out: list[OpResult] = []
        while self._results:
            out.append(self._results.popleft())
        return out

    def _stalled(self, op: _Op) -> None:
        """A started op past its deadline: a timeout against its direction's health."""
        self.health.timed_out(
            op.kind is OpKind.UPLOAD,
            f"a {op.kind} has been in its backend call for "
            f"{time.monotonic() - op.t0:.2f} s, past its {op.stall_at - op.t0:.2f} s deadline",
        )

    def _fail_queued_writes(self) -> None:
        """Every write thread is stuck: report the queued uploads (their slots go back)."""
        while True:
            try:
                op = self._wq.get_nowait()
            except queue.Empty:
                return
            if op is None:  # close()'s stop request: put it back for a thread to see
                try:
                    self._wq.put_nowait(None)
                except queue.Full:  # a racing submit took the place; the threads are daemons
                    pass
                return
            self._finish(op, False, "unreachable")

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

    # -- state ---------------------------------------------------------------------------

    @property
    def is_down(self) -> bool:
        """True while reads or writes fail fast after a tier failure."""
        return self.reads_down or self.writes_down

    @property
    def reads_down(self) -> bool:
        """True while fetches fail fast: after a read failed to reach the tier or timed
        out, and while every read thread is stuck in a backend call."""
        return self.health.reads.is_down or self.stuck_reads >= self.read_threads

    @property
    def writes_down(self) -> bool:
        """True while uploads fail fast: after a write failed to reach the tier or
        stalled, and while every write thread is stuck in a backend call."""
        return self.health.writes.is_down or self.stuck_writes >= self.write_threads

    @property
    def reads_down_s(self) -> float:
        """How long fetches will still fail fast: the backoff left or, while every read
        thread is stuck, at least the lookup deadline (ask again after it)."""
        left = max(0.0, self.health.reads.down_until - time.monotonic())
        return max(left, self.timeout_s) if self.stuck_reads >= self.read_threads else left

    @property
    def stuck_reads(self) -> int:
        """Reads past their deadline still in their backend call (each holds a read
        thread and its slot until the call returns; at most ``read_threads``)."""
        return self._stuck[OpKind.FETCH]

    @property
    def stuck_writes(self) -> int:
        """Uploads in their backend call for longer than ``write_stall_s``."""
        return self._stuck[OpKind.UPLOAD]

    @property
    def seals(self) -> int:
        """Chunks sealed (encrypted, one random nonce each) with this engine's key."""
        sealer = self.signer.sealer if self.signer is not None else None
        return sealer.seals if sealer is not None else 0

    @property
    def pending_writes(self) -> int:
        return self._pending_writes

    def counters(self) -> dict[str, int]:
        """Cumulative counters since start."""
        with self._lock:
            return dict(self._totals)

    def take_compression(self) -> dict[str, tuple[int, int, float]]:
        """Per direction ("read", "write"), since the previous call: KV bytes moved, their
        bytes in the object tier (compressed or not), seconds spent (de)compressing."""
        with self._lock:
            delta = {k: self._totals[k] - self._z_taken[k] for k in _ZCOUNTERS}
            self._z_taken = {k: self._totals[k] for k in _ZCOUNTERS}
        return {
            d: (delta[f"z_raw_{d}"], delta[f"z_stored_{d}"], delta[f"z_us_{d}"] / 1e6)
            for d in ("read", "write")
        }

    def _count_z(self, direction: str, raw: int, stored: int, seconds: float) -> None:
        with self._lock:
            self._totals[f"z_raw_{direction}"] += raw
            self._totals[f"z_stored_{direction}"] += stored
            self._totals[f"z_us_{direction}"] += round(seconds * 1e6)

    def take_counters(self) -> dict[str, int]:
        """Counter increments since the previous call (for per-interval stats)."""
        with self._lock:
            delta = {k: v - self._taken[k] for k, v in self._totals.items()}
            self._taken = dict(self._totals)
        return delta

    # -- workers -------------------------------------------------------------------------

    def _worker(self, q: queue.Queue[_Op | None]) -> None:
        while True:
            op = q.get()
            if op is None:
                return
            try:
                self._execute(op)
            except BaseException:  # a bug must cost one op, not the I/O thread
                log.exception("object-tier %s op failed unexpectedly", op.kind)
                self._finish(op, False, "tier")

    def _execute(self, op: _Op) -> None:
        if op.done:  # timed out (or closed) while queued: do not touch the network
            return
        write = op.kind is OpKind.UPLOAD
        if self.writes_down if write else self.reads_down:
            self._finish(op, False, "unreachable")
            return
        # start or time out: one decision, under the lock poll() decides timeouts under;
        # once started, a get reads straight into its slot and reports only when the read
        # is over, so the slot cannot be reused under a late write
        with op.lock:
            if op.done or op.buf is None:  # reported, or closed while being picked up
                return
            key, buf, now = op.key, op.buf, time.monotonic()
            late = not write and now > op.deadline
            if not late:
                op.started = True
                if write:
                    op.stall_at = now + self.write_stall_s
                    with self._lock:
                        self._writing[op.seq] = op
        if late:
            self._finish(op, False, "timeout")
            return
        try:
            if not write:
                got = self._read(key, buf)
                self._answered(op)
                if got is None:
                    self._finish(op, False, None)
                    return
                head, payload = got
                nread = len(head) + payload.nbytes
                self._add("bytes_read", nread)
                # a compressed chunk is verified as stored, in the scratch buffer, then
                # decompressed into the slot; one read into the slot is never decompressed
                secs = codec.verify(head, payload, key=key, dtype=op.dtype, shape=op.shape,
                                    signer=self.signer,
                                    out=None if payload is buf else buf,
                                    lossy=self.reads_lossy)  # fmt: skip
                self._count_z("read", buf.nbytes, payload.nbytes, secs)
                self._finish(op, True, None, nbytes=nread)
            else:
                with self._lock:
                    rewrite = key in self._rewrite
                # the key names the chunk: an object already there is this chunk, and
                # writing it again would spend one of the encryption key's nonces
                if not rewrite and self.tier.exists([key])[0]:
                    self._answered(op)
                    self._add("puts_existing", 1)
                    self._finish(op, True, None)
                    return
                z: tuple[str, bytes] | None = None
                secs = 0.0
                zgot = None
                if self.compressor is not None:
                    zgot = self.compressor.compress_chunk(buf, op.dtype)
                if zgot is not None:
                    z, secs = (zgot[0], zgot[1]), zgot[2]
                parts = codec.encode(key, buf, dtype=op.dtype, shape=op.shape, signer=self.signer,
                                     compressed=z)  # fmt: skip
                self.tier.put(key, parts)
                self._answered(op)
                n = codec.encoded_size(parts)
                # only a compressed frame is shorter than the raw payload alone
                stored = memoryview(parts[-1]).nbytes if n < buf.nbytes else buf.nbytes
                self._count_z("write", buf.nbytes, stored, secs)
                with self._lock:
                    self._totals["bytes_written"] += n
                    self._rewrite.pop(key, None)
                self._finish(op, True, None, nbytes=n)
        except CodecError as exc:
            self._data_log.warning("object-tier chunk rejected (%s): %s", exc.kind, exc)
            if not write:
                self._remember_rewrite(key)
            self._finish(op, False, exc.kind)
        except TierUnavailable as exc:
            self.health.failed(write, exc)
            self._finish(op, False, "unreachable")
        except TierError as exc:  # one object failed; the tier answered, so it is up
            self._answered(op)
            self._object_log.warning("object tier %s: %s failed: %s", self.tier.name, op.kind, exc)
            if not write and isinstance(exc, ObjectError):
                self._remember_rewrite(key)
            self._finish(op, False, exc.kind if exc.kind in ERROR_KINDS else "tier")

    def _read(self, key: str, slot: memoryview) -> tuple[bytes, memoryview] | None:
        """Read ``key`` for ``slot``: (head, payload), None when it is not stored.

        Without a compressor the object is read straight into the slot (the payload is
        ``slot``). With one, or when the object is too short for that (compressed by
        another engine), it is read whole, at most the slot plus the largest header: a
        compressed payload into this thread's scratch buffer (decompressed into the slot
        once verified; with an encryption key, as it opens in place), a raw one copied
        into the slot.
        """
        if self.compressor is None:
            try:
                head = self.tier.read_into(key, slot, MAX_FRAME)
            except TruncatedError:
                pass  # shorter than a raw chunk: perhaps a compressed one; read it whole
            else:
                return None if head is None else (head, slot)
        blob = self.tier.get(key, max_bytes=slot.nbytes + MAX_FRAME)
        if blob is None:
            return None
        view = memoryview(blob)
        body_at = codec.head_length(view[:8])
        if view.nbytes < body_at:
            raise TruncatedError(f"chunk of {view.nbytes} bytes ends inside its header")
        head, payload = bytes(view[:body_at]), view[body_at:]
        if not codec.is_compressed(head):
            if payload.nbytes != slot.nbytes:
                raise TruncatedError(f"chunk payload has {payload.nbytes} bytes, its slot "
                                     f"{slot.nbytes}")  # fmt: skip
            slot[:] = payload
            return head, slot
        if self.signer is None or self.signer.sealer is None:
            return head, payload  # not opened in place: decompressed from where it was read
        scratch = self._scratch.view(payload.nbytes)  # at most slot + MAX_FRAME
        scratch[:] = payload  # writable: a sealed chunk opens in place
        return head, scratch

    def _answered(self, op: _Op) -> None:
        """The tier answered ``op``'s call: up again, unless it answered too late (then
        that is a timeout, once per op: a tier that answers only after the deadline
        stays down, however it answers)."""
        if time.monotonic() <= op.stall_at:
            self.health.succeeded(op.kind is OpKind.UPLOAD)
        elif not op.stuck:  # poll() counted it already when it saw it stuck
            self._stalled(op)

    def _remember_rewrite(self, key: str) -> None:
        """A fetch of ``key`` was rejected: the next upload of it writes it again."""
        with self._lock:
            self._rewrite[key] = None
            self._rewrite.move_to_end(key)
            while len(self._rewrite) > REWRITE_KEYS:
                self._rewrite.popitem(last=False)

    def _add(self, counter: str, n: int) -> None:
        with self._lock:
            self._totals[counter] += n

    def _finish(
        self,
        op: _Op,
        ok: bool,
        error_kind: str | None,
        *,
        nbytes: int = 0,
    ) -> None:
        """Report ``op`` unless poll() already reported it as a timeout; go on with its run.

        A miss reports the run's unstarted chunks after it first, then itself: a poll
        between the two would let the lookup end at this miss while those chunks still
        hold claimed slots, and the request's own stores of them would need new slots."""
        if not ok and op.run is not None and not op.done:
            self._skip_after(op)
        with op.lock:
            if op.done:
                return
            self._report(op, ok, error_kind, nbytes)
        if op.run is None or not ok:
            return
        if op.pos == 0:
            for later in op.run[1:]:
                self._queue_once(later)

    def _skip_after(self, op: _Op) -> None:
        """The run's chunks after a miss are of no use: report those not started as misses."""
        assert op.run is not None
        skipped = 0
        for later in op.run[op.pos + 1 :]:
            with later.lock:
                if later.done or later.started:
                    continue
                self._report(later, False, None, 0, counted=False)
                skipped += 1
        if skipped:
            self._add("gets_skipped", skipped)

    def _report(
        self,
        op: _Op,
        ok: bool,
        error_kind: str | None,
        nbytes: int,
        *,
        counted: bool = True,
    ) -> None:
        """Publish the result; the caller holds ``op.lock``. ``counted=False``: an op
        that never reached the tier (not in ``ops_*``)."""
        op.done = True
        op.buf = None
        result = OpResult(
            op.op_id, op.kind, ok, time.monotonic() - op.t0, nbytes, error_kind
        )
        with self._lock:
            if counted:
                self._totals["ops_" + op.kind] += 1
            if error_kind is not None:
                self._totals["errors_" + error_kind] += 1
            if op.stuck:
                self._stuck[op.kind] -= 1
            if op.kind is OpKind.UPLOAD:
                self._pending_writes -= 1
                self._writing.pop(op.seq, None)
                if ok:
                    self._puts_written += 1
                else:
                    self._put_failed_kinds[error_kind or "tier"] += 1
                self._writes_idle.notify_all()
            else:
                self._inflight.pop(op.seq, None)
        self._results.append(result)
