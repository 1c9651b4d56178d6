"""The directory tier's layout on disk, which the tier (:mod:`kvtier.objects.tiers.file`)
and its sweep (:mod:`kvtier.objects.tiers.file_sweep`) share: where a key's file goes
(:func:`place`: a fan-out directory named by the first byte of the key's xxh3 hash, then
the quoted key), how the root and a fan-out directory are opened (never through a symlink
planted under the root), and the names that are not objects (temp files of writes in
flight) or never evicted (generation manifests)."""

from __future__ import annotations

import hashlib
import os
from urllib.parse import quote

import xxhash

from kvtier.keys import GENERATION_PREFIX

__all__ = [
    "FANOUT",
    "OPEN_ROOT",
    "OPEN_SUBDIR",
    "TMP_PREFIX",
    "is_fanout",
    "is_manifest",
    "place",
    "unlink",
]

_MAX_NAME = 200  # below every common filesystem's 255-byte name limit
#: a write's temp file in the fan-out directory of its object, renamed over its name
TMP_PREFIX = ".tmp-"
#: the end of a generation manifest's file name (``gen-<id>/manifest`` quoted by
#: :func:`place`; kvtier.objects.manifest.MANIFEST, which imports this package)
_MANIFEST_SUFFIX = "%2Fmanifest"
#: the fan-out directories, in the ledger's slot order
FANOUT = [f"{i:02x}" for i in range(256)]
#: the root (the operator's path: a symlink there is theirs, and followed)
OPEN_ROOT = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
#: a fan-out directory, opened relative to the root's fd: O_NOFOLLOW refuses a symlink
#: planted at its name (ELOOP) and O_DIRECTORY anything else that is not a directory, so
#: every object is opened, created, renamed and unlinked relative to a directory that is
#: really under the root, whatever the path looks like a moment later (no check-then-use)
OPEN_SUBDIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_HEX = frozenset("0123456789abcdef")


def place(key: str) -> tuple[str, str]:
    """``key``'s fan-out directory and file name under the root."""
    name = quote(key, safe="-_.")
    if len(name) > _MAX_NAME or name.startswith("."):
        name = "h-" + hashlib.sha256(key.encode()).hexdigest()
    return xxhash.xxh3_64_hexdigest(key.encode())[:2], name


def is_fanout(name: str) -> bool:
    """Whether a name at the root is a fan-out directory's (two hex digits)."""
    return len(name) == 2 and set(name) <= _HEX


def is_manifest(name: str) -> bool:
    """Whether a file name under a fan-out directory is a generation's manifest
    (:func:`kvtier.objects.manifest.manifest_key` placed by :func:`place`)."""
    return name.startswith(GENERATION_PREFIX) and name.endswith(_MANIFEST_SUFFIX)


def unlink(name: str, dir_fd: int) -> bool:
    """Remove ``name`` in the directory ``dir_fd``; False when it was gone already or
    could not be removed."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False
