"""One object-tier op's work against the tier, on an I/O thread: :class:`ChunkIO`.

A fetch reads a chunk and verifies it into its slot; an upload compresses, frames,
seals, signs and puts one. Each returns an :class:`Outcome` (the op's result, what to
count, whether and when the tier answered) and holds no queue state: the queue
(:mod:`kvtier.objects.io_queue`) decides when an op may start, applies the outcome to
the tier's health and counters, and reports it. How each failure maps to an error kind
and to the tier's health:

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
import threading
import time
from dataclasses import dataclass

from kvtier.errors import CodecError, ObjectError, TierError, TierUnavailable, TruncatedError
from kvtier.objects import codec, compress
from kvtier.objects.health import RateLimitedLog
from kvtier.objects.io_counts import ERROR_KINDS
from kvtier.objects.tiers.base import Found, ObjectTier
from kvtier.objects.tiers.policy import call_deadline

__all__ = ["MAX_FRAME", "REWRITE_KEYS", "ChunkIO", "Outcome"]

#: what a stored chunk may add to its slot's bytes: magic, header length, the largest header
MAX_FRAME = len(codec.MAGIC) + 4 + codec.MAX_HEADER
#: keys whose last fetch was rejected, remembered so that their next upload rewrites them
REWRITE_KEYS = 4096


@dataclass(slots=True)
class Outcome:
    """What one op's work came to: its result (``ok``, ``error_kind``, ``nbytes`` as
    reported) and what the queue counts and tells the tier's health."""

    ok: bool
    error_kind: str | None = None
    nbytes: int = 0
    #: ``time.monotonic()`` when the tier answered the op's call (up again, unless that
    #: was past the op's deadline); None: it did not answer (or a cluster node failed)
    answered_at: float | None = None
    #: the connection-level failure that makes its direction back off
    unreachable: TierUnavailable | None = None
    #: bytes read from or written to the tier (counted even when the read is rejected)
    bytes_read: int = 0
    bytes_written: int = 0
    #: an upload whose object was there already (not written again)
    existing: bool = False
    #: (direction, KV bytes, bytes as stored, seconds (de)compressing)
    z: tuple[str, int, int, float] | None = None


