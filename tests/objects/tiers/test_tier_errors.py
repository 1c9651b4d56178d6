"""Which failures stop one object and which stop the whole tier, for every backend.

A per-object error (``ObjectError``) is that object's counted miss and nothing else
stops; a whole-tier error (``TierUnavailable``) makes RemoteIO back off, so every
lookup misses until the tier answers again. Filing one object's error as the
tier's lets one planted or stale object pause every read: these tables pin each
mapping, and the tests below show a per-object error leaves the tier up.
"""

from __future__ import annotations

import errno
import time
from typing import Any

import pytest
import redis
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from kvtier.errors import ObjectError, ObjectTooLarge, TierUnavailable
from kvtier.objects import codec
from kvtier.objects.health import ConstantBackoff
from kvtier.objects.remote import RemoteIO
from kvtier.objects.tiers.file import FileTier
from kvtier.objects.tiers.redis import RedisTier, ReplyTooLarge
from kvtier.objects.tiers.s3 import S3Tier

OBJ, TIER = ObjectError, TierUnavailable

# -- file: errno -> class ------------------------------------------------------------------

FILE_ERRNOS = [
    # one file: another node replaced or deleted it (NFS), a full disk or quota (the sweep
    # makes room), a name no object can be read from, a planted symlink, FIFO or directory
    (errno.ESTALE, OBJ),
    (errno.ENOSPC, OBJ),
    (errno.EDQUOT, OBJ),
    (errno.EACCES, OBJ),
    (errno.EPERM, OBJ),
    (errno.ELOOP, OBJ),
    (errno.ENOTDIR, OBJ),
    (errno.EISDIR, OBJ),
    (errno.ENAMETOOLONG, OBJ),
    (errno.ENXIO, OBJ),
    (errno.EFBIG, OBJ),
    (errno.EOVERFLOW, OBJ),
    # the mount or the device
    (errno.EIO, TIER),
    (errno.ENOTCONN, TIER),
    (errno.ETIMEDOUT, TIER),
    (errno.EHOSTDOWN, TIER),
    (errno.EHOSTUNREACH, TIER),
    (errno.ENETDOWN, TIER),
    (errno.ENETUNREACH, TIER),
    (errno.ECONNREFUSED, TIER),
    (errno.ECONNRESET, TIER),
    (errno.ENODEV, TIER),
    (errno.EROFS, TIER),
    (errno.ESHUTDOWN, TIER),
]


@pytest.mark.parametrize(
    ("code", "expected"),
    FILE_ERRNOS,
    ids=lambda v: getattr(v, "__name__", errno.errorcode.get(v, str(v))),
)
def test_file_errno_mapping(tmp_path, code: int, expected: type) -> None:
    tier = FileTier(str(tmp_path), background_sweep=False)
    err = tier._error("get", OSError(code, "x"))
    assert type(err) is expected, (errno.errorcode[code], type(err))


# -- S3: service error code (and op) -> class ------------------------------------------------


def _client_error(code: str, status: int, op: str = "GetObject") -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        op,
    )


S3_ERRORS = [
    # one object
    ("get", _client_error("InvalidObjectState", 403), OBJ),  # archived (Glacier)
    ("get", _client_error("AccessDenied", 403), OBJ),  # SSE-KMS key we may not use, foreign ACL
    ("get", _client_error("InvalidRequest", 400), OBJ),  # SSE-C object
    ("get", _client_error("KMS.DisabledException", 400), OBJ),
    ("get", _client_error("MethodNotAllowed", 405), OBJ),  # a delete marker
    ("put", _client_error("EntityTooLarge", 400), OBJ),
    ("put", _client_error("XMinioStorageFull", 507), OBJ),  # MinIO's ENOSPC
    ("put", _client_error("OperationAborted", 409), OBJ),
    # the bucket, the credentials, the service
    ("put", _client_error("AccessDenied", 403), TIER),
    ("head", _client_error("403", 403, "HeadObject"), TIER),
    ("get", _client_error("NoSuchBucket", 404), TIER),
    ("get", _client_error("InvalidAccessKeyId", 403), TIER),
    ("get", _client_error("ExpiredToken", 400), TIER),
    ("get", _client_error("SlowDown", 503), TIER),
    ("get", _client_error("InternalError", 500), TIER),
    ("get", _client_error("PermanentRedirect", 301), TIER),
    ("get", EndpointConnectionError(endpoint_url="http://127.0.0.1:9"), TIER),
    ("get", ReadTimeoutError(endpoint_url="http://127.0.0.1:9"), TIER),
    ("get", OSError(errno.ECONNRESET, "reset"), TIER),
]


