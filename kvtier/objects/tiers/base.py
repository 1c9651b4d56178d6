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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvtier.errors import ObjectTooLarge, TruncatedError
from kvtier.objects.codec import payload_crc32

__all__ = [
    "Found",
    "ObjectTier",
    "Parts",
    "SlotReader",
    "StoredObject",
    "byte_view",
    "head_length_for",
    "split_into",
    "stored_prefix",
]

#: bytes before a chunk's header: magic and header length
_PREFIX_BYTES = 8

#: an encoded chunk as a list of buffers (header, payload), written without joining
Parts = Sequence[bytes | memoryview]
#: called once during a read, as soon as the object is known to be stored (before its
#: payload is read where the backend can tell: S3's response headers, Redis's length
#: line, an opened file); a lookup then queues the rest of its run
Found = Callable[[], None] | None


@dataclass(frozen=True, slots=True)
class StoredObject:
    """One object as the backend lists it (:meth:`ObjectTier.list_objects`)."""

    key: str
    #: bytes as stored (what the backend bills)
    size: int
    #: when it was last used, as the backend records it (Unix seconds; what counts as a
    #: use differs: each backend's ``list_objects`` says)
    used: float


def stored_prefix(found: Sequence[bool]) -> list[bool]:
    """True up to the first missing key, False from there on: what every backend's
    :meth:`ObjectTier.exists` answers (a lookup only uses the stored prefix)."""
    n = list(found).index(False) if False in found else len(found)
    return [True] * n + [False] * (len(found) - n)


def byte_view(buf: memoryview) -> memoryview:
    """``buf`` as flat unsigned bytes (what :meth:`ObjectTier.get_into` writes)."""
    return buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")


def head_length_for(size: int, payload: int, max_head: int, where: str) -> int:
    """How many bytes of a ``size``-byte object come before a ``payload``-byte slot;
    raises when no chunk for that slot can be that size (checked before reading)."""
    head = size - payload
    if head > max_head:
        raise ObjectTooLarge(
            f"{where}: object of {size} bytes, at most {payload + max_head} expected"
        )
    if head < _PREFIX_BYTES:
        raise TruncatedError(f"{where}: object of {size} bytes, too short for this chunk")
    return head


