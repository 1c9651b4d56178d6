"""The object tier on a real Redis Cluster (3 primaries + 3 replicas on loopback, started
here): URLs, the single node's guarantees on every node, a primary killed mid-run."""

from __future__ import annotations

import functools
import os
import time
import zlib
from collections.abc import Iterator

import pytest
import redis
import redis.cluster
from kit import payload, snapshot
from local_cluster import RedisCluster

from kvtier.config import load_config
from kvtier.errors import ConfigError, ObjectError, ObjectTooLarge, TierUnavailable
from kvtier.keys import KeySpace, Namespace
from kvtier.objects import codec
from kvtier.objects.codec import HASH_PIECE
from kvtier.objects.health import ConstantBackoff
from kvtier.objects.remote import MAX_FRAME, RemoteIO
from kvtier.objects.tiers import open_tier
from kvtier.objects.tiers.redis import BoundedParser, RedisTier
from kvtier.objects.tiers.redis_cluster import (
    NodeUnavailable,
    RedisClusterTier,
    _ClusterParser,
    _SlotDown,
)
from kvtier.ops import OpResult

pytestmark = pytest.mark.integration

SHAPE = [2, 8, 64]
DT = "bfloat16"
SIZE = 2 * 8 * 64 * 2


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    c = RedisCluster()
    try:
        c.start()
        yield c
    finally:
        c.cleanup()


@pytest.fixture
def tier(cluster: RedisCluster) -> Iterator[RedisClusterTier]:
    for port in cluster.primary_ports():
        redis.Redis(port=port).flushall()
    t = open_tier(load_config({"remote_url": cluster.url}))
    assert isinstance(t, RedisClusterTier)
    yield t
    t.close()


def prompt_keys(n: int) -> list[str]:
    """A prompt's object keys as a worker makes them (KeySpace: namespace digest + hash)."""
    ns = Namespace(
        model="m",
        revision=None,
        dtype="bfloat16",
        kv_cache_dtype="auto",
        block_size=16,
        chunk_size=256,
        tp_size=1,
    )
    space = KeySpace.worker(ns, 0, 0)
    return [space.key(os.urandom(16)) for _ in range(n)]


# -- URLs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://10.0.0.1:7000,10.0.0.2:7000/",
        "redis+cluster://10.0.0.1/",
        "rediss+cluster://:pw@a.example:7000,[::1]:7001/?ssl_ca_certs=/ca.pem",
        "redis+cluster://user:pw@h1:1,h2:2",
    ],
)
def test_cluster_urls_accepted(url: str) -> None:
    assert load_config({"remote_url": url}).remote_url == url


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+cluster://h1:1,h2:x/", "not host:port"),
        ("redis+cluster://h1:1,,h2:2/", "not host:port"),
        ("redis+cluster://h1:99999/", "not host:port"),
        ("redis+cluster://h1:1/3", "database 0 only"),
        ("rediss+cluster://h1:1/?ssl_cert_reqs=none", "remote_tls_insecure"),
        ("rediss+cluster://h1:1/?ssl_check_hostname=false", "remote_tls_insecure"),
    ],
)
def test_cluster_urls_refused(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        load_config({"remote_url": url})


def test_cluster_url_password_never_shown() -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"remote_url": "redis+cluster://u:s3cretpass@h1:1,h2:x/"})
    assert "s3cretpass" not in str(err.value)


def test_query_a_cluster_client_would_ignore_is_refused() -> None:
    """RedisCluster drops connection arguments it does not know: refused, not half-applied."""
    with pytest.raises(ConfigError, match="health_check_interval would be ignored"):
        RedisClusterTier("redis+cluster://127.0.0.1:1/?health_check_interval=5")


def test_redis_url_at_a_cluster_node_is_refused(cluster: RedisCluster) -> None:
    """redis:// at one node of a cluster would serve that node's slots and MOVED for the
    rest: refused at startup, naming the URL to use."""
    with pytest.raises(ConfigError, match=r"redis\+cluster://"):
        RedisTier(f"redis://127.0.0.1:{cluster.ports[0]}/0")


def test_cluster_url_at_a_single_node_is_refused(redis_url: str) -> None:
    port = redis_url.rsplit(":", 1)[1].split("/")[0]
    with pytest.raises(ConfigError, match="without cluster mode"):
        RedisClusterTier(f"redis+cluster://127.0.0.1:{port}/")


