"""One primary of a real Redis Cluster hung (SIGSTOP: a hung host, or packets dropped),
issue 47 item 4: reads of the healthy primaries' slots are all served, a read of the hung
one's slots holds its read thread no longer than its deadline, the hung node's failures
are its own (never the tier's read health), and once its backoff is over one read (the
probe) goes to it while the others still fail fast.

Counts, not durations: what reached the hung node is counted by the node itself (its
``INFO`` once it runs again: it accepts the connections and executes what was sent to
it meanwhile),
stuck reads by RemoteIO. The one duration check is marked ``timing``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
from kit import payload
from local_cluster import RedisCluster, node_command

from kvtier.objects.remote import RemoteIO
from kvtier.objects.tiers.redis_cluster import RedisClusterTier
from kvtier.ops import OpResult

pytestmark = pytest.mark.integration

SHAPE = [2, 8, 64]
DT = "bfloat16"
SIZE = 2 * 8 * 64 * 2
#: the lookup deadline: long enough for one read thread to serve a round's healthy reads
#: on a loaded machine while another waits on the hung node
DEADLINE_MS = 1000


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    # no replicas, and a node timeout far beyond the test: the stopped primary keeps its
    # slots (nothing fails it over), as a hung host would until the cluster notices
    c = RedisCluster(replicas=0, node_timeout_ms=120_000)
    try:
        c.start()
        yield c
    finally:
        c.cleanup()


def prompt_keys(n: int) -> list[str]:
    from test_redis_cluster import prompt_keys as keys

    return keys(n)


def collect(rio: RemoteIO, n: int, timeout: float = 20.0) -> dict[int, OpResult]:
    out: list[OpResult] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += rio.poll()
        time.sleep(0.002)
    assert len(out) == n, f"expected {n} results, got {len(out)}"
    return {r.op_id: r for r in out}


def attempts(port: int) -> int:
    """Reads that reached the node since its stats were reset, at most: a read sends
    STRLEN on a pooled connection, or opens a new one (and then waits for its
    handshake's reply; a stopped node's kernel accepts the connection)."""
    stats = {}
    for line in node_command(port, "INFO", "all").splitlines():
        name, _, value = line.partition(":")
        stats[name] = value
    strlen = int(stats.get("cmdstat_strlen", "calls=0,").split("calls=")[1].split(",")[0])
    return strlen + int(stats["total_connections_received"])


class Hung:
    """A cluster with one primary stopped, and a RemoteIO on it (3 read threads)."""

    def __init__(self, cluster: RedisCluster) -> None:
        for port in cluster.primary_ports():
            node_command(port, "FLUSHALL")
        self.cluster = cluster
        self.tier = RedisClusterTier(cluster.url, lookup_timeout_ms=DEADLINE_MS)
        self.rio = RemoteIO(
            self.tier, threads=6, queue_depth=256, timeout_s=DEADLINE_MS / 1000, signer=None
        )
        assert self.rio.read_threads == 3
        self.keys = prompt_keys(60)
        for i, key in enumerate(self.keys):
            assert self.rio.submit_put(i, key, payload(i), dtype=DT, shape=SHAPE)
        assert all(r.ok for r in collect(self.rio, len(self.keys)).values())
        port_of = {k: cluster.port_of_slot(self.tier._cluster.keyslot(k)) for k in self.keys}
        self.victim = port_of[self.keys[0]]
        self.node = f"127.0.0.1:{self.victim}"
        self.hung = [k for k in self.keys if port_of[k] == self.victim]
        self.healthy = [k for k in self.keys if port_of[k] != self.victim]
        assert len(self.hung) >= 5 and len(self.healthy) >= 20
        node_command(self.victim, "CONFIG", "RESETSTAT")
        self.base = 1000

    def stop(self) -> None:
        os.kill(self.cluster.procs[self.victim].pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.cluster.procs[self.victim].pid, signal.SIGCONT)

    def fetch(self, keys: list[str]) -> dict[str, OpResult]:
        """One lookup per key (each its own run), all submitted at once."""
        base, self.base = self.base, self.base + len(keys)
        for i, key in enumerate(keys):
            self.rio.submit_get_into(
                base + i, key, memoryview(bytearray(SIZE)), dtype=DT, shape=SHAPE
            )
        got = collect(self.rio, len(keys))
        return {key: got[base + i] for i, key in enumerate(keys)}

    def wait_node_backoff(self) -> None:
        """Until the hung node's backoff is over (its next op may probe it)."""
        state = self.tier._node_health[self.node]
        deadline = time.monotonic() + 5
        while time.monotonic() < state.down_until and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.rio.close()
        self.tier.close()


