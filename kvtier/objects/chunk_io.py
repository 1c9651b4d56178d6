"""One object-tier op against the tier, on an I/O thread: :class:`ChunkIO`.

A fetch reads a chunk and verifies it into its slot; an upload compresses, frames,
seals, signs and puts one. Kept apart from the queues and the reporting
(:mod:`kvtier.objects.io_queue`): this is what an op does once it may start, and how
each failure maps to an error kind and to the tier's health:

- An upload whose object already exists under its key is not written again
  (``puts_existing``): the key names the chunk's content, and with an encryption key
  every write spends one of the key's random nonces. A key whose last fetch was
  rejected (corrupt, forged, sealed for another key, oversize) is written again, which
  repairs it.
- A connection-level failure (``TierUnavailable``) marks that direction (reads:
  fetches; writes: uploads) down for ``backoff.compute(n)`` seconds; until then its ops
  fail fast as ``"unreachable"`` without touching the network. After that one op (the
  probe) is a real attempt while the others still fail fast; its success clears the
  state, its failure backs off again. Reads and writes back off separately: a store
  that refuses writes must not stop hits. A fetch runs within its deadline
  (``policy.call_deadline``), which a tier that ``bounds_reads`` holds every wait to.
- One node of a cluster failing (kind ``"node"``) is that chunk's miss and that node's
  health (the tier keeps it), neither a failure nor a success of the tier.
- A failure of one object (``ObjectError``: a full disk on write, a Redis key of the
  wrong type, a planted FIFO) is that op's miss, counted as ``"object"``; the tier stays
  up. A fetch never reads more than the codec's largest header plus the slot: a bigger
  object is refused unread, counted as ``"oversize"``.
- With a compressor (``compression: lossless``) an upload is compressed, then framed,
  sealed and signed, all on its write thread; a fetch reads the whole object (one
  bounded ``get_into``) into a per-read-thread scratch buffer, verifies it there and
  decompresses it into the slot. Without one, or with ``auto`` while it stores raw, a
  fetch reads straight into the slot; an object too short for that (a compressed chunk)
  is read again whole and decompressed the same way, so every engine reads both. Bytes
  before and after compression and the seconds spent are counted
  (``take_compression``); ``auto`` also gets each read's time (``observe_read``).
"""

from __future__ import annotations

import collections
import functools
import time

from kvtier.errors import CodecError, ObjectError, TierError, TierUnavailable, TruncatedError
from kvtier.objects import codec, compress
from kvtier.objects.health import Backoff, RateLimitedLog
from kvtier.objects.io_counts import ERROR_KINDS
from kvtier.objects.io_queue import OpQueue, QueuedOp
from kvtier.objects.tiers.base import Found, ObjectTier
from kvtier.objects.tiers.policy import call_deadline
from kvtier.ops import OpKind

__all__ = ["MAX_FRAME", "REWRITE_KEYS", "ChunkIO"]

#: what a stored chunk may add to its slot's bytes: magic, header length, the largest header
MAX_FRAME = len(codec.MAGIC) + 4 + codec.MAX_HEADER
#: keys whose last fetch was rejected, remembered so that their next upload rewrites them
REWRITE_KEYS = 4096