def split_into(blob: bytes | bytearray, dest: memoryview, max_head: int, where: str) -> bytes:
    """A chunk read whole, split as :meth:`ObjectTier.read_into` splits it: its last
    ``dest.nbytes`` bytes copied into ``dest``, the head before them returned."""
    head_len = head_length_for(len(blob), dest.nbytes, max_head, where)
    view = memoryview(blob)
    dest[:] = view[head_len:]
    return bytes(view[:head_len])


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
    #: its reads are served by this machine's own disks or memory (a directory on a local
    #: filesystem): the worker may read a lookup's first chunks itself (``inline_read_ms``)
    reads_local: bool = False
    #: bytes a read into a slot checksums at a time as they land (0: ``codec.HASH_PIECE``);
    #: :class:`~kvtier.objects.remote.RemoteIO` sets it from its read threads
    #: (``codec.hash_piece``). The directory tier's reads follow it
    hash_piece: int = 0
    #: its reads end by the deadline RemoteIO gives them
    #: (:func:`kvtier.objects.tiers.policy.call_deadline`): a read still in its call well
    #: after it is stuck (a bug, or a wait the backend cannot bound), not slow
    bounds_reads: bool = False

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """The stored prefix of ``keys`` (a prompt's chunks, in order): True up to the
        first missing key, False for it and every key after it, stored or not. A
        backend stops asking at the first missing key where it can (one request when
        the first chunk is missing); see :func:`stored_prefix`."""

    @abstractmethod
    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        """The stored bytes, or None when the key is not stored.

        With ``max_bytes``, an object larger than that raises
        :class:`~kvtier.errors.ObjectTooLarge` before it is read, and no more
        than ``max_bytes`` are ever read: a planted multi-GiB object must not
        make the engine allocate it.
        """

    def will_read(self, keys: Sequence[str]) -> None:
        """A hint that ``keys`` (a run's chunks, in order) are about to be read one after
        another (a local tier's inline reads): a backend may start fetching them. No-op
        by default; never raises."""
        del keys  # nothing to start for a backend that reads on request

    def get_into(self, key: str, buf: memoryview) -> int | None:
        """Read the whole object into the front of ``buf``; its length, or None when the
        key is not stored.

        An object longer than ``buf`` raises what :meth:`get` with ``max_bytes=buf.nbytes``
        raises (:class:`~kvtier.errors.ObjectTooLarge`), and nothing is ever written past
        ``buf``; its bytes after the returned length, and all of them after an error,
        may be anything. A compressed chunk (shorter than its slot) is read this way into
        a reused buffer, so a read allocates nothing of its size. This default reads
        through :meth:`get` (one copy); backends override it to read into ``buf``.
        """
        view = byte_view(buf)
        blob = self.get(key, max_bytes=view.nbytes)
        if blob is None:
            return None
        if len(blob) > view.nbytes:  # a backend's get that does not bound its read
            raise ObjectTooLarge(
                f"{self.name}: object of {len(blob)} bytes, at most {view.nbytes} expected"
            )
        view[: len(blob)] = blob
        return len(blob)

    def read_into(
        self, key: str, dest: memoryview, max_head: int, *, found: Found = None
    ) -> bytes | None:
        """Read a chunk straight into its host slot: the object's last ``dest.nbytes``
        bytes land in ``dest``, the bytes before them (the chunk's head) are returned;
        ``found`` is called once the key is known to be stored (:data:`Found`).

        None when the key is not stored. An object longer than ``dest.nbytes +
        max_head`` raises :class:`~kvtier.errors.ObjectTooLarge` before it is read;
        one too short to hold a head and ``dest`` raises
        :class:`~kvtier.errors.TruncatedError`. ``dest`` may hold any bytes after
        an error: the caller verifies before it uses them. This default reads
        through :meth:`get` (one extra copy); kvtier's backends read into ``dest``
        directly (:class:`SlotReader`).
        """
        blob = self.get(key, max_bytes=dest.nbytes + max_head)
        if blob is None:
            return None
        if found is not None:
            found()
        return split_into(blob, dest, max_head, self.name)

    def read_into_hashed(
        self, key: str, dest: memoryview, max_head: int, *, found: Found = None
    ) -> tuple[bytes, int] | None:
        """:meth:`read_into`, and the CRC-32 of the bytes in ``dest`` (the codec's
        checksum): (head, crc), None when the key is not stored. This default checksums
        ``dest`` after the read; kvtier's backends checksum the payload as it arrives
        (:class:`SlotReader`: one pass over memory instead of two)."""
        head = self.read_into(key, dest, max_head, found=found)
        return None if head is None else (head, payload_crc32(dest))

    @abstractmethod
    def put(self, key: str, parts: Parts) -> None:
        """Store the concatenation of ``parts``; readers see all of it or nothing."""

    def create_if_absent(self, key: str, parts: Parts) -> bool:
        """Store the concatenation of ``parts`` only if nothing is stored under ``key``,
        atomically: of any number of callers at once, on any machines, exactly one gets
        True and its bytes are what readers see; every other caller gets False and
        stores nothing. A claim, not a cache write (a generation's first writer,
        :func:`kvtier.objects.manifest.claim_generation`): a backend that cannot create
        atomically must raise, never fall back to a check and a :meth:`put`. Every kvtier
        tier overrides it; this default raises NotImplementedError.

        A retried call may answer False for bytes its own first try stored (the reply
        was lost): a caller that must know reads the object back and compares.
        """
        raise NotImplementedError(f"{type(self).__name__} has no atomic create")

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Remove keys; missing ones are ignored."""

    # -- listing and deleting in bulk: what ``kvtier store`` (usage, gc, verify) needs ----

    def list_objects(
        self, prefix: str = "", *, keep: Callable[[str], bool] | None = None
    ) -> Iterator[StoredObject]:
        """Every stored object whose key starts with ``prefix``: its key, its size as
        stored and its last use as the backend records it. ``keep``: only the keys it
        answers True for are measured and listed (a Redis listing spends commands on each
        key it measures: another application's keys are never measured). In no set order;
        an object written or deleted while the listing runs may be listed or not. Raises
        TierError when the backend fails; this default raises NotImplementedError (a
        tier that cannot be listed)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be listed")

    def list_keys(self, prefix: str) -> Iterator[str]:
        """The keys starting with ``prefix``, names only: less work than
        :meth:`list_objects` where the backend can tell (nothing measured, or only that
        prefix listed). This default lists through :meth:`list_objects`."""
        return (o.key for o in self.list_objects(prefix))

    def delete_many(self, keys: Sequence[str]) -> None:
        """Remove any number of keys (a gc's thousands) in the batches the backend takes;
        missing ones are ignored, a key the backend refuses to delete is a TierError
        (:meth:`delete`, an engine's few keys, may pass such a refusal over). This default
        is :meth:`delete`."""
        self.delete(keys)

    @abstractmethod
    def close(self) -> None:
        """Release connections and threads; the tier is unusable afterwards."""

    def __enter__(self) -> ObjectTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SlotReader(ObjectTier):
    """A backend that reads a chunk straight into its slot itself, checksumming each
    piece as it lands when asked (:meth:`_read_slot`): :meth:`read_into` and
    :meth:`read_into_hashed` are its two uses."""

    def read_into(
        self, key: str, dest: memoryview, max_head: int, *, found: Found = None
    ) -> bytes | None:
        got = self._read_slot(key, dest, max_head, hashed=False, found=found)
        return None if got is None else got[0]

    def read_into_hashed(
        self, key: str, dest: memoryview, max_head: int, *, found: Found = None
    ) -> tuple[bytes, int] | None:
        return self._read_slot(key, dest, max_head, hashed=True, found=found)

    @abstractmethod
    def _read_slot(
        self, key: str, dest: memoryview, max_head: int, *, hashed: bool, found: Found = None
    ) -> tuple[bytes, int] | None:
        """:meth:`read_into`'s read: (head, the payload's CRC-32 computed as it landed when
        ``hashed``, else 0); None when ``key`` is not stored. ``found``: called before the
        payload is read, once the key is known to be stored."""
