"""A hostile Redis node answers with replies its command can never give (issue 47, items
5 and 6): every reply is bounded as a whole by what its command can answer.

A fake RESP server on loopback (one thread per connection, its replies streamed so it
never holds them whole) answers STRLEN with an array of 1,024 bulk strings just under
the slot size, GETRANGE with nested arrays, CLUSTER SLOTS deeper or longer than a real
reply can be: each is refused where it shows, with bounded memory (tracemalloc's peak),
and the next command on the tier works. A healthy CLUSTER SLOTS of 2,048 ranges (more
than the 1,024 elements an unknown reply may have) is a cluster the tier uses.
"""

from __future__ import annotations

import socket
import threading
import tracemalloc
from collections.abc import Callable, Iterator

import pytest

from kvtier.errors import ObjectError, TierUnavailable
from kvtier.objects.tiers.redis import RedisTier
from kvtier.objects.tiers.redis_cluster import RedisClusterTier
from kvtier.objects.tiers.redis_resp import WrongReply, command_name

Reply = Callable[[socket.socket], None]
SLOT = 1 << 20  # a 1 MiB slot: the bound of a chunk read


def _send(data: bytes) -> Reply:
    return lambda conn: conn.sendall(data)


def _bulks(count: int, size: int) -> Reply:
    """An array of ``count`` bulk strings of ``size`` bytes each, streamed."""

    body = b"$%d\r\n" % size + bytes(size) + b"\r\n"  # (made before memory is traced)

    def reply(conn: socket.socket) -> None:
        conn.sendall(b"*%d\r\n" % count)
        for _ in range(count):
            conn.sendall(body)

    return reply


def _nested(depth: int, leaf: bytes = b":1\r\n") -> Reply:
    """Arrays of one element nested ``depth`` deep around ``leaf``."""
    return _send(b"*1\r\n" * depth + leaf)


def _slots(ranges: int, port: int) -> bytes:
    """CLUSTER SLOTS as Redis 7 answers it: ``ranges`` ranges, all on one node."""
    per = 16384 // ranges
    node_id = b"f" * 40
    out = [b"*%d\r\n" % ranges]
    for i in range(ranges):
        lo, hi = i * per, (16383 if i == ranges - 1 else (i + 1) * per - 1)
        out.append(
            b"*3\r\n:%d\r\n:%d\r\n*4\r\n$9\r\n127.0.0.1\r\n:%d\r\n$40\r\n%s\r\n*0\r\n"
            % (lo, hi, port, node_id)
        )
    return b"".join(out)


