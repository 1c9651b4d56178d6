"""Object tier on any S3 API: AWS S3, MinIO, Ceph RGW, or moto's server in tests."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import boto3
import urllib3.exceptions
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from kvtier.config import RemoteURL
from kvtier.errors import (
    ObjectError,
    ObjectTooLarge,
    TierError,
    TierUnavailable,
    TruncatedError,
)
from kvtier.objects.codec import HASH_PIECE, LandingCrc, payload_crc32
from kvtier.objects.tiers.base import (
    Found,
    Parts,
    SlotReader,
    StoredObject,
    byte_view,
    head_length_for,
    split_into,
    stored_prefix,
)
from kvtier.objects.tiers.policy import RETRIES, Timeouts

__all__ = ["S3Tier", "client_config"]

#: the most bytes asked of a GET's body at once (see :func:`_read_upto`): the checksum's
#: piece, so each piece is checked as it lands, still in the CPU's cache. urllib3 spends
#: the same Python calls on every read whatever its size: 128 KiB pieces cost 0.35 ms more
#: client CPU per 4 MiB GET, and read at 0.80-0.86x of boto3's own ``read()`` against
#: 0.86-0.96x for 1 MiB (bench/tier_throughput.py, moto on 2 cores)
_PIECE = HASH_PIECE
#: the most keys one DeleteObjects takes
DELETE_BATCH = 1000
_MISSING = frozenset({"404", "NoSuchKey", "NotFound"})
_FAILURES = (BotoCoreError, ClientError, OSError, urllib3.exceptions.HTTPError)
#: error codes about one object: that object is a miss, the bucket keeps being used.
#: XMinioStorageFull is MinIO's full disk: like ENOSPC on the file tier and OOM on Redis,
#: writes fail one by one while reads go on.
_OBJECT_CODES = frozenset(
    {
        "InvalidObjectState",
        "InvalidRange",
        "EntityTooLarge",
        "KeyTooLongError",
        "PreconditionFailed",
        "NoSuchVersion",
        "InvalidArgument",
        "InvalidRequest",
        "XMinioStorageFull",
    }
)
#: more codes that concern one object when a GET of it answers them: an object sealed with
#: a KMS key this engine may not use, or written by another account without granting the
#: bucket's owner access, is refused with 403 AccessDenied while every other object reads
#: (anyone who can write the bucket can plant one). A credential that lost access to the
#: whole bucket still shows on every write (and HEAD), which back off; reads then fail
#: fast, one request each, instead of pausing every read for one planted object.
_GET_OBJECT_CODES = frozenset({"AccessDenied"})
#: error codes about the bucket, the credentials or the service: back off
_TIER_CODES = frozenset(
    {
        "NoSuchBucket",
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "RequestTimeTooSkewed",
        "AccountProblem",
        "AuthorizationHeaderMalformed",
        "PermanentRedirect",
        "SlowDown",
        "Throttling",
        "RequestTimeout",
        "ServiceUnavailable",
        "InternalError",
    }
)


def _is_object_error(exc: ClientError, op: str = "") -> bool:
    """Whether a service error concerns one object (4xx) rather than bucket or service."""
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    if code in _OBJECT_CODES or (op == "get" and code in _GET_OBJECT_CODES):
        return True
    if code in _TIER_CODES or status >= 500 or status in (301, 307, 401, 403):
        return False
    return 400 <= status < 500


def _object_size(resp: dict[str, Any]) -> int | None:
    """The whole object's size: from ``Content-Range: bytes 0-N/TOTAL`` of a ranged GET."""
    total = str(resp.get("ContentRange") or "").rpartition("/")[2]
    if total.isdigit():
        return int(total)
    length = resp.get("ContentLength")
    return int(length) if length is not None else None


def _read_upto(body: Any, buf: memoryview, landing: LandingCrc | None = None) -> int:
    """Fill ``buf`` from a GET's streamed ``body``; the bytes read (fewer when it ends).
    ``landing``: ``buf``'s checksum, computed as its pieces land.

    In pieces of :data:`_PIECE`: urllib3's ``readinto`` reads into a new bytes object of
    the size asked for and copies it, so one call for the whole buffer would allocate a
    buffer of the object's size per read (and check it only once all of it landed)."""
    got = 0
    while got < buf.nbytes:
        n = body.readinto(buf[got : got + _PIECE])
        if not n:
            break
        got += n
        if landing is not None:
            landing.landed(got)
    return got


