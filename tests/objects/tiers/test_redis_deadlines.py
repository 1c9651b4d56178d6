"""Deadlines and probes around the Redis tiers (issue 47, item 4), apart from the hung
cluster (test_redis_cluster_hung.py):

- a single node that answers too late: the read ends at its deadline (every socket wait
  is what is left of it), is reported then, and never counts as stuck;
- after a backoff exactly one op (the probe) reaches the tier, per direction
  (:class:`BackoffState`), and the other ops fail fast until it reports;
- the thread's call deadline bounds a new connection's connect too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
from kit import payload

from kvtier.errors import TierUnavailable
from kvtier.objects import codec
from kvtier.objects.health import BackoffState, ConstantBackoff, ExponentialBackoff
from kvtier.objects.remote import RemoteIO
from kvtier.objects.tiers.base import ObjectTier
from kvtier.objects.tiers.policy import call_deadline, time_left
from kvtier.objects.tiers.redis import RedisTier
from kvtier.ops import OpResult

SHAPE = [2, 8, 64]
DT = "bfloat16"
SIZE = 2 * 8 * 64 * 2


def collect(rio: RemoteIO, n: int, timeout: float = 15.0) -> dict[int, OpResult]:
    out: list[OpResult] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += rio.poll()
        time.sleep(0.002)
    assert len(out) == n, f"expected {n} results, got {len(out)}"
    return {r.op_id: r for r in out}


# -- BackoffState: one probe after a backoff ------------------------------------------------


def test_one_probe_after_a_backoff() -> None:
    state = BackoffState(ConstantBackoff(0.05))
    assert state.admit() == 0  # up: every op goes, none is a probe
    state.failed()
    assert state.is_down and state.admit() is None
    time.sleep(0.06)
    assert not state.is_down
    probe = state.admit()
    assert probe  # the first op after the backoff is the probe
    assert state.is_down  # the rest fail fast while it is out
    assert [state.admit() for _ in range(10)] == [None] * 10
    state.failed()  # the probe failed: back off again, a new probe after that
    assert state.admit() is None
    time.sleep(0.06)
    second = state.admit()
    assert second and second != probe
    state.probe_over(probe)  # a stale token releases nothing
    assert state.admit() is None
    state.succeeded()  # the probe answered: every op goes again
    assert state.admit() == 0 and not state.is_down


def test_a_probe_that_ends_without_a_verdict_lets_the_next_op_probe() -> None:
    """A probe that ends with neither a failure nor a success of the tier (one object's
    error) hands the probe on; an unreported probe's lease runs out."""
    state = BackoffState(ConstantBackoff(0.01), probe_lease_s=0.05)
    state.failed()
    time.sleep(0.02)
    probe = state.admit()
    assert probe and state.admit() is None
    state.probe_over(probe)
    assert state.admit()  # the next op probes
    assert state.admit() is None
    time.sleep(0.06)  # that one never reported: after its lease another may probe
    assert state.admit()


