"""Object tier on a directory: a local disk, or NFS/shared storage mounted on every node.

The read and write path (:class:`FileTier`), and whether the directory is on a local
filesystem (:func:`is_local`: reads the worker makes itself hold up its step, so kvtier
does them only where a read is known to be local and fast: a directory whose mount is of
a filesystem type in :data:`LOCAL_TYPES`. Anything else, NFS, CIFS, Ceph, Lustre, a FUSE
mount such as s3fs or gcsfuse, a mount table that cannot be read, is treated as remote,
and its reads stay on the I/O threads). Beside it: its layout on disk
(:mod:`~kvtier.objects.tiers.file_layout`: fan-out directories, names, the flags every
directory is opened with), the bound on its size
(:mod:`~kvtier.objects.tiers.file_sweep`: :class:`DirectorySweep`, which the tier owns and
runs on a background thread: a read never sweeps) and the byte count engines sharing the
directory keep (:mod:`~kvtier.objects.tiers.file_ledger`).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from urllib.parse import unquote

from kvtier.errors import ObjectError, ObjectTooLarge, TierError, TierUnavailable, TruncatedError
from kvtier.objects import codec
from kvtier.objects.tiers.base import (
    Found,
    Parts,
    SlotReader,
    StoredObject,
    byte_view,
    head_length_for,
)
from kvtier.objects.tiers.file_layout import OPEN_ROOT, OPEN_SUBDIR, TMP_PREFIX, place, unlink
from kvtier.objects.tiers.file_sweep import DirectorySweep, SweepStats

__all__ = ["LOCAL_TYPES", "FileTier", "filesystem_type", "is_local"]

log = logging.getLogger("kvtier.tiers.file")

#: errors of the file system or its mount rather than of one file: RemoteIO backs off on
#: these; every other OSError (ENOSPC, EACCES, ELOOP from a symlink, ESTALE: NFS says the
#: file another node deleted or replaced is gone ...) is one object's miss
_TIER_ERRNOS = frozenset(
    {
        errno.EIO,
        errno.ENOTCONN,
        errno.ETIMEDOUT,
        errno.EHOSTDOWN,
        errno.EHOSTUNREACH,
        errno.ENETDOWN,
        errno.ENETUNREACH,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ENODEV,
        errno.EROFS,
        errno.ESHUTDOWN,
    }
)
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

#: filesystem types whose reads are served by this machine's own disks or memory
LOCAL_TYPES = frozenset(
    {
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "f2fs",
        "zfs",
        "bcachefs",
        "jfs",
        "reiserfs",
        "tmpfs",
        "ramfs",
        "overlay",
        "vfat",
        "exfat",
        "ntfs3",
    }
)

_MOUNTINFO = "/proc/self/mountinfo"


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
        return os.path.join(self.root, *place(key))

    def _subdir(self, sub: str, op: str, *, create: bool = False) -> int | None:
        """An fd of the fan-out directory ``sub``, opened relative to the root without
        following a symlink there; None when it does not exist (and ``create`` is off).
        Raises ObjectError when ``sub`` is a symlink or anything but a directory."""
        root_fd = os.open(self.root, OPEN_ROOT)
        try:
            for attempt in range(2):
                try:
                    return os.open(sub, OPEN_SUBDIR, dir_fd=root_fd)
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
            sub, name = place(key)
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
        sub, name = place(key)
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
            return (
                st.st_size == 0 or os.preadv(fd, [bytearray(1)], st.st_size - 1, _RWF_NOWAIT) == 1
            )
        except OSError:  # EAGAIN: on the device; EOPNOTSUPP: cannot tell
            return False
        finally:
            os.close(fd)

    def _read_slot(
        self, key: str, dest: memoryview, max_head: int, *, hashed: bool, found: Found = None
    ) -> tuple[bytes, int] | None:
        """:meth:`SlotReader._read_slot`: one ``preadv`` fills the head buffer and the slot
        (no copy, GIL released); ``hashed``: the slot in pieces of :attr:`hash_piece`
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
                    at, step = len(head), self.hash_piece or codec.HASH_PIECE
                    landing = codec.LandingCrc(dest, step)
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
        sub, name = place(key)
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
                        sweeper.landed(nbytes, (sub, name), scans, stored=True, replaced=replaced)
                except OSError as exc:
                    if exc.errno in _DISK_FULL and self.max_bytes is not None:
                        sweeper.wake()  # make room for the next writes
                    raise
        except BaseException:
            with sweeper.held():  # the removal and its count are one
                gone = tmp is not None and dir_fd is not None and unlink(tmp, dir_fd)
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
        tmp = TMP_PREFIX + secrets.token_hex(8)
        return os.open(tmp, _OPEN_TMP, self.file_mode, dir_fd=dir_fd), tmp

    def _temp_maker(
        self, dir_fd: int
    ) -> tuple[Callable[[], tuple[int, str]], Callable[[str], bool]]:
        """:meth:`_create_temp` in ``dir_fd`` and the removal of what it made, for
        :meth:`DirectorySweep.reserve`."""
        return (lambda: self._create_temp(dir_fd)), (lambda tmp: unlink(tmp, dir_fd))

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            sub, name = place(key)
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

    def list_objects(
        self, prefix: str = "", *, keep: Callable[[str], bool] | None = None
    ) -> Iterator[StoredObject]:
        """:meth:`ObjectTier.list_objects`: ``os.scandir`` of the fan-out directories (in
        order); an object's bytes are its file's size, its last use its mtime (a hit
        refreshes it, at most once a minute). Dot-names (temp files, the ledger, the sweep's
        lock) are bookkeeping, never listed."""
        for sub in self._listed_fanout(sort=True):
            try:
                entries = list(os.scandir(sub))
            except OSError:
                continue  # removed meanwhile
            for e in entries:
                if e.name.startswith("."):
                    continue
                key = unquote(e.name)
                if not key.startswith(prefix) or (keep is not None and not keep(key)):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    yield StoredObject(key, st.st_size, st.st_mtime)

    def list_keys(self, prefix: str) -> Iterator[str]:
        """:meth:`ObjectTier.list_keys`: the fan-out directories' names, no stat."""
        for sub in self._listed_fanout(sort=False):
            try:
                names = os.listdir(sub)
            except OSError:
                continue  # removed meanwhile
            for name in names:
                if not name.startswith("."):
                    key = unquote(name)
                    if key.startswith(prefix):
                        yield key

    def _listed_fanout(self, *, sort: bool) -> list[str]:
        """The paths of the root's fan-out directories (symlinks there are not listed)."""
        try:
            subs = [
                e
                for e in os.scandir(self.root)
                if len(e.name) == 2 and e.is_dir(follow_symlinks=False)
            ]
        except OSError as exc:
            raise TierUnavailable(f"file tier {self.root}: {exc.strerror}") from None
        if sort:
            subs.sort(key=lambda e: e.name)
        return [e.path for e in subs]

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
        sub, name = place(key)
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
                        os.link(
                            tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False
                        )
                        created = linked = True
                        unlink(tmp, dir_fd)  # the object keeps the temp file's bytes
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
                    gone = tmp is not None and dir_fd is not None and unlink(tmp, dir_fd)
                    sweeper.landed(
                        nbytes, (sub, name), scans, stored=created, freed=nbytes if gone else 0
                    )
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


def _size_at(name: str, dir_fd: int) -> int:
    """The size of the regular file ``name`` in ``dir_fd`` (0: none there)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


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