def _fill(body: Any, bufs: list[memoryview], where: str, landing: LandingCrc | None = None) -> None:
    """Fill ``bufs`` in order from a GET's streamed ``body`` (TruncatedError when it ends
    first); ``landing`` checksums the one of them it was made for as it fills."""
    for buf in bufs:
        track = landing if landing is not None and buf is landing.view else None
        if _read_upto(body, buf, track) < buf.nbytes:
            raise TruncatedError(f"{where}: body ended early")


def client_config(io_threads: int, lookup_timeout_ms: int) -> Config:
    """botocore settings: a pool per I/O thread, the tier policy's waits and retries.

    RemoteIO has its own deadline and backoff, so botocore's default of
    several retries with sleeps would only hide an outage for longer. The
    codec's end-to-end CRC-32 checksum makes botocore's extra CRC pass redundant.
    """
    waits = Timeouts.from_ms(lookup_timeout_ms)
    return Config(
        max_pool_connections=io_threads + 2,
        connect_timeout=waits.connect_s,
        read_timeout=waits.body_s,
        retries={"max_attempts": 1 + RETRIES, "mode": "standard"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )


class _PartsReader(io.RawIOBase):
    """A seekable file over a list of buffers, so a chunk is uploaded without joining."""

    def __init__(self, parts: Parts) -> None:
        self._parts = [memoryview(p).cast("B") for p in parts]
        self._len = sum(p.nbytes for p in self._parts)
        self._pos = 0

    def __len__(self) -> int:
        return self._len

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, min(self._len, base + offset))
        return self._pos

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        out = memoryview(buffer).cast("B")
        want, done, skip = out.nbytes, 0, self._pos
        for part in self._parts:
            if skip >= part.nbytes:
                skip -= part.nbytes
                continue
            n = min(part.nbytes - skip, want - done)
            out[done : done + n] = part[skip : skip + n]
            done += n
            skip = 0
            if done == want:
                break
        self._pos += done
        return done

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = self._len - self._pos
        buf = bytearray(min(size, self._len - self._pos))
        n = self.readinto(memoryview(buf))
        return bytes(buf[:n])


