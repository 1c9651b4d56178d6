"""Object tier on Redis (or Valkey / a Redis-protocol cache), plain or TLS."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast
from urllib.parse import urlparse

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtier.config import redact_url
from kvtier.errors import ObjectError, ObjectTooLarge, TierError, TierUnavailable
from kvtier.tiers.base import ObjectTier, Parts, stored_prefix
from kvtier.tiers.policy import RETRIES, Timeouts

__all__ = ["RedisTier"]

_SMALL = 64 * 1024
#: error replies about the server, not one key (a replica mid-failover, MASTERDOWN, ACLs, a
#: cluster answering MOVED): back off. Every other error reply (WRONGTYPE, OOM ...) is that
#: key's miss.
_TIER_REPLIES = (
    redis.exceptions.ReadOnlyError, redis.exceptions.NoPermissionError,
    redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError,
    redis.exceptions.AskError, redis.exceptions.AuthenticationWrongNumberOfArgsError,
)  # fmt: skip


def _coalesce(buffers: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """Merge neighbouring small buffers so a chunk goes out in few sendall calls."""
    out: list[bytes | memoryview] = []
    pending = b""
    for buf in buffers:
        if memoryview(buf).nbytes < _SMALL:
            pending += bytes(buf)
            continue
        if pending:
            out.append(pending)
            pending = b""
        out.append(buf)
    if pending:
        out.append(pending)
    return out


def _connection(pool: redis.ConnectionPool) -> redis.connection.Connection:
    try:
        return pool.get_connection()  # redis-py >= 5.3 warns when given a command name
    except TypeError:  # redis-py < 5.3 requires one
        return pool.get_connection("SET")


class RedisTier(ObjectTier):
    """Chunks as plain string values; AUTH, TLS (``rediss://``) and db come from the URL.

    The pool blocks (briefly) instead of failing when all connections are in
    use, and redis-py retries a failed command once without sleeping, which
    replaces a pooled connection that died with a restarted server; longer
    outages are RemoteIO's backoff's business.
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        io_threads: int = 4,
        lookup_timeout_ms: int = 2000,
        ttl_s: int | None = None,
    ) -> None:
        self._safe_url = redact_url(url)
        self._password = redis.connection.parse_url(url).get("password")  # type: ignore[no-untyped-call]
        self.ttl_s = ttl_s
        waits = Timeouts.from_ms(lookup_timeout_ms)
        # TLS verifies the server's certificate and name whatever redis-py's version
        # defaults to (5.x did not check the hostname); a URL's own ssl_* arguments win
        tls = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
        try:
            pool = redis.BlockingConnectionPool.from_url(
                url,
                **(tls if urlparse(url).scheme == "rediss" else {}),
                max_connections=io_threads + 2,
                timeout=waits.pool_wait_s,
                socket_timeout=waits.reply_s,
                socket_connect_timeout=waits.connect_s,
                retry=Retry(NoBackoff(), RETRIES),
            )
        except (ValueError, redis.RedisError) as exc:
            raise TierUnavailable(f"redis {self._safe_url}: {self._clean(exc)}") from None
        self._client = redis.Redis(connection_pool=pool)

    def __repr__(self) -> str:
        return f"RedisTier({self._safe_url!r})"

    def _clean(self, exc: BaseException) -> str:
        text = f"{type(exc).__name__}: {exc}"
        return text.replace(self._password, "***") if self._password else text

    def _fail(self, op: str, exc: BaseException) -> TierError:
        """ObjectError for an error reply about one key, TierUnavailable for the rest.

        Connection errors, timeouts, AUTH failures and protocol errors mean the
        server cannot be used; an error *reply* (one key of the wrong type, a
        value refused for memory) means it answered and only this key failed.
        """
        text = f"redis {op} {self._safe_url}: {self._clean(exc)}"
        if isinstance(exc, redis.ResponseError) and not isinstance(exc, _TIER_REPLIES):
            return ObjectError(text)
        if isinstance(exc, redis.DataError):
            return ObjectError(text)
        return TierUnavailable(text)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        try:
            with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.exists(key)
                found = [bool(n) for n in pipe.execute()]
        except (redis.RedisError, OSError) as exc:
            raise self._fail("exists", exc) from None
        return stored_prefix(found)

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        """GET; with ``max_bytes`` STRLEN + GETRANGE in one round trip, never more bytes.

        An empty or missing value is None (STRLEN says 0 for both). A value
        replaced between the two commands can only come back cut or mixed,
        which the codec rejects.
        """
        try:
            if max_bytes is None:
                return cast("bytes | None", self._client.get(key))  # decode_responses is off
            with self._client.pipeline(transaction=False) as pipe:
                pipe.strlen(key)
                pipe.getrange(key, 0, max(1, max_bytes) - 1)
                size, data = pipe.execute()
        except (redis.RedisError, OSError) as exc:
            raise self._fail("get", exc) from None
        if size > max_bytes:
            raise ObjectTooLarge(
                f"redis get {self._safe_url}: value of {size} bytes, at most {max_bytes} expected"
            )
        return data if size else None

    def put(self, key: str, parts: Parts) -> None:
        """SET (with EX when a TTL is configured), sending the parts without joining them.

        redis-py's ``set`` takes one value, which would mean copying an 8 MiB
        payload behind its header; instead the RESP frame is written around
        the parts and sent with the connection's own ``send_packed_command``.
        """
        total = sum(memoryview(p).nbytes for p in parts)
        name = key.encode()
        extra = [b"EX", b"%d" % self.ttl_s] if self.ttl_s else []
        head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
            3 + len(extra),
            len(name),
            name,
            total,
        )
        tail = b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in extra)
        frame = _coalesce([head, *parts, tail])
        pool = self._client.connection_pool
        for attempt in range(1 + RETRIES):  # a retry replaces a connection the server dropped
            try:
                conn = _connection(pool)
            except (redis.RedisError, OSError) as exc:
                raise self._fail("put", exc) from None
            try:
                conn.send_packed_command(frame)  # type: ignore[no-untyped-call]
                reply = conn.read_response()
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                conn.disconnect()  # type: ignore[no-untyped-call]
                if attempt == RETRIES:
                    raise self._fail("put", exc) from None
                continue
            except redis.RedisError as exc:
                raise self._fail("put", exc) from None
            finally:
                pool.release(conn)
            if reply not in (b"OK", "OK", True):
                raise ObjectError(f"redis put {self._safe_url}: unexpected reply {reply!r:.80}")
            return

    def delete(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        try:
            self._client.delete(*keys)
        except (redis.RedisError, OSError) as exc:
            raise self._fail("delete", exc) from None

    def close(self) -> None:
        self._client.close()
        self._client.connection_pool.disconnect()
