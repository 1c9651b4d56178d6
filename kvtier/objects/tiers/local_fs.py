"""Is a directory on a local filesystem? (the file tier's inline reads need to know)

A read the worker makes itself holds up its step (:mod:`kvtier.objects.op_queue`), so
kvtier does it only where a read is known to be local and fast: a directory whose
mount is of a filesystem type on this list. Anything else (NFS, CIFS, Ceph, Lustre, a
FUSE mount such as s3fs or gcsfuse, a mount table that cannot be read) is treated as
remote, and its reads stay on the I/O threads.
"""

from __future__ import annotations

import os

__all__ = ["LOCAL_TYPES", "filesystem_type", "is_local"]

#: filesystem types whose reads are served by this machine's own disks or memory
LOCAL_TYPES = frozenset({
    "ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "jfs", "reiserfs",
    "tmpfs", "ramfs", "overlay", "vfat", "exfat", "ntfs3",
})  # fmt: skip

_MOUNTINFO = "/proc/self/mountinfo"


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