class S3Tier(SlotReader):
    """Chunks as objects under ``s3://bucket/prefix/``.

    Endpoint, region and credentials come from boto3's own discovery
    (``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``, profiles, instance roles), and
    ``endpoint_url`` overrides the endpoint when given.
    """

    name = "s3"

    def __init__(
        self,
        url: RemoteURL | str,
        *,
        endpoint_url: str | None = None,
        io_threads: int = 4,
        lookup_timeout_ms: int = 2000,
        join_parts: bool = False,
    ) -> None:
        remote = RemoteURL.parse(url)
        if remote.kind != "s3":
            raise ValueError("S3Tier needs s3://bucket[/prefix]")
        self.bucket, self.prefix = remote.bucket, remote.prefix
        self._join_parts = join_parts
        try:
            self._client = boto3.session.Session().client(
                "s3",
                endpoint_url=endpoint_url or None,
                config=client_config(io_threads, lookup_timeout_ms),
            )
        except _FAILURES as exc:
            raise TierUnavailable(f"s3 client for {self._where()}: {exc}") from exc
        # RemoteIO runs at most io_threads requests itself; two HEAD helpers (whose caller
        # waits without a connection) keep every request within the pool of io_threads + 2,
        # so urllib3 never opens and discards extra connections
        self._heads = ThreadPoolExecutor(
            max_workers=max(1, min(2, io_threads // 2)), thread_name_prefix="kvtier-s3-head"
        )

    def _where(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def __repr__(self) -> str:
        return f"S3Tier({self._where()!r})"

    def object_key(self, key: str) -> str:
        """The S3 object key that holds chunk ``key``."""
        return self.prefix + key

    @contextmanager
    def _errors(self, op: str) -> Iterator[None]:
        """The one place botocore's, urllib3's and the OS's exceptions become kvtier errors
        (:meth:`_fail` says which); anything else (a kvtier error raised on purpose, a
        bug) passes as it is."""
        try:
            yield
        except _FAILURES as exc:
            raise self._fail(op, exc) from exc

    def _fail(self, op: str, exc: Exception) -> TierError:
        """ObjectError for a 4xx about one object, TierUnavailable for everything else."""
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            detail = f"{err.get('Code', '?')} {err.get('Message', '')}".strip()
            if _is_object_error(exc, op):
                return ObjectError(f"s3 {op} {self._where()}: {detail}")
        else:
            detail = f"{type(exc).__name__}: {exc}"
        return TierUnavailable(f"s3 {op} {self._where()}: {detail}")

    def _head(self, key: str) -> bool:
        with self._errors("head"):
            try:
                self._client.head_object(Bucket=self.bucket, Key=self.object_key(key))
                return True
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in _MISSING:
                    return False
                if _is_object_error(exc, "head"):
                    return False  # this object cannot be served; the others may
                raise

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """The first key alone (a missing first chunk costs one request), then the rest
        in parallel; answers after the first missing key are False."""
        if not keys:
            return []
        if not self._head(keys[0]):
            return [False] * len(keys)
        # map's iterator cancels the HEADs not yet sent when one fails: none waits out a
        # timeout against an endpoint that is down
        out = [True, *self._heads.map(self._head, keys[1:])]
        return stored_prefix(out)

    def _get_object(self, key: str, limit: int | None) -> dict[str, Any] | None:
        """GetObject of ``key``'s first ``limit`` bytes (all without one); None when it is
        not stored, TruncatedError for a range of an empty object, else mapped errors."""
        extra = {} if limit is None else {"Range": f"bytes=0-{max(1, limit) - 1}"}
        with self._errors("get"):
            try:
                resp: dict[str, Any] = self._client.get_object(
                    Bucket=self.bucket, Key=self.object_key(key), **extra
                )
                return resp
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                if code in _MISSING:
                    return None
                if code == "InvalidRange" and limit is not None:
                    raise TruncatedError(f"s3 get {self._where()}: empty object") from None
                raise

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        """GET, ranged to ``max_bytes`` when given: an oversized object is never downloaded."""
        try:
            resp = self._get_object(key, max_bytes)
        except TruncatedError:
            return b""  # a range of an empty object: the codec reports it as truncated
        if resp is None:
            return None
        body = resp["Body"]
        try:
            with self._errors("get"):
                if max_bytes is None:
                    return bytes(body.read())
                # the size before the body: a server that ignores Range sends the whole object
                size = _object_size(resp)
                if size is None or size <= max_bytes:
                    data = body.read(max_bytes + 1)  # bounded even without a length
                    size = len(data)
                if size > max_bytes:
                    raise self._too_large(size, max_bytes)
                return bytes(data)
        finally:
            body.close()

    def get_into(self, key: str, buf: memoryview) -> int | None:
        """:meth:`ObjectTier.get_into`: one GET ranged to ``buf``'s size, its body streamed
        into ``buf`` (``readinto``: no buffer of the object's size); an object its length
        shows to be larger is refused before a byte of its body is read."""
        view = byte_view(buf)
        try:
            resp = self._get_object(key, view.nbytes)
        except TruncatedError:
            return 0  # a range of an empty object (get's b"")
        if resp is None:
            return None
        body = resp["Body"]
        try:
            with self._errors("get"):
                size = _object_size(resp)
                if size is not None and size > view.nbytes:
                    raise self._too_large(size, view.nbytes)
                got = _read_upto(body, view if size is None else view[:size])
                if size is None and got == view.nbytes and body.read(1):  # no length said
                    raise self._too_large(got + 1, view.nbytes)
                return got
        finally:
            body.close()

    def _too_large(self, size: int, max_bytes: int) -> ObjectTooLarge:
        return ObjectTooLarge(
            f"s3 get {self._where()}: object of {size} bytes or more, at most {max_bytes} expected"
        )

    def _read_slot(
        self, key: str, dest: memoryview, max_head: int, *, hashed: bool, found: Found = None
    ) -> tuple[bytes, int] | None:
        """:meth:`SlotReader._read_slot`: one ranged GET, its body streamed into the slot
        (``readinto``, no full copy); ``hashed``: each piece checksummed as it lands (one
        pass over memory, not a read and then a checksum)."""
        limit = dest.nbytes + max_head
        resp = self._get_object(key, limit)
        if resp is None:
            return None
        body = resp["Body"]
        where = f"s3 get {self._where()}"
        try:
            if found is not None:  # the response's headers are in, its body not read yet
                found()
            with self._errors("get"):
                size = _object_size(resp)
                if size is None:  # no length: read what the range allows, then split it
                    whole_head = split_into(body.read(limit + 1), dest, max_head, where)
                    return whole_head, payload_crc32(dest) if hashed else 0
                head = bytearray(head_length_for(size, dest.nbytes, max_head, where))
                landing = LandingCrc(dest) if hashed else None
                _fill(body, [memoryview(head), dest], where, landing)
                return bytes(head), landing.result() if landing is not None else 0
        finally:
            body.close()

    def put(self, key: str, parts: Parts) -> None:
        body = b"".join(parts) if self._join_parts or len(parts) == 1 else _PartsReader(parts)
        with self._errors("put"):
            self._client.put_object(Bucket=self.bucket, Key=self.object_key(key), Body=body)

    def delete(self, keys: Sequence[str]) -> None:
        keys = list(keys)
        with self._errors("delete"):
            for i in range(0, len(keys), DELETE_BATCH):
                batch = [{"Key": self.object_key(k)} for k in keys[i : i + DELETE_BATCH]]
                self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )

    def list_objects(
        self, prefix: str = "", *, keep: Callable[[str], bool] | None = None
    ) -> Iterator[StoredObject]:
        """:meth:`ObjectTier.list_objects`: ListObjectsV2 pages under the tier's prefix; an
        object's bytes are its listed ``Size``, its last use its ``LastModified``: its last
        *write* (S3 records no reads: a chunk every engine hits but none rewrites looks
        old)."""
        for obj in self._listed(prefix):
            key = str(obj["Key"])[len(self.prefix) :]
            if keep is None or keep(key):
                yield StoredObject(key, int(obj["Size"]), obj["LastModified"].timestamp())

    def list_keys(self, prefix: str) -> Iterator[str]:
        """:meth:`ObjectTier.list_keys`: one listing of that prefix alone."""
        for obj in self._listed(prefix):
            yield str(obj["Key"])[len(self.prefix) :]

    def _listed(self, prefix: str) -> Iterator[dict[str, Any]]:
        pages = self._client.get_paginator("list_objects_v2")
        with self._errors("list"):
            for page in pages.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                yield from page.get("Contents", ())

    def delete_many(self, keys: Sequence[str]) -> None:
        """:meth:`ObjectTier.delete_many`: DeleteObjects in batches of :data:`DELETE_BATCH`;
        an object a batch did not delete (its ``Errors``: AccessDenied ...) is a TierError,
        raised after that batch."""
        for i in range(0, len(keys), DELETE_BATCH):
            batch = [{"Key": self.object_key(k)} for k in keys[i : i + DELETE_BATCH]]
            with self._errors("delete"):
                resp = self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )
            errors = resp.get("Errors") or []
            if errors:
                first = errors[0]
                raise TierError(
                    f"s3 delete: {len(errors)} objects not deleted "
                    f"({first.get('Code')}: {first.get('Message')})"
                )

    def close(self) -> None:
        self._heads.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def create_if_absent(self, key: str, parts: Parts) -> bool:
        """:meth:`ObjectTier.create_if_absent`: PutObject with ``If-None-Match: *`` (AWS S3
        since 2024-08, MinIO, R2, GCS; SeaweedFS since 2025-08): 412 PreconditionFailed
        when the object exists; 409 ConditionalRequestConflict (a write of it under way)
        is tried again. A store that ignores the header overwrites: kvtier needs one that
        honours it for the claim to be exclusive."""
        body = b"".join(parts)
        attempt = 0
        while True:
            with self._errors("create"):
                try:
                    self._client.put_object(
                        Bucket=self.bucket, Key=self.object_key(key), Body=body, IfNoneMatch="*"
                    )
                    return True
                except ClientError as exc:
                    code = str(exc.response.get("Error", {}).get("Code", ""))
                    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                    if code == "PreconditionFailed" or status == 412:
                        return False
                    conflict = code == "ConditionalRequestConflict" or status == 409
                    if not conflict or attempt == RETRIES:
                        raise
            attempt += 1
