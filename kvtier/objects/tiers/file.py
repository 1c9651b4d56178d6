"""Object tier on a directory: a local disk, or NFS/shared storage mounted on every node.

One module for the directory tier: its layout (fan-out directories, temp files, the
flags every directory is opened with), the read and write path (:class:`FileTier`), the
bound on its size (:class:`DirectorySweep`, which the tier owns and runs on a
background thread: a read never sweeps), and whether the directory is on a local
filesystem (:func:`is_local`: reads the worker makes itself hold up its step, so kvtier
does them only where a read is known to be local and fast: a directory whose mount is of
a filesystem type in :data:`LOCAL_TYPES`. Anything else, NFS, CIFS, Ceph, Lustre, a FUSE
mount such as s3fs or gcsfuse, a mount table that cannot be read, is treated as remote,
and its reads stay on the I/O threads).

The sweep's state lives in the files themselves (sizes, mtimes a hit refreshes), so the
bound survives restarts; a lock file keeps engines sharing the directory from sweeping at
once, and a small ledger beside it (:class:`_Ledger`) holds the directory's byte count
that all of them keep, so the bound holds for the directory, not for each engine.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import hashlib
import logging
import os
import secrets
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import quote

import xxhash

from kvtier.errors import ObjectError, ObjectTooLarge, TierError, TierUnavailable, TruncatedError
from kvtier.keys import GENERATION_PREFIX
from kvtier.objects import codec
from kvtier.objects.tiers.base import Found, Parts, SlotReader, byte_view, head_length_for

__all__ = [
    "LOCAL_TYPES", "DirectorySweep", "FileTier", "SweepStats", "filesystem_type", "is_local",
]  # fmt: skip

log = logging.getLogger("kvtier.tiers.file")

_MAX_NAME = 200  # below every common filesystem's 255-byte name limit
#: errors of the file system or its mount rather than of one file: RemoteIO backs off on
#: these; every other OSError (ENOSPC, EACCES, ELOOP from a symlink, ESTALE: NFS says the
#: file another node deleted or replaced is gone ...) is one object's miss
_TIER_ERRNOS = frozenset({
    errno.EIO, errno.ENOTCONN, errno.ETIMEDOUT, errno.EHOSTDOWN,
    errno.EHOSTUNREACH, errno.ENETDOWN, errno.ENETUNREACH, errno.ECONNREFUSED,
    errno.ECONNRESET, errno.ENODEV, errno.EROFS, errno.ESHUTDOWN,
})  # fmt: skip
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
#: ``link`` refused by a filesystem without hard links (FAT, some FUSE and object mounts)
_NO_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK})
# O_NOFOLLOW: a symlink planted at a chunk's name is refused, not followed. O_NONBLOCK: a FIFO
# planted there opens at once (and is refused by fstat) instead of blocking an I/O thread.
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: a read that fails rather than wait for the device (Linux; None elsewhere)
_RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
_OPEN_TMP = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: a hit refreshes a file's mtime at most this often: LRU needs minutes, not a write per hit
_TOUCH_AFTER_S = 60.0
_TMP_PREFIX = ".tmp-"
#: the end of a generation manifest's file name (``gen-<id>/manifest`` quoted by _place;
#: kvtier.objects.manifest.MANIFEST, which imports this package)
_MANIFEST_SUFFIX = "%2Fmanifest"
#: the most objects a scan keeps in eviction order for the writes
_MAX_CANDIDATES = 1 << 16
_LOCK_NAME = ".sweep.lock"
#: the shared count of a bounded directory (:class:`_Ledger`), at the root: never listed,
#: counted as an object, evicted or removed (only the fan-out directories hold objects)
_LEDGER_NAME = ".kvtier-usage"
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
#: the fan-out directories, in the ledger's slot order
_FANOUT = [f"{i:02x}" for i in range(256)]
#: the root (the operator's path: a symlink there is theirs, and followed)
_OPEN_ROOT = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
#: a fan-out directory, opened relative to the root's fd: O_NOFOLLOW refuses a symlink
#: planted at its name (ELOOP) and O_DIRECTORY anything else that is not a directory, so
#: every object is opened, created, renamed and unlinked relative to a directory that is
#: really under the root, whatever the path looks like a moment later (no check-then-use)
_OPEN_SUBDIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_HEX = frozenset("0123456789abcdef")

#: filesystem types whose reads are served by this machine's own disks or memory
LOCAL_TYPES = frozenset({
    "ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "jfs", "reiserfs",
    "tmpfs", "ramfs", "overlay", "vfat", "exfat", "ntfs3",
})  # fmt: skip

_MOUNTINFO = "/proc/self/mountinfo"


@dataclass(slots=True)
class SweepStats:
    """What one :meth:`FileTier.sweep` did (``skipped``: another engine was sweeping)."""

    skipped: bool = False
    total_bytes: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    temp_removed: int = 0
    #: fan-out names that are not directories (a symlink aiming writes out of the root, a
    #: file): never followed, never counted, never written through; logged
    foreign: int = 0


class _Ledger:
    """What a bounded directory holds, shared by every engine writing into it: a small
    file at the root (:data:`_LEDGER_NAME`) holding one byte count per fan-out
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
        fd = os.open(os.path.join(root, _LEDGER_NAME), flags, 0o660)
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
                        _LEDGER_NAME, min(counts), max(counts),
                    )  # fmt: skip
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
            os.pwrite(self.fd, _LEDGER_HEAD.pack(_LEDGER_MAGIC, _LEDGER_VERSION, scans + 1,
                                                 layout), 0)  # fmt: skip

    def close(self) -> None:
        """Close the file, unless a thread stuck on a hung mount still holds it."""
        if self._mutex.acquire(timeout=1.0):
            try:
                if self.fd >= 0:
                    os.close(self.fd)
                    self.fd = -1
            finally:
                self._mutex.release()


