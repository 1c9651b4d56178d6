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
bound survives restarts and holds with several engines sharing the directory; a lock
file keeps them from sweeping at once.
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
import threading
import time
from collections.abc import Iterator, Sequence
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


class DirectorySweep:
    """The bound on a :class:`FileTier`'s directory: least recently used objects (oldest
    mtime) deleted down to ``low_water`` of ``max_bytes``, stale temp files removed,
    bounded or not.

    The bound is kept on the write path (``bound_writes``): the tier asks
    :meth:`admit` before each write, which counts the write's bytes against what the
    directory holds (the last scan's total, plus every byte admitted since) and, when
    that passes ``max_bytes``, deletes the oldest objects the last scan saw (a few
    unlinks; a full scan when it saw too few) on the writing thread before the write
    starts. A sweep thread alone (:meth:`start`: when puts wrote a good part of the
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

    def start(self) -> None:
        """Sweep in the background from now on (at once, then as :meth:`_loop` says)."""
        # daemon: a sweep stuck on a hung mount must not keep the engine from exiting
        self._thread = threading.Thread(target=self._loop, name="kvtier-file-sweep", daemon=True)
        self._thread.start()

    @property
    def used_bytes(self) -> int | None:
        """What the directory holds as this engine counts it (None: not scanned yet)."""
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
        if over and self.bound_writes and not self._stop.is_set():
            try:
                self._make_room()
            except Exception:  # the write goes ahead: a failed eviction is not its failure
                log.warning("file tier %s: making room failed", self.root, exc_info=True)
        return scans

    def landed(
        self, nbytes: int, where: tuple[str, str], scans: int, *, stored: bool, replaced: int = 0
    ) -> None:
        """The write :meth:`admit` counted (``scans``: what it returned) is over:
        ``stored`` when it created or replaced the object (``replaced``: the bytes of the
        object it replaced)."""
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

    def removed(self, nbytes: int) -> None:
        """The tier deleted an object of ``nbytes``."""
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
                    gone = _evict(root_fd, sub, name, mtime)
                finally:
                    os.close(root_fd)
                if gone is not None:
                    with self._lock:
                        if self._used is not None:
                            self._used -= size
                        self.evicted += gone == _EVICTED
            self._sweep(evict_over=limit)

    def sweep(self) -> SweepStats:
        """One pass: remove stale temp files, then LRU objects while over ``max_bytes``.

        Never called on the read path: the background thread runs it at open,
        every ``sweep_interval_s`` after writes, and when puts wrote a good part
        of the headroom; a write runs it when the last one's eviction order ran out.
        Tests call it directly.
        """
        return self._sweep(evict_over=self.max_bytes)

    def _sweep(self, evict_over: int | None) -> SweepStats:
        """:meth:`sweep`, evicting to ``low_water`` when the directory holds more than
        ``evict_over`` (a write making room: already less than ``max_bytes``)."""
        with self._room:
            lock_fd = self._try_lock()
            if lock_fd == -2:
                return SweepStats(skipped=True)
            try:
                return self._sweep_locked(evict_over)
            finally:
                if lock_fd >= 0:
                    os.close(lock_fd)  # releases the flock

    def _try_lock(self) -> int:
        """An fd holding the sweep lock; -1 when locking is unsupported, -2 when it is held."""
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
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return -2
        except OSError:
            os.close(fd)
            return -1
        return fd

    def _sweep_locked(self, evict_over: int | None) -> SweepStats:
        stats = SweepStats()
        try:
            root_fd = os.open(self.root, _OPEN_ROOT)
        except OSError as exc:
            log.warning("file tier %s: cannot open for a sweep: %s", self.root, exc.strerror)
            return stats
        with self._lock:
            self._landed = []
        try:
            return self._sweep_at(root_fd, stats, evict_over)
        finally:
            with self._lock:
                self._landed = None
            os.close(root_fd)

    def _sweep_at(self, root_fd: int, stats: SweepStats, evict_over: int | None) -> SweepStats:
        """The sweep through directory fds: like every read and write it never leaves the
        root (a symlinked fan-out name is neither listed, counted nor evicted through)."""
        now = time.time()
        objects: list[tuple[float, int, str, str]] = []
        seen: dict[tuple[str, str], int] = {}  # every object counted, and its size
        try:
            subdirs = []
            for e in os.scandir(root_fd):
                if len(e.name) != 2 or not set(e.name) <= _HEX:
                    continue
                if e.is_dir(follow_symlinks=False):
                    subdirs.append(e.name)
                else:
                    stats.foreign += 1
        except OSError as exc:
            log.warning("file tier %s: cannot list for a sweep: %s", self.root, exc.strerror)
            return stats
        if stats.foreign:
            log.warning(
                "file tier %s: %d fan-out name(s) are not directories (symlinks or files "
                "put there); kvtier never reads or writes through them",
                self.root,
                stats.foreign,
            )
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
                gone = _evict(root_fd, sub, name, mtime)
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
        self, rest: list[tuple[float, int, str, str]], seen: dict[tuple[str, str], int], total: int
    ) -> None:
        """After a complete scan: the count of what the directory holds (``total``, what
        the scan counted less what it evicted), and the oldest objects left, ``rest``
        (enough for two evictions to ``low_water``), for the writes to evict."""
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


def _evict(root_fd: int, sub: str, name: str, mtime: float) -> str | None:
    """Unlink ``sub/name`` under the root when its mtime is still ``mtime``: _EVICTED when
    this call removed it, _GONE when it was gone already (another engine evicted it),
    None when it stays (read or rewritten since it was seen: young now; or it cannot be
    removed)."""
    try:
        sub_fd = os.open(sub, _OPEN_SUBDIR, dir_fd=root_fd)
    except FileNotFoundError:
        return _GONE
    except OSError:
        return None
    try:
        if os.stat(name, dir_fd=sub_fd, follow_symlinks=False).st_mtime != mtime:
            return None
        os.unlink(name, dir_fd=sub_fd)
        return _EVICTED
    except FileNotFoundError:
        return _GONE
    except OSError:
        return None
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
    so one engine's directory never holds more than the bound, writes in flight
    included. A background sweep counts again what other engines wrote. State
    lives in the files themselves, so the bound survives restarts and holds with
    several engines sharing the directory (a lock file keeps them from sweeping
    at the same time; files vanishing mid-sweep are expected; between two of its
    scans an engine does not see the others' writes). Temp files of crashed
    writers older than ``tmp_max_age_s`` are swept at open and then
    periodically, bounded or not. ``background_sweep=False`` (tests, tools):
    no sweep thread, and unless ``bound_writes`` the caller's :meth:`sweep`
    calls alone keep the bound.
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
        stored, replaced, scans = False, 0, 0
        try:
            scans = self.sweeper.admit(nbytes, (sub, name))
            with self._errors("put"):
                try:
                    dir_fd = self._subdir(sub, "put", create=True)
                    if dir_fd is None:  # removed again by another engine between mkdir and open
                        raise FileNotFoundError(errno.ENOENT, "fan-out directory vanished")
                    fd, tmp = self._create_temp(dir_fd)
                    self._write_parts(fd, parts)
                    if self.max_bytes is not None:
                        replaced = _size_at(name, dir_fd)  # a rewrite frees the old bytes
                    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                    tmp, stored = None, True
                except OSError as exc:
                    if exc.errno in _DISK_FULL and self.max_bytes is not None:
                        self.sweeper.wake()  # make room for the next writes
                    raise
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp, dir_fd=dir_fd)
                except OSError:
                    pass
            if dir_fd is not None:
                os.close(dir_fd)
            self.sweeper.landed(nbytes, (sub, name), scans, stored=stored,
                                replaced=replaced)  # fmt: skip

    def _write_parts(self, fd: int, parts: Parts) -> None:
        """Write ``parts`` to the new file ``fd`` (closed after), in the tier's group."""
        with open(fd, "wb") as f:
            self._own_group(fd)
            for part in parts:
                f.write(part)

    def _create_temp(self, dir_fd: int) -> tuple[int, str]:
        """A new temp file in the directory ``dir_fd``: its fd and its name there, created
        with ``file_mode`` (the kernel applies umask)."""
        tmp = _TMP_PREFIX + secrets.token_hex(8)
        return os.open(tmp, _OPEN_TMP, self.file_mode, dir_fd=dir_fd), tmp

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            sub, name = _place(key)
            with self._errors("delete"):
                dir_fd = self._subdir(sub, "delete")
                if dir_fd is None:
                    continue
                try:
                    size = _size_at(name, dir_fd) if self.max_bytes is not None else 0
                    os.unlink(name, dir_fd=dir_fd)
                    self.sweeper.removed(size)  # the bound's count frees it too
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
        try:
            # counted like a put's: the bound holds for claims too
            scans = self.sweeper.admit(nbytes, (sub, name))
            with self._errors("create"):
                dir_fd = self._subdir(sub, "create", create=True)
                if dir_fd is None:  # removed again by another engine between mkdir and open
                    raise FileNotFoundError(errno.ENOENT, "fan-out directory vanished")
                fd, tmp = self._create_temp(dir_fd)
                self._write_parts(fd, parts)
                try:
                    os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd,
                            follow_symlinks=False)  # fmt: skip
                    created = True
                except FileExistsError:
                    return False
                except OSError as exc:
                    if exc.errno not in _NO_LINKS:
                        raise
                    created = self._create_excl(dir_fd, name, parts)
                    return created
        finally:
            if tmp is not None and dir_fd is not None:
                _unlink(tmp, dir_fd)
            if dir_fd is not None:
                os.close(dir_fd)
            self.sweeper.landed(nbytes, (sub, name), scans, stored=created)
        return True

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