@pytest.fixture
def hung(cluster: RedisCluster) -> Iterator[Hung]:
    h = Hung(cluster)
    try:
        yield h
    finally:
        h.resume()
        h.close()


def test_a_hung_primary_costs_only_its_own_slots(hung: Hung) -> None:
    """SIGSTOP one primary: every read of the other primaries' slots is served, each read
    of the hung one's fails as ``node`` (never ``unreachable``: the tier's reads stay up),
    none is stuck past its deadline, and after each backoff one read (the probe) reaches
    the hung node while the rest of a burst of its keys fail fast without the network."""
    hung.stop()
    # the first read of the hung node: held until its deadline, on one read thread; the
    # healthy reads submitted with it are served by the other
    res = hung.fetch([hung.hung[0], *hung.healthy])
    assert not res[hung.hung[0]].ok and res[hung.hung[0]].error_kind == "node"
    assert all(res[k].ok for k in hung.healthy), {k: res[k].error_kind for k in hung.healthy}
    rounds = 3
    for _ in range(rounds):
        hung.wait_node_backoff()
        res = hung.fetch([*hung.hung, *hung.healthy])  # the hung node's keys first
        bad = {k: r.error_kind for k, r in res.items() if k in hung.healthy and not r.ok}
        assert not bad, f"reads of healthy primaries failed: {bad}"
        assert all(not res[k].ok and res[k].error_kind == "node" for k in hung.hung), res
    counts = hung.rio.counters()
    assert counts["errors_unreachable"] == 0, "the hung node took the tier's reads down"
    assert counts["reads_stuck"] == 0, "a read of the hung node was held past its deadline"
    assert counts["errors_timeout"] == 0
    assert not hung.rio.reads_down
    # uploads too: the healthy primaries' are written, the hung one's fail as ``node``
    fresh = prompt_keys(30)
    doomed = {k for k in fresh if hung.tier._node_of(k) == hung.node}  # (the tier's slot map)
    assert 0 < len(doomed) < len(fresh)
    for i, key in enumerate(fresh):
        assert hung.rio.submit_put(5000 + i, key, payload(i), dtype=DT, shape=SHAPE)
    ups = collect(hung.rio, len(fresh))
    for i, key in enumerate(fresh):
        r = ups[5000 + i]
        assert (r.ok, r.error_kind) == ((False, "node") if key in doomed else (True, None)), r
    counts = hung.rio.counters()
    assert counts["errors_unreachable"] == 0 and counts["writes_stuck"] == 0
    assert not hung.rio.is_down
    assert set(hung.tier.take_node_errors()) == {hung.node}
    # the node runs again and executes what reached it meanwhile: one read per backoff
    hung.resume()
    assert "PONG" in node_command(hung.victim, "PING", timeout=10)  # (after its backlog)
    reached = attempts(hung.victim) - 2  # (the connections of this PING and INFO)
    assert 1 <= reached <= 1 + rounds, (
        f"{reached} reads reached the hung node; at most one per backoff expected ({1 + rounds})"
    )
    deadline = time.monotonic() + 15
    while True:  # its next probe finds it answering: every slot is served again
        hung.wait_node_backoff()
        res = hung.fetch(hung.keys)
        if all(r.ok for r in res.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert all(r.ok for r in res.values()), {k: r.error_kind for k, r in res.items()}


@pytest.mark.timing
def test_a_read_of_a_hung_primary_ends_at_its_deadline(hung: Hung) -> None:
    """The read that finds a primary hung is reported at its deadline (the socket wait
    is what is left of it), not after a socket timeout of twice the deadline and a
    retry."""
    hung.stop()
    res = hung.fetch([hung.hung[0]])[hung.hung[0]]
    assert not res.ok and res.error_kind == "node"
    assert res.seconds < DEADLINE_MS / 1000 + 0.35, f"{res.seconds:.2f} s"
    hung.wait_node_backoff()
    probe = hung.fetch([hung.hung[1]])[hung.hung[1]]
    assert not probe.ok and probe.seconds < DEADLINE_MS / 1000 + 0.35, f"{probe.seconds:.2f} s"


def _failed_over(port: int, victim: int) -> bool:
    """As node ``port`` sees the cluster: ``victim`` is marked failed and every slot is
    served (its replica took its slots)."""
    try:
        info = node_command(port, "CLUSTER", "INFO")
        nodes = node_command(port, "CLUSTER", "NODES")
    except Exception:  # noqa: BLE001 - not yet
        return False
    gone = any(
        f":{victim}@" in line and "fail" in line.split()[2] and "fail?" not in line.split()[2]
        for line in nodes.splitlines()
    )
    return gone and "cluster_state:ok" in info


def test_a_hung_primary_failed_over_is_found_by_the_next_probe() -> None:
    """The cluster fails a hung primary over to its replica: the hung node still accepts
    connections (its kernel does) and never answers, so nothing but a topology refresh
    finds the new primary. The node's next probe runs the refresh its timeout asked for,
    and every slot is served again by the same tier."""
    c = RedisCluster(replicas=1, node_timeout_ms=1000)
    try:
        c.start()
        tier = RedisClusterTier(c.url, lookup_timeout_ms=DEADLINE_MS)
        rio = RemoteIO(tier, threads=4, queue_depth=256, timeout_s=DEADLINE_MS / 1000, signer=None)
        keys = prompt_keys(24)
        for i, key in enumerate(keys):
            assert rio.submit_put(i, key, payload(i), dtype=DT, shape=SHAPE)
        assert all(r.ok for r in collect(rio, len(keys)).values())
        victim = c.port_of_slot(tier._cluster.keyslot(keys[0]))
        c.wait_replicated(victim)
        healthy = next(p for p in c.primary_ports() if p != victim)
        os.kill(c.procs[victim].pid, signal.SIGSTOP)
        base = 100
        first = {}
        for i, key in enumerate(keys):
            rio.submit_get_into(base + i, key, memoryview(bytearray(SIZE)), dtype=DT, shape=SHAPE)
        first = collect(rio, len(keys))
        assert any(r.error_kind == "node" for r in first.values())
        deadline = time.monotonic() + 30
        while not _failed_over(healthy, victim) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _failed_over(healthy, victim), "the cluster did not fail the hung node over"
        while True:  # each round: the node's probe (and its refresh), then every key
            base += 100
            for i, key in enumerate(keys):
                rio.submit_get_into(
                    base + i, key, memoryview(bytearray(SIZE)), dtype=DT, shape=SHAPE
                )
            res = collect(rio, len(keys))
            if all(r.ok for r in res.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert all(r.ok for r in res.values()), {r.op_id: r.error_kind for r in res.values()}
        assert rio.counters()["errors_unreachable"] == 0
        rio.close()
        tier.close()
    finally:
        for proc in c.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        c.cleanup()


def test_a_put_behind_a_nodes_probe_waits_for_it(cluster: RedisCluster) -> None:
    """A node that is back after its backoff: the first op to it is the probe, and an
    upload to it meanwhile waits for the probe's report and is written (the read path
    still fails fast). Failing it fast lost the uploads stored right after a node came
    back, as the single-node tier did (tests/objects/test_health_probe_wait.py)."""
    import threading

    tier = RedisClusterTier(cluster.url, lookup_timeout_ms=DEADLINE_MS)
    try:
        key = prompt_keys(1)[0]
        node = tier._node_of(key)
        assert node is not None
        tier._node_failed(node)  # the node failed a moment ago ...
        state = tier._node_health[node]
        time.sleep(state.backoff.compute(state.failures) + 0.05)  # ... and its backoff ended
        probe = state.admit()
        assert probe, "the next op is not the probe"
        errors: list[Exception] = []

        def upload() -> None:
            try:
                tier.put(key, [payload()])
            except Exception as exc:  # noqa: BLE001 - the test reports what it raised
                errors.append(exc)

        t = threading.Thread(target=upload)
        t.start()
        time.sleep(0.2)
        assert t.is_alive() and not errors, errors  # waiting for the probe, not failed
        state.succeeded()  # the probe's report: the node answers again
        t.join(10)
        assert not t.is_alive() and not errors, errors
        assert tier.exists([key]) == [True]
    finally:
        tier.close()