def test_concurrent_ops_after_a_backoff_admit_one_probe() -> None:
    state = BackoffState(ExponentialBackoff(0.02, 1.0))
    state.failed()
    time.sleep(0.03)
    got: list[int | None] = []
    go = threading.Barrier(8)

    def op() -> None:
        go.wait()
        got.append(state.admit())

    threads = [threading.Thread(target=op) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(1 for g in got if g) == 1 and got.count(None) == 7, got


class _Down(ObjectTier):
    """A tier that cannot be reached; counts the calls that reached it."""

    name = "down"

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()

    def _fail(self) -> None:
        self.calls += 1
        self.release.wait(2)  # the probe stays out while the burst is submitted
        raise TierUnavailable("down")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._fail()
        return []

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        self._fail()
        return None

    def put(self, key: str, parts: object) -> None:
        self._fail()

    def delete(self, keys: Sequence[str]) -> None:
        pass

    def close(self) -> None:
        pass


def test_remoteio_sends_one_probe_after_its_backoff() -> None:
    """The tier's read health after a backoff: of a burst of reads queued on 4 read
    threads, one reaches the tier; the rest fail fast as ``unreachable``."""
    tier = _Down()
    tier.release.set()
    rio = RemoteIO(
        tier, threads=8, queue_depth=64, timeout_s=5.0, signer=None, backoff=ConstantBackoff(0.05)
    )
    rio.submit_get_into(0, "k", memoryview(bytearray(SIZE)), dtype=DT, shape=SHAPE)
    assert collect(rio, 1)[0].error_kind == "unreachable"
    assert tier.calls == 1
    time.sleep(0.06)
    tier.release.clear()  # the probe waits in the tier until the burst is over
    for i in range(1, 21):
        rio.submit_get_into(i, f"k{i}", memoryview(bytearray(SIZE)), dtype=DT, shape=SHAPE)
    early = collect(rio, 19)
    tier.release.set()
    late = collect(rio, 1)
    assert {r.error_kind for r in [*early.values(), *late.values()]} == {"unreachable"}
    assert tier.calls == 2, f"{tier.calls - 1} ops reached the tier after its backoff"
    rio.close()


# -- deadlines --------------------------------------------------------------------------------


def test_call_deadline_nests_and_clears() -> None:
    assert time_left() is None
    with call_deadline(time.monotonic() + 10):
        assert 9 < (time_left() or 0) <= 10
        with call_deadline(None):
            assert time_left() is None
        assert time_left() is not None
    assert time_left() is None


@pytest.mark.integration
def test_a_late_single_node_ends_its_read_at_the_deadline(redis_server, services) -> None:
    """A Redis that answers 3 s late: the read is reported at its 1 s deadline as the
    tier's outage (the node is the tier), not when the reply comes, and never counted
    stuck (which it would be half a deadline after it); with a socket timeout of twice
    the deadline it held its read thread 2 s and was stuck."""
    redis_server.start()
    direct = RedisTier(redis_server.url)
    direct.put("late", codec.encode("late", payload(), dtype=DT, shape=SHAPE))
    proxy = services.proxy((redis_server.host, redis_server.port))
    late = RedisTier(f"redis://127.0.0.1:{proxy.port}/0", lookup_timeout_ms=1000)
    assert late.exists(["late"]) == [True]  # a pooled connection, before the delay
    proxy.latency_s = 1.5  # each way: the reply would come after 3 s
    rio = RemoteIO(
        late, threads=2, queue_depth=16, timeout_s=1.0, signer=None, backoff=ConstantBackoff(0.05)
    )
    rio.submit_get_into(1, "late", memoryview(bytearray(SIZE)), dtype=DT, shape=SHAPE)
    got = collect(rio, 1)[1]
    assert not got.ok and got.error_kind == "unreachable"
    counts = rio.counters()
    assert counts["reads_stuck"] == 0 and rio.stuck_reads == 0
    proxy.latency_s = 0
    rio.close()
    direct.close()


@pytest.mark.integration
@pytest.mark.timing
def test_a_new_connection_connects_within_the_deadline() -> None:
    """A connect that would hang (a non-routable address) ends by the call's deadline."""
    tier = RedisTier("redis://10.255.255.1:6379/0", lookup_timeout_ms=5000)
    t0 = time.monotonic()
    with call_deadline(time.monotonic() + 0.3), pytest.raises(TierUnavailable):
        tier.get("k", 100)
    assert time.monotonic() - t0 < 1.5
    tier.close()


@pytest.mark.integration
def test_reads_within_a_deadline_over_tls_with_auth(services) -> None:
    """Under a call deadline a new connection (TCP, TLS handshake, AUTH, INFO) and the
    read itself work as without one; the socket's own timeout is restored after."""
    server = services.redis(tls=True, password="pw-47")
    tier = RedisTier(server.url)
    tier.put("k", [b"head1234", payload(1)])
    tier._client.connection_pool.disconnect()  # the next read opens a new connection
    dest = memoryview(bytearray(SIZE))
    with call_deadline(time.monotonic() + 5):
        assert tier.read_into("k", dest, 64) == b"head1234"
    assert dest == payload(1)
    conn = tier._client.connection_pool.get_connection()
    try:
        assert conn._sock.gettimeout() == conn.socket_timeout
    finally:
        tier._client.connection_pool.release(conn)
    tier.close()
