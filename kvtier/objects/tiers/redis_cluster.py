"""Object tier on Redis Cluster or a Valkey cluster (``redis+cluster://`` / ``rediss+cluster://``).

The URL names seed nodes only (``redis+cluster://h1:6379,h2:6379/``); redis-py's own
:class:`redis.cluster.RedisCluster` discovers the slots and follows MOVED, ASK and
failovers: kvtier keeps no slot map and writes no redirection logic. What kvtier adds is
the single node's guarantees, on every node's connections:

- every reply is parsed by the single node's bounded RESP2 parser (``BoundedParser``,
  plugged in through the node pools' class, since ``RedisCluster`` drops a
  ``parser_class`` argument), so a reply's size is checked from its length line;
- a chunk read is STRLEN + GETRANGE on its one node in one round trip; a chunk write is
  one SET sent from its parts without joining them (redis-py's ``execute_command``, with
  its redirection handling, only when the fast path meets a redirection or a dead
  connection);
- a chunk read is STRLEN + GETRANGE sent straight to its node's connection, every wait
  within the read's deadline (a hung node costs the read its deadline, never a socket
  timeout or a retry beyond it); redis-py's pipeline only for a redirection or a dead
  connection;
- a node that cannot be reached (killed, hung, partitioned, mid-failover) is that chunk's
  error, of kind ``node`` (:class:`NodeUnavailable`), never the tier's: the cluster's other
  slots keep serving and RemoteIO does not back the whole tier off. Health is kept per
  node: ops on a node that just failed fail fast for a short, growing while (at most
  :data:`NODE_BACKOFF_CAP_S`), then one op (the probe) tries it again while the others
  still fail fast, and a topology refresh (asked for by the failure, run by the probe or
  by redis-py's next command) finds a promoted replica. Only when no node at all can be
  reached (the topology refresh fails) or
  the cluster says it is down as a whole (``CLUSTERDOWN The cluster is down``, the server
  default ``cluster-require-full-coverage yes`` during a failover) is the tier unavailable.

Keys are the same strings as on one node (no hash tags): a fleet can move between a
single node and a cluster, and a prompt's chunks spread over every primary.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence
from typing import Any

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtier import metrics
from kvtier.config import RemoteURL
from kvtier.errors import ConfigError, ObjectError, TierError, TierUnavailable
from kvtier.objects.health import BackoffState, ExponentialBackoff
from kvtier.objects.tiers.base import Parts
from kvtier.objects.tiers.policy import RETRIES, Timeouts
from kvtier.objects.tiers.redis import RedisTier
from kvtier.objects.tiers.redis_resp import (
    BoundedParser,
    ReplyBound,
    bounded_connection,
    command_frame,
    expect_reply,
    pool_connection,
    set_frame,
)

__all__ = ["NODE_BACKOFF_CAP_S", "NodeUnavailable", "RedisClusterTier"]

log = logging.getLogger("kvtier.tiers.redis")

#: the longest a node that failed is skipped before one op tries it again
NODE_BACKOFF_CAP_S = 1.0
#: distinct node addresses counted one by one; the rest are counted under "other"
NODE_LABELS = metrics.NODE_LABELS


class NodeUnavailable(TierError):
    """One cluster node (and so the slots it serves) cannot be reached; the cluster can."""

    kind = "node"


class _SlotDown(redis.ResponseError):
    """``CLUSTERDOWN`` / ``TRYAGAIN`` under a class redis-py's cluster client does not retry
    with sleeps (it sleeps 0.25 s on ClusterDownError, 0.05 s per TRYAGAIN): backends never
    sleep, so the reply goes to the tier's own classification at once."""


class _ClusterParser(BoundedParser):
    EXCEPTION_CLASSES = {
        **BoundedParser.EXCEPTION_CLASSES,
        "CLUSTERDOWN": _SlotDown,
        "TRYAGAIN": _SlotDown,
    }


