"""Every foreign exception a backend maps, raised where the backend's client raises it,
ends as the same kvtier error through every public method (exists, get, read_into, put,
delete), and an exception no backend maps is never swallowed or renamed.

``test_tier_errors.py`` pins each backend's classifier; these tests pin that every
operation goes through it (a call site left out of the mapping leaks a redis-py, botocore
or OS exception into RemoteIO, which files it as an unexpected failure).
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import urllib3.exceptions
from botocore.exceptions import (
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)

from kvtier.errors import ObjectError, ObjectTooLarge, TierError, TierUnavailable
from kvtier.objects.tiers.file import FileTier
from kvtier.objects.tiers.redis import RedisTier, ReplyTooLarge
from kvtier.objects.tiers.redis_cluster import NodeUnavailable, RedisClusterTier
from kvtier.objects.tiers.s3 import S3Tier

OBJ, TIER, BIG, NODE = ObjectError, TierUnavailable, ObjectTooLarge, NodeUnavailable


class Unexpected(Exception):
    """No backend maps this: it must reach the caller as it is."""


def _get(tier: Any) -> object:
    return tier.get("k")


def _get_bounded(tier: Any) -> object:
    return tier.get("k", max_bytes=4096)


def _read_into(tier: Any) -> object:
    return tier.read_into("k", memoryview(bytearray(64)), 1024)


def _put(tier: Any) -> object:
    return tier.put("k", [b"head", b"payload"])


def _delete(tier: Any) -> object:
    return tier.delete(["k", "j"])


def _exists(tier: Any) -> object:
    return tier.exists(["k", "j"])


def _get_into(tier: Any) -> object:
    return tier.get_into("k", memoryview(bytearray(4096)))


READS: list[Callable[[Any], object]] = [_get, _get_bounded, _read_into, _get_into]
OPS: list[Callable[[Any], object]] = [_exists, *READS, _put, _delete]


def _raises(op: Callable[[Any], object], tier: Any, expected: type[BaseException]) -> None:
    with pytest.raises(BaseException) as info:
        op(tier)
    assert type(info.value) is expected, (op.__name__, info.value)
    if issubclass(expected, TierError):
        assert str(info.value)  # says what failed


# -- file: OSError by errno ------------------------------------------------------------------

FILE_ERRNOS = [
    (errno.ESTALE, OBJ),
    (errno.ENOSPC, OBJ),
    (errno.EACCES, OBJ),
    (errno.ELOOP, OBJ),
    (errno.ENOENT, OBJ),
    (errno.EISDIR, OBJ),
    (errno.EIO, TIER),
    (errno.ENOTCONN, TIER),
    (errno.ETIMEDOUT, TIER),
    (errno.EROFS, TIER),
    (errno.ESHUTDOWN, TIER),
    (errno.ECONNRESET, TIER),
]


def _errno_id(v: object) -> str:
    return errno.errorcode.get(v, "") if isinstance(v, int) else getattr(v, "__name__", "")


@pytest.fixture
def file_tier(tmp_path) -> Iterator[FileTier]:
    tier = FileTier(str(tmp_path), background_sweep=False)
    yield tier
    tier.close()


def _file_raising(tier: FileTier, exc: BaseException) -> None:
    """Every path of the file tier reaches its fan-out directory first: fail there."""

    def fail(*_a: object, **_k: object) -> int | None:
        raise exc

    tier._subdir = fail  # type: ignore[method-assign]


@pytest.mark.parametrize("op", [*READS, _put, _delete], ids=lambda f: f.__name__)
@pytest.mark.parametrize(("code", "expected"), FILE_ERRNOS, ids=_errno_id)
def test_file_oserror_ends_as_the_same_kvtier_error(
    file_tier: FileTier, op: Callable[[Any], object], code: int, expected: type
) -> None:
    _file_raising(file_tier, OSError(code, "injected"))
    _raises(op, file_tier, expected)


@pytest.mark.parametrize(("code", "expected"), FILE_ERRNOS, ids=_errno_id)
def test_file_exists_is_a_miss_for_one_object_and_raises_for_the_tier(
    file_tier: FileTier, code: int, expected: type
) -> None:
    """exists answers "not stored" for a name no object can be read from; a failing
    mount is the tier's error."""
    _file_raising(file_tier, OSError(code, "injected"))
    if expected is OBJ:
        assert file_tier.exists(["k", "j"]) == [False, False]
    else:
        _raises(_exists, file_tier, expected)