class ChunkIO(OpQueue):
    """Executes the queued ops (:meth:`_execute`); see the module docstring."""

    def __init__(
        self,
        tier: ObjectTier,
        *,
        threads: int,
        queue_depth: int,
        timeout_s: float,
        write_stall_s: float,
        backoff: Backoff,
        signer: codec.Signer | None,
        compressor: compress.ChunkCompressor | None,
    ) -> None:
        super().__init__(tier, threads=threads, queue_depth=queue_depth, timeout_s=timeout_s,
                         write_stall_s=write_stall_s, backoff=backoff)  # fmt: skip
        self.signer = signer
        #: compresses uploads (``compression: lossless``, ``fp8``, or ``auto``: where reads
        #: are faster so); None: stored raw
        self.compressor = compressor
        #: fp8 chunks are read only by an engine that chose them: other engines' hits
        #: stay exact
        self.reads_lossy = isinstance(compressor, compress.Fp8Compressor)
        #: a read thread's buffer for compressed objects, reused (compress.ThreadScratch)
        self._scratch = compress.ThreadScratch()
        #: keys whose last fetch was rejected: their next upload rewrites the object
        self._rewrite: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._data_log = RateLimitedLog()
        self._object_log = RateLimitedLog()

    def _execute(self, op: QueuedOp) -> None:
        if op.done:  # timed out (or closed) while queued: do not touch the network
            return
        write = op.kind is OpKind.UPLOAD
        stuck = self.stuck_writes >= self.write_threads if write else (
            self.stuck_reads >= self.read_threads)  # fmt: skip
        health = self.health.of(write)
        probe = None if stuck else health.admit()  # after a backoff: one op, the probe
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
        try:
            if write:
                self._put(op, key, buf)
            else:
                # a tier that can hold every wait of the read to its deadline is told it
                with call_deadline(op.deadline if self.tier.bounds_reads else None):
                    self._get(op, key, buf)
        except CodecError as exc:
            self._data_log.warning("object-tier chunk rejected (%s): %s", exc.kind, exc)
            if not write:
                self._remember_rewrite(key)
            self._finish(op, False, exc.kind)
        except TierUnavailable as exc:
            self.health.failed(write, exc)
            self._finish(op, False, "unreachable")
        except TierError as exc:  # one object (or one node of a cluster) failed
            if exc.kind != "node":  # the tier answered, so it is up; a node's failure is
                self._answered(op)  # that node's (the tier keeps its health per node)
            self._object_log.warning("object tier %s: %s failed: %s", self.tier.name, op.kind, exc)
            if not write and isinstance(exc, ObjectError):
                self._remember_rewrite(key)
            self._finish(op, False, exc.kind if exc.kind in ERROR_KINDS else "tier")

    def _get(self, op: QueuedOp, key: str, buf: memoryview) -> None:
        """The read path of a started fetch: read, verify into the slot, report."""
        t0 = time.perf_counter()
        found = None
        if op.pos == 0 and op.run is not None and not self._queue_rest_if_stored(op):
            found = functools.partial(self._queue_rest, op)  # once the tier knows it is there
        got = self._read(key, buf, found)
        self._answered(op)
        if got is None:
            self._finish(op, False, None)
            return
        head, payload, crc = got
        nread = len(head) + payload.nbytes
        self._add("bytes_read", nread)
        # a compressed chunk is verified as stored, in the scratch buffer, then
        # decompressed into the slot; one read into the slot is never decompressed
        secs = codec.verify(head, payload, key=key, dtype=op.dtype, shape=op.shape,
                            signer=self.signer,
                            out=None if payload is buf else buf,
                            lossy=self.reads_lossy, payload_crc=crc)  # fmt: skip
        self._count_z("read", buf.nbytes, payload.nbytes, secs)
        if self.compressor is not None:  # the whole read, timed for compression: auto
            self.compressor.observe_read(buf.nbytes, time.perf_counter() - t0,
                                         codec.is_compressed(head))  # fmt: skip
        self._finish(op, True, None, nbytes=nread)

    def _put(self, op: QueuedOp, key: str, buf: memoryview) -> None:
        """The write path of a started upload: compress, encode, put, report."""
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
        if self.compressor is not None:  # the write path's one compression step
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

    def _read(
        self, key: str, slot: memoryview, found: Found = None
    ) -> tuple[bytes, memoryview, int | None] | None:
        """Read ``key`` for ``slot``: (head, payload, the payload's CRC-32 if it was
        computed while read), None when it is not stored; ``found`` as the tier's reads
        take it (:data:`~kvtier.objects.tiers.base.Found`).

        Without a compressor, or with one that stores raw now (``auto``), the object is
        read straight into the slot (the payload is ``slot``), checksummed as it lands unless
        an encryption key is configured (sealed chunks carry no checksum). Otherwise, or when the
        object is too short for that (compressed), it is read whole into this thread's
        scratch buffer, at most the slot plus the largest header: a compressed payload
        stays there (verified, opened in place with an encryption key, then decompressed
        into the slot), a raw one is copied into the slot.
        """
        if self.compressor is None or self.compressor.reads_raw_first:
            try:
                if self.signer is not None and self.signer.sealer is not None:
                    head = self.tier.read_into(key, slot, MAX_FRAME, found=found)
                    return None if head is None else (head, slot, None)
                hashed = self.tier.read_into_hashed(key, slot, MAX_FRAME, found=found)
            except TruncatedError:
                pass  # shorter than a raw chunk: perhaps a compressed one; read it whole
            else:
                return None if hashed is None else (hashed[0], slot, hashed[1])
        whole = self._scratch.view(slot.nbytes + MAX_FRAME)
        n = self.tier.get_into(key, whole)
        if n is None:
            return None
        view = whole[:n]
        body_at = codec.head_length(view[:8])
        if view.nbytes < body_at:
            raise TruncatedError(f"chunk of {view.nbytes} bytes ends inside its header")
        head, payload = bytes(view[:body_at]), view[body_at:]
        if not codec.is_compressed(head):
            if payload.nbytes != slot.nbytes:
                raise TruncatedError(f"chunk payload has {payload.nbytes} bytes, its slot "
                                     f"{slot.nbytes}")  # fmt: skip
            slot[:] = payload
            return head, slot, None
        return head, payload, None  # in the scratch buffer: a sealed chunk opens in place there

    def _answered(self, op: QueuedOp) -> None:
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