#: what redis-py's cluster client raises (RedisClusterException is no RedisError)
_CLIENT_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)
#: errors of the fast write path that redis-py's own ``execute_command`` then handles: a
#: dead connection or node (it refreshes the topology and retries once), a redirection
_SLOW_PATH = (
    redis.ConnectionError,
    OSError,
    redis.exceptions.MovedError,
    redis.exceptions.AskError,
    redis.exceptions.SlotNotCoveredError,
)


def _node_name(exc: BaseException, default: str | None) -> str:
    """host:port of the node an error of redis-py's cluster client came from (the node
    the key mapped to when the call began, where redis-py does not say)."""
    where = getattr(exc, "connection", None)
    host, port = getattr(where, "host", None), getattr(where, "port", None)
    if host is not None:
        return f"{host}:{port}"
    return default or "unknown"


_NOT_A_CLUSTER = (
    "a Redis Cluster; this server runs without cluster mode: use redis://host:port/0 "
    "(or rediss://) for a single node"
)


def _seed(host: str, port: int) -> Any:
    return redis.cluster.ClusterNode(host, port)  # type: ignore[no-untyped-call]


class RedisClusterTier(RedisTier):
    """Chunks as plain string values on a Redis Cluster; seeds, AUTH and TLS from the URL."""

    name = "redis"

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
        if remote.kind != "redis-cluster":
            raise ConfigError("remote_url", remote.text, "redis+cluster://host:port,...")
        tls = remote.tls
        self._seeds = list(remote.seeds)
        # redis-py reads the connection options from the first seed's URL, which carries
        # the cluster URL's user, password and query (RemoteURL.node_url)
        options = redis.connection.parse_url(remote.node_url)  # type: ignore[no-untyped-call]
        self._password = options.get("password")
        self.ttl_s = ttl_s
        self._waits = Timeouts.from_ms(lookup_timeout_ms)
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
                "redis cluster %s: TLS verification is OFF (%s, allowed by remote_tls_insecure):"
                " anyone on the network path can read and replace chunks",
                self._safe_url,
                ", ".join(weak),
            )
        self._bound = ReplyBound()
        parser = type("_TierParser", (_ClusterParser,), {"bound": self._bound})
        # at most io_threads calls at once, each holding one connection per node, plus a
        # topology refresh: a node's pool never runs out
        limits = {"parser_class": parser, "max_connections": io_threads + 2}

        class _Pool(redis.ConnectionPool):
            """Every node's pool: the tier's parser and bounds (RedisCluster passes only the
            connection arguments it knows to a node's pool). Not redis-py's blocking pool:
            the cluster client's topology refresh disconnects the connections such a pool
            lists as free, and one another thread was taking at that moment had its reply
            cut mid-read (its parser's buffer gone)."""

            def __init__(self, **kwargs: Any) -> None:
                base = kwargs.pop("connection_class", redis.Connection)
                super().__init__(connection_class=bounded_connection(base), **{**kwargs, **limits})

        options.pop("host"), options.pop("port"), options.pop("db", None)
        # arguments RedisCluster would drop without a word: refused, never half-applied
        known = set(redis.cluster.REDIS_ALLOWED_KEYS) - {"host", "port", "retry", "db"}
        dropped = sorted(set(options) - known)
        if dropped:
            raise ConfigError(
                "remote_url",
                self._safe_url,
                f"query arguments a cluster client can use ({', '.join(sorted(known))}); "
                f"{', '.join(dropped)} would be ignored",
            )
        if tls:  # verify certificate and name whatever redis-py defaults to; the URL's own win
            options = {"ssl_cert_reqs": "required", "ssl_check_hostname": True, **options}
        options.update(
            protocol=2,
            socket_timeout=self._waits.reply_s,
            socket_connect_timeout=self._waits.connect_s,
        )
        self._cluster_args: dict[str, Any] = {
            "url": remote.seed_url,  # the first seed's address: every option is a keyword below
            "startup_nodes": [_seed(h, p) for h, p in self._seeds[1:]],
            "require_full_coverage": False,
            "retry": Retry(NoBackoff(), RETRIES),
            "connection_pool_class": _Pool,
            **options,
        }
        self._client_lock = threading.Lock()
        self._calling = threading.local()  # .node: the node this thread's call maps to
        self._cluster: Any = None  # redis.cluster.RedisCluster
        self._nodes_lock = threading.Lock()
        self._node_health: dict[str, BackoffState] = {}
        self._node_errors: collections.Counter[str] = collections.Counter()
        self._node_errors_new: collections.Counter[str] = collections.Counter()
        self._node_backoff = ExponentialBackoff(0.05, NODE_BACKOFF_CAP_S)
        self._refresh_wanted = False  # (redis-py without requested refreshes)
        try:
            self._cluster_client(opening=True)
        except TierError as exc:  # unreachable now: ops try again (and back off) later
            log.warning("redis cluster %s not reachable at startup: %s", self._safe_url, exc)

    def __repr__(self) -> str:
        return f"RedisClusterTier({self._safe_url!r})"

    # -- the client ------------------------------------------------------------------

    def _cluster_client(self, opening: bool = False) -> Any:
        """The cluster client, built on first use (the topology is read then): a cluster
        that cannot be reached at startup costs misses until it can, not the engine. A
        server without cluster mode is a ConfigError at startup, later the tier's outage."""
        client = self._cluster
        if client is not None:
            return client
        with self._client_lock:
            if self._cluster is None:
                try:
                    self._cluster = redis.cluster.RedisCluster(**self._cluster_args)
                except _CLIENT_ERRORS as exc:
                    text = str(exc).lower()
                    if opening and "cluster" in text and "not enabled" in text:
                        raise ConfigError("remote_url", self._safe_url, _NOT_A_CLUSTER) from None
                    if "cluster" in text and "not enabled" in text:
                        raise TierUnavailable(
                            f"redis cluster {self._safe_url}: {_NOT_A_CLUSTER}"
                        ) from None
                    raise TierUnavailable(
                        f"redis cluster {self._safe_url}: {self.clean_error(exc)}"
                    ) from None
            return self._cluster

    @property
    def _client(self) -> Any:  # type: ignore[override]
        """The cluster client, under the name RedisTier's methods use."""
        return self._cluster_client()

    # -- errors ----------------------------------------------------------------------

    #: what redis-py's cluster client raises (:meth:`RedisTier.tier_errors` maps it)
    FOREIGN_ERRORS = _CLIENT_ERRORS

    def tier_error(self, op: str, exc: BaseException) -> TierError:
        """The single node's mapping, plus what only a cluster says: one node unreachable
        (``node``), a slot not served or being migrated (that chunk's miss), no node
        reachable or the whole cluster down (the tier)."""
        if isinstance(exc, redis.ConnectionError | redis.TimeoutError) and not isinstance(
            exc, redis.AuthenticationError
        ):
            node = _node_name(exc, getattr(self._calling, "node", None))
            self._node_failed(node)
            return NodeUnavailable(
                f"redis cluster {op} {self._safe_url}: node {node}: {self.clean_error(exc)}"
            )
        if isinstance(exc, _SlotDown):
            text = f"redis cluster {op} {self._safe_url}: {self.clean_error(exc)}"
            if "cluster is down" in str(exc).lower():
                return TierUnavailable(text)
            return ObjectError(text)  # a slot not served, TRYAGAIN during a migration
        if isinstance(exc, redis.exceptions.SlotNotCoveredError):
            return ObjectError(f"redis cluster {op} {self._safe_url}: {self.clean_error(exc)}")
        if isinstance(exc, redis.exceptions.RedisClusterException):
            return TierUnavailable(f"redis cluster {op} {self._safe_url}: {self.clean_error(exc)}")
        if isinstance(exc, redis.exceptions.MovedError | redis.exceptions.AskError):
            # redis-py follows these; one left over is a slot moving under the call
            return ObjectError(f"redis cluster {op} {self._safe_url}: {self.clean_error(exc)}")
        return super().tier_error(op, exc)

    def _node_failed(self, node: str) -> None:
        self._count_node(node)
        with self._nodes_lock:
            state = self._node_health.get(node)
            if state is None and len(self._node_health) < 4 * NODE_LABELS:
                state = self._node_health[node] = BackoffState(self._node_backoff)
        if state is not None:
            state.failed()

    def _count_node(self, node: str) -> None:
        """One call failed for ``node``: counted under its address (bounded)."""
        with self._nodes_lock:
            label = (
                node
                if node in self._node_errors or len(self._node_errors) < NODE_LABELS
                else "other"
            )
            self._node_errors[label] += 1
            self._node_errors_new[label] += 1

    def _node_of(self, key: str) -> str | None:
        """host:port of the primary serving ``key`` in the client's current slot map."""
        client = self._cluster
        if client is None:
            return None
        try:
            node = client.nodes_manager.get_node_from_slot(client.keyslot(key))
        except (*_CLIENT_ERRORS, IndexError, KeyError):
            return None
        return node.name if node is not None else None

    def _admit(self, op: str, key: str, wait_s: float = 0.0) -> tuple[str | None, int]:
        """Fail fast on a key whose node failed a moment ago (no network): the tier's other
        slots go on; once the node's short backoff is over one op (the probe) tries it
        again while the rest still fail fast, or, given ``wait_s`` (uploads), wait that
        long for the probe's report: a node that is back must not lose the uploads that
        came while its probe was out. (the node, the probe's token or 0)."""
        node = self._calling.node = self._node_of(key)
        state = self._node_health.get(node) if node is not None else None
        if node is None or state is None:
            return node, 0
        token = state.admit_waiting(wait_s) if wait_s > 0 else state.admit()
        if token is None:
            self._count_node(node)
            raise NodeUnavailable(
                f"redis cluster {op} {self._safe_url}: node {node} failed "
                f"{state.failures} time(s) in a row, skipped for a moment"
            )
        if token:  # the probe: a topology refresh the failure asked for goes first
            self._run_refresh()
        return node, token

    def _check_node(self, op: str, key: str) -> None:
        """:meth:`_admit` for an op that needs no probe token (tests)."""
        node, token = self._admit(op, key)
        self._probe_over(node, token)

    def _probe_over(self, node: str | None, token: int) -> None:
        state = self._node_health.get(node) if token and node is not None else None
        if state is not None:
            state.probe_over(token)

    def _node_answered(self, node: str | None) -> None:
        state = self._node_health.get(node) if node is not None else None
        if state is not None and state.failures and state.succeeded():
            log.info("redis cluster %s: node %s answers again", self._safe_url, node)

    def _refresh_later(self, node: str | None) -> None:
        """Ask for a topology refresh, run by the node's next probe (or redis-py's next
        command), not now: the call that timed out has no time left for one."""
        manager = getattr(self._cluster, "nodes_manager", None)
        request = getattr(manager, "_request_refresh", None)
        if request is None:  # a redis-py that refreshes only inline: the probe runs one
            self._refresh_wanted = True
            return
        try:  # (redis-py 8: refreshes are requested, then run when due)
            request(last_failed_node_name=node)
        except TypeError:
            request()

    def _run_refresh(self) -> None:
        """Run a topology refresh asked for, when it is due (the probe of a node that
        failed: a replica may have taken its slots). Its failure is logged; the probe
        goes on with the slot map it has."""
        client = self._cluster
        manager = getattr(client, "nodes_manager", None)
        run = getattr(manager, "_run_requested_refresh", None)
        try:
            if run is not None and getattr(manager, "_refresh_requested", False):
                run(client.retry)
            elif run is None and self._refresh_wanted and manager is not None:
                self._refresh_wanted = False
                manager.initialize()
        except _CLIENT_ERRORS as exc:
            log.info(
                "redis cluster %s: topology refresh failed: %s",
                self._safe_url,
                self.clean_error(exc),
            )

    def node_errors(self) -> dict[str, int]:
        """Connection failures per node address since open (at most :data:`NODE_LABELS`
        addresses, the rest under "other")."""
        with self._nodes_lock:
            return dict(self._node_errors)

    def take_node_errors(self) -> dict[str, int]:
        """Connection failures per node address since the last call (the worker turns
        them into ``kvtier:node_errors{node}``)."""
        with self._nodes_lock:
            new, self._node_errors_new = self._node_errors_new, collections.Counter()
        return dict(new)

    # -- the object tier -------------------------------------------------------------

    def _exists_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return super().exists(keys)
        node, token = self._admit("exists", keys[0])
        try:
            found = super().exists(keys)
        finally:
            self._probe_over(node, token)
        self._node_answered(node)
        return found

    def get_bounded(self, key: str, max_bytes: int | None) -> bytes | bytearray | None:
        node, token = self._admit("get", key)
        try:
            data = super().get_bounded(key, max_bytes)
        finally:
            self._probe_over(node, token)
        self._node_answered(node)
        return data

    def strlen_getrange(self, key: str, n: int) -> tuple[Any, Any]:
        """STRLEN + GETRANGE on the key's node (:meth:`_on_node`), redis-py's pipeline for
        a dead connection or a redirection."""
        replies = self._on_node(key, [("STRLEN", key), ("GETRANGE", key, 0, n - 1)])
        if replies is None:
            return super().strlen_getrange(key, n)
        return replies[0], replies[1]

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """EXISTS of one key (an upload's check) on its node (:meth:`_on_node`); of more,
        redis-py's pipeline (it splits them by node)."""
        if len(keys) != 1:
            return self._exists_many(keys)
        node, token = self._admit("exists", keys[0])
        try:
            with self.tier_errors("exists"):
                replies = self._on_node(keys[0], [("EXISTS", keys[0])])
            found = RedisTier.exists(self, keys) if replies is None else self._found(replies)
        finally:
            self._probe_over(node, token)
        self._node_answered(node)
        return found

    def _found(self, replies: list[Any]) -> list[bool]:
        if type(replies[0]) is not int:
            raise self.wrong_reply("exists", "EXISTS", replies[0])
        return [replies[0] > 0]

    def _on_node(self, key: str, commands: list[tuple[str | int, ...]]) -> list[Any] | None:
        """``commands`` sent straight to the key's node in one round trip and every reply
        read there, each wait within the thread's deadline (None: use redis-py's path, for
        a dead pooled connection or node, or a redirection, which it reconnects, refreshes
        and follows). A timeout is that node's failure: no retry and no topology refresh
        now (the call's time is spent; one is asked for, run by the node's next probe)."""
        client = self._cluster_client()
        try:
            node = client.nodes_manager.get_node_from_slot(client.keyslot(key))
            pool = client.get_redis_connection(node).connection_pool
        except (*_CLIENT_ERRORS, IndexError, KeyError):
            return None
        conn: Any = None
        replies: list[Any] = []
        try:
            conn = pool_connection(pool)
            for command in commands:
                expect_reply(conn, str(command[0]))
            conn.send_packed_command([b"".join(command_frame(*c) for c in commands)])
            for _ in commands:
                try:
                    replies.append(conn.read_response())
                except redis.ResponseError as exc:  # one reply's error: the rest are read too
                    replies.append(exc)
        except redis.TimeoutError:
            self._refresh_later(getattr(node, "name", None))
            raise
        except (redis.ConnectionError, OSError):
            replies = []  # a dead pooled connection or node: redis-py's path
        finally:
            if conn is not None:
                if len(replies) < len(commands):
                    conn.disconnect()
                pool.release(conn)
        errors = [r for r in replies if isinstance(r, redis.ResponseError)]
        redirected = (redis.exceptions.MovedError, redis.exceptions.AskError)
        if not replies or any(isinstance(e, redirected) for e in errors):
            return None
        if errors:
            raise errors[0]
        return replies

    def put(self, key: str, parts: Parts) -> None:
        """SET from the parts on the key's primary (one round trip, no join); a
        redirection or a dead pooled connection goes through redis-py's own
        ``execute_command`` (which follows MOVED / ASK and refreshes the topology), a
        timeout is the node's failure at once (a hung node is not waited for twice)."""
        node_name, token = self._admit("put", key, wait_s=self._waits.reply_s)
        try:
            self._put(key, parts)
        finally:
            self._probe_over(node_name, token)
        self._node_answered(node_name)

    def _put(self, key: str, parts: Parts) -> None:
        client = self._cluster_client()
        extra: list[Any] = ["EX", self.ttl_s] if self.ttl_s else []
        reply: Any = None
        conn: Any = None
        node: Any = None
        with self.tier_errors("put"):
            try:
                node = client.nodes_manager.get_node_from_slot(client.keyslot(key))
                pool = client.get_redis_connection(node).connection_pool
                conn = pool_connection(pool)
                expect_reply(conn, "SET")
                conn.send_packed_command(set_frame(key, parts, self.ttl_s))
                reply = conn.read_response()
            except redis.TimeoutError:  # a hung node: no second wait (nor a retry) on it
                if conn is not None:
                    conn.disconnect()
                self._refresh_later(getattr(node, "name", None))
                raise
            except _SLOW_PATH as exc:
                if conn is not None and not isinstance(exc, redis.ResponseError):
                    conn.disconnect()
                reply = None
            finally:
                if conn is not None:
                    pool.release(conn)
            if reply is None:  # the slow path: redis-py's redirections, retry and refresh
                reply = client.execute_command("SET", key, b"".join(parts), *extra)
        if reply not in (b"OK", "OK", True):
            raise ObjectError(f"redis put {self._safe_url}: unexpected reply {reply!r:.80}")

    def delete(self, keys: Sequence[str]) -> None:
        """DEL per key (a cluster refuses one DEL across slots), pipelined per node."""
        if not keys:
            return
        self._calling.node = None
        with self.tier_errors("delete"), self._cluster_client().pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.delete(key)
            pipe.execute()

    def _primaries(self) -> list[Any]:
        """:meth:`RedisTier._primaries`: a client of each primary (a listing SCANs each)."""
        client = self._cluster_client()
        return [client.get_redis_connection(n) for n in client.get_primaries()]

    def _by_node(self, keys: Sequence[str]) -> list[tuple[Any, list[str]]]:
        """:meth:`RedisTier._by_node`: each key with the client of its slot's node."""
        client = self._cluster_client()
        by_node: dict[int, tuple[Any, list[str]]] = {}
        for k in keys:
            node = client.get_redis_connection(client.get_node_from_key(k))
            by_node.setdefault(id(node), (node, []))[1].append(k)
        return list(by_node.values())

    def close(self) -> None:
        with self._client_lock:
            client, self._cluster = self._cluster, None
        if client is not None:
            client.close()

    def create_if_absent(self, key: str, parts: Parts) -> bool:
        """:meth:`RedisTier.create_if_absent` (SET NX) on the key's primary through the
        cluster client (it follows MOVED / ASK), with the node's health as :meth:`put`."""
        node_name, token = self._admit("create", key)
        try:
            created = super().create_if_absent(key, parts)
        finally:
            self._probe_over(node_name, token)
        self._node_answered(node_name)
        return created