class DirectorySweep:
    """The bound on a :class:`FileTier`'s directory: least recently used objects (oldest
    mtime) deleted down to ``low_water`` of ``max_bytes``, stale temp files removed,
    bounded or not.

    The bound is kept on the write path (``bound_writes``): the tier asks
    :meth:`admit` before each write, which counts the write's bytes against what the
    directory holds (the last scan's total, plus every byte admitted since) and, when
    that passes ``max_bytes``, deletes the oldest objects the last scan saw (a few
    unlinks; a full scan when it saw too few) on the writing thread before the write
    starts.

    Engines sharing the directory (replicas, tensor-parallel workers) keep one count
    (:class:`_Ledger`, where the mount has ``flock``): each write's temp file is made
    at its full size, counted, once the shared count has room for it (:meth:`reserve`),
    and every rename, removal and eviction changes the count with the file, under the
    ledger's lock; each scan sets each fan-out directory's count to what it holds. So
    the directory, writes in flight included, stays within ``max_bytes`` whatever the
    number of engines (a write goes past it only when nothing could be evicted). Each
    engine evicts the oldest objects its own last scan saw; one another engine evicted
    first is gone, and counted off once. Without the ledger (no ``flock`` on the mount,
    a read-only directory: logged once) each engine counts its own writes between its
    scans, as below, and engines together can take the directory past the bound until
    their next scans. Any fault of the ledger that is not an OSError (a bug) falls back
    the same way: a count is bookkeeping, never worth a failed write.

    ``keep_ledger`` (an unbounded tool's tier: ``kvtier store``): no bound of its own,
    but where the engines' ledger exists, this tier's deletes change it as theirs do
    (it is never created).

    A sweep thread alone (:meth:`start`: when puts wrote a good part of the
    headroom, but at most one sweep a second) let an engine that writes faster than
    that run the directory to several times its bound between sweeps. The thread still
    scans: it counts what other engines wrote, refreshes the eviction order, removes
    stale temp files. Never on a read. Generation manifests (``gen-<id>/manifest``: an
    engine's claim of its generation, a few hundred bytes) count, but are never
    evicted: ``kvtier store gc`` removes those of dead generations. Tests call
    :meth:`sweep` directly."""

    def __init__(
        self,
        root: str,
        *,
        max_bytes: int | None,
        file_mode: int,
        low_water: float,
        tmp_max_age_s: float,
        interval_s: float,
        bound_writes: bool = True,
        keep_ledger: bool = False,
    ) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.file_mode = file_mode
        self.low_water = low_water
        self.tmp_max_age_s = tmp_max_age_s
        self.sweep_interval_s = interval_s
        self.bound_writes = bound_writes
        self._lock = threading.Lock()
        #: one thread of this process sweeps or makes room at a time (a writer waiting for
        #: a sweep's count rather than skipping it as another engine's)
        self._room = threading.RLock()
        self._written_since_sweep = 0
        #: bytes the directory holds as far as this engine knows: the last complete scan's
        #: total after its evictions, plus every byte admitted since, writes in flight
        #: included, less what was evicted or failed (None: no complete scan yet)
        self._used: int | None = None
        #: bytes admitted whose write has not finished, by the object they write (a scan
        #: does not see them, or sees them renamed into place a moment before they end)
        self._in_flight: dict[tuple[str, str], int] = {}
        #: complete scans so far: a write a scan completed under counts from its count
        self._scans = 0
        #: objects this engine evicted, on the write path and in sweeps
        self.evicted = 0
        #: objects that landed while a scan ran (None: no scan running): added at its end
        #: unless it saw them
        self._landed: list[tuple[str, str, int]] | None = None
        #: the oldest objects of the last scan, oldest first: what a write evicts
        self._candidates: collections.deque[tuple[float, int, str, str]] = collections.deque()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        #: the count every engine sharing the directory keeps (None: this engine counts
        #: alone, as above: no bound, or no ledger on this mount)
        self._ledger: _Ledger | None = None
        if max_bytes is not None:
            try:
                self._ledger = _Ledger(root)
            except Exception as exc:
                self._alone(exc)
        elif keep_ledger:
            try:
                self._ledger = _Ledger(root, create=False)
            except FileNotFoundError:
                pass  # no engine bounds the directory: nothing to keep
            except Exception as exc:
                log.warning("file tier %s: cannot keep %s (%s): the engines' next scans "
                            "count what this run deletes", root, _LEDGER_NAME,
                            getattr(exc, "strerror", None) or exc)  # fmt: skip

    def start(self) -> None:
        """Sweep in the background from now on (at once, then as :meth:`_loop` says)."""
        # daemon: a sweep stuck on a hung mount must not keep the engine from exiting
        self._thread = threading.Thread(target=self._loop, name="kvtier-file-sweep", daemon=True)
        self._thread.start()

    @property
    def shared(self) -> bool:
        """Whether the bound is kept with a count every engine shares (:class:`_Ledger`)."""
        return self._ledger is not None

    @property
    def counting(self) -> bool:
        """Whether the tier's writes and deletes must say their bytes: a bound of its own,
        or a ledger kept (``keep_ledger``)."""
        return self.max_bytes is not None or self._ledger is not None

    def _alone(self, exc: Exception, ledger: _Ledger | None = None) -> None:
        """No shared count (``ledger``: the one that failed; ``exc``: why, an OSError or
        any other fault of the ledger): from now on this engine counts its own writes
        between its scans, from its next scan on. Said once per ledger."""
        if ledger is not None:
            if self._ledger is not ledger:
                return  # another thread fell back already
            self._ledger = None
            with self._lock:
                self._used = None  # counted again by the next scan
            ledger.close()  # its fd (a thread inside :meth:`held` releases nothing then)
        log.warning(
            "file tier %s: no count shared with the other engines in the directory (%s: %s); "
            "this engine counts only its own writes between its scans, so engines sharing "
            "the directory can take it past file_max_bytes",
            self.root, _LEDGER_NAME, getattr(exc, "strerror", None) or repr(exc),
        )  # fmt: skip

    @contextmanager
    def held(self) -> Iterator[None]:
        """The shared count locked for this thread (nests; nothing without one): a change
        of a fan-out directory's bytes and of its count made inside are one, for every
        engine's scans and writes."""
        ledger = self._ledger
        if ledger is not None:
            try:
                ledger.acquire()
            except Exception as exc:
                self._alone(exc, ledger)
                ledger = None
        try:
            yield
        finally:
            if ledger is not None:
                ledger.release()

    def _count(self, sub: str, delta: int) -> None:
        """``sub`` holds ``delta`` bytes more (under :meth:`held`)."""
        ledger = self._ledger
        if ledger is not None and delta:
            try:
                ledger.add(sub, delta)
            except Exception as exc:
                self._alone(exc, ledger)

    def _total(self) -> int | None:
        """The shared count of the directory (under :meth:`held`; None: none yet)."""
        ledger = self._ledger
        if ledger is None:
            return None
        try:
            return ledger.total()
        except Exception as exc:
            self._alone(exc, ledger)
            return None

    @property
    def used_bytes(self) -> int | None:
        """What the directory holds as this engine counts it (None: not scanned yet);
        with a shared count, that count (objects and temp files; not the ledger's own
        :data:`LEDGER_BYTES`)."""
        if self._ledger is not None:
            with self.held():
                if self._ledger is not None:
                    return self._total()
        with self._lock:
            return self._used

    def admit(self, nbytes: int, where: tuple[str, str]) -> int:
        """A write of ``nbytes`` to ``where`` (its fan-out directory and name) is about to
        start: count it, and first make room (down to ``low_water``) when it would take
        the directory past ``max_bytes``. Every call is followed by one :meth:`landed`,
        given what this returns."""
        if self.max_bytes is None:
            return 0
        with self._lock:
            scans = self._scans
            self._in_flight[where] = self._in_flight.get(where, 0) + nbytes
            if self._used is not None:
                self._used += nbytes
            over = self._used is None or self._used > self.max_bytes
        if over and self._ledger is None and self.bound_writes and not self._stop.is_set():
            try:
                self._make_room()
            except Exception:  # the write goes ahead: a failed eviction is not its failure
                log.warning("file tier %s: making room failed", self.root, exc_info=True)
        return scans

    def reserve(
        self,
        nbytes: int,
        sub: str,
        create: Callable[[], tuple[int, str]],
        discard: Callable[[str], object],
    ) -> tuple[int, str]:
        """The temp file of a write of ``nbytes`` into ``sub``, made by ``create`` (its fd
        and name). With a shared count, it is made at its full size once the count says
        the directory has room for it (room is made first, as in :meth:`admit`) and
        counted with it, under the lock: engines writing at once never take the count
        past the bound together. Whatever fails once it is made, its fd is closed and
        ``discard`` removes it (by name) before the error goes on. The caller's next
        change of the file (rename, removal) comes with :meth:`landed`, under
        :meth:`held`."""
        if self._ledger is None:
            return create()
        force = not self.bound_writes or self.max_bytes is None
        for _ in range(8):
            with self.held():
                if self._ledger is None:
                    return create()
                total = self._total()
                if force or self._stop.is_set() or (
                    total is not None and self.max_bytes is not None
                    and total + nbytes <= self.max_bytes
                ):  # fmt: skip
                    return self._create_counted(nbytes, sub, create, discard)
            try:
                force = not self._make_room_shared(nbytes)
            except Exception:  # the write goes ahead: a failed eviction is not its failure
                log.warning("file tier %s: making room failed", self.root, exc_info=True)
                force = True
        with self.held():  # others took the room as fast as it was made: go ahead
            return self._create_counted(nbytes, sub, create, discard)

    def _create_counted(
        self,
        nbytes: int,
        sub: str,
        create: Callable[[], tuple[int, str]],
        discard: Callable[[str], object],
    ) -> tuple[int, str]:
        """``create`` a temp file, at its full size, and count it (under :meth:`held`);
        on any failure after the create, the fd is closed and the file removed (nothing
        was counted: counting is the last step)."""
        fd, tmp = create()
        try:
            try:
                os.ftruncate(fd, nbytes)  # its bytes, for every scan, from now on
            except OSError:
                pass  # then it grows as it is written
            self._count(sub, nbytes)
        except BaseException:
            os.close(fd)
            discard(tmp)
            raise
        return fd, tmp

    def landed(
        self,
        nbytes: int,
        where: tuple[str, str],
        scans: int,
        *,
        stored: bool,
        replaced: int = 0,
        freed: int = 0,
    ) -> None:
        """The write :meth:`admit` counted (``scans``: what it returned) is over:
        ``stored`` when it created or replaced the object (``replaced``: the bytes of the
        object it replaced); ``freed``: the bytes of its temp file, removed, when it was
        not stored. With a shared count, called under :meth:`held` together with the
        rename or removal."""
        self._count(where[0], -(replaced if stored else freed))  # a kept ledger, unbounded
        if self.max_bytes is None:
            return
        with self._lock:
            if scans != self._scans:
                replaced = 0  # a scan counted the write in place of what it replaced
            left = self._in_flight.pop(where, 0) - nbytes
            if left > 0:  # another write of the same object is still in flight
                self._in_flight[where] = left
            if self._used is not None:
                self._used -= replaced if stored else nbytes
            if stored and self._landed is not None:
                self._landed.append((*where, nbytes))
        if stored:
            self.wrote(nbytes)

    def removed(self, nbytes: int, sub: str | None = None) -> None:
        """The tier deleted an object of ``nbytes`` in ``sub`` (under :meth:`held`)."""
        if sub is not None:
            self._count(sub, -nbytes)
        with self._lock:
            if self._used is not None:
                self._used -= nbytes

    def wrote(self, nbytes: int) -> None:
        """The tier stored ``nbytes`` more: sweep soon once they fill a good part of the
        headroom (half of what a sweep frees)."""
        if self.max_bytes is None:
            return
        with self._lock:
            self._written_since_sweep += nbytes
            due = self._written_since_sweep > (1.0 - self.low_water) * self.max_bytes / 2
        if due:
            self._wake.set()

    def wake(self) -> None:
        """Sweep now (a write found the disk full: make room for the next ones)."""
        self._wake.set()

    @property
    def woken(self) -> bool:
        """A sweep was asked for and has not begun yet."""
        return self._wake.is_set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)  # bounded: a hung mount must not hang shutdown
        ledger = self._ledger
        if ledger is not None and (self._thread is None or not self._thread.is_alive()):
            self._ledger = None  # a write after close counts alone
            with self._lock:
                self._used = None
            ledger.close()

    def _make_room(self) -> None:
        """Evict the oldest objects the last scan saw until the count is at ``low_water``;
        a full sweep when they do not get it there (or nothing was scanned yet). Another
        engine sweeping (the lock file held) lets the write go ahead: its sweep makes the
        room, and this engine's next write tries again."""
        assert self.max_bytes is not None
        target = int(self.max_bytes * self.low_water)
        with self._room:
            limit = self.max_bytes  # another thread may have made the room meanwhile
            while True:
                with self._lock:
                    if self._used is not None and self._used <= limit:
                        return
                    cand = self._candidates.popleft() if self._candidates else None
                if cand is None:
                    break
                limit = target
                mtime, size, sub, name = cand
                try:
                    root_fd = os.open(self.root, _OPEN_ROOT)
                except OSError:
                    break
                try:
                    gone, _ = _evict(root_fd, sub, name, mtime)
                finally:
                    os.close(root_fd)
                if gone is not None:
                    with self._lock:
                        if self._used is not None:
                            self._used -= size
                        self.evicted += gone == _EVICTED
            self._sweep(evict_over=limit)

    def _make_room_shared(self, nbytes: int) -> bool:
        """:meth:`_make_room` with the shared count: evict the oldest objects this
        engine's last scan saw, each with its count (one another engine evicted first is
        gone, and not counted twice), until a write of ``nbytes`` fits under
        ``low_water``; else wait for another engine's sweep and sweep when it did not make
        the room. False when no room could be made (the write goes ahead)."""
        assert self.max_bytes is not None
        target = int(self.max_bytes * self.low_water)
        with self._room:
            limit = self.max_bytes  # another thread may have made the room meanwhile
            try:
                root_fd = os.open(self.root, _OPEN_ROOT)
            except OSError:
                return False
            try:
                while True:
                    with self.held():
                        if self._ledger is None:
                            return False
                        total = self._total()
                        if total is None:
                            break  # no engine's scan has counted the directory yet
                        if total + nbytes <= limit:
                            return True
                        with self._lock:
                            cand = self._candidates.popleft() if self._candidates else None
                        if cand is None:
                            break
                        limit = target
                        self._evict_counted(root_fd, cand)
            finally:
                os.close(root_fd)
            return not self._sweep(evict_over=limit, need=nbytes, wait=True).skipped

    def _evict_counted(self, root_fd: int, obj: tuple[float, int, str, str]) -> int:
        """Evict ``obj`` (its mtime, size, fan-out directory and name) with its count
        (under :meth:`held`); the bytes evicted."""
        mtime, _, sub, name = obj
        gone, size = _evict(root_fd, sub, name, mtime)
        if gone != _EVICTED:
            return 0  # gone already (evicted and counted by another engine), or young
        self._count(sub, -size)
        with self._lock:
            self.evicted += 1
        return size

    def sweep(self) -> SweepStats:
        """One pass: remove stale temp files, then LRU objects while over ``max_bytes``.

        Never called on the read path: the background thread runs it at open,
        every ``sweep_interval_s`` after writes, and when puts wrote a good part
        of the headroom; a write runs it when the last one's eviction order ran out.
        Tests call it directly.
        """
        return self._sweep(evict_over=self.max_bytes)

    def _sweep(self, evict_over: int | None, need: int = 0, wait: bool = False) -> SweepStats:
        """:meth:`sweep`, evicting to ``low_water`` when the directory holds more than
        ``evict_over`` (a write making room: already less than ``max_bytes``) less
        ``need`` (the write's bytes, with a shared count). ``wait``: for another engine's
        sweep, rather than skip (a write making room with the shared count: that sweep
        may make the room, which is then not made again)."""
        with self._room:
            lock_fd = self._try_lock(wait and self._ledger is not None)
            if lock_fd == -2:
                return SweepStats(skipped=True)
            try:
                if wait and evict_over is not None:
                    with self.held():
                        total = self._total()
                    if total is not None and total + need <= evict_over:
                        return SweepStats()
                return self._sweep_locked(evict_over, need)
            finally:
                if lock_fd >= 0:
                    os.close(lock_fd)  # releases the flock

    def _try_lock(self, wait: bool = False) -> int:
        """An fd holding the sweep lock; -1 when locking is unsupported, -2 when it is held
        (``wait``: until it is free)."""
        path = os.path.join(self.root, _LOCK_NAME)
        base = os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = -1
        for mode in (os.O_RDWR, os.O_RDONLY):  # NFS wants a writable fd; another's file may not be
            try:
                fd = os.open(path, base | mode, self.file_mode)
                break
            except OSError:
                continue
        if fd < 0:
            return -1  # sweeping twice at once only wastes work; it stays correct
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return -2
        except OSError:
            os.close(fd)
            return -1
        return fd

    def _sweep_locked(self, evict_over: int | None, need: int = 0) -> SweepStats:
        stats = SweepStats()
        try:
            root_fd = os.open(self.root, _OPEN_ROOT)
        except OSError as exc:
            log.warning("file tier %s: cannot open for a sweep: %s", self.root, exc.strerror)
            return stats
        with self._lock:
            self._landed = []
        try:
            if self._ledger is not None:
                return self._sweep_shared(root_fd, stats, evict_over, need)
            return self._sweep_at(root_fd, stats, evict_over)
        finally:
            with self._lock:
                self._landed = None
            os.close(root_fd)

    def _fanout_dirs(self, root_fd: int, stats: SweepStats) -> list[str] | None:
        """The root's fan-out directories; names of them that are not directories
        (symlinks, files) are counted in ``stats.foreign`` and warned of. None: the root
        could not be listed (warned)."""
        subdirs = []
        try:
            for e in os.scandir(root_fd):
                if len(e.name) != 2 or not set(e.name) <= _HEX:
                    continue
                if e.is_dir(follow_symlinks=False):
                    subdirs.append(e.name)
                else:
                    stats.foreign += 1
        except OSError as exc:
            log.warning("file tier %s: cannot list for a sweep: %s", self.root, exc.strerror)
            return None
        if stats.foreign:
            log.warning(
                "file tier %s: %d fan-out name(s) are not directories (symlinks or files "
                "put there); kvtier never reads or writes through them",
                self.root,
                stats.foreign,
            )
        return subdirs

    def _sweep_at(self, root_fd: int, stats: SweepStats, evict_over: int | None) -> SweepStats:
        """The sweep through directory fds: like every read and write it never leaves the
        root (a symlinked fan-out name is neither listed, counted nor evicted through)."""
        now = time.time()
        objects: list[tuple[float, int, str, str]] = []
        seen: dict[tuple[str, str], int] = {}  # every object counted, and its size
        subdirs = self._fanout_dirs(root_fd, stats)
        if subdirs is None:
            return stats
        for sub in subdirs:
            if self._stop.is_set():
                return stats
            try:
                sub_fd = os.open(sub, _OPEN_SUBDIR, dir_fd=root_fd)
            except OSError:
                continue  # removed by another engine, swapped for a symlink, unreadable
            try:
                for entry in list(os.scandir(sub_fd)):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue  # vanished under us
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    if entry.name.startswith(_TMP_PREFIX):
                        if now - st.st_mtime > self.tmp_max_age_s and _unlink(entry.name, sub_fd):
                            stats.temp_removed += 1
                        continue  # a live writer's temp file becomes an object soon
                    stats.total_bytes += st.st_size
                    seen[(sub, entry.name)] = st.st_size
                    if not _is_manifest(entry.name):  # counted, never evicted
                        objects.append((st.st_mtime, st.st_size, sub, entry.name))
            except OSError:
                continue  # unreadable: next pass
            finally:
                os.close(sub_fd)
        with self._lock:
            self._written_since_sweep = 0
            pending = self._pending(seen)
        total = stats.total_bytes
        objects.sort()
        start = 0
        if self.max_bytes is not None and evict_over is not None and total + pending > evict_over:
            target = int(self.max_bytes * self.low_water)
            for mtime, size, sub, name in objects:
                if total + pending <= target or self._stop.is_set():
                    break
                start += 1
                gone, _ = _evict(root_fd, sub, name, mtime)
                if gone is not None:
                    total -= size
                if gone == _EVICTED:
                    stats.evicted += 1
                    stats.evicted_bytes += size
        with self._lock:
            self.evicted += stats.evicted
        if self.max_bytes is not None and not self._stop.is_set():
            self._remember(objects[start:], seen, total)
        return stats

    def _sweep_shared(
        self, root_fd: int, stats: SweepStats, evict_over: int | None, need: int
    ) -> SweepStats:
        """:meth:`_sweep_at` with the shared count: each fan-out directory is counted
        under the ledger's lock and its count set to what was found, writes in flight
        included (their temp files are made at their full size, under the lock), so the
        count needs nothing added for writes in flight or landing meanwhile. Then the
        oldest objects are evicted, each with its count, while the directory holds more
        than ``evict_over`` less ``need``."""
        now = time.time()
        objects: list[tuple[float, int, str, str]] = []
        # every fan-out name is counted below (a removed directory's count is set to 0):
        # the listing only finds, and warns of, names that are not directories
        if self._fanout_dirs(root_fd, stats) is None:
            return stats
        with self.held():
            ledger = self._ledger
            if ledger is None:
                return stats
            try:
                layout = ledger.layout()
            except Exception as exc:
                self._alone(exc, ledger)
                return stats
        for sub in _FANOUT:
            if self._stop.is_set():
                return stats
            with self.held():
                ledger = self._ledger
                if ledger is None:
                    return stats  # counted alone from the next scan on
                count = self._scan_sub(root_fd, sub, now, stats, objects)
                if count is not None:
                    try:
                        ledger.set(sub, count)
                    except Exception as exc:
                        self._alone(exc, ledger)
                        return stats
        with self.held():
            ledger = self._ledger
            if ledger is None:
                return stats
            try:
                ledger.scanned(layout)
            except Exception as exc:
                self._alone(exc, ledger)
                return stats
        with self._lock:
            self._written_since_sweep = 0
        objects.sort()
        start = 0
        if self.max_bytes is not None and evict_over is not None:
            with self.held():
                total = self._total()
            if total is not None and total + need > evict_over:
                target = int(self.max_bytes * self.low_water)
                for obj in objects:
                    if self._stop.is_set():
                        break
                    with self.held():
                        total = self._total()
                        if total is None or total + need <= target:
                            break
                        start += 1
                        size = self._evict_counted(root_fd, obj)
                    if size:
                        stats.evicted += 1
                        stats.evicted_bytes += size
        if self.max_bytes is not None and not self._stop.is_set():
            self._remember(objects[start:], {}, None)
        return stats

    def _scan_sub(
        self, root_fd: int, sub: str, now: float, stats: SweepStats,
        objects: list[tuple[float, int, str, str]],
    ) -> int | None:  # fmt: skip
        """The bytes the fan-out directory ``sub`` holds, objects and temp files of writes
        in flight (each inode once); its objects go to ``stats`` and (but manifests)
        ``objects``, its stale temp files are removed. 0 when there is no directory
        ``sub`` (or a symlink or file is there: never counted); None when it cannot be
        read (its count stays)."""
        try:
            sub_fd = os.open(sub, _OPEN_SUBDIR, dir_fd=root_fd)
        except OSError as exc:
            return 0 if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR) else None
        count = 0
        inodes: set[int] = set()
        try:
            for entry in list(os.scandir(sub_fd)):
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # vanished under us (a writer without the ledger)
                if not stat.S_ISREG(st.st_mode):
                    continue
                if entry.name.startswith(_TMP_PREFIX):
                    if now - st.st_mtime > self.tmp_max_age_s and _unlink(entry.name, sub_fd):
                        stats.temp_removed += 1
                        continue
                else:
                    stats.total_bytes += st.st_size
                    if not _is_manifest(entry.name):  # counted, never evicted
                        objects.append((st.st_mtime, st.st_size, sub, entry.name))
                if st.st_ino not in inodes:  # a temp file being linked to its name
                    inodes.add(st.st_ino)
                    count += st.st_size
        except OSError:
            return None  # unreadable: next pass
        finally:
            os.close(sub_fd)
        return count

    def _pending(self, seen: dict[tuple[str, str], int]) -> int:
        """What to add to the bytes a scan counted (``seen``: each object's size) for
        what the directory holds, or is about to: the writes in flight (less what the
        scan counted of their objects: renamed into place a moment before they end, or
        the object a rewrite replaces), and those that landed during the scan where it
        had looked already. Under ``_lock``."""
        landed = sum(n for sub, name, n in self._landed or () if (sub, name) not in seen)
        flight = sum(n - seen.get(w, 0) for w, n in self._in_flight.items())
        return landed + flight

    def _remember(
        self,
        rest: list[tuple[float, int, str, str]],
        seen: dict[tuple[str, str], int],
        total: int | None,
    ) -> None:
        """After a complete scan: the count of what the directory holds (``total``, what
        the scan counted less what it evicted; None: the count is shared), and the
        oldest objects left, ``rest`` (enough for two evictions to ``low_water``), for
        the writes to evict."""
        assert self.max_bytes is not None
        want = 2 * (self.max_bytes - int(self.max_bytes * self.low_water))
        cands: collections.deque[tuple[float, int, str, str]] = collections.deque()
        got = 0
        for obj in rest:
            if got >= want or len(cands) >= _MAX_CANDIDATES:
                break
            cands.append(obj)
            got += obj[1]
        with self._lock:
            if total is not None:
                self._used = total + self._pending(seen)
            self._candidates = cands
            self._scans += 1

    def _loop(self) -> None:
        last = -float("inf")
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                written = self._written_since_sweep
            woken = self._wake.is_set()
            self._wake.clear()
            if (
                woken
                or now - last >= self.tmp_max_age_s / 2
                or (written and self.max_bytes is not None and now - last >= self.sweep_interval_s)
            ):
                try:
                    self.sweep()
                except Exception:  # a sweep must never take the tier (or the engine) down
                    log.warning("file tier %s: sweep failed", self.root, exc_info=True)
                last = time.monotonic()
                self._stop.wait(min(1.0, self.sweep_interval_s))  # at most one sweep a second
            self._wake.wait(self.sweep_interval_s)


