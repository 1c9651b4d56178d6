"""Object tier on a directory: a local disk, or NFS/shared storage mounted on every node."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote

import xxhash

from kvtier.errors import ObjectError, ObjectTooLarge, TierError, TierUnavailable, TruncatedError
from kvtier.tiers.base import ObjectTier, Parts, head_length_for

__all__ = ["FileTier", "SweepStats"]

log = logging.getLogger("kvtier.tiers.file")

_MAX_NAME = 200  # below every common filesystem's 255-byte name limit
_TMP_PREFIX = ".tmp-"
_LOCK_NAME = ".sweep.lock"
#: errors of the file system or its mount rather than of one file: RemoteIO backs off on
#: these; every other OSError (ENOSPC, EACCES, ELOOP from a symlink, ESTALE: NFS says the
#: file another node deleted or replaced is gone ...) is one object's miss
_TIER_ERRNOS = frozenset({
    errno.EIO, errno.ENOTCONN, errno.ETIMEDOUT, errno.EHOSTDOWN,
    errno.EHOSTUNREACH, errno.ENETDOWN, errno.ENETUNREACH, errno.ECONNREFUSED,
    errno.ECONNRESET, errno.ENODEV, errno.EROFS, errno.ESHUTDOWN,
})  # fmt: skip
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
# O_NOFOLLOW: a symlink planted at a chunk's name is refused, not followed. O_NONBLOCK: a FIFO
# planted there opens at once (and is refused by fstat) instead of blocking an I/O thread.
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_OPEN_TMP = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: a hit refreshes a file's mtime at most this often: LRU needs minutes, not a write per hit
_TOUCH_AFTER_S = 60.0
_HEX = frozenset("0123456789abcdef")


@dataclass(slots=True)
class SweepStats:
    """What one :meth:`FileTier.sweep` did (``skipped``: another engine was sweeping)."""

    skipped: bool = False
    total_bytes: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    temp_removed: int = 0


class FileTier(ObjectTier):
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
    directory through a common group (a setgid directory, umask 002).

    Nothing in the directory is trusted: a read opens with ``O_NOFOLLOW |
    O_NONBLOCK`` and refuses anything but a regular file no larger than the
    caller's bound before reading a byte.

    ``max_bytes`` bounds the directory: a background sweep deletes the least
    recently used objects (oldest mtime; a hit refreshes it) down to
    ``low_water`` of the bound when the total exceeds it. State lives in the
    files themselves, so the bound survives restarts and holds with several
    engines sharing the directory (a lock file keeps them from sweeping at
    the same time; files vanishing mid-sweep are expected). Temp files of
    crashed writers older than ``tmp_max_age_s`` are swept at open and then
    periodically, bounded or not.
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
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError("FileTier max_bytes must not be negative")
        if not 0.0 < low_water <= 1.0:
            raise ValueError("FileTier low_water must be in (0, 1]")
        self.root = os.path.abspath(root)
        self.max_bytes = max_bytes
        self.file_mode = file_mode
        self.low_water = low_water
        self.tmp_max_age_s = tmp_max_age_s
        self.sweep_interval_s = sweep_interval_s
        try:
            os.makedirs(self.root, mode=0o770, exist_ok=True)
        except OSError as exc:
            raise TierUnavailable(f"file tier {self.root}: {exc.strerror}") from exc
        self._lock = threading.Lock()
        self._written_since_sweep = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._sweeper: threading.Thread | None = None
        if background_sweep:
            # daemon: a sweep stuck on a hung mount must not keep the engine from exiting
            self._sweeper = threading.Thread(
                target=self._sweep_loop, name="kvtier-file-sweep", daemon=True
            )
            self._sweeper.start()

    def __repr__(self) -> str:
        return f"FileTier({self.root!r})"

    def path(self, key: str) -> str:
        """Where ``key`` is stored (tests write corrupt objects straight there)."""
        name = quote(key, safe="-_.")
        if len(name) > _MAX_NAME or name.startswith("."):
            name = "h-" + hashlib.sha256(key.encode()).hexdigest()
        return os.path.join(self.root, xxhash.xxh3_64_hexdigest(key.encode())[:2], name)

    def _error(self, op: str, exc: OSError) -> TierError:
        msg = f"file tier {op} under {self.root}: {exc.strerror or type(exc).__name__}"
        if exc.errno in _TIER_ERRNOS:
            return TierUnavailable(msg)
        return ObjectError(msg)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """In order, stopping at the first missing key (answers after it are False)."""
        out = []
        for key in keys:
            try:
                st = os.lstat(self.path(key))
            except OSError as exc:
                if exc.errno in _TIER_ERRNOS:
                    raise self._error("exists", exc) from None
                break  # missing, or a name no object can be read from
            if not stat.S_ISREG(st.st_mode):
                break
            out.append(True)
        return out + [False] * (len(keys) - len(out))

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        try:
            fd = os.open(self.path(key), _OPEN_READ)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._error("get", exc) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ObjectError(f"file tier get under {self.root}: not a regular file")
            if max_bytes is not None and st.st_size > max_bytes:
                raise ObjectTooLarge(
                    f"file tier get under {self.root}: object of {st.st_size} bytes, "
                    f"at most {max_bytes} expected"
                )
            data = _read(fd, st.st_size)  # the size fstat saw: a file growing meanwhile is cut
            self._touch(fd, st)
            return data
        except OSError as exc:
            raise self._error("get", exc) from None
        finally:
            os.close(fd)

    def read_into(self, key: str, dest: memoryview, max_head: int) -> bytes | None:
        """One ``preadv`` fills the head buffer and the slot (no copy, GIL released)."""
        try:
            fd = os.open(self.path(key), _OPEN_READ)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._error("get", exc) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ObjectError(f"file tier get under {self.root}: not a regular file")
            where = f"file tier get under {self.root}"
            head = bytearray(head_length_for(st.st_size, dest.nbytes, max_head, where))
            bufs, offset = [memoryview(head), dest], 0
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
            self._touch(fd, st)
            return bytes(head)
        except OSError as exc:
            raise self._error("get", exc) from None
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
        dest = self.path(key)
        tmp = None
        try:
            fd, tmp = self._create_temp(os.path.dirname(dest))
            with open(fd, "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(tmp, dest)
            tmp = None
        except OSError as exc:
            if exc.errno in _DISK_FULL and self.max_bytes is not None:
                self._wake.set()  # make room for the next writes
            raise self._error("put", exc) from None
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        if self.max_bytes is not None:
            with self._lock:
                self._written_since_sweep += sum(memoryview(p).nbytes for p in parts)
                due = self._written_since_sweep > (1.0 - self.low_water) * self.max_bytes / 2
            if due:
                self._wake.set()

    def _create_temp(self, folder: str) -> tuple[int, str]:
        """A new temp file in ``folder``, created with ``file_mode`` (the kernel applies umask)."""
        for attempt in range(2):
            tmp = os.path.join(folder, _TMP_PREFIX + secrets.token_hex(8))
            try:
                return os.open(tmp, _OPEN_TMP, self.file_mode), tmp
            except FileNotFoundError:
                if attempt:
                    raise
                os.makedirs(folder, mode=0o770, exist_ok=True)
        raise AssertionError("unreachable")

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            try:
                os.unlink(self.path(key))
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise self._error("delete", exc) from None

    # -- bounding the directory ------------------------------------------------------------

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
        now = time.time()
        objects: list[tuple[float, int, str]] = []
        try:
            subdirs = [
                e.path for e in os.scandir(self.root)
                if len(e.name) == 2 and set(e.name) <= _HEX and e.is_dir(follow_symlinks=False)
            ]  # fmt: skip
        except OSError as exc:
            log.warning("file tier %s: cannot list for a sweep: %s", self.root, exc.strerror)
            return stats
        for sub in subdirs:
            if self._stop.is_set():
                return stats
            try:
                entries = list(os.scandir(sub))
            except OSError:
                continue  # removed by another engine, or unreadable: next pass
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # vanished under us
                if not stat.S_ISREG(st.st_mode):
                    continue
                if entry.name.startswith(_TMP_PREFIX):
                    if now - st.st_mtime > self.tmp_max_age_s and _unlink(entry.path):
                        stats.temp_removed += 1
                    continue  # a live writer's temp file becomes an object soon
                objects.append((st.st_mtime, st.st_size, entry.path))
                stats.total_bytes += st.st_size
        with self._lock:
            self._written_since_sweep = 0
        if self.max_bytes is None or stats.total_bytes <= self.max_bytes:
            return stats
        target = int(self.max_bytes * self.low_water)
        total = stats.total_bytes
        objects.sort()
        for mtime, size, path in objects:
            if total <= target or self._stop.is_set():
                break
            try:
                if os.lstat(path).st_mtime != mtime:
                    continue  # read or rewritten since the scan: young now
            except FileNotFoundError:
                total -= size  # another engine evicted it
                continue
            except OSError:
                continue
            if _unlink(path):
                stats.evicted += 1
                stats.evicted_bytes += size
            total -= size
        return stats

    def _sweep_loop(self) -> None:
        last = -float("inf")
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                written = self._written_since_sweep
            woken = self._wake.is_set()
            self._wake.clear()
            if woken or now - last >= self.tmp_max_age_s / 2 or (
                written and self.max_bytes is not None and now - last >= self.sweep_interval_s
            ):
                try:
                    self.sweep()
                except Exception:  # a sweep must never take the tier (or the engine) down
                    log.warning("file tier %s: sweep failed", self.root, exc_info=True)
                last = time.monotonic()
                self._stop.wait(min(1.0, self.sweep_interval_s))  # at most one sweep a second
            self._wake.wait(self.sweep_interval_s)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._sweeper is not None and self._sweeper is not threading.current_thread():
            self._sweeper.join(timeout=1.0)  # bounded: a hung mount must not hang shutdown


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


def _unlink(path: str) -> bool:
    """Remove ``path``; False when it was gone already or could not be removed."""
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