def test_cluster_unreachable_at_startup_is_the_tiers_outage() -> None:
    """No seed answers: the engine starts, every op is TierUnavailable (RemoteIO backs off)."""
    t = RedisClusterTier("redis+cluster://127.0.0.1:1,127.0.0.1:2/")
    for call in (lambda: t.get("k", 10), lambda: t.put("k", [b"x"]), lambda: t.exists(["k"])):
        with pytest.raises(TierUnavailable):
            call()


# -- errors -----------------------------------------------------------------------------


def test_cluster_error_classes() -> None:
    """One node unreachable is that chunk's ``node`` error; a slot not served or being
    migrated that chunk's miss; no node or the whole cluster down is the tier's."""
    t = RedisClusterTier("redis+cluster://127.0.0.1:1/")
    dead = redis.ConnectionError("Error 111 connecting to 10.0.0.9:7000.")
    assert isinstance(t.tier_error("get", dead), NodeUnavailable)
    assert t.tier_error("get", dead).kind == "node"
    assert isinstance(t.tier_error("get", redis.TimeoutError("Timeout reading")), NodeUnavailable)
    slot = _SlotDown("Hash slot not served")
    assert type(t.tier_error("get", slot)) is ObjectError
    assert type(t.tier_error("get", _SlotDown("TRYAGAIN Multiple keys request"))) is ObjectError
    assert isinstance(t.tier_error("get", _SlotDown("The cluster is down")), TierUnavailable)
    assert isinstance(
        t.tier_error("get", redis.exceptions.RedisClusterException("cannot be connected")),
        TierUnavailable,
    )
    assert isinstance(t.tier_error("get", redis.AuthenticationError("WRONGPASS")), TierUnavailable)
    assert isinstance(t.tier_error("get", redis.exceptions.ResponseError("WRONGTYPE")), ObjectError)


def test_clusterdown_and_tryagain_are_not_slept_on() -> None:
    """redis-py's cluster client sleeps on ClusterDownError (0.25 s) and TRYAGAIN (0.05 s);
    the tier's parser gives those replies a class it does not sleep on (backends never
    sleep)."""
    for reply in ("CLUSTERDOWN The cluster is down", "TRYAGAIN Multiple keys"):
        exc = _ClusterParser.parse_error(reply)
        assert isinstance(exc, _SlotDown)
        sleeps_on = redis.exceptions.ClusterDownError | redis.exceptions.TryAgainError
        assert not isinstance(exc, sleeps_on)


# -- on a real cluster --------------------------------------------------------------------


def test_round_trip_spread_and_same_keys(cluster: RedisCluster, tier: RedisClusterTier) -> None:
    """put / get / read_into / exists through the tier; a prompt's keys spread over every
    primary; a key is the same string as on one node (read back by its plain name)."""
    keys = prompt_keys(48)
    for i, key in enumerate(keys):
        tier.put(key, [b"head1234", payload(i)])
    per_primary = [cluster.keys_on(p) for p in cluster.primary_ports()]
    assert sum(per_primary) == 48
    assert min(per_primary) >= 6, per_primary  # 16 expected per primary
    raw = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    try:
        assert raw.get(keys[0]) == b"head1234" + bytes(payload(0))
    finally:
        raw.close()
    for i, key in enumerate(keys[:8]):
        dest = memoryview(bytearray(SIZE))
        assert tier.read_into(key, dest, 64) == b"head1234"
        assert dest == payload(i)
        assert tier.get(key) == b"head1234" + bytes(payload(i))
    assert tier.get("absent", 100) is None
    assert tier.exists([*keys[:5], "absent", keys[6]]) == [True] * 5 + [False, False]
    tier.delete(keys[:3])
    assert tier.exists(keys[:1]) == [False]


def test_every_node_reads_through_the_bounded_parser(
    cluster: RedisCluster, tier: RedisClusterTier
) -> None:
    """RedisCluster drops a parser_class argument: the tier's node pools put it back, so a
    value larger than the slot is refused from its length line on every node."""
    keys = prompt_keys(24)
    raw = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    try:
        for key in keys:
            raw.set(key, b"x" * 200_000)
    finally:
        raw.close()
    for key in keys:
        with pytest.raises(ObjectTooLarge):
            tier.read_into(key, memoryview(bytearray(1000)), 64)
    nodes = tier._cluster.get_primaries()
    assert len(nodes) == 3
    for node in nodes:
        pool = node.redis_connection.connection_pool
        conn = pool.get_connection()
        try:
            assert isinstance(conn._parser, BoundedParser), type(conn._parser)
        finally:
            pool.release(conn)