class ChunkIO:
    """Reads and writes single chunks against ``tier`` (:meth:`get`, :meth:`put`); see the
    module docstring. Thread-safe: its only state is the keys to rewrite, under its lock."""

    def __init__(
        self,
        tier: ObjectTier,
        *,
        signer: codec.Signer | None,
        compressor: compress.ChunkCompressor | None,
    ) -> None:
        self.tier = tier
        self.signer = signer
        #: compresses uploads (``compression: lossless``, ``fp8``, or ``auto``: where reads
        #: are faster so); None: stored raw
        self.compressor = compressor
        #: fp8 chunks are read only by an engine that chose them: other engines' hits
        #: stay exact
        self.reads_lossy = isinstance(compressor, compress.Fp8Compressor)
        #: a read thread's buffer for compressed objects, reused (compress.ThreadScratch)
        self.scratch = compress.ThreadScratch()
        #: keys whose last fetch was rejected: their next upload rewrites the object
        self._rewrite: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._rewrite_lock = threading.Lock()
        self._data_log = RateLimitedLog()
        self._object_log = RateLimitedLog()

    def get(
        self,
        key: str,
        buf: memoryview,
        *,
        dtype: str,
        shape: list[int],
        deadline: float | None,
        found: Found = None,
    ) -> Outcome:
        """Fetch ``key`` into ``buf``, verified; ``deadline``: the one a tier that
        ``bounds_reads`` holds every wait of the read to; ``found``: as the tier's reads
        take it."""
        out = Outcome(False)
        try:
            with call_deadline(deadline):
                self._get(key, buf, dtype, shape, found, out)
        except Exception as exc:
            self._failed(exc, key, False, out)
        return out

    def put(self, key: str, buf: memoryview, *, dtype: str, shape: list[int]) -> Outcome:
        """Compress, encode and store ``buf`` under ``key`` (unless it is there already)."""
        out = Outcome(False)
        try:
            self._put(key, buf, dtype, shape, out)
        except Exception as exc:
            self._failed(exc, key, True, out)
        return out

    def _failed(self, exc: Exception, key: str, write: bool, out: Outcome) -> None:
        """``exc`` as the op's outcome; anything but a kvtier error (a bug) is raised."""
        op = "upload" if write else "fetch"
        if isinstance(exc, CodecError):
            self._data_log.warning("object-tier chunk rejected (%s): %s", exc.kind, exc)
            if not write:
                self._remember_rewrite(key)
            out.ok, out.error_kind = False, exc.kind
        elif isinstance(exc, TierUnavailable):
            out.ok, out.error_kind, out.unreachable = False, "unreachable", exc
        elif isinstance(exc, TierError):  # one object (or one node of a cluster) failed
            if exc.kind != "node" and out.answered_at is None:  # the tier answered, so it
                out.answered_at = time.monotonic()  # is up; a node's failure is that node's
            self._object_log.warning("object tier %s: %s failed: %s", self.tier.name, op, exc)
            if not write and isinstance(exc, ObjectError):
                self._remember_rewrite(key)
            out.ok, out.error_kind = False, exc.kind if exc.kind in ERROR_KINDS else "tier"
        else:
            raise exc

    def _get(
        self,
        key: str,
        buf: memoryview,
        dtype: str,
        shape: list[int],
        found: Found,
        out: Outcome,
    ) -> None:
        """The read path of a started fetch: read, verify into the slot."""
        t0 = time.perf_counter()
        got = self._read(key, buf, found)
        out.answered_at = time.monotonic()
        if got is None:
            return  # a miss
        head, payload, crc = got
        nread = len(head) + payload.nbytes
        out.bytes_read = nread
        # a compressed chunk is verified as stored, in the scratch buffer, then
        # decompressed into the slot; one read into the slot is never decompressed
        secs = codec.verify(
            head,
            payload,
            key=key,
            dtype=dtype,
            shape=shape,
            signer=self.signer,
            out=None if payload is buf else buf,
            lossy=self.reads_lossy,
            payload_crc=crc,
        )
        out.z = ("read", buf.nbytes, payload.nbytes, secs)
        if self.compressor is not None:  # the whole read, timed for compression: auto
            self.compressor.observe_read(
                buf.nbytes, time.perf_counter() - t0, codec.is_compressed(head)
            )
        out.ok, out.nbytes = True, nread

    def _put(self, key: str, buf: memoryview, dtype: str, shape: list[int], out: Outcome) -> None:
        """The write path of a started upload: compress, encode, put."""
        with self._rewrite_lock:
            rewrite = key in self._rewrite
        # the key names the chunk: an object already there is this chunk, and
        # writing it again would spend one of the encryption key's nonces
        if not rewrite and self.tier.exists([key])[0]:
            out.answered_at = time.monotonic()
            out.ok = out.existing = True
            return
        z: tuple[str, bytes] | None = None
        secs = 0.0
        zgot = None
        if self.compressor is not None:  # the write path's one compression step
            zgot = self.compressor.compress_chunk(buf, dtype)
        if zgot is not None:
            z, secs = (zgot[0], zgot[1]), zgot[2]
        parts = codec.encode(key, buf, dtype=dtype, shape=shape, signer=self.signer, compressed=z)
        self.tier.put(key, parts)
        out.answered_at = time.monotonic()
        n = codec.encoded_size(parts)
        # only a compressed frame is shorter than the raw payload alone
        stored = memoryview(parts[-1]).nbytes if n < buf.nbytes else buf.nbytes
        out.z = ("write", buf.nbytes, stored, secs)
        out.bytes_written = n
        with self._rewrite_lock:
            self._rewrite.pop(key, None)
        out.ok, out.nbytes = True, n

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
        whole = self.scratch.view(slot.nbytes + MAX_FRAME)
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
                raise TruncatedError(
                    f"chunk payload has {payload.nbytes} bytes, its slot {slot.nbytes}"
                )
            slot[:] = payload
            return head, slot, None
        return head, payload, None  # in the scratch buffer: a sealed chunk opens in place there

    def _remember_rewrite(self, key: str) -> None:
        """A fetch of ``key`` was rejected: the next upload of it writes it again."""
        with self._rewrite_lock:
            self._rewrite[key] = None
            self._rewrite.move_to_end(key)
            while len(self._rewrite) > REWRITE_KEYS:
                self._rewrite.popitem(last=False)
