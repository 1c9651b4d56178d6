"""The bound on a directory tier (``file_max_bytes``): :class:`DirectorySweep`, which the
tier (:class:`~kvtier.objects.tiers.file.FileTier`) owns, asks before each write and runs
on a background thread (a read never sweeps). Least recently used objects (oldest mtime; a
hit refreshes it) go first. Its state lives in the files themselves (sizes, mtimes), so
the bound survives restarts; a lock file keeps engines sharing the directory from sweeping
at once, and the shared ledger beside it
(:class:`~kvtier.objects.tiers.file_ledger.DirectoryLedger`) holds the directory's byte
count that all of them keep."""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvtier.objects.tiers.file_layout import (
    FANOUT,
    OPEN_ROOT,
    OPEN_SUBDIR,
    TMP_PREFIX,
    is_fanout,
    is_manifest,
    unlink,
)
from kvtier.objects.tiers.file_ledger import LEDGER_NAME, DirectoryLedger

__all__ = ["DirectorySweep", "SweepStats"]

log = logging.getLogger("kvtier.tiers.file")

#: the most objects a scan keeps in eviction order for the writes
_MAX_CANDIDATES = 1 << 16
_LOCK_NAME = ".sweep.lock"


@dataclass(slots=True)
class SweepStats:
    """What one :meth:`~kvtier.objects.tiers.file.FileTier.sweep` did (``skipped``: another
    engine was sweeping)."""

    skipped: bool = False
    total_bytes: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    temp_removed: int = 0
    #: fan-out names that are not directories (a symlink aiming writes out of the root, a
    #: file): never followed, never counted, never written through; logged
    foreign: int = 0


class DirectorySweep:
    """The bound on a :class:`~kvtier.objects.tiers.file.FileTier`'s directory: least
    recently used objects (oldest mtime) deleted down to ``low_water`` of ``max_bytes``,
    stale temp files removed, bounded or not.

    The bound is kept on the write path (``bound_writes``): the tier asks
    :meth:`admit` before each write, which counts the write's bytes against what the
    directory holds (the last scan's total, plus every byte admitted since) and, when
    that passes ``max_bytes``, deletes the oldest objects the last scan saw (a few
    unlinks; a full scan when it saw too few) on the writing thread before the write
    starts.

    Engines sharing the directory (replicas, tensor-parallel workers) keep one count
    (:class:`DirectoryLedger`, where the mount has ``flock``): each write's temp file is made
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
        self._ledger: DirectoryLedger | None = None
        if max_bytes is not None:
            try:
                self._ledger = DirectoryLedger(root)
            except Exception as exc:
                self._alone(exc)
        elif keep_ledger:
            try:
                self._ledger = DirectoryLedger(root, create=False)
            except FileNotFoundError:
                pass  # no engine bounds the directory: nothing to keep
            except Exception as exc:
                log.warning(
                    "file tier %s: cannot keep %s (%s): the engines' next scans "
                    "count what this run deletes",
                    root,
                    LEDGER_NAME,
                    getattr(exc, "strerror", None) or exc,
                )

    def start(self) -> None:
        """Sweep in the background from now on (at once, then as :meth:`_loop` says)."""
        # daemon: a sweep stuck on a hung mount must not keep the engine from exiting
        self._thread = threading.Thread(target=self._loop, name="kvtier-file-sweep", daemon=True)
        self._thread.start()

    @property
    def shared(self) -> bool:
        """Whether the bound is kept with a count every engine shares (:class:`DirectoryLedger`)."""
        return self._ledger is not None

    @property
    def counting(self) -> bool:
        """Whether the tier's writes and deletes must say their bytes: a bound of its own,
        or a ledger kept (``keep_ledger``)."""
        return self.max_bytes is not None or self._ledger is not None

    def _alone(self, exc: Exception, ledger: DirectoryLedger | None = None) -> None:
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
            self.root,
            LEDGER_NAME,
            getattr(exc, "strerror", None) or repr(exc),
        )

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
                if (
                    force
                    or self._stop.is_set()
                    or (
                        total is not None
                        and self.max_bytes is not None
                        and total + nbytes <= self.max_bytes
                    )
                ):
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
                    root_fd = os.open(self.root, OPEN_ROOT)
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
                root_fd = os.open(self.root, OPEN_ROOT)
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
            root_fd = os.open(self.root, OPEN_ROOT)
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
                if not is_fanout(e.name):
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
                sub_fd = os.open(sub, OPEN_SUBDIR, dir_fd=root_fd)
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
                    if entry.name.startswith(TMP_PREFIX):
                        if now - st.st_mtime > self.tmp_max_age_s and unlink(entry.name, sub_fd):
                            stats.temp_removed += 1
                        continue  # a live writer's temp file becomes an object soon
                    stats.total_bytes += st.st_size
                    seen[(sub, entry.name)] = st.st_size
                    if not is_manifest(entry.name):  # counted, never evicted
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
        for sub in FANOUT:
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
        self,
        root_fd: int,
        sub: str,
        now: float,
        stats: SweepStats,
        objects: list[tuple[float, int, str, str]],
    ) -> int | None:
        """The bytes the fan-out directory ``sub`` holds, objects and temp files of writes
        in flight (each inode once); its objects go to ``stats`` and (but manifests)
        ``objects``, its stale temp files are removed. 0 when there is no directory
        ``sub`` (or a symlink or file is there: never counted); None when it cannot be
        read (its count stays)."""
        try:
            sub_fd = os.open(sub, OPEN_SUBDIR, dir_fd=root_fd)
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
                if entry.name.startswith(TMP_PREFIX):
                    if now - st.st_mtime > self.tmp_max_age_s and unlink(entry.name, sub_fd):
                        stats.temp_removed += 1
                        continue
                else:
                    stats.total_bytes += st.st_size
                    if not is_manifest(entry.name):  # counted, never evicted
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
        sub_fd = os.open(sub, OPEN_SUBDIR, dir_fd=root_fd)
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