def test_get_into_on_every_node(cluster: RedisCluster, tier: RedisClusterTier) -> None:
    """get_into on the cluster: the key's node, its bounded parser reading the whole value
    into the front of the buffer; missing is None; an oversize value is refused as get
    refuses it, the buffer untouched and nothing written past it."""
    keys = prompt_keys(12)
    values = [os.urandom(100_000 + 1000 * i) for i in range(len(keys))]
    for key, value in zip(keys, values, strict=True):
        tier.put(key, [value[:10], value[10:]])
    whole = bytearray(b"\xa5") * 200_000
    buf = memoryview(whole)[:150_000]
    for key, value in zip(keys, values, strict=True):
        assert tier.get_into(key, buf) == len(value)
        assert whole[: len(value)] == value
        assert whole[150_000:] == bytearray(b"\xa5") * 50_000
    assert tier.get_into("absent", buf) is None
    small = memoryview(bytearray(b"\xa5") * 100_000)
    with pytest.raises(ObjectTooLarge):
        tier.get_into(keys[-1], small[:99_000])
    with pytest.raises(ObjectTooLarge):
        tier.get(keys[-1], max_bytes=99_000)
    assert small == bytearray(b"\xa5") * 100_000
    assert tier.get(keys[0]) == values[0]  # the next read is intact


def test_read_into_hashed_on_every_node(cluster: RedisCluster, tier: RedisClusterTier) -> None:
    """The read a hit makes, on the cluster: each node's bounded parser reads the payload
    into the slot and checksums it as it lands; the CRC is of exactly the slot's bytes."""
    keys = prompt_keys(6)
    n = 2 * HASH_PIECE + 4321
    values = [os.urandom(n) for _ in keys]
    for key, value in zip(keys, values, strict=True):
        tier.put(key, codec.encode(key, value, dtype="uint8", shape=[n]))
    nodes = {tier._cluster.get_node_from_key(key).name for key in keys}
    assert len(nodes) > 1  # the keys spread over several primaries
    for key, value in zip(keys, values, strict=True):
        slot = memoryview(bytearray(n))
        found: list[bytes] = []  # the slot as it was when the node's reply began
        got = tier.read_into_hashed(
            key, slot, MAX_FRAME, found=functools.partial(snapshot, found, slot)
        )
        assert got is not None
        head, crc = got
        assert bytes(slot) == value and crc == zlib.crc32(value)
        assert found == [bytes(n)]  # once, before a byte of the payload landed
        codec.verify(head, slot, key=key, dtype="uint8", shape=[n], payload_crc=crc)
    missing: list[bytes] = []
    assert (
        tier.read_into_hashed(
            "absent", memoryview(bytearray(n)), MAX_FRAME, found=lambda: missing.append(b"")
        )
        is None
    )
    assert missing == []


def collect(rio: RemoteIO, n: int, timeout: float = 15.0) -> list[OpResult]:
    out: list[OpResult] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += rio.poll()
        time.sleep(0.002)
    assert len(out) == n, f"expected {n} results, got {len(out)}"
    return out


