"""Object tier on a directory: a local disk, or NFS/shared storage mounted on every node."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from urllib.parse import quote

import xxhash

from kvtier.errors import TierUnavailable
from kvtier.tiers.base import ObjectTier, Parts

__all__ = ["FileTier"]

_MAX_NAME = 200  # below every common filesystem's 255-byte name limit


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
    """

    name = "file"

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise TierUnavailable(f"file tier {self.root}: {exc.strerror}") from exc

    def __repr__(self) -> str:
        return f"FileTier({self.root!r})"

    def path(self, key: str) -> str:
        """Where ``key`` is stored (tests write corrupt objects straight there)."""
        name = quote(key, safe="-_.")
        if len(name) > _MAX_NAME or name.startswith("."):
            name = "h-" + hashlib.sha256(key.encode()).hexdigest()
        return os.path.join(self.root, xxhash.xxh3_64_hexdigest(key.encode())[:2], name)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [os.path.isfile(self.path(k)) for k in keys]

    def get(self, key: str) -> bytes | None:
        try:
            with open(self.path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TierUnavailable(f"file tier get: {exc.strerror}") from exc

    def put(self, key: str, parts: Parts) -> None:
        dest = self.path(key)
        tmp = None
        try:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(dest))
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide chunks from engines run as others
            with open(fd, "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(tmp, dest)
            tmp = None
        except OSError as exc:
            raise TierUnavailable(f"file tier put under {self.root}: {exc.strerror}") from exc
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            try:
                os.unlink(self.path(key))
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise TierUnavailable(f"file tier delete: {exc.strerror}") from exc

    def close(self) -> None:
        pass