def test_file_put_of_a_full_disk_wakes_the_sweep(tmp_path) -> None:
    tier = FileTier(str(tmp_path), max_bytes=1 << 20, background_sweep=False)
    _file_raising(tier, OSError(errno.ENOSPC, "injected"))
    _raises(_put, tier, OBJ)
    assert tier.sweeper.woken


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_file_unexpected_exception_is_not_swallowed(
    file_tier: FileTier, op: Callable[[Any], object]
) -> None:
    _file_raising(file_tier, Unexpected("boom"))
    _raises(op, file_tier, Unexpected)


# -- Redis: redis-py's exceptions and OSError --------------------------------------------------

_parse = redis._parsers.base._RESPBase.parse_error


class _Conn:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def send_packed_command(self, *_a: object, **_k: object) -> None:
        raise self.exc

    def read_response(self, *_a: object, **_k: object) -> object:
        raise self.exc

    def disconnect(self) -> None:
        pass


class _Pool:
    def __init__(self, exc: BaseException, where: str) -> None:
        self.exc, self.where = exc, where

    def get_connection(self, *_a: object, **_k: object) -> _Conn:
        if self.where == "pool":
            raise self.exc
        return _Conn(self.exc)

    def release(self, conn: object) -> None:
        pass

    def disconnect(self) -> None:
        pass


class _Pipe:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __enter__(self) -> _Pipe:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *a, **k: None  # exists, strlen, getrange: queued

    def execute(self) -> list[object]:
        raise self.exc


class _Client:
    """What the Redis tiers call on their client, each call raising ``exc`` (a write's
    connection raising at the pool, or on the connection, by ``where``)."""

    def __init__(self, exc: BaseException, where: str = "conn") -> None:
        self.exc = exc
        self.connection_pool = _Pool(exc, where)
        self.nodes_manager = self

    def pipeline(self, *_a: object, **_k: object) -> _Pipe:
        return _Pipe(self.exc)

    def get(self, *_a: object) -> object:
        raise self.exc

    def delete(self, *_a: object) -> object:
        raise self.exc

    def execute_command(self, *_a: object, **_k: object) -> object:
        raise self.exc

    # the cluster client's slot map: no node known
    def keyslot(self, key: str) -> int:
        return 0

    def get_node_from_slot(self, slot: int) -> None:
        return None

    def get_redis_connection(self, node: object) -> _Client:
        return self

    def close(self) -> None:
        pass


REDIS_ERRORS = [
    (_parse("WRONGTYPE Operation against a key holding the wrong kind of value"), OBJ),
    (_parse("OOM command not allowed when used memory > 'maxmemory'."), OBJ),
    (_parse("ASK 3999 127.0.0.1:6381"), OBJ),
    (_parse("ERR value is not an integer or out of range"), OBJ),
    (redis.DataError("bad argument"), OBJ),
    (ReplyTooLarge("a reply of 536870912 bytes"), BIG),
    (_parse("READONLY You can't write against a read only replica."), TIER),
    (_parse("NOPERM this user has no permissions to run the 'get' command"), TIER),
    (_parse("MOVED 3999 127.0.0.1:6381"), TIER),
    (_parse("BUSY Redis is busy running a script."), TIER),
    (_parse("LOADING Redis is loading the dataset in memory"), TIER),
    (redis.AuthenticationError("invalid password"), TIER),
    (redis.ConnectionError("refused"), TIER),
    (redis.TimeoutError("timeout"), TIER),
    (redis.exceptions.InvalidResponse("Protocol Error: b'?'"), TIER),
    (OSError(errno.ECONNRESET, "reset"), TIER),
]


