"""A hostile or broken Redis: replies too large for their command, or of the wrong type.

A fake RESP server on loopback answers what a real one never would: GETRANGE that
ignores its range and sends 64 MiB, STRLEN as a bulk string, GETRANGE as an integer,
a length line that never ends. Each must cost one counted per-object miss (or a
dropped connection), never the bytes the server sends, a ``TypeError`` or a
traceback per op.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator

import pytest

from kvtier.errors import ObjectError, ObjectTooLarge, TierUnavailable
from kvtier.objects.health import ConstantBackoff
from kvtier.objects.remote import RemoteIO
from kvtier.objects.tiers.redis import RedisTier

Reply = Callable[[socket.socket], None]


def _send(data: bytes) -> Reply:
    return lambda conn: conn.sendall(data)


def _huge_bulk(n: int) -> Reply:
    """A bulk reply of ``n`` zero bytes, streamed (the server never holds it whole)."""

    def reply(conn: socket.socket) -> None:
        conn.sendall(b"$%d\r\n" % n)
        piece = bytes(1 << 20)
        left = n
        while left > 0:
            conn.sendall(piece[: min(left, len(piece))])
            left -= len(piece)
        conn.sendall(b"\r\n")

    return reply


#: a client that speaks RESP3 (redis-py 8's default) asks HELLO first; kvtier speaks RESP2
#: and a new connection asks INFO cluster (a cache without it answers an error)
_DEFAULTS = {"HELLO": _send(b"%1\r\n$5\r\nproto\r\n:3\r\n"), "INFO": _send(b"$0\r\n\r\n")}


class FakeRedis:
    """A RESP2 server answering each command with ``replies[NAME]`` (default ``+OK``)."""

    def __init__(self, replies: dict[str, Reply]) -> None:
        self.replies = replies
        self.commands: list[str] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def _client(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        try:
            while True:
                line = f.readline()
                if not line:
                    return
                args = []
                for _ in range(int(line[1:])):
                    n = int(f.readline()[1:])
                    args.append(f.read(n + 2)[:-2])
                name = args[0].decode().upper()
                self.commands.append(name)
                self.replies.get(name, _DEFAULTS.get(name, _send(b"+OK\r\n")))(conn)
        except (OSError, ValueError):
            return  # the client dropped the connection mid-reply: what a bound does
        finally:
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._sock.close()


@pytest.fixture
def fake() -> Iterator[Callable[[dict[str, Reply]], FakeRedis]]:
    servers: list[FakeRedis] = []

    def start(replies: dict[str, Reply]) -> FakeRedis:
        servers.append(FakeRedis(replies))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_a_reply_that_ignores_getrange_is_refused_from_its_length(fake) -> None:
    """64 MiB sent for a 1 MiB range: refused after its length line, memory stays small."""
    server = fake({"STRLEN": _send(b":1000\r\n"), "GETRANGE": _huge_bulk(64 << 20)})
    tier = RedisTier(server.url)
    tracemalloc.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(ObjectTooLarge, match="67108864"):
            tier.get("k", max_bytes=1 << 20)
        seconds = time.monotonic() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB allocated for a refused reply"
    assert seconds < 2.0
    # the connection that held the rest of the reply was dropped, not reused
    server.replies.update(STRLEN=_send(b":3\r\n"), GETRANGE=_send(b"$3\r\nabc\r\n"))
    assert tier.get("k", max_bytes=1 << 20) == b"abc"
    tier.close()


def test_replies_to_small_commands_are_bounded_too(fake) -> None:
    server = fake({"EXISTS": _huge_bulk(64 << 20), "DEL": _send(b":" + b"9" * 100_000)})
    tier = RedisTier(server.url)
    tracemalloc.start()
    try:
        with pytest.raises(ObjectError, match="EXISTS replied with a bulk string"):
            tier.exists(["a", "b"])
        with pytest.raises(TierUnavailable, match="line longer"):  # a line that never ends
            tier.delete(["a"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB"
    tier.close()


@pytest.mark.parametrize(
    ("replies", "match"),
    [
        ({"STRLEN": _send(b"$4\r\n1000\r\n")}, "STRLEN replied with a bulk string, an integer"),
        (
            {"STRLEN": _send(b":3\r\n"), "GETRANGE": _send(b":42\r\n")},
            "GETRANGE replied with an integer, a bulk string",
        ),
        ({"STRLEN": _send(b"*0\r\n")}, "STRLEN replied with an array"),
        ({"STRLEN": _send(b"+OK\r\n")}, "STRLEN replied with a status"),
        ({"STRLEN": _send(b"$-1\r\n")}, "STRLEN replied with nil"),
        ({"GET": _send(b":42\r\n")}, "GET replied with an integer"),
        ({"EXISTS": _send(b"$1\r\n1\r\n")}, "EXISTS replied with a bulk string"),
    ],
)
def test_replies_of_the_wrong_type_are_object_errors(fake, replies, match) -> None:
    tier = RedisTier(fake(replies).url)
    with pytest.raises(ObjectError, match=match):
        if "GET" in replies:
            tier.get("k")
        elif "EXISTS" in replies:
            tier.exists(["k"])
        else:
            tier.get("k", max_bytes=1 << 20)
    tier.close()


@pytest.mark.parametrize("line", [b"$abc\r\n", b":12x\r\n", b"*-7abc\r\n"])
def test_malformed_length_lines_are_protocol_errors(fake, line: bytes) -> None:
    tier = RedisTier(fake({"STRLEN": _send(line)}).url)
    with pytest.raises(TierUnavailable, match="(?i)protocol error|bad"):
        tier.get("k", max_bytes=1 << 20)
    tier.close()


def test_wrong_types_through_remoteio_are_counted_misses_with_rate_limited_logs(
    fake, caplog: pytest.LogCaptureFixture
) -> None:
    server = fake({"STRLEN": _send(b"$4\r\n1000\r\n"), "GETRANGE": _send(b":1\r\n")})
    rio = RemoteIO(
        RedisTier(server.url),
        threads=1,
        queue_depth=64,
        timeout_s=5.0,
        signer=None,
        backoff=ConstantBackoff(30.0),
    )
    n = 20
    caplog.set_level(logging.WARNING)
    for i in range(n):
        rio.submit_get_into(i, f"k{i}", memoryview(bytearray(64)), dtype="uint8", shape=[64])
    results = []
    deadline = time.monotonic() + 10
    while len(results) < n and time.monotonic() < deadline:
        results += rio.poll()
        time.sleep(0.002)
    assert len(results) == n
    assert {r.error_kind for r in results} == {"object"}, results
    assert not rio.is_down
    assert rio.counters()["errors_object"] == n
    assert "Traceback" not in caplog.text and "TypeError" not in caplog.text
    warnings = [r for r in caplog.records if "STRLEN replied" in r.getMessage()]  # (WrongReply)
    assert 1 <= len(warnings) <= 2, f"{len(warnings)} warnings for {n} bad replies"
    rio.close()