_EVICTED, _GONE = "evicted", "gone"


def _evict(root_fd: int, sub: str, name: str, mtime: float) -> tuple[str | None, int]:
    """Unlink ``sub/name`` under the root when its mtime is still ``mtime``: _EVICTED when
    this call removed it, _GONE when it was gone already (another engine evicted it),
    None when it stays (read or rewritten since it was seen: young now; or it cannot be
    removed); and the bytes removed."""
    try:
        sub_fd = os.open(sub, _OPEN_SUBDIR, dir_fd=root_fd)
    except FileNotFoundError:
        return _GONE, 0
    except OSError:
        return None, 0
    try:
        st = os.stat(name, dir_fd=sub_fd, follow_symlinks=False)
        if st.st_mtime != mtime:
            return None, 0
        os.unlink(name, dir_fd=sub_fd)
        return _EVICTED, st.st_size
    except FileNotFoundError:
        return _GONE, 0
    except OSError:
        return None, 0
    finally:
        os.close(sub_fd)


def _is_manifest(name: str) -> bool:
    """Whether a file name under a fan-out directory is a generation's manifest
    (:func:`kvtier.objects.manifest.manifest_key` placed by :func:`_place`)."""
    return name.startswith(GENERATION_PREFIX) and name.endswith(_MANIFEST_SUFFIX)