@pytest.fixture(scope="module")
def redis_tier() -> Iterator[RedisTier]:
    tier = RedisTier("redis://127.0.0.1:9/0")
    real = tier._client
    yield tier
    tier._client = real
    tier.close()


@pytest.mark.parametrize(
    ("op", "where"), [*((op, "conn") for op in OPS), (_put, "pool")], ids=lambda v: str(v)[:20]
)
@pytest.mark.parametrize(("exc", "expected"), REDIS_ERRORS, ids=lambda v: str(v)[:30])
def test_redis_error_ends_as_the_same_kvtier_error(
    redis_tier: RedisTier, op: Callable[[Any], object], where: str, exc: Exception, expected: type
) -> None:
    """``where``: a write's connection fails on its command or at the pool."""
    redis_tier._client = _Client(exc, where)  # type: ignore[assignment]
    _raises(op, redis_tier, expected)


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_redis_unexpected_exception_is_not_swallowed(
    redis_tier: RedisTier, op: Callable[[Any], object]
) -> None:
    redis_tier._client = _Client(Unexpected("boom"))  # type: ignore[assignment]
    _raises(op, redis_tier, Unexpected)


# -- Redis Cluster: the single node's mapping plus the cluster's own ------------------------------

CLUSTER_ERRORS = [
    (redis.ConnectionError("refused"), NODE),
    (redis.TimeoutError("timeout"), NODE),
    (redis.AuthenticationError("invalid password"), TIER),
    (_parse("WRONGTYPE Operation against a key holding the wrong kind of value"), OBJ),
    (_parse("READONLY You can't write against a read only replica."), TIER),
    (redis.DataError("bad argument"), OBJ),
    (ReplyTooLarge("a reply of 536870912 bytes"), BIG),
    (redis.exceptions.SlotNotCoveredError("slot 3 not covered"), OBJ),
    (redis.exceptions.RedisClusterException("no node reachable"), TIER),
    (redis.exceptions.MovedError("3999 127.0.0.1:6381"), OBJ),
    (redis.exceptions.AskError("3999 127.0.0.1:6381"), OBJ),
    (OSError(errno.ECONNRESET, "reset"), TIER),
]


def _cluster_reply(text: str) -> BaseException:
    from kvtier.objects.tiers.redis_cluster import _ClusterParser

    exc: BaseException = _ClusterParser.parse_error(text)
    return exc


CLUSTER_REPLIES = [
    ("CLUSTERDOWN The cluster is down", TIER),
    ("CLUSTERDOWN Hash slot not served", OBJ),
    ("TRYAGAIN Multiple keys request during rehashing of slot", OBJ),
]


@pytest.fixture(scope="module")
def cluster_tier() -> Iterator[RedisClusterTier]:
    tier = RedisClusterTier("redis+cluster://127.0.0.1:9/")
    yield tier
    tier._cluster = None
    tier.close()


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    ("exc", "expected"),
    [*CLUSTER_ERRORS, *((_cluster_reply(t), k) for t, k in CLUSTER_REPLIES)],
    ids=lambda v: str(v)[:30],
)
def test_cluster_error_ends_as_the_same_kvtier_error(
    cluster_tier: RedisClusterTier, op: Callable[[Any], object], exc: Exception, expected: type
) -> None:
    cluster_tier._cluster = _Client(exc)
    cluster_tier._node_health.clear()  # no node skipped from an earlier case
    _raises(op, cluster_tier, expected)


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_cluster_unexpected_exception_is_not_swallowed(
    cluster_tier: RedisClusterTier, op: Callable[[Any], object]
) -> None:
    cluster_tier._cluster = _Client(Unexpected("boom"))
    _raises(op, cluster_tier, Unexpected)


