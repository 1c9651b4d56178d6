"""The shared count of a bounded directory tier: a small file at the root
(:data:`LEDGER_NAME`) holding one byte count per fan-out directory, which every engine
writing into the directory keeps under ``flock`` (:class:`DirectoryLedger`), so
``file_max_bytes`` holds for the directory, not for each engine. Its sweep
(:class:`~kvtier.objects.tiers.file_sweep.DirectorySweep`) owns it."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import stat
import struct
import threading

__all__ = ["LEDGER_BYTES", "LEDGER_NAME", "DirectoryLedger"]

log = logging.getLogger("kvtier.tiers.file")

#: the shared count of a bounded directory (:class:`DirectoryLedger`), at the root: never
#: listed, counted as an object, evicted or removed (only the fan-out directories hold
#: objects)
LEDGER_NAME = ".kvtier-usage"
_LEDGER_MAGIC = b"KVTU"
_LEDGER_VERSION = 1
#: magic, version (u32), complete scans (u64), the layout's random id (u64), then one
#: int64 per fan-out directory
_LEDGER_HEAD = struct.Struct("<4sIQQ")
_LEDGER_SLOTS = struct.Struct("<256q")
_SLOT = struct.Struct("<q")
#: the ledger's size: bookkeeping, like the lock file and the directories themselves,
#: outside the bound (which counts the objects and the temp files of writes in flight)
LEDGER_BYTES = _LEDGER_HEAD.size + _LEDGER_SLOTS.size
#: the most one fan-out directory's count may be (4 PiB; 1 EiB for all 256): anyone who
#: can write the directory can write the ledger, so a count outside 0..this (negative,
#: INT64 extremes that sum to a small total, past any disk) is no count: the ledger is
#: laid out afresh and the next scan counts the directory again
_LEDGER_MAX_COUNT = 1 << 52


class DirectoryLedger:
    """What a bounded directory holds, shared by every engine writing into it: a small
    file at the root (:data:`LEDGER_NAME`) holding one byte count per fan-out
    directory, read and changed under ``flock`` on it.

    Every change to a fan-out directory's bytes is made together with its count, under
    the lock: a write's temp file is created at its full size (+bytes), renamed over
    what it replaces (-the bytes replaced) or removed when it fails (-bytes); an
    eviction or a delete unlinks (-bytes). A scan counts a fan-out directory under the
    lock too and sets its count to what it found, so the count is exact whenever the
    lock is free, writes in flight included, and a crash between a change and its count
    (or a writer that does not keep the ledger) is made good by the next scan of that
    directory. Each change is a ``flock``, a ``pread`` of 2 KiB and a ``pwrite`` of 8
    bytes. Nothing read is trusted: a file of another size or layout, or a count outside
    ``0.._LEDGER_MAX_COUNT``, is laid out afresh (no count until the next scan). Raises
    OSError (or, on a bug, anything else): the caller falls back to counting its own
    writes. ``create``: False for a tool that only keeps a ledger the engines made
    (FileNotFoundError when there is none)."""

    def __init__(self, root: str, *, create: bool = True) -> None:
        # group-writable (less the umask): every engine of the group keeps the count;
        # it holds counts, no KV
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        fd = os.open(os.path.join(root, LEDGER_NAME), flags, 0o660)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                self.fd = fd
                #: whether counts out of range were logged (once per engine: a hostile
                #: writer could rewrite them before every write)
                self._warned = False
                self._read()  # a new (or foreign) file is laid out afresh
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            raise
        #: one thread of this process at a time holds the flock (every thread shares the
        #: fd, and a flock belongs to the open file, not to a thread)
        self._mutex = threading.RLock()
        self._depth = 0

    def acquire(self) -> None:
        """Lock the ledger for this thread (nests); raises OSError when it cannot."""
        self._mutex.acquire()
        try:
            if self.fd < 0:
                raise OSError(errno.EBADF, "ledger closed")
            if self._depth == 0:
                fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            self._mutex.release()
            raise
        self._depth += 1

    def release(self) -> None:
        self._depth -= 1
        try:
            if self._depth == 0 and self.fd >= 0:  # closed meanwhile: that released it
                fcntl.flock(self.fd, fcntl.LOCK_UN)
        except OSError:
            pass  # closing the fd releases it
        finally:
            self._mutex.release()

    def _read(self) -> tuple[int, int, tuple[int, ...]]:
        """The complete scans counted, the layout's id and the counts (held); a file of
        another size or layout (new, torn, foreign) or with a count out of range
        (:data:`_LEDGER_MAX_COUNT`) is laid out afresh: no scan yet."""
        data = os.pread(self.fd, LEDGER_BYTES + 1, 0)
        if len(data) == LEDGER_BYTES:
            magic, version, scans, layout = _LEDGER_HEAD.unpack_from(data)
            if magic == _LEDGER_MAGIC and version == _LEDGER_VERSION:
                counts = _LEDGER_SLOTS.unpack_from(data, _LEDGER_HEAD.size)
                if min(counts) >= 0 and max(counts) <= _LEDGER_MAX_COUNT:
                    return scans, layout, counts
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "%s: counts out of range (%d..%d; written by something other than "
                        "kvtier?): laid out afresh, and counted again by the next scan",
                        LEDGER_NAME,
                        min(counts),
                        max(counts),
                    )
        return self._fresh()

    def _fresh(self) -> tuple[int, int, tuple[int, ...]]:
        """Lay the file out afresh (held): zero counts, no scan, a new layout id."""
        zeros = (0,) * 256
        layout = secrets.randbits(64)
        fresh = _LEDGER_HEAD.pack(_LEDGER_MAGIC, _LEDGER_VERSION, 0, layout)
        os.ftruncate(self.fd, LEDGER_BYTES)
        if os.pwrite(self.fd, fresh + _LEDGER_SLOTS.pack(*zeros), 0) != LEDGER_BYTES:
            raise OSError(errno.EIO, "short write")
        return 0, layout, zeros

    def layout(self) -> int:
        """The layout's id (held): a scan counts as complete only if it is unchanged."""
        return self._read()[1]

    def total(self) -> int | None:
        """What the fan-out directories hold (held); None before the first complete scan
        of any engine."""
        scans, _, counts = self._read()
        return sum(counts) if scans else None

    def add(self, sub: str, delta: int) -> None:
        """``sub``'s count moves by ``delta`` (held): read, and checked, with the whole
        file (a torn or hostile one is laid out afresh first); a count that would leave
        the range lays it out afresh too (unknown until the next scan)."""
        if delta:
            slot = int(sub, 16)
            count = self._read()[2][slot] + delta
            if count > _LEDGER_MAX_COUNT:
                self._fresh()
                return
            os.pwrite(self.fd, _SLOT.pack(max(0, count)), _LEDGER_HEAD.size + _SLOT.size * slot)

    def set(self, sub: str, count: int) -> None:
        """``sub``'s count is ``count`` (held: a scan of ``sub`` found it). A file laid
        out afresh meanwhile (no scan counted) is counted by the scan's end."""
        count = min(max(0, count), _LEDGER_MAX_COUNT)
        os.pwrite(self.fd, _SLOT.pack(count), _LEDGER_HEAD.size + _SLOT.size * int(sub, 16))

    def scanned(self, layout: int) -> None:
        """A complete scan set every count (held), unless the file was laid out afresh
        (torn or foreign) while it ran (``layout``: the id at its start): then the
        counts it set before are gone."""
        scans, now, _ = self._read()
        if now == layout:
            os.pwrite(
                self.fd, _LEDGER_HEAD.pack(_LEDGER_MAGIC, _LEDGER_VERSION, scans + 1, layout), 0
            )

    def close(self) -> None:
        """Close the file, unless a thread stuck on a hung mount still holds it."""
        if self._mutex.acquire(timeout=1.0):
            try:
                if self.fd >= 0:
                    os.close(self.fd)
                    self.fd = -1
            finally:
                self._mutex.release()