class FileTier(SlotReader):
    """One file per chunk under ``root/<2 hex digits>/``.

    Writes go to a temp file in the destination directory and are renamed into
    place with ``os.replace``, which is atomic on POSIX: several engines (or
    processes) writing the same key at once leave one complete object, and a
    reader never sees a partial one. Files are not fsynced: a crash can lose
    recent chunks, and a torn file is caught by the codec as a miss, which is
    the right trade for a cache.

    The fan-out directory is the first byte of the key's xxh3 hash rather than
    of the key itself, because keys share a long namespace prefix.

    Files hold prompt KV, so they are created with ``file_mode`` (default
    ``0o640``) and directories with ``0o770``, both less the process umask:
    never world-readable. Engines that run as different users share the
    directory through a common group (a setgid directory, umask 002). A file
    only ever has a group this process is a member of: where a setgid
    directory (the root, or a fan-out directory someone else made) would give
    it another group, it is handed to the process's own group before a byte
    is written, so a directory's owner cannot give the KV to a group of their
    choosing (a setgid root of a foreign group is also logged at open).

    Nothing in the directory is trusted. Every object is reached through
    directory fds: the root, then its fan-out directory opened with
    ``O_NOFOLLOW | O_DIRECTORY`` relative to it, then the object relative to
    that; a symlink planted at a fan-out name (``ab -> /dev/shm``) is refused,
    never followed, so nothing is read, written or deleted outside the root.
    A read opens with ``O_NOFOLLOW | O_NONBLOCK`` and refuses anything but a
    regular file no larger than the caller's bound before reading a byte.

    ``max_bytes`` bounds the directory: a write that would take it past the
    bound first deletes the least recently used objects (oldest mtime; a hit
    refreshes it) down to ``low_water`` of the bound (:class:`DirectorySweep`),
    so the directory never holds more than the bound, writes in flight included,
    however many engines share it: they keep one count of it, in a ledger at the
    root (:class:`DirectorySweep`; without ``flock`` on the mount each engine
    counts alone, and between two of its scans does not see the others' writes).
    A background sweep counts the directory again. State lives in the files
    themselves, so the bound survives restarts (a lock file keeps engines from
    sweeping at the same time; files vanishing mid-sweep are expected). Temp files of crashed
    writers older than ``tmp_max_age_s`` are swept at open and then
    periodically, bounded or not. ``background_sweep=False`` (tests, tools):
    no sweep thread, and unless ``bound_writes`` the caller's :meth:`sweep`
    calls alone keep the bound. ``keep_ledger`` (``kvtier store``, unbounded): its
    deletes change the engines' ledger, where one exists, as theirs do.
    """

    name = "file"

    def __init__(
        self,
        root: str,
        *,
        max_bytes: int | None = None,
        file_mode: int = 0o640,
        low_water: float = 0.9,
        tmp_max_age_s: float = 600.0,
        sweep_interval_s: float = 30.0,
        background_sweep: bool = True,
        bound_writes: bool | None = None,
        keep_ledger: bool = False,
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError("FileTier max_bytes must not be negative")
        if not 0.0 < low_water <= 1.0:
            raise ValueError("FileTier low_water must be in (0, 1]")
        self.root = os.path.abspath(root)
        self.max_bytes = max_bytes
        self.file_mode = file_mode
        try:
            os.makedirs(self.root, mode=0o770, exist_ok=True)
            root_st = os.stat(self.root)
        except OSError as exc:
            raise TierUnavailable(f"file tier {self.root}: {exc.strerror}") from exc
        #: the groups a file may have: the process's own; any other is handed back to egid
        self._gids = frozenset({os.getegid(), *os.getgroups()})
        if root_st.st_mode & stat.S_ISGID and root_st.st_gid not in self._gids:
            log.warning(
                "file tier %s: the directory is setgid to group %d, which this process is not "
                "a member of; kvtier creates its files with its own group (%d) instead",
                self.root,
                root_st.st_gid,
                os.getegid(),
            )
        self.reads_local = is_local(self.root)
        self.sweeper = DirectorySweep(
            self.root,
            max_bytes=max_bytes,
            file_mode=file_mode,
            low_water=low_water,
            tmp_max_age_s=tmp_max_age_s,
            interval_s=sweep_interval_s,
            bound_writes=background_sweep if bound_writes is None else bound_writes,
            keep_ledger=keep_ledger,
        )
        if background_sweep:
            self.sweeper.start()

    def __repr__(self) -> str:
        return f"FileTier({self.root!r})"

    def path(self, key: str) -> str:
        """Where ``key`` is stored (tests write corrupt objects straight there)."""
        return os.path.join(self.root, *_place(key))

    def _subdir(self, sub: str, op: str, *, create: bool = False) -> int | None:
        """An fd of the fan-out directory ``sub``, opened relative to the root without
        following a symlink there; None when it does not exist (and ``create`` is off).
        Raises ObjectError when ``sub`` is a symlink or anything but a directory."""
        root_fd = os.open(self.root, _OPEN_ROOT)
        try:
            for attempt in range(2):
                try:
                    return os.open(sub, _OPEN_SUBDIR, dir_fd=root_fd)
                except FileNotFoundError:
                    if not create or attempt:
                        return None
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise ObjectError(
                            f"file tier {op} under {self.root}: {sub} is not a directory (a "
                            "symlink or a file put there); refused, never followed"
                        ) from None
                    raise
                try:
                    os.mkdir(sub, 0o770, dir_fd=root_fd)
                    self._own_group_at(root_fd, sub)
                except FileExistsError:
                    pass  # another engine made it: open it (and check it) again
            return None
        finally:
            os.close(root_fd)

    def _own_group_at(self, dir_fd: int, name: str) -> None:
        """A directory this process just made keeps a group it is a member of."""
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if st.st_gid not in self._gids:
                os.chown(name, -1, os.getegid(), dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            pass  # the files in it get their group checked one by one anyway

    def _own_group(self, fd: int) -> None:
        """A new file's group is one of this process's, never one a setgid directory
        chose; raises OSError (the write fails) when it cannot be made so."""
        if os.fstat(fd).st_gid not in self._gids:
            os.fchown(fd, -1, os.getegid())

    @contextmanager
    def _errors(self, op: str) -> Iterator[None]:
        """The one place an OSError becomes a kvtier error (:meth:`_error` says which);
        anything else (a kvtier error raised on purpose, a bug) passes as it is."""
        try:
            yield
        except OSError as exc:
            raise self._error(op, exc) from None

    def _error(self, op: str, exc: OSError) -> TierError:
        msg = f"file tier {op} under {self.root}: {exc.strerror or type(exc).__name__}"
        if exc.errno in _TIER_ERRNOS:
            return TierUnavailable(msg)
        return ObjectError(msg)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """In order, stopping at the first missing key (answers after it are False)."""
        out = []
        for key in keys:
            sub, name = _place(key)
            try:
                with self._errors("exists"):
                    dir_fd = self._subdir(sub, "exists")
                    if dir_fd is None:
                        break
                    try:
                        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    finally:
                        os.close(dir_fd)
            except ObjectError:
                break  # missing, or a name no object can be read from (a fan-out name
                # that is not a directory included): nothing there is served
            if not stat.S_ISREG(st.st_mode):
                break
            out.append(True)
        return out + [False] * (len(keys) - len(out))

    def _open_object(self, key: str) -> int | None:
        """An fd of ``key``'s file, read-only, reached through the fan-out directory's fd;
        None when it is not stored."""
        sub, name = _place(key)
        dir_fd = self._subdir(sub, "get")
        if dir_fd is None:
            return None
        try:
            return os.open(name, _OPEN_READ, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        finally:
            os.close(dir_fd)

    def _open_regular(self, key: str) -> tuple[int, os.stat_result] | None:
        """The object's fd and its stat (None: no such object); the caller closes the fd.
        Anything but a regular file is an ObjectError (the fd is closed then)."""
        with self._errors("get"):
            fd = self._open_object(key)
            if fd is None:
                return None
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise ObjectError(f"file tier get under {self.root}: not a regular file")
            except BaseException:
                os.close(fd)
                raise
        return fd, st

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        opened = self._open_regular(key)
        if opened is None:
            return None
        fd, st = opened
        try:
            with self._errors("get"):
                self._refuse_oversize(st, max_bytes)
                data = _read(fd, st.st_size)  # what fstat saw: a file growing meanwhile is cut
                self._touch(fd, st)
                return data
        finally:
            os.close(fd)

    def get_into(self, key: str, buf: memoryview) -> int | None:
        """:meth:`ObjectTier.get_into`: ``readv`` into ``buf`` (no buffer of the object's
        size); an object larger than ``buf`` is refused from its fstat, unread."""
        opened = self._open_regular(key)
        if opened is None:
            return None
        fd, st = opened
        view = byte_view(buf)
        try:
            with self._errors("get"):
                self._refuse_oversize(st, view.nbytes)
                n = _read_into(fd, view[: st.st_size])  # a file growing meanwhile is cut
                self._touch(fd, st)
                return n
        finally:
            os.close(fd)

    def _refuse_oversize(self, st: os.stat_result, max_bytes: int | None) -> None:
        if max_bytes is not None and st.st_size > max_bytes:
            raise ObjectTooLarge(
                f"file tier get under {self.root}: object of {st.st_size} bytes, "
                f"at most {max_bytes} expected"
            )

    def will_read(self, keys: Sequence[str]) -> None:
        """:meth:`ObjectTier.will_read`: the kernel starts reading each stored file into
        the page cache (``POSIX_FADV_WILLNEED``), all at once, while the first is read.

        Not when the run's first and last files are in the page cache already (a warm
        restart, where the hint has nothing to start): opening every file for it took
        about 60 us each, 2 ms before an 8,192-token prompt's first read."""
        if keys and self._in_page_cache(keys[0]) and self._in_page_cache(keys[-1]):
            return
        for key in keys:
            try:
                opened = self._open_regular(key)
            except TierError:
                return  # a hint: the read itself meets (and counts) the failure
            if opened is None:
                return  # a run is useful up to its first gap
            try:
                os.posix_fadvise(opened[0], 0, opened[1].st_size, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(opened[0])

    def _in_page_cache(self, key: str) -> bool:
        """Whether the last byte of ``key``'s file is in the page cache: a read that may
        not wait for the device (``RWF_NOWAIT``) gets it. False when it cannot tell (no
        such file, a kernel or filesystem without it): the caller then hints."""
        if _RWF_NOWAIT is None:
            return False
        try:
            opened = self._open_regular(key)
        except TierError:
            return False
        if opened is None:
            return False
        fd, st = opened
        try:
            return st.st_size == 0 or os.preadv(fd, [bytearray(1)], st.st_size - 1,
                                                _RWF_NOWAIT) == 1  # fmt: skip
        except OSError:  # EAGAIN: on the device; EOPNOTSUPP: cannot tell
            return False
        finally:
            os.close(fd)

    def _read_slot(
        self, key: str, dest: memoryview, max_head: int, *, hashed: bool, found: Found = None
    ) -> tuple[bytes, int] | None:
        """:meth:`SlotReader._read_slot`: one ``preadv`` fills the head buffer and the slot
        (no copy, GIL released); ``hashed``: the slot in pieces of ``codec.HASH_PIECE``
        bytes, each checksummed right after it lands, while it is still in the CPU's cache
        (one pass over memory instead of a read, then a checksum)."""
        opened = self._open_regular(key)
        if opened is None:
            return None
        fd, st = opened
        if found is not None:
            found()
        crc = 0
        try:
            with self._errors("get"):
                where = f"file tier get under {self.root}"
                head = bytearray(head_length_for(st.st_size, dest.nbytes, max_head, where))
                if not hashed:
                    _preadv_all(fd, [memoryview(head), dest], 0, where)
                else:
                    at, step, landing = len(head), codec.HASH_PIECE, codec.LandingCrc(dest)
                    for start in range(0, dest.nbytes, step):
                        piece = dest[start : start + step]
                        bufs = [memoryview(head), piece] if start == 0 else [piece]
                        _preadv_all(fd, bufs, 0 if start == 0 else at + start, where)
                        landing.landed(start + piece.nbytes)
                    if not dest.nbytes:
                        _preadv_all(fd, [memoryview(head)], 0, where)
                    crc = landing.result()
                self._touch(fd, st)
                return bytes(head), crc
        finally:
            os.close(fd)

    def _touch(self, fd: int, st: os.stat_result) -> None:
        """LRU for ``file_max_bytes``: a hit makes the object young again (rarely written)."""
        if time.time() - st.st_mtime > _TOUCH_AFTER_S:
            try:
                os.utime(fd)
            except OSError:
                pass  # another user's file or a read-only mount: eviction order only

    def put(self, key: str, parts: Parts) -> None:
        """Write ``parts`` to a temp file, renamed over ``key``'s name; with
        ``max_bytes``, room is made first (:meth:`DirectorySweep.admit`)."""
        sub, name = _place(key)
        dir_fd: int | None = None
        tmp = None
        nbytes = sum(memoryview(p).nbytes for p in parts)
        scans = 0
        sweeper = self.sweeper
        try:
            scans = sweeper.admit(nbytes, (sub, name))
            with self._errors("put"):
                try:
                    dir_fd = self._subdir(sub, "put", create=True)
                    if dir_fd is None:  # removed again by another engine between mkdir and open
                        raise FileNotFoundError(errno.ENOENT, "fan-out directory vanished")
                    fd, tmp = sweeper.reserve(nbytes, sub, *self._temp_maker(dir_fd))
                    self._write_parts(fd, parts)
                    with sweeper.held():  # the rename and its count are one
                        # a rewrite frees the old bytes
                        replaced = _size_at(name, dir_fd) if sweeper.counting else 0
                        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                        tmp = None
                        sweeper.landed(nbytes, (sub, name), scans, stored=True,
                                       replaced=replaced)  # fmt: skip
                except OSError as exc:
                    if exc.errno in _DISK_FULL and self.max_bytes is not None:
                        sweeper.wake()  # make room for the next writes
                    raise
        except BaseException:
            with sweeper.held():  # the removal and its count are one
                gone = tmp is not None and dir_fd is not None and _unlink(tmp, dir_fd)
                freed = nbytes if gone else 0
                sweeper.landed(nbytes, (sub, name), scans, stored=False, freed=freed)
            raise
        finally:
            if dir_fd is not None:
                os.close(dir_fd)

    def _write_parts(self, fd: int, parts: Parts) -> None:
        """Write ``parts`` to the new file ``fd`` (closed after, whatever fails), in the
        tier's group."""
        try:
            f = open(fd, "wb")  # noqa: SIM115 (closed by the with below)
        except BaseException:
            os.close(fd)
            raise
        with f:
            self._own_group(fd)
            for part in parts:
                f.write(part)

    def _create_temp(self, dir_fd: int) -> tuple[int, str]:
        """A new temp file in the directory ``dir_fd``: its fd and its name there, created
        with ``file_mode`` (the kernel applies umask)."""
        tmp = _TMP_PREFIX + secrets.token_hex(8)
        return os.open(tmp, _OPEN_TMP, self.file_mode, dir_fd=dir_fd), tmp

    def _temp_maker(
        self, dir_fd: int
    ) -> tuple[Callable[[], tuple[int, str]], Callable[[str], bool]]:
        """:meth:`_create_temp` in ``dir_fd`` and the removal of what it made, for
        :meth:`DirectorySweep.reserve`."""
        return (lambda: self._create_temp(dir_fd)), (lambda tmp: _unlink(tmp, dir_fd))

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            sub, name = _place(key)
            with self._errors("delete"):
                dir_fd = self._subdir(sub, "delete")
                if dir_fd is None:
                    continue
                try:
                    with self.sweeper.held():  # the unlink and its count are one
                        size = _size_at(name, dir_fd) if self.sweeper.counting else 0
                        os.unlink(name, dir_fd=dir_fd)
                        self.sweeper.removed(size, sub)  # the bound's count frees it too
                except FileNotFoundError:
                    pass
                finally:
                    os.close(dir_fd)

    def sweep(self) -> SweepStats:
        """One pass of the directory's bound now (:meth:`DirectorySweep.sweep`)."""
        return self.sweeper.sweep()

    def close(self) -> None:
        self.sweeper.close()

    def create_if_absent(self, key: str, parts: Parts) -> bool:
        """:meth:`ObjectTier.create_if_absent`: the bytes go to a temp file, which is then
        hard-linked to the key's name (``link`` fails with EEXIST when anything is there,
        atomically, on local filesystems and NFS alike), so a reader sees all of it or
        nothing. A filesystem without hard links creates the name with ``O_EXCL`` and
        writes into it (a reader may then see it short for a moment: a miss)."""
        sub, name = _place(key)
        dir_fd: int | None = None
        tmp = None
        nbytes = sum(memoryview(p).nbytes for p in parts)
        created, scans = False, 0
        sweeper = self.sweeper
        try:
            # counted like a put's: the bound holds for claims too
            scans = sweeper.admit(nbytes, (sub, name))
            with self._errors("create"):
                dir_fd = self._subdir(sub, "create", create=True)
                if dir_fd is None:  # removed again by another engine between mkdir and open
                    raise FileNotFoundError(errno.ENOENT, "fan-out directory vanished")
                fd, tmp = sweeper.reserve(nbytes, sub, *self._temp_maker(dir_fd))
                self._write_parts(fd, parts)
                linked: bool | None = False
                with sweeper.held():  # the link, the temp file's removal and the count are one
                    try:
                        os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd,
                                follow_symlinks=False)  # fmt: skip
                        created = linked = True
                        _unlink(tmp, dir_fd)  # the object keeps the temp file's bytes
                        tmp = None
                    except FileExistsError:
                        pass
                    except OSError as exc:
                        if exc.errno not in _NO_LINKS:
                            raise
                        linked = None
                if linked is None:  # its bytes count as the temp file's until it is removed
                    created = self._create_excl(dir_fd, name, parts)
                return created
        finally:
            try:
                with sweeper.held():  # the temp file's removal and its count are one
                    gone = tmp is not None and dir_fd is not None and _unlink(tmp, dir_fd)
                    sweeper.landed(nbytes, (sub, name), scans, stored=created,
                                   freed=nbytes if gone else 0)  # fmt: skip
            finally:
                if dir_fd is not None:
                    os.close(dir_fd)

    def _create_excl(self, dir_fd: int, name: str, parts: Parts) -> bool:
        """:meth:`create_if_absent` where the filesystem has no hard links: ``O_EXCL``."""
        try:
            fd = os.open(name, _OPEN_TMP, self.file_mode, dir_fd=dir_fd)
        except FileExistsError:
            return False
        self._write_parts(fd, parts)
        return True


def _read(fd: int, n: int) -> bytes:
    """At most ``n`` bytes from ``fd`` (fewer at end of file)."""
    chunks = []
    while n > 0:
        data = os.read(fd, n)
        if not data:
            break
        chunks.append(data)
        n -= len(data)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _preadv_all(fd: int, bufs: list[memoryview], offset: int, where: str) -> None:
    """Fill every buffer of ``bufs`` from ``offset`` on (``preadv``, GIL released)."""
    while bufs:
        n = os.preadv(fd, bufs, offset)
        if n == 0:
            raise TruncatedError(f"{where}: object shrank while it was read")
        offset += n
        while bufs and n >= bufs[0].nbytes:
            n -= bufs[0].nbytes
            bufs.pop(0)
        if bufs and n:
            bufs[0] = bufs[0][n:]


def _read_into(fd: int, view: memoryview) -> int:
    """Fill ``view`` from ``fd``; the bytes read (fewer at end of file)."""
    got = 0
    while got < view.nbytes:
        n = os.readv(fd, [view[got:]])
        if not n:
            break
        got += n
    return got


def _place(key: str) -> tuple[str, str]:
    """``key``'s fan-out directory and file name under the root."""
    name = quote(key, safe="-_.")
    if len(name) > _MAX_NAME or name.startswith("."):
        name = "h-" + hashlib.sha256(key.encode()).hexdigest()
    return xxhash.xxh3_64_hexdigest(key.encode())[:2], name


def _size_at(name: str, dir_fd: int) -> int:
    """The size of the regular file ``name`` in ``dir_fd`` (0: none there)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def _unlink(name: str, dir_fd: int) -> bool:
    """Remove ``name`` in the directory ``dir_fd``; False when it was gone already or
    could not be removed."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False


def _unescape(field: str) -> str:
    """A mount point as the kernel escapes it (space, tab, newline, backslash as octal)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def filesystem_type(path: str, mountinfo: str | None = None) -> str | None:
    """The type of the filesystem ``path`` lies on (its longest mount point), or None
    when the mount table cannot be read. ``mountinfo``: the table's text (tests)."""
    if mountinfo is None:
        try:
            with open(_MOUNTINFO) as f:
                mountinfo = f.read()
        except OSError:
            return None
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, after = left.split(), right.split()
        if not sep or len(fields) < 5 or not after:
            continue
        point = _unescape(fields[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):  # a later mount over the same point wins
            best, best_type = point, after[0]
    return best_type


def is_local(path: str, mountinfo: str | None = None) -> bool:
    """True when ``path`` is on a filesystem type of :data:`LOCAL_TYPES`."""
    return filesystem_type(path, mountinfo) in LOCAL_TYPES