class FakeNode:
    """A RESP2 server answering each command by its name (``CLUSTER SLOTS``, ``GET``) from
    ``replies``; a new connection's handshake (INFO, CLIENT SETINFO) gets what a real
    single node answers."""

    def __init__(self, replies: dict[str, Reply]) -> None:
        self.replies = replies
        self.commands: list[str] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def _client(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        defaults = {"INFO": _send(b"$19\r\ncluster_enabled:0\r\n\r\n"), "COMMAND": _send(b"*0\r\n")}
        try:
            while True:
                line = f.readline()
                if not line:
                    return
                args = []
                for _ in range(int(line[1:])):
                    n = int(f.readline()[1:])
                    args.append(f.read(n + 2)[:-2])
                name = command_name(tuple(args))
                self.commands.append(name)
                reply = self.replies.get(name) or defaults.get(name) or _send(b"+OK\r\n")
                reply(conn)
        except (OSError, ValueError):
            return  # the client dropped the connection mid-reply: what a bound does
        finally:
            conn.close()

    def close(self) -> None:
        self._sock.close()


@pytest.fixture
def node() -> Iterator[Callable[[dict[str, Reply]], FakeNode]]:
    nodes: list[FakeNode] = []

    def start(replies: dict[str, Reply]) -> FakeNode:
        nodes.append(FakeNode(replies))
        return nodes[-1]

    yield start
    for n in nodes:
        n.close()


def _peak(call: Callable[[], object], expected: type[BaseException], match: str) -> int:
    """``call`` raises ``expected``; the most memory it allocated meanwhile."""
    tracemalloc.start()
    try:
        with pytest.raises(expected, match=match):
            call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_command_names() -> None:
    assert command_name(("GET", "k")) == "GET"
    assert command_name(("CLUSTER SLOTS",)) == "CLUSTER SLOTS"
    assert command_name((b"cluster", b"slots")) == "CLUSTER SLOTS"
    assert command_name(("CLIENT", "SETINFO", "LIB-NAME", "x")) == "CLIENT SETINFO"
    assert command_name(("COMMAND",)) == "COMMAND"


@pytest.mark.parametrize(
    ("replies", "match"),
    [
        # STRLEN as 1,024 bulk strings just under the slot: 1 GiB had it been read
        ({"STRLEN": _bulks(1024, SLOT - 16)}, "STRLEN replied with an array"),
        ({"STRLEN": _nested(200_000)}, "STRLEN replied with an array"),
        # GETRANGE as an array of slot-sized strings, or nested arrays
        (
            {"STRLEN": _send(b":100\r\n"), "GETRANGE": _bulks(1024, SLOT - 16)},
            "GETRANGE replied with an array",
        ),
        (
            {"STRLEN": _send(b":100\r\n"), "GETRANGE": _nested(1_000_000)},
            "GETRANGE replied with an array",
        ),
    ],
)
def test_a_reply_of_a_type_its_command_never_gives_is_refused_unread(
    node: Callable[[dict[str, Reply]], FakeNode], replies: dict[str, Reply], match: str
) -> None:
    """The parser knows STRLEN answers an integer and GETRANGE a bulk string: an array
    is refused at its first line, however much follows; the connection is dropped and
    the next read on the tier is served."""
    server = node(replies)
    tier = RedisTier(f"redis://127.0.0.1:{server.port}/0")
    peak = _peak(lambda: tier.get("k", max_bytes=SLOT), ObjectError, match)
    assert peak < 2 << 20, f"{peak / 2**20:.1f} MiB allocated for a refused reply"
    server.replies.update(STRLEN=_send(b":3\r\n"), GETRANGE=_send(b"$3\r\nabc\r\n"))
    assert tier.get("k", max_bytes=SLOT) == b"abc"
    tier.close()


def test_replies_to_every_command_kvtier_sends_are_typed(
    node: Callable[[dict[str, Reply]], FakeNode],
) -> None:
    """EXISTS and DEL answer integers, SET a status: arrays (of anything) are refused."""
    server = node({"EXISTS": _bulks(1024, 60_000), "DEL": _nested(100_000), "SET": _bulks(2, 10)})
    tier = RedisTier(f"redis://127.0.0.1:{server.port}/0")
    peak = _peak(lambda: tier.exists(["a"]), ObjectError, "EXISTS replied with an array")
    peak = max(peak, _peak(lambda: tier.delete(["a"]), ObjectError, "DEL replied with an array"))
    assert peak < 2 << 20, f"{peak / 2**20:.1f} MiB"
    with pytest.raises(ObjectError, match="SET replied with an array"):
        tier.put("a", [b"x"])
    tier.close()


def _cluster_tier(port: int) -> RedisClusterTier:
    return RedisClusterTier(f"redis+cluster://127.0.0.1:{port}/", lookup_timeout_ms=2000)


def test_a_cluster_of_more_than_1024_slot_ranges_is_used(
    node: Callable[[dict[str, Reply]], FakeNode],
) -> None:
    """A healthy cluster whose CLUSTER SLOTS lists 2,048 ranges (a cluster resharded
    slot by slot) is read from like any other; once refused as "not reachable"."""
    server = node({})
    server.replies["CLUSTER SLOTS"] = _send(_slots(2048, server.port))
    server.replies["STRLEN"] = _send(b":5\r\n")
    server.replies["GETRANGE"] = _send(b"$5\r\nhello\r\n")
    tier = _cluster_tier(server.port)
    assert tier.get("k", max_bytes=100) == b"hello"
    assert len(tier._cluster.nodes_manager.slots_cache) == 16384
    tier.close()


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        (lambda port: _send(_slots(2, port)[:-4] + b"*1\r\n" * 10 + b"*0\r\n"), "deeper than 4"),
        (lambda port: _send(b"*16385\r\n" + b"*0\r\n" * 16385), "16385 elements"),
        (lambda port: _bulks(100, 1 << 20), "a string of 1048576 bytes, at most 4096"),
        (lambda port: _bulks(16384, 4000), "more than 33554432 bytes"),
    ],
)
def test_a_cluster_slots_reply_no_cluster_can_give_is_refused(
    node: Callable[[dict[str, Reply]], FakeNode], reply: Callable[[int], Reply], match: str
) -> None:
    """CLUSTER SLOTS is bounded by what a real reply can be: at most 16,384 ranges,
    arrays 4 deep (range, node, node metadata), 32 MiB on the wire: beyond that the
    cluster is not reachable (the tier's outage), with bounded memory."""
    server = node({})
    server.replies["CLUSTER SLOTS"] = reply(server.port)
    tracemalloc.start()
    try:
        tier = _cluster_tier(server.port)  # unreachable at startup: logged, not raised
        with pytest.raises(TierUnavailable, match=match):
            tier.get("k", max_bytes=100)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 80 << 20, f"{peak / 2**20:.1f} MiB"
    tier.close()


def test_wrong_reply_is_an_object_error_class() -> None:
    """A wrong reply is that object's miss (the connection dropped), like WRONGTYPE."""
    import redis

    assert issubclass(WrongReply, redis.exceptions.DataError)


def test_a_long_error_reply_keeps_its_meaning(node: Callable[[dict[str, Reply]], FakeNode]) -> None:
    """An error reply is bounded as a line, not by its command's (small) reply: a long
    NOPERM to STRLEN is still the tier's outage, not a wrong reply."""
    noperm = _send(b"-NOPERM " + b"u" * 1000 + b" has no permissions\r\n")
    server = node({"STRLEN": noperm, "GETRANGE": noperm})
    tier = RedisTier(f"redis://127.0.0.1:{server.port}/0")
    with pytest.raises(TierUnavailable, match="NoPermissionError"):
        tier.get("k", max_bytes=SLOT)
    tier.close()