@pytest.fixture(scope="module")
def s3_tier():
    tier = S3Tier("s3://kvtier-mapping/p", endpoint_url="http://127.0.0.1:9")
    yield tier
    tier.close()


@pytest.mark.parametrize(("op", "exc", "expected"), S3_ERRORS, ids=lambda v: str(v)[:40])
def test_s3_error_mapping(s3_tier: S3Tier, op: str, exc: Exception, expected: type) -> None:
    err = s3_tier._fail(op, exc)
    assert type(err) is expected, (op, exc, type(err))


# -- Redis: reply or exception -> class -------------------------------------------------------

_parse = redis._parsers.base._RESPBase.parse_error

REDIS_ERRORS = [
    # one key
    (_parse("WRONGTYPE Operation against a key holding the wrong kind of value"), OBJ),
    (_parse("OOM command not allowed when used memory > 'maxmemory'."), OBJ),
    (_parse("ASK 3999 127.0.0.1:6381"), OBJ),  # that key's slot is being migrated
    (_parse("TRYAGAIN Multiple keys request during rehashing of slot"), OBJ),
    (_parse("ERR value is not an integer or out of range"), OBJ),
    (redis.DataError("bad argument"), OBJ),
    (ReplyTooLarge("a reply of 536870912 bytes"), ObjectTooLarge),
    # the server
    (_parse("READONLY You can't write against a read only replica."), TIER),
    (_parse("NOPERM this user has no permissions to run the 'get' command"), TIER),
    (_parse("MOVED 3999 127.0.0.1:6381"), TIER),  # a cluster behind a non-cluster client
    (_parse("CLUSTERDOWN The cluster is down"), TIER),
    (_parse("MASTERDOWN Link with MASTER is down"), TIER),
    (_parse("BUSY Redis is busy running a script."), TIER),
    (_parse("MISCONF Redis is configured to save RDB snapshots, but it's failing"), TIER),
    (_parse("NOREPLICAS Not enough good replicas to write."), TIER),
    (_parse("LOADING Redis is loading the dataset in memory"), TIER),
    (_parse("NOAUTH Authentication required."), TIER),
    (redis.ConnectionError("refused"), TIER),
    (redis.TimeoutError("timeout"), TIER),
    (redis.exceptions.InvalidResponse("Protocol Error: b'?'"), TIER),
    (OSError(errno.ECONNRESET, "reset"), TIER),
]


@pytest.fixture(scope="module")
def redis_tier():
    tier = RedisTier("redis://127.0.0.1:9/0")
    yield tier
    tier.close()


@pytest.mark.parametrize(("exc", "expected"), REDIS_ERRORS, ids=lambda v: str(v)[:40])
def test_redis_error_mapping(redis_tier: RedisTier, exc: Exception, expected: type) -> None:
    err = redis_tier.tier_error("get", exc)
    assert type(err) is expected, (exc, type(err))


# -- a per-object error leaves the tier up ------------------------------------------------------

SHAPE = [2, 8, 64]
SIZE = 2 * 8 * 64 * 2


class _StaleFileTier(FileTier):
    """Reads of one key fail as NFS fails them when another node replaced the file."""

    def _read_slot(self, key: str, dest: memoryview, *a: Any, **kw: Any) -> Any:
        # both read paths (read_into, read_into_hashed) go through it
        if key == "stale":
            raise self._error("get", OSError(errno.ESTALE, "Stale file handle"))
        return super()._read_slot(key, dest, *a, **kw)


def test_a_stale_nfs_file_is_one_miss_not_an_outage(tmp_path) -> None:
    tier = _StaleFileTier(str(tmp_path), background_sweep=False)
    payload = memoryview(bytearray(i % 251 for i in range(SIZE)))
    tier.put("good", codec.encode("good", payload, dtype="bfloat16", shape=SHAPE))
    rio = RemoteIO(
        tier, threads=1, queue_depth=8, timeout_s=5.0, signer=None, backoff=ConstantBackoff(30.0)
    )
    dests = [memoryview(bytearray(SIZE)) for _ in range(2)]
    rio.submit_get_into(1, "stale", dests[0], dtype="bfloat16", shape=SHAPE)
    rio.submit_get_into(2, "good", dests[1], dtype="bfloat16", shape=SHAPE)
    results = []
    deadline = time.monotonic() + 10
    while len(results) < 2 and time.monotonic() < deadline:
        results += rio.poll()
        time.sleep(0.002)
    by_id = {r.op_id: r for r in results}
    assert by_id[1].error_kind == "object", by_id[1]
    assert by_id[2].ok, "the stale file paused the tier: the next read failed"
    assert not rio.is_down and rio.counters()["errors_unreachable"] == 0
    rio.close()
