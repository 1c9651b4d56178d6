"""The life of an object-tier op, from submit to its one result: :class:`OpQueue`, and
the op as it holds it (:class:`QueuedOp`; :class:`ReadQueue`).

Queues, I/O threads, deadlines, the tier's health, the counters and the exactly-once
report, under the queue's own lock, apart from what an op does against the tier
(:class:`~kvtier.objects.chunk_io.ChunkIO`, which returns an outcome and holds no queue
state), so that the rules on when a slot may be written and when an op is reported live
in one place:

- Reads (fetches) and writes (uploads) have their own bounded queues and threads
  (``threads`` is split: ceil(n/2) read, max(1, n//2) write), so a backlog of uploads
  never delays a lookup. A full read queue reports the lookup at once as ``"timeout"``
  (``reads_dropped``); a full write queue drops the upload and counts it
  (``writes_dropped``): a chunk that never reaches the tier costs a future recompute,
  whereas blocking would stall the engine.
- A lookup is a read (:meth:`OpQueue.submit_get_run`): a prompt's chunks are fetched in
  order, the first alone, the rest in parallel once the tier found it: as its read
  begins to return the payload (S3's response headers, Redis's reply length, an opened
  file), not once the payload is in. After a miss the chunks behind it are not asked
  for, so a prompt the tier lacks costs one request; a rejected chunk (a forgery) ends
  its run, those its threads took meanwhile read and reported. Where the tier's reads
  are local (a directory on a local filesystem) a ``stat`` finds the first chunk and the
  rest are queued before it is opened; and the submitting thread may read the first chunk itself
  and serve the read queue beside the I/O threads, within a budget (``inline_until``).
  While any read is in flight, Python's switch interval is short (``FetchSwitches``).
- A read still queued at its deadline (``timeout_s`` from submit) is reported as
  ``"timeout"`` at the next poll. Whether a read starts (its thread begins writing into
  the destination) or times out is one decision, taken under the op's lock, so a slot
  reported free is never written afterwards.
- A read that has begun is reported only when its backend call is over (its slot must
  not be reused under a late write). Past its deadline (for a tier that ends its reads
  by their deadline, ``bounds_reads``: a grace after it) it is *stuck*: counted
  (``reads_stuck``, :attr:`OpQueue.stuck_reads` while it lasts) and a timeout against
  the tier's health, so a tier that keeps timing out goes down and lookups fail fast.
  The caller's lookup deadline stops waiting for it; its slot stays claimed until the
  read returns. While every read thread is stuck, reads fail fast and queued ones are
  reported at once. A read that returns after its deadline counts as a timeout, never
  as the tier's recovery.
- Uploads have no deadline of their own (the tier's socket timeouts bound them): the
  caller's payload must stay untouched until the put is reported. One still in its
  backend call after ``write_stall_s`` is stuck the same way (``writes_stuck``; writes
  go down; while every write thread is stuck, queued uploads are reported failed at
  once, which releases their slots).
- Every accepted op yields exactly one :class:`~kvtier.ops.OpResult`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence

from kvtier.errors import TierError
from kvtier.objects.chunk_io import ChunkIO, Outcome
from kvtier.objects.health import Backoff, TierHealth
from kvtier.objects.io_counts import FlushReport, IOCounts
from kvtier.objects.tiers.base import ObjectTier
from kvtier.ops import OpKind, OpResult, Put
from kvtier.threads import FetchSwitches, stop_within

__all__ = ["OpQueue", "QueuedOp", "ReadQueue", "byte_view"]

#: an upload waits at most this long for the reads in flight before it starts (loads
#: before stores: a lookup waits on its reads, nobody waits on an upload, and both share
#: the link; bounded, so a steady stream of lookups slows uploads but never stops them,
#: and a write queue that fills meanwhile drops, counted in ``writes_dropped``)
UPLOAD_YIELD_S = 0.5

log = logging.getLogger("kvtier.remote")


class QueuedOp:
    """One queued op. ``lock`` + ``done`` make reporting happen exactly once."""

    __slots__ = (
        "op_id",
        "kind",
        "key",
        "buf",
        "dtype",
        "shape",
        "t0",
        "deadline",
        "lock",
        "done",
        "seq",
        "started",
        "stall_at",
        "stuck",
        "run",
        "pos",
        "queued",
        "taken",
        "first",
    )

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
        self.run: list[QueuedOp] | None = None
        self.pos = 0
        #: put on the read queue already (never twice: a get read twice at once would
        #: write its slot twice)
        self.queued = False
        #: taken off the read queue (by an I/O thread, or the submitter reading inline):
        #: set as it leaves the queue, under the queue's lock (:class:`ReadQueue`)
        self.taken = False
        #: an upload written ahead of the queued ones (a drain's hand-off: WriteQueue)
        self.first = False


class ReadQueue(queue.Queue["QueuedOp | None"]):
    """The read queue: an op is marked ``taken`` in the same step that removes it, so
    whoever sees it not taken knows it is still queued (no thread holds it unstarted)."""

    def _get(self) -> QueuedOp | None:
        op: QueuedOp | None = super()._get()
        if op is not None:
            op.taken = True
        return op


class WriteQueue(queue.Queue["QueuedOp | None"]):
    """The write queue: uploads marked ``first`` (a drain's hand-off of hot chunks) go
    ahead of the others, in the order they came among themselves."""

    def _init(self, maxsize: int) -> None:
        super()._init(maxsize)
        self._firsts = 0  # ``first`` ops at the head of the deque

    def _put(self, item: QueuedOp | None) -> None:
        if item is not None and item.first:
            self.queue.insert(self._firsts, item)
            self._firsts += 1
        else:
            self.queue.append(item)

    def _get(self) -> QueuedOp | None:
        op: QueuedOp | None = self.queue.popleft()
        if op is not None and op.first:
            self._firsts -= 1
        return op

    def put_many(self, ops: Sequence[QueuedOp]) -> int:
        """Queue as many of ``ops`` as there is room for, in order, under one lock and
        with one wake-up of the waiting threads; returns how many were queued. (A
        ``put_nowait`` per op wakes a write thread per op, and each woken thread takes the
        GIL from the engine's step: ~0.1 ms an upload on 2 cores.)"""
        with self.not_full:
            n = len(ops) if self.maxsize <= 0 else min(len(ops), self.maxsize - len(self.queue))
            for op in ops[:n]:
                self._put(op)
            self.unfinished_tasks += n
            if n:
                self.not_empty.notify(n)
        return n


def byte_view(buf: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class OpQueue:
    """Queues and I/O threads for ops whose work ``work`` does (:class:`ChunkIO`: one op,
    an :class:`~kvtier.objects.chunk_io.Outcome`); see the module docstring. Owns its
    threads (started here), deadlines, counters (:attr:`counts`) and its lock."""

    def __init__(
        self,
        tier: ObjectTier,
        work: ChunkIO,
        *,
        threads: int,
        queue_depth: int,
        timeout_s: float,
        write_stall_s: float,
        backoff: Backoff,
    ) -> None:
        if threads < 1 or queue_depth < 1 or timeout_s <= 0:
            raise ValueError("RemoteIO needs threads >= 1, queue_depth >= 1, timeout_s > 0")
        self.tier = tier
        self.work = work
        self.counts = IOCounts()
        self._lock = threading.Lock()
        self.timeout_s = timeout_s
        #: an upload still in its backend call after this long is stuck
        self.write_stall_s = write_stall_s
        self.backoff = backoff
        self._rq: queue.Queue[QueuedOp | None] = ReadQueue(maxsize=queue_depth)
        self._wq = WriteQueue(maxsize=queue_depth)
        self._results: collections.deque[OpResult] = collections.deque()
        self._writes_idle = threading.Condition(self._lock)
        self._read_done = threading.Condition(self._lock)  # a fetch was reported
        self._inflight: dict[int, QueuedOp] = {}  # reads, watched by poll() for timeouts
        self.switches = FetchSwitches()  # held while a read is in flight
        self._seq = itertools.count()
        self._pending_writes = 0
        self._puts_written = 0
        self._put_failed_kinds: collections.Counter[str] = collections.Counter()
        self._writing: dict[int, QueuedOp] = {}  # uploads in their backend call
        self._stuck = {OpKind.FETCH: 0, OpKind.UPLOAD: 0}  # started, past stall_at, not over
        self.health = TierHealth(tier.name, self.backoff)
        #: a read of a tier that ends its reads by their deadline (``bounds_reads``) is
        #: stuck only this long after it (the thread may be slow to get the CPU back)
        self.read_grace_s = max(0.25, timeout_s / 2)
        self._closed = False
        # reads get the larger half: lookups are latency-critical, uploads are not
        self.read_threads, self.write_threads = max(1, (threads + 1) // 2), max(1, threads // 2)
        self._threads: list[threading.Thread] = []
        self._start_threads()

    def _start_threads(self) -> None:
        n_read, n_write = self.read_threads, self.write_threads
        self._threads = [
            threading.Thread(target=self._worker, args=(q,), name=f"kvtier-{role}-{i}", daemon=True)
            for q, role, n in ((self._rq, "read", n_read), (self._wq, "write", n_write))
            for i in range(n)
        ]
        for t in self._threads:
            t.start()

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
        """True while uploads fail fast: for the backoff after a write failed to reach the
        tier or stalled, and while every write thread is stuck in a backend call. Not while
        the one probe after a backoff is out: an upload submitted then is queued and waits
        for the probe's report (:meth:`BackoffState.admit_waiting`); failing it at submit
        lost every chunk stored while the probe of a restarted server was out."""
        return self.health.writes.backing_off or self.stuck_writes >= self.write_threads

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
    def pending_writes(self) -> int:
        return self._pending_writes

    # -- submitting ----------------------------------------------------------------------

    def submit_get_run(
        self,
        gets: Sequence[tuple[int, str, memoryview]],
        *,
        dtype: str,
        shape: Sequence[int],
        inline_until: float = 0.0,
    ) -> None:
        """Queue fetches of one prompt's consecutive chunks ``(op_id, key, dest)``, in order.

        A lookup is a read: the first chunk is fetched at once (a missing object is a
        miss, one request for a prompt the tier does not hold); once the tier found it
        (``found``, before its payload is read: see ``ObjectTier.read_into``) the rest
        are queued and read in parallel. Where reads are local
        (``ObjectTier.reads_local``) the thread that takes the first chunk ``stat``s it
        and, when it is there, queues the rest before opening it. Either way a forged
        first chunk costs the reads the threads got to meanwhile; the submitter never
        queues the rest itself. A
        prompt can only use its chunks up to the first gap, so when one is missing or
        fails, those after it that have not started are reported as misses without
        asking (counted in ``gets_skipped``). Every get yields one result.

        With ``inline_until`` (a ``time.monotonic()``), the caller's thread reads the run's
        chunks itself, beside the I/O threads, until that time (:meth:`_read_inline`):
        only for a tier whose reads are local and fast.
        """
        run = []
        for op_id, key, dest in gets:
            view = byte_view(dest)
            if view.readonly:
                raise ValueError("submit_get_run needs writable destinations")
            run.append(
                QueuedOp(
                    next(self._seq), op_id, OpKind.FETCH, key, self.timeout_s, view, dtype, shape
                )
            )
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
            self.switches.hold(True)
        if inline_until > time.monotonic():
            self._read_inline(run, inline_until)
        else:
            self._queue_once(run[0])

    def _queue_rest_if_stored(self, first: QueuedOp) -> bool:
        """On a local tier, before the first chunk of a run is read: when a ``stat``
        finds it, queue the rest now (its read need not hold them back). Whether it did."""
        assert first.run is not None
        if not self.tier.reads_local or all(op.queued for op in first.run[1:]):
            return False
        try:
            if not self.tier.exists([first.key])[0]:
                return False
        except TierError:
            return False  # the read itself meets (and counts) the failure
        self._queue_rest(first)
        return True

    def _read_inline(self, run: list[QueuedOp], until: float) -> None:
        """Read ``run``'s first chunk on this thread (the rest queued once a ``stat`` or
        its read found it) and serve the read queue beside the I/O threads until ``until``.

        The step that submits a lookup then reports its chunks itself, with no engine
        step spent waiting for the I/O threads (its cost: that step is held up to twice
        the budget plus one chunk's read, while the engine computes nothing)."""
        hold_until = 2 * until - time.monotonic()  # the budget, and as long again to wait
        self.tier.will_read([op.key for op in run])  # a cold disk reads them all at once
        early = self._queue_rest_if_stored(run[0])
        for op in run:  # claimed: finding the first does not queue the rest (again)
            op.queued = True
        self._run_op(run[0])
        rest = [op for op in run[1:] if not op.done]  # none after a miss
        for op in rest if not early else ():
            self._enqueue_read(op)
        # serve the queue too, taking what it reads off it (no entry left holding its room)
        while time.monotonic() < until and not all(op.done or op.taken for op in rest):
            try:
                taken = self._rq.get_nowait()
            except queue.Empty:
                break
            if taken is None:  # close()'s stop request: it is for an I/O thread
                with contextlib.suppress(queue.Full):  # else a racing submit took it
                    self._rq.put_nowait(None)
                break
            self._run_op(taken)
        # what the I/O threads took meanwhile is over within a chunk's read: report it
        # in this step too, unless the disk is that slow (then in a later step)
        with self._lock:
            self._read_done.wait_for(
                lambda: all(op.done or not op.taken for op in rest),
                timeout=max(0.0, hold_until - time.monotonic()),
            )

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
        """Queue an upload (``first``: ahead of the queued ones, :class:`WriteQueue`); False
        when the write queue is full (dropped, counted, not reported)."""
        op = QueuedOp(
            next(self._seq),
            op_id,
            OpKind.UPLOAD,
            key,
            self.timeout_s,
            byte_view(payload),
            dtype,
            shape,
        )
        op.first = first
        with self._lock:
            if self._closed:
                self.counts.add("writes_dropped", 1)
                return False
            self._pending_writes += 1
        if self.writes_down:
            self._finish(op, False, "unreachable")
            return True
        try:
            self._wq.put_nowait(op)
        except queue.Full:
            self.counts.add("writes_dropped", 1)
            with self._lock:
                self._pending_writes -= 1
            return False
        return True

    def submit_puts(self, puts: Sequence[Put]) -> list[int]:
        """Queue uploads together (one step's stores: the write threads woken once);
        returns the op ids refused (a full write queue: dropped, counted, not reported)."""
        ops = [
            QueuedOp(
                next(self._seq),
                p.op_id,
                OpKind.UPLOAD,
                p.key,
                self.timeout_s,
                byte_view(p.payload),
                p.dtype,
                p.shape,
            )
            for p in puts
        ]
        with self._lock:
            if self._closed:
                self.counts.add("writes_dropped", len(ops))
                return [op.op_id for op in ops]
            self._pending_writes += len(ops)
        if self.writes_down:
            for op in ops:
                self._finish(op, False, "unreachable")
            return []
        n = self._wq.put_many(ops)
        refused = ops[n:]
        if refused:
            self.counts.add("writes_dropped", len(refused))
            with self._lock:
                self._pending_writes -= len(refused)
        return [op.op_id for op in refused]

    def _queue_once(self, op: QueuedOp) -> None:
        """Queue a get of a run unless it was queued already or reported (a miss before
        it skipped it): the submitter and the thread that found the run's first chunk
        may both try, and a get read twice at once would write its slot twice."""
        with op.lock:
            if op.done or op.queued:
                return
            op.queued = True
        self._enqueue_read(op)

    def _enqueue_read(self, op: QueuedOp) -> None:
        try:
            self._rq.put_nowait(op)
        except queue.Full:
            # more lookups queued than can finish in time: this one would time out anyway
            self.counts.add("reads_dropped", 1)
            self._finish(op, False, "timeout")

    # -- results -------------------------------------------------------------------------

    def wait_for_fetch(self, timeout_s: float) -> bool:
        """Wait until a result is ready to poll, at most ``timeout_s`` (woken by a fetch's
        report); whether one is. For a caller that only fetches and polls (a warm-up),
        instead of sleeping between polls."""
        with self._lock:
            return self._read_done.wait_for(lambda: bool(self._results), timeout=timeout_s)

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
                self.counts.add("reads_stuck" if op.kind is OpKind.FETCH else "writes_stuck", 1)
            self._stalled(op)
        if self.stuck_writes >= self.write_threads and not self._closed:
            self._fail_queued_writes()
        out: list[OpResult] = []
        while self._results:
            out.append(self._results.popleft())
        return out

    def _stalled(self, op: QueuedOp) -> None:
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
                with contextlib.suppress(queue.Full):  # else a racing submit took it
                    self._wq.put_nowait(None)
                return
            self._finish(op, False, "unreachable")

    # -- the end -------------------------------------------------------------------------

    def flush(self, timeout_s: float) -> FlushReport:
        """Wait up to ``timeout_s`` for the pending uploads; what became of each."""
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
            return FlushReport(
                pending=pending,
                written=self._puts_written - written0,
                failed=dict(failed),
                queued=self._pending_writes - writing,
                writing=writing,
                timeout_s=timeout_s,
            )

    def close(self, deadline: float) -> bool:
        """Stop the threads by ``deadline`` (``time.monotonic()``), drop what is still
        queued (counted); False when it was closed already. A thread stuck in a backend
        call is a daemon and is left behind."""
        with self._lock:
            if self._closed:
                return False
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
        self.counts.add("writes_dropped", dropped)
        with self._lock:
            self._pending_writes -= dropped
            self._writes_idle.notify_all()
            inflight = list(self._inflight.values())
            self._inflight.clear()
            self._read_done.notify_all()  # uploads yielding to reads go on
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
                "(they may or may not land)",
                writing,
                self.tier.name,
            )
        queues = [self._rq if "-read-" in t.name else self._wq for t in self._threads]
        stuck = stop_within(self._threads, queues, deadline)
        if stuck:
            log.warning(
                "closing object-tier I/O: %d I/O threads are still in a %s call; not waiting",
                stuck,
                self.tier.name,
            )
        return True

    # -- I/O threads ---------------------------------------------------------------------

    def _worker(self, q: queue.Queue[QueuedOp | None]) -> None:
        while True:
            op = q.get()
            if op is None:
                return
            if op.kind is OpKind.UPLOAD:
                self._yield_to_reads()
            self._run_op(op, BaseException)  # a bug must cost one op, not the I/O thread

    def _yield_to_reads(self) -> None:
        """Loads before stores: wait (at most ``UPLOAD_YIELD_S``) until no read is in
        flight, so an upload does not take the link from a lookup that waits on it."""
        with self._lock:
            if self._inflight and not self._closed:
                self.counts.add("writes_yielded", 1)
                self._read_done.wait_for(
                    lambda: not self._inflight or self._closed, timeout=UPLOAD_YIELD_S
                )

    def _run_op(self, op: QueuedOp, catch: type[BaseException] = Exception) -> None:
        """:meth:`_execute`, a bug costing one op: on an I/O thread anything it raises; on
        the caller's thread (inline reads) not an interrupt or exit meant for the engine."""
        try:
            self._execute(op)
        except catch:
            log.exception("object-tier %s op failed unexpectedly", op.kind)
            self._finish(op, False, "tier")

    def _execute(self, op: QueuedOp) -> None:
        """Run ``op``'s work and :meth:`_finish` it (on an I/O thread, or inline)."""
        if op.done:  # timed out (or closed) while queued: do not touch the network
            return
        write = op.kind is OpKind.UPLOAD
        stuck = (
            self.stuck_writes >= self.write_threads
            if write
            else (self.stuck_reads >= self.read_threads)
        )
        health = self.health.of(write)
        # after a backoff: one op, the probe; an upload behind it waits for its report
        probe = (
            None
            if stuck
            else (health.admit_waiting(self.write_stall_s) if write else health.admit())
        )
        if probe is None:
            self._finish(op, False, "unreachable")
            return
        try:
            self._start(op, write)
        finally:
            health.probe_over(probe)

    def _start(self, op: QueuedOp, write: bool) -> None:
        # start or time out: one decision, under the lock poll() decides timeouts under;
        # once started, a get reads straight into its slot and reports only when the read
        # is over, so the slot cannot be reused under a late write
        with op.lock:
            # reported, closed while being picked up, or (were it ever queued twice) started
            # by another thread: a get read twice at once would write its slot twice
            if op.done or op.buf is None or op.started:
                return
            key, buf, now = op.key, op.buf, time.monotonic()
            late = not write and now > op.deadline
            if not late:
                op.started = True
                if write:
                    op.stall_at = now + self.write_stall_s
                    with self._lock:
                        self._writing[op.seq] = op
                elif self.tier.bounds_reads:
                    # the tier ends the read by its deadline: only a read still in its
                    # call well after that is stuck (not one a busy machine reports late)
                    op.stall_at = op.deadline + self.read_grace_s
        if late:
            self._finish(op, False, "timeout")
            return
        if write:
            out = self.work.put(key, buf, dtype=op.dtype, shape=op.shape)
        else:
            found = None
            if op.pos == 0 and op.run is not None and not self._queue_rest_if_stored(op):
                found = functools.partial(self._queue_rest, op)  # once the tier knows it is there
            # a tier that can hold every wait of the read to its deadline is told it
            deadline = op.deadline if self.tier.bounds_reads else None
            out = self.work.get(
                key, buf, dtype=op.dtype, shape=op.shape, deadline=deadline, found=found
            )
        self._apply(op, write, out)
        self._finish(op, out.ok, out.error_kind, nbytes=out.nbytes)

    def _apply(self, op: QueuedOp, write: bool, out: Outcome) -> None:
        """What ``op``'s outcome tells the tier's health and the counters."""
        if out.unreachable is not None:
            self.health.failed(write, out.unreachable)
        if out.answered_at is not None:
            # up again, unless it answered too late (then that is a timeout, once per op:
            # a tier that answers only after the deadline stays down, however it answers)
            if out.answered_at <= op.stall_at:
                self.health.succeeded(write)
            elif not op.stuck:  # poll() counted it already when it saw it stuck
                self._stalled(op)
        if out.bytes_read:
            self.counts.add("bytes_read", out.bytes_read)
        if out.bytes_written:
            self.counts.add("bytes_written", out.bytes_written)
        if out.existing:
            self.counts.add("puts_existing", 1)
        if out.z is not None:
            self.counts.count_z(*out.z)

    def _finish(
        self,
        op: QueuedOp,
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
        if op.run is not None and ok and op.pos == 0:
            self._queue_rest(op)  # (done already where the tier said it found it)

    def _queue_rest(self, first: QueuedOp) -> None:
        """The run's first chunk is stored: queue the rest, to be read in parallel."""
        assert first.run is not None
        for later in first.run[1:]:
            self._queue_once(later)

    def _skip_after(self, op: QueuedOp) -> None:
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
            self.counts.add("gets_skipped", skipped)

    def _report(
        self,
        op: QueuedOp,
        ok: bool,
        error_kind: str | None,
        nbytes: int,
        *,
        counted: bool = True,
    ) -> None:
        """Publish the result; the caller holds ``op.lock``. ``counted=False``: an op
        that never reached the tier (not in ``ops_*``). ``done`` is set under the queue's
        lock with the result's publication: a submitter waiting for its run's chunks
        (``_read_done``) that sees one done finds its result in the next poll."""
        op.buf = None
        result = OpResult(op.op_id, op.kind, ok, time.monotonic() - op.t0, nbytes, error_kind)
        with self._lock:
            op.done = True
            if counted:
                self.counts.add("ops_" + op.kind, 1)
            if error_kind is not None:
                self.counts.add("errors_" + error_kind, 1)
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
                self.switches.hold(bool(self._inflight))
            self._results.append(result)  # before a waiter for this fetch wakes up
            if op.kind is OpKind.FETCH:
                self._read_done.notify_all()