def test_primary_killed_mid_run() -> None:
    """kill -9 one primary: fetches and uploads of its slots fail as kind ``node`` (misses,
    dropped uploads), the other slots keep serving, the tier is never marked down, and once
    a replica is promoted the same tier serves every slot again without being reopened."""
    # the reads and writes right after the kill must run before the cluster promotes the
    # replica: 3 s of node timeout leaves room for a loaded 2-core machine (1 s once did not)
    c = RedisCluster(node_timeout_ms=3000)
    try:
        c.start()
        tier = RedisClusterTier(c.url, lookup_timeout_ms=1000)
        rio = RemoteIO(
            tier,
            threads=4,
            queue_depth=256,
            timeout_s=5.0,
            signer=None,
            backoff=ConstantBackoff(5.0),
        )
        keys = prompt_keys(30)
        for i, key in enumerate(keys):
            assert rio.submit_put(i, key, payload(i), dtype=DT, shape=SHAPE)
        assert all(r.ok for r in collect(rio, 30))
        slot_of = {k: tier._cluster.keyslot(k) for k in keys}
        victim = c.port_of_slot(slot_of[keys[0]])
        on_victim = {k for k in keys if c.port_of_slot(slot_of[k]) == victim}
        assert 0 < len(on_victim) < len(keys)
        c.wait_replicated(victim)  # else the promoted replica may lack the last writes
        c.kill(victim)

        def fetch_all(base: int) -> dict[str, OpResult]:
            for i, key in enumerate(keys):  # one chunk per run: each is its own lookup
                rio.submit_get_into(
                    base + i, key, memoryview(bytearray(SIZE)), dtype=DT, shape=SHAPE
                )
            got = {r.op_id: r for r in collect(rio, len(keys))}
            return {key: got[base + i] for i, key in enumerate(keys)}

        before = rio.counters()
        res = fetch_all(1000)
        for key, r in res.items():
            if key in on_victim:
                assert not r.ok and r.error_kind == "node", r
            else:
                assert r.ok, r
        fresh = prompt_keys(40)
        doomed = {k for k in fresh if c.port_of_slot(tier._cluster.keyslot(k)) == victim}
        for i, key in enumerate(fresh):
            assert rio.submit_put(2000 + i, key, payload(i), dtype=DT, shape=SHAPE)
        ups = {r.op_id: r for r in collect(rio, len(fresh))}
        for i, key in enumerate(fresh):
            r = ups[2000 + i]
            assert (r.ok, r.error_kind) == ((False, "node") if key in doomed else (True, None))
        assert not rio.is_down, "one node's failure took the whole tier down"
        after = rio.counters()
        assert after["errors_node"] - before["errors_node"] == len(on_victim) + len(doomed)
        assert after["errors_unreachable"] == before["errors_unreachable"] == 0
        # per node (kvtier:node_errors{node}): every failed call, the victim's address only
        assert tier.take_node_errors() == {f"127.0.0.1:{victim}": len(on_victim) + len(doomed)}
        assert tier.take_node_errors() == {}

        c.wait_failover(victim)
        deadline = time.monotonic() + 10
        base = 3000
        while True:  # the node's short fail-fast ends, one op finds the promoted replica
            res = fetch_all(base)
            base += 100
            if all(r.ok for r in res.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert all(r.ok for r in res.values()), {k: r.error_kind for k, r in res.items()}
        for i, key in enumerate(fresh):
            assert rio.submit_put(5000 + i, key, payload(i), dtype=DT, shape=SHAPE)
        assert all(r.ok for r in collect(rio, len(fresh)))
        rio.close()
        tier.close()
    finally:
        c.cleanup()


def test_codec_frames_round_trip_through_remoteio(cluster: RedisCluster) -> None:
    """The signed frame RemoteIO writes reads back from the cluster (no hash tags in keys)."""
    for port in cluster.primary_ports():
        redis.Redis(port=port).flushall()
    tier = RedisClusterTier(cluster.url)
    rio = RemoteIO(
        tier,
        threads=2,
        queue_depth=16,
        timeout_s=5.0,
        signer=codec.Signer(b"k"),
        backoff=ConstantBackoff(0.2),
    )
    keys = prompt_keys(6)
    for i, key in enumerate(keys):
        rio.submit_put(i, key, payload(i), dtype=DT, shape=SHAPE)
    assert all(r.ok for r in collect(rio, 6))
    dests = [memoryview(bytearray(SIZE)) for _ in keys]
    run = [(100 + i, k, d) for i, (k, d) in enumerate(zip(keys, dests, strict=True))]
    rio.submit_get_run(run, dtype=DT, shape=SHAPE)
    assert all(r.ok for r in collect(rio, 6))
    assert all(d == payload(i) for i, d in enumerate(dests))
    rio.close()
    tier.close()


def test_tls_and_auth_on_every_node() -> None:
    """rediss+cluster:// with a password: the TLS options and AUTH reach every node the
    cluster announces (not only the seed); an untrusted certificate or a wrong password
    is the tier's outage, never a per-node miss."""
    c = RedisCluster(replicas=0, tls=True, password="cluster-pw-5e1f")
    try:
        c.start()
        tier = open_tier(load_config({"remote_url": c.url}))
        keys = prompt_keys(24)
        for i, key in enumerate(keys):
            tier.put(key, [b"head1234", payload(i)])
        assert all(c.keys_on(p) > 0 for p in c.primary_ports())
        for i, key in enumerate(keys):
            dest = memoryview(bytearray(SIZE))
            assert tier.read_into(key, dest, 64) == b"head1234"
            assert dest == payload(i)
        with pytest.raises(ObjectTooLarge):
            tier.read_into(keys[0], memoryview(bytearray(100)), 64)
        tier.close()
        wrong_pw = c.url.replace("cluster-pw-5e1f", "wrong-pw")
        no_ca = c.url.split("?")[0]
        for url in (wrong_pw, no_ca):
            t = RedisClusterTier(url)
            with pytest.raises(TierUnavailable) as err:
                t.get(keys[0], 10_000)
            assert "cluster-pw-5e1f" not in str(err.value) and "wrong-pw" not in str(err.value)
            t.close()
    finally:
        c.cleanup()


def test_a_node_that_just_failed_is_skipped_for_a_moment(
    cluster: RedisCluster, tier: RedisClusterTier
) -> None:
    """After a node's failure its keys fail fast (no network: the node here is up), the
    other nodes' keys are served, and after the node's short backoff it is tried again."""
    keys = prompt_keys(12)
    for i, key in enumerate(keys):
        tier.put(key, [b"head1234", payload(i)])
    node = tier._node_of(keys[0])
    assert node is not None
    other = next(k for k in keys if tier._node_of(k) != node)
    tier._node_failed(node)
    with pytest.raises(NodeUnavailable, match="skipped for a moment"):
        tier.get(keys[0], 10_000)
    assert tier.get(other, 10_000) is not None
    assert tier.take_node_errors() == {node: 2}  # the failure, and the call it skipped
    time.sleep(0.06)  # the first failure's backoff: 50 ms
    assert tier.get(keys[0], 10_000) == b"head1234" + bytes(payload(0))
    assert not tier._node_health[node].failures  # answered: the node is up again


def test_a_topology_refresh_never_cuts_a_reply_being_read(
    cluster: RedisCluster, tier: RedisClusterTier
) -> None:
    """redis-py's topology refresh (after any node's connection error) disconnects the
    connections a node's pool lists as free. A connection another thread took at that
    moment must not be among them: its reply would be cut mid-read (with redis-py's
    blocking pool the parser's buffer vanished: AttributeError, a fetch failed as "tier")."""
    import threading

    tier.put("refresh-probe", [b"x"])
    node = tier._cluster.get_node_from_key("refresh-probe")
    pool = node.redis_connection.connection_pool
    conn = pool.get_connection()
    pool.release(conn)  # one free, connected connection
    in_refresh, go, refreshed, sent = (threading.Event() for _ in range(4))
    disconnect = conn.disconnect

    def slow_disconnect(*args, **kwargs):  # the refresh, holding its list of free ones
        in_refresh.set()
        go.wait(5)
        return disconnect(*args, **kwargs)

    conn.disconnect = slow_disconnect
    out: list[object] = []

    def refresh() -> None:
        pool.disconnect_free_connections()
        refreshed.set()

    def command() -> None:
        try:
            c = pool.get_connection()
            c.send_command("GET", "refresh-probe")
            sent.set()
            refreshed.wait(5)
            out.append(c.read_response())
            pool.release(c)
        except Exception as exc:  # noqa: BLE001 - the failure under test
            out.append(exc)

    t1 = threading.Thread(target=refresh)
    t1.start()
    assert in_refresh.wait(5)
    t2 = threading.Thread(target=command)
    t2.start()
    sent.wait(0.5)  # a pool that hands the connection out now lets the command go ahead
    go.set()
    t1.join(5)
    t2.join(5)
    assert out == [b"x"], out


def test_a_slot_moved_under_the_tier_is_followed(
    cluster: RedisCluster, tier: RedisClusterTier
) -> None:
    """A slot migrated to another primary while the tier's slot map still names the old
    one: mid-migration the moved key is read through ASK, afterwards through MOVED, and a
    write there takes redis-py's redirection path; no error, the same bytes."""
    from local_cluster import node_command

    key = prompt_keys(1)[0]
    tier.put(key, [b"head1234", payload(7)])
    slot = tier._cluster.keyslot(key)
    src = cluster.port_of_slot(slot)
    dst = next(p for p in cluster.primary_ports() if p != src)
    src_id, dst_id = (node_command(p, "CLUSTER", "MYID").strip() for p in (src, dst))
    assert "OK" in node_command(dst, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", src_id)
    assert "OK" in node_command(src, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", dst_id)
    assert "OK" in node_command(src, "MIGRATE", "127.0.0.1", str(dst), "", "0", "5000", "KEYS", key)
    dest = memoryview(bytearray(SIZE))
    assert tier.read_into(key, dest, 64) == b"head1234" and dest == payload(7)  # ASK
    for port in cluster.primary_ports():
        assert "OK" in node_command(port, "CLUSTER", "SETSLOT", str(slot), "NODE", dst_id)
    assert tier.get(key) == b"head1234" + bytes(payload(7))  # MOVED
    tier.put(key, [b"head5678", payload(8)])  # MOVED on the fast path: redis-py's path
    assert tier.get(key, 10_000) == b"head5678" + bytes(payload(8))
    assert cluster.keys_on(dst) >= 1
    assert tier.take_node_errors() == {}