# -- S3: botocore's, urllib3's and the OS's exceptions -------------------------------------------


def _client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "Op",
    )


#: (exception, on a read, on a write or delete): a HEAD of an object error is "not stored"
S3_ERRORS = [
    (_client_error("InvalidObjectState", 403), OBJ, OBJ),
    (_client_error("AccessDenied", 403), OBJ, TIER),  # a read of one planted object
    (_client_error("EntityTooLarge", 400), OBJ, OBJ),
    (_client_error("MethodNotAllowed", 405), OBJ, OBJ),
    (_client_error("NoSuchBucket", 404), TIER, TIER),
    (_client_error("InvalidAccessKeyId", 403), TIER, TIER),
    (_client_error("SlowDown", 503), TIER, TIER),
    (_client_error("InternalError", 500), TIER, TIER),
    (EndpointConnectionError(endpoint_url="http://127.0.0.1:9"), TIER, TIER),
    (ReadTimeoutError(endpoint_url="http://127.0.0.1:9"), TIER, TIER),
    (NoCredentialsError(), TIER, TIER),
    (urllib3.exceptions.ProtocolError("connection broken"), TIER, TIER),
    (OSError(errno.ECONNRESET, "reset"), TIER, TIER),
]


class _Body:
    """A GET's body that fails once read."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def read(self, *_a: object) -> bytes:
        raise self.exc

    def readinto(self, _b: object) -> int:
        raise self.exc

    def close(self) -> None:
        pass


class _S3Client:
    def __init__(self, exc: BaseException, in_body: bool = False) -> None:
        self.exc, self.in_body = exc, in_body

    def _fail(self, **_k: object) -> object:
        raise self.exc

    head_object = put_object = delete_objects = _fail

    def get_object(self, **_k: object) -> dict[str, object]:
        if self.in_body:
            return {
                "Body": _Body(self.exc),
                "ContentLength": 1000,
                "ContentRange": "bytes 0-999/1000",
            }
        raise self.exc

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def s3_tier() -> Iterator[S3Tier]:
    tier = S3Tier("s3://kvtier-mapping/p", endpoint_url="http://127.0.0.1:9")
    real = tier._client
    yield tier
    tier._client = real
    tier.close()


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(("exc", "on_read", "on_write"), S3_ERRORS, ids=lambda v: str(v)[:30])
def test_s3_error_ends_as_the_same_kvtier_error(
    s3_tier: S3Tier, op: Callable[[Any], object], exc: Exception, on_read: type, on_write: type
) -> None:
    s3_tier._client = _S3Client(exc)
    if op is _exists:
        if on_write is OBJ:
            assert s3_tier.exists(["k", "j"]) == [False, False]
        else:
            _raises(op, s3_tier, on_write)
        return
    _raises(op, s3_tier, on_read if op in READS else on_write)


@pytest.mark.parametrize("op", READS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(("exc", "on_read", "on_write"), S3_ERRORS, ids=lambda v: str(v)[:30])
def test_s3_error_reading_the_body_ends_as_the_same_kvtier_error(
    s3_tier: S3Tier, op: Callable[[Any], object], exc: Exception, on_read: type, on_write: type
) -> None:
    s3_tier._client = _S3Client(exc, in_body=True)
    _raises(op, s3_tier, TIER if not isinstance(exc, ClientError) else on_read)


@pytest.mark.parametrize(
    ("op", "in_body"),
    [*((op, False) for op in OPS), *((op, True) for op in READS)],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_s3_unexpected_exception_is_not_swallowed(
    s3_tier: S3Tier, op: Callable[[Any], object], in_body: bool
) -> None:
    s3_tier._client = _S3Client(Unexpected("boom"), in_body=in_body)
    _raises(op, s3_tier, Unexpected)
