"""Object tier on Redis (or Valkey / a Redis-protocol cache), plain or TLS."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtier.config import RemoteURL
from kvtier.errors import ConfigError, ObjectError, ObjectTooLarge, TierError, TierUnavailable
from kvtier.objects.codec import LandingCrc, payload_crc32
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
from kvtier.objects.tiers.redis_resp import (
    REPLY_CAP,
    BoundedParser,
    ReplyBound,
    ReplyTooLarge,
    bounded_connection,
    expect_reply,
    pool_connection,
    set_frame,
)

# ReplyTooLarge and BoundedParser (redis_resp.py, the wire) are read from here too
__all__ = ["ClusterNodeRefused", "RedisTier", "ReplyTooLarge", "BoundedParser"]

log = logging.getLogger("kvtier.tiers.redis")

#: error replies about the server, not one key (a replica mid-failover, MASTERDOWN, ACLs, a
#: cluster answering MOVED to a client that is not a cluster client): back off. Every
#: other error reply is that key's miss: WRONGTYPE, OOM (the ENOSPC of Redis), and ASK /
#: TRYAGAIN, which are about one hash slot being migrated, not the server.
_TIER_REPLIES = (
    redis.exceptions.ReadOnlyError,
    redis.exceptions.NoPermissionError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.MovedError,
    redis.exceptions.AuthenticationWrongNumberOfArgsError,
)
#: error codes redis-py has no class for that are about the server: a script hogging it
#: (BUSY), failing snapshots refusing writes (MISCONF), too few replicas (NOREPLICAS)
_TIER_CODES = re.compile(r"(BUSY|MISCONF|NOREPLICAS)\b")
#: keys per SCAN page and per pipeline of a listing or a :meth:`RedisTier.delete_many`
#: (below the tier's reply bounds)
LIST_BATCH = 256
#: what a glob pattern (SCAN MATCH) reads as other than itself
_GLOB = re.compile(r"([\\*?\[\]])")


class ClusterNodeRefused(redis.exceptions.RedisError):
    """A ``redis://`` URL that names a node of a Redis Cluster: it would serve only the keys
    of its own slots and answer MOVED for the rest, so every connection refuses it."""


#: what a ``redis://`` URL at a cluster node is told, at open and on every connection
CLUSTER_NODE_HELP = (
    "a single Redis node; this server is a node of a Redis Cluster (cluster_enabled:1): "
    "use redis+cluster://host:port[,host:port...]/ (or rediss+cluster://) with the same "
    "query, which follows the cluster's slots"
)


def _refuse_cluster_node(conn: Any) -> None:
    """Every new connection (after AUTH): a node in cluster mode is refused (INFO cluster,
    one round trip per pooled connection). A server that does not say is taken as one node."""
    conn.on_connect()
    conn.send_command("INFO", "cluster")
    try:
        info = conn.read_response()
    except redis.ResponseError:  # an ACL without INFO, a cache without the section
        return
    if isinstance(info, bytes | bytearray) and b"cluster_enabled:1" in info:
        raise ClusterNodeRefused(CLUSTER_NODE_HELP)


class RedisTier(SlotReader):
    """Chunks as plain string values; AUTH, TLS (``rediss://``) and db come from the URL.

    The pool blocks (briefly) instead of failing when all connections are in
    use, and redis-py retries a failed command once without sleeping, which
    replaces a pooled connection that died with a restarted server; longer
    outages are RemoteIO's backoff's business.
    """

    name = "redis"
    #: every socket wait of a read ends by the read's deadline (redis_resp's parser and
    #: connections): a server that stopped answering costs a read its deadline, no more
    bounds_reads = True

    def __init__(
        self,
        url: RemoteURL | str,
        *,
        io_threads: int = 4,
        lookup_timeout_ms: int = 2000,
        ttl_s: int | None = None,
        tls_insecure: bool = False,
    ) -> None:
        remote = RemoteURL.parse(url)
        self._safe_url = remote.safe
        # redis-py reads the connection options from the URL itself (a cluster URL here
        # is refused by it, as any scheme but redis:// and rediss://)
        options = redis.connection.parse_url(remote.text)  # type: ignore[no-untyped-call]
        self._password = options.get("password")
        self.ttl_s = ttl_s
        waits = Timeouts.from_ms(lookup_timeout_ms)
        weak = remote.weak_tls
        if weak and not tls_insecure:
            raise ConfigError(
                "remote_url",
                remote.text,
                f"{', '.join(weak)} turns off TLS verification; "
                "set remote_tls_insecure to true to allow it",
            )
        if weak:
            log.warning(
                "redis %s: TLS verification is OFF (%s, allowed by remote_tls_insecure): "
                "anyone on the network path can read and replace chunks",
                self._safe_url,
                ", ".join(weak),
            )
        self._bound = ReplyBound()
        parser = type("_TierParser", (BoundedParser,), {"bound": self._bound})
        # TLS verifies the server's certificate and name whatever redis-py's version
        # defaults to (5.x did not check the hostname); a URL's own ssl_* arguments win
        tls = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
        try:
            if remote.scheme == "rediss":
                options = {**tls, **options}
            # kvtier's own settings win over the URL's query (which redis-py would let
            # override them): the reply bounds, RESP2, the tier policy's waits and retry
            options.update(
                parser_class=parser,
                protocol=2,
                max_connections=io_threads + 2,
                timeout=waits.pool_wait_s,
                socket_timeout=waits.reply_s,
                socket_connect_timeout=waits.connect_s,
                retry=Retry(NoBackoff(), RETRIES),
                redis_connect_func=_refuse_cluster_node,
                connection_class=bounded_connection(
                    options.get("connection_class", redis.Connection)
                ),
            )
            pool = redis.BlockingConnectionPool(**options)  # type: ignore[no-untyped-call]
        except (ValueError, TypeError, redis.RedisError) as exc:
            raise TierUnavailable(f"redis {self._safe_url}: {self.clean_error(exc)}") from None
        self._client = redis.Redis(connection_pool=pool)
        self._refuse_if_cluster(pool)

    def _refuse_if_cluster(self, pool: redis.ConnectionPool) -> None:
        """A ``redis://`` URL at a Redis Cluster node stops startup with a ConfigError when
        the server answers now; one that cannot be reached is asked on each connection.
        One attempt of at most 0.5 s, so a server that does not answer hardly delays
        startup."""
        kwargs = dict(pool.connection_kwargs)
        kwargs.update(retry=Retry(NoBackoff(), 0), socket_connect_timeout=0.5)
        conn = pool.connection_class(**kwargs)
        try:
            conn.connect()
        except ClusterNodeRefused:
            raise ConfigError("remote_url", self._safe_url, CLUSTER_NODE_HELP) from None
        except (redis.RedisError, OSError) as exc:
            log.info(
                "redis %s not reachable at startup (%s)", self._safe_url, self.clean_error(exc)
            )
        finally:
            conn.disconnect()

    def __repr__(self) -> str:
        return f"RedisTier({self._safe_url!r})"

    # -- what a subclass (RedisClusterTier) builds on: errors, replies, bounded reads ------

    def clean_error(self, exc: BaseException) -> str:
        """``exc`` as text for a message or a log, the password masked."""
        text = f"{type(exc).__name__}: {exc}"
        return text.replace(self._password, "***") if self._password else text

    #: what the client raises; :meth:`tier_error` says which kvtier error each one is
    FOREIGN_ERRORS: tuple[type[BaseException], ...] = (redis.RedisError, OSError)

    @contextmanager
    def tier_errors(self, op: str) -> Iterator[None]:
        """The one place the client's exceptions become kvtier errors: every one of
        :attr:`FOREIGN_ERRORS` raised in the block is raised again as :meth:`tier_error` classifies
        it; anything else (a kvtier error raised on purpose, a bug) passes as it is."""
        try:
            yield
        except self.FOREIGN_ERRORS as exc:
            raise self.tier_error(op, exc) from None

    def tier_error(self, op: str, exc: BaseException) -> TierError:
        """ObjectError for an error reply about one key, TierUnavailable for the rest.

        Connection errors, timeouts, AUTH failures and protocol errors mean the
        server cannot be used; an error *reply* (one key of the wrong type, a
        value refused for memory) means it answered and only this key failed.
        A reply longer than the caller's bound is that object's ``oversize``.
        """
        text = f"redis {op} {self._safe_url}: {self.clean_error(exc)}"
        if isinstance(exc, ClusterNodeRefused):
            return TierUnavailable(text)
        if isinstance(exc, ReplyTooLarge):
            return ObjectTooLarge(text)
        if isinstance(exc, redis.ResponseError):
            if isinstance(exc, _TIER_REPLIES) or _TIER_CODES.match(str(exc)):
                return TierUnavailable(text)
            return ObjectError(text)
        if isinstance(exc, redis.DataError):
            return ObjectError(text)
        return TierUnavailable(text)

    def wrong_reply(self, op: str, command: str, reply: object) -> ObjectError:
        """A reply of the wrong type (a bulk string for STRLEN, an integer for GETRANGE):
        that object's miss, counted and logged like any other, never a TypeError."""
        return ObjectError(
            f"redis {op} {self._safe_url}: {command} replied with a {type(reply).__name__}"
        )

    def exists(self, keys: Sequence[str]) -> list[bool]:
        with self.tier_errors("exists"), self._client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.exists(key)
            replies = pipe.execute()
        found = []
        for n in replies:
            if type(n) is not int:
                raise self.wrong_reply("exists", "EXISTS", n)
            found.append(n > 0)
        return stored_prefix(found)

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        """GET; with ``max_bytes`` STRLEN + GETRANGE in one round trip, never more bytes.

        An empty or missing value is None (STRLEN says 0 for both). A value
        replaced between the two commands can only come back cut or mixed,
        which the codec rejects. Every bulk reply is bounded from its length
        line (:class:`BoundedParser`): a server that ignores the range costs
        a dropped connection, not the bytes it sends.
        """
        data = self.get_bounded(key, max_bytes)
        return data if data is None or type(data) is bytes else bytes(data)

    def _read_slot(
        self, key: str, dest: memoryview, max_head: int, *, hashed: bool, found: Found = None
    ) -> tuple[bytes, int] | None:
        """:meth:`SlotReader._read_slot`: the reply's last ``dest.nbytes`` bytes are read
        from the socket straight into ``dest`` (no buffer of the chunk's size, no copy), a
        reply shorter than that (a compressed chunk, a truncated one) whole; ``hashed``:
        checksummed piece by piece as it lands in the slot (one pass over memory)."""
        bound = self._bound
        landing = LandingCrc(dest) if hashed else None
        bound.into, bound.landed, bound.last_int, bound.landing = dest, False, None, landing
        bound.found = found  # called from the reply's length line, before its bytes
        try:
            blob = self.get_bounded(key, dest.nbytes + max_head)
            landed = bound.landed
            found = bound.found  # None once the parser called it
        finally:
            bound.into, bound.landed, bound.last_int, bound.landing = None, False, None, None
            bound.found = None
        if blob is None:
            return None
        if found is not None:  # a reply too short to go into the slot (read whole)
            found()
        if landed:  # ``blob`` is the head: the payload is in ``dest`` already
            head_length_for(len(blob) + dest.nbytes, dest.nbytes, max_head, self.name)
            return bytes(blob), landing.result() if landing is not None else 0
        head = split_into(blob, dest, max_head, self.name)  # short: read whole, copied
        return head, payload_crc32(dest) if hashed else 0

    def get_into(self, key: str, buf: memoryview) -> int | None:
        """:meth:`ObjectTier.get_into`: STRLEN + GETRANGE as :meth:`get` with ``max_bytes``
        of ``buf``'s size; a value STRLEN shows to be longer is refused unread into
        ``buf``, a chunk-sized reply is read from the socket straight into ``buf``'s front
        (no buffer of its size), a small one copied there."""
        view = byte_view(buf)
        bound = self._bound
        bound.into, bound.front, bound.front_n, bound.last_int = view, True, None, None
        try:
            blob = self.get_bounded(key, view.nbytes)
            n = bound.front_n
        finally:
            bound.into, bound.front, bound.front_n, bound.last_int = None, False, None, None
        if blob is None:
            return None
        if n is None:  # a small reply, parsed by redis-py
            n = len(blob)
            view[:n] = blob
        return n

    def get_bounded(self, key: str, max_bytes: int | None) -> bytes | bytearray | None:
        """The object at ``key`` (None: absent), its reply bounded to ``max_bytes``."""
        self._bound.limit = None if max_bytes is None else max(1, max_bytes)
        try:
            with self.tier_errors("get"):
                if max_bytes is None:
                    data = self._client.get(key)  # decode_responses is off
                    if data is not None and type(data) not in (bytes, bytearray):
                        raise self.wrong_reply("get", "GET", data)
                    return cast("bytes | bytearray | None", data)
                size, data = self.strlen_getrange(key, max(1, max_bytes))
        finally:
            self._bound.limit = REPLY_CAP
        if type(size) is not int:
            raise self.wrong_reply("get", "STRLEN", size)
        if type(data) not in (bytes, bytearray):
            raise self.wrong_reply("get", "GETRANGE", data)
        if size > max_bytes:
            raise ObjectTooLarge(
                f"redis get {self._safe_url}: value of {size} bytes, at most {max_bytes} expected"
            )
        return cast("bytes | bytearray", data) if size else None

    def strlen_getrange(self, key: str, n: int) -> tuple[Any, Any]:
        """STRLEN and GETRANGE of the first ``n`` bytes, in one round trip."""
        with self._client.pipeline(transaction=False) as pipe:
            pipe.strlen(key)
            pipe.getrange(key, 0, n - 1)
            size, data = pipe.execute()
        return size, data

    def put(self, key: str, parts: Parts) -> None:
        """SET (with EX when a TTL is configured), sending the parts without joining them.

        redis-py's ``set`` takes one value, which would mean copying an 8 MiB
        payload behind its header; instead the RESP frame is written around
        the parts and sent with the connection's own ``send_packed_command``.
        """
        frame = set_frame(key, parts, self.ttl_s)
        pool = self._client.connection_pool
        with self.tier_errors("put"):
            for attempt in range(1 + RETRIES):  # a retry replaces a connection the server dropped
                conn = pool_connection(pool)
                if attempt:
                    # the pool's other idle connections died with the one that failed (a
                    # restarted server): the retry opens a new one instead of taking another
                    # dead one, which would fail the upload and back the tier's writes off
                    conn.disconnect()  # type: ignore[no-untyped-call]
                try:
                    expect_reply(conn, "SET")
                    conn.send_packed_command(frame)  # type: ignore[no-untyped-call]
                    reply = conn.read_response()
                except (redis.ConnectionError, redis.TimeoutError, OSError):
                    conn.disconnect()  # type: ignore[no-untyped-call]
                    if attempt == RETRIES:
                        raise
                    continue
                finally:
                    pool.release(conn)
                if reply not in (b"OK", "OK", True):
                    raise ObjectError(f"redis put {self._safe_url}: unexpected reply {reply!r:.80}")
                return

    def delete(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        with self.tier_errors("delete"):
            self._client.delete(*keys)

    # -- listing and deleting in bulk (kvtier store) -----------------------------------

    def _primaries(self) -> list[Any]:
        """A client of each node that holds keys: this one (a cluster: each primary)."""
        return [self._client]

    def _by_node(self, keys: Sequence[str]) -> list[tuple[Any, list[str]]]:
        """``keys`` with the client of the node holding each (one node here)."""
        return [(self._client, list(keys))]

    def _scan(self, prefix: str) -> Iterator[tuple[Any, list[bytes]]]:
        """Each node's SCAN pages of the keys starting with ``prefix`` (with its node)."""
        match = {"match": _GLOB.sub(r"\\\1", prefix) + "*"} if prefix else {}
        with self.tier_errors("list"):
            nodes = self._primaries()
        for node in nodes:
            cursor = 0
            while True:
                with self.tier_errors("list"):
                    cursor, keys = node.scan(cursor=cursor, count=LIST_BATCH, **match)
                yield node, keys
                if int(cursor) == 0:
                    break

    def list_objects(
        self, prefix: str = "", *, keep: Callable[[str], bool] | None = None
    ) -> Iterator[StoredObject]:
        """:meth:`ObjectTier.list_objects`: SCAN (every primary of a cluster), then per page
        one pipeline of ``MEMORY USAGE`` (what the server spends on the key; ``STRLEN``
        where MEMORY is not allowed) and ``OBJECT IDLETIME`` (its last use: reads and
        writes count, listing does not)."""
        for node, keys in self._scan(prefix):
            ours = [k for k in keys if keep is None or keep(_text(k))]
            with self.tier_errors("list"):
                sized = _measure(node, ours)
            now = time.time()
            for key, size, idle in sized:
                yield StoredObject(key, size, now - idle)

    def list_keys(self, prefix: str) -> Iterator[str]:
        """:meth:`ObjectTier.list_keys`: SCAN MATCH, nothing measured."""
        for _, keys in self._scan(prefix):
            yield from (_text(k) for k in keys)

    def delete_many(self, keys: Sequence[str]) -> None:
        """:meth:`ObjectTier.delete_many`: UNLINK (the server frees the value in the
        background), one key per command (a cluster node's keys are in many slots),
        pipelined :data:`LIST_BATCH` at a time per node."""
        with self.tier_errors("delete"):
            for node, ks in self._by_node(keys):
                for i in range(0, len(ks), LIST_BATCH):
                    pipe = node.pipeline(transaction=False)
                    for k in ks[i : i + LIST_BATCH]:
                        pipe.unlink(k)
                    pipe.execute()

    def close(self) -> None:
        self._client.close()
        self._client.connection_pool.disconnect()

    def create_if_absent(self, key: str, parts: Parts) -> bool:
        """:meth:`ObjectTier.create_if_absent`: SET NX (with EX as :meth:`put`), which the
        server runs atomically; a claim is small, so its parts are joined."""
        with self.tier_errors("create"):
            reply = self._client.set(key, b"".join(parts), nx=True, ex=self.ttl_s or None)
        if reply is None:
            return False
        if reply not in (b"OK", "OK", True):
            raise ObjectError(f"redis create {self._safe_url}: unexpected reply {reply!r:.80}")
        return True


def _text(key: bytes | str) -> str:
    return key.decode("utf-8", "replace") if isinstance(key, bytes) else key


def _measure(node: Any, keys: list[bytes]) -> list[tuple[str, int, float]]:
    """(key, bytes, seconds idle) of each of ``keys`` still stored on ``node``."""
    if not keys:
        return []
    # neither command touches the key (an engine's read does): listing twice keeps the
    # order of last use
    pipe = node.pipeline(transaction=False)
    for k in keys:
        pipe.execute_command("OBJECT", "IDLETIME", k)
        pipe.execute_command("MEMORY", "USAGE", k, "SAMPLES", "0")
    replies = pipe.execute(raise_on_error=False)
    idles, sizes = replies[0::2], replies[1::2]
    refused = [i for i, m in enumerate(sizes) if isinstance(m, Exception)]
    if refused:  # MEMORY not allowed (an ACL): the value's length, which counts as a use
        pipe = node.pipeline(transaction=False)
        for i in refused:
            pipe.strlen(keys[i])
        for i, n in zip(refused, pipe.execute(raise_on_error=False), strict=True):
            sizes[i] = n
    out = []
    for k, idle, size in zip(keys, idles, sizes, strict=True):
        if not isinstance(size, int) or isinstance(size, bool) or idle is None:
            continue  # deleted meanwhile
        out.append((_text(k), size, float(idle) if isinstance(idle, int) else 0.0))
    return out
