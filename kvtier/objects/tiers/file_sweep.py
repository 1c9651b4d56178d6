"""The file tier's bound on its directory: the LRU sweep, and the temp files of crashed
writers swept away.

State lives in the files themselves (sizes, mtimes a hit refreshes), so the bound
survives restarts and holds with several engines sharing the directory; a lock file keeps
them from sweeping at once. Apart from :mod:`kvtier.objects.tiers.file` (the read and
write path), which never sweeps on a read: a background thread does, as this mixin.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass

__all__ = ["DirectoryBound", "SweepStats"]

log = logging.getLogger("kvtier.tiers.file")

_TMP_PREFIX = ".tmp-"
_LOCK_NAME = ".sweep.lock"
#: the root (the operator's path: a symlink there is theirs, and followed)
_OPEN_ROOT = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
#: a fan-out directory, opened relative to the root's fd: O_NOFOLLOW refuses a symlink
#: planted at its name (ELOOP) and O_DIRECTORY anything else that is not a directory, so
#: every object is opened, created, renamed and unlinked relative to a directory that is
#: really under the root, whatever the path looks like a moment later (no check-then-use)
_OPEN_SUBDIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_HEX = frozenset("0123456789abcdef")


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


class DirectoryBound:
    """:class:`~kvtier.objects.tiers.file.FileTier`'s sweep: least recently used objects
    (oldest mtime) deleted down to ``low_water`` of ``max_bytes`` when the total exceeds
    it, stale temp files removed, bounded or not. Runs on the tier's background thread
    (:meth:`_sweep_loop`), woken by writes; tests call :meth:`sweep` directly."""

    root: str
    max_bytes: int | None
    file_mode: int
    low_water: float
    tmp_max_age_s: float
    sweep_interval_s: float
    _lock: threading.Lock
    _written_since_sweep: int
    _stop: threading.Event
    _wake: threading.Event

    def sweep(self) -> SweepStats:
        """One pass: remove stale temp files, then LRU objects while over ``max_bytes``.

        Never called on the read path: the background thread runs it at open,
        every ``sweep_interval_s`` after writes, and when puts wrote a good part
        of the headroom. Tests call it directly.
        """
        lock_fd = self._try_lock()
        if lock_fd == -2:
            return SweepStats(skipped=True)
        try:
            return self._sweep_locked()
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

    def _sweep_locked(self) -> SweepStats:
        stats = SweepStats()
        try:
            root_fd = os.open(self.root, _OPEN_ROOT)
        except OSError as exc:
            log.warning("file tier %s: cannot open for a sweep: %s", self.root, exc.strerror)
            return stats
        try:
            return self._sweep_at(root_fd, stats)
        finally:
            os.close(root_fd)

    def _sweep_at(self, root_fd: int, stats: SweepStats) -> SweepStats:
        """The sweep through directory fds: like every read and write it never leaves the
        root (a symlinked fan-out name is neither listed, counted nor evicted through)."""
        now = time.time()
        objects: list[tuple[float, int, str, str]] = []
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
                    objects.append((st.st_mtime, st.st_size, sub, entry.name))
                    stats.total_bytes += st.st_size
            except OSError:
                continue  # unreadable: next pass
            finally:
                os.close(sub_fd)
        with self._lock:
            self._written_since_sweep = 0
        if self.max_bytes is None or stats.total_bytes <= self.max_bytes:
            return stats
        target = int(self.max_bytes * self.low_water)
        total = stats.total_bytes
        objects.sort()
        for mtime, size, sub, name in objects:
            if total <= target or self._stop.is_set():
                break
            try:
                sub_fd = os.open(sub, _OPEN_SUBDIR, dir_fd=root_fd)
            except OSError:
                continue
            try:
                if os.stat(name, dir_fd=sub_fd, follow_symlinks=False).st_mtime != mtime:
                    continue  # read or rewritten since the scan: young now
                if _unlink(name, sub_fd):
                    stats.evicted += 1
                    stats.evicted_bytes += size
                total -= size
            except FileNotFoundError:
                total -= size  # another engine evicted it
            except OSError:
                continue
            finally:
                os.close(sub_fd)
        return stats

    def _sweep_loop(self) -> None:
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


def _unlink(name: str, dir_fd: int) -> bool:
    """Remove ``name`` in the directory ``dir_fd``; False when it was gone already or
    could not be removed."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False
