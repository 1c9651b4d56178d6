"""The one interface every object tier implements.

Deliberately tiny and synchronous: RemoteIO runs it on its own threads and
owns queues, timeouts and backoff, so a backend only has to move bytes and
sort its own failures: :class:`~kvtier.errors.TierUnavailable` when the
backend cannot be reached (RemoteIO backs off), :class:`~kvtier.errors.ObjectError`
when one object is bad and the backend works (that object is a miss, nothing
else stops).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

__all__ = ["ObjectTier", "Parts"]

#: an encoded chunk as a list of buffers (header, payload), written without joining
Parts = Sequence[bytes | memoryview]


class ObjectTier(ABC):
    """A flat key -> bytes store shared by replicas (a directory, a bucket, a Redis).

    Every method may be called from several threads at once. A connection-level
    failure raises ``TierUnavailable``, a failure of one object ``ObjectError``,
    both with a message that holds no secret; a missing key is not a failure.
    The store is shared and writable by others, so nothing read from it is
    trusted: sizes are checked before bytes are read.
    """

    #: "file", "s3" or "redis"
    name: str

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored, in order."""

    @abstractmethod
    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        """The stored bytes, or None when the key is not stored.

        With ``max_bytes``, an object larger than that raises
        :class:`~kvtier.errors.ObjectTooLarge` before it is read, and no more
        than ``max_bytes`` are ever read: a planted multi-GiB object must not
        make the engine allocate it.
        """

    @abstractmethod
    def put(self, key: str, parts: Parts) -> None:
        """Store the concatenation of ``parts``; readers see all of it or nothing."""

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Remove keys; missing ones are ignored."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and threads; the tier is unusable afterwards."""

    def __enter__(self) -> ObjectTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
