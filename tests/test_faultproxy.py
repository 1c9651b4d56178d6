"""tests/faultproxy.py's shared link and stall: the throttled and stalling tiers of issue 59.

Why: a benchmark of priced loads needs a tier throttled as a whole (a client's read threads
share one link) and one that stops sending in the middle of a read. The link's booking is
checked with explicit times; the stall through real loopback sockets, by bytes only.
"""

from __future__ import annotations

import socket
import threading

import pytest
from faultproxy import FaultProxy

PAYLOAD = bytes(range(256)) * 256  # 64 KiB


def test_the_link_books_every_connections_bytes_one_after_another() -> None:
    proxy = FaultProxy(("127.0.0.1", 9))
    try:
        assert proxy._reserve(500, 10.0) == 0.0, "no link_bps: no wait"
        proxy.link_bps = 1000.0
        assert proxy._reserve(500, 10.0) == 0.5
        assert proxy._reserve(500, 10.0) == 1.0, "a second connection queues behind the first"
        assert proxy._reserve(100, 20.0) == pytest.approx(0.1), "an idle link starts afresh"
        proxy.clear()
        assert proxy.link_bps is None and proxy.stall_after_bytes is None
    finally:
        proxy.close()


def _server() -> tuple[socket.socket, threading.Thread]:
    """A loopback server that sends PAYLOAD to its first client and waits for it to close."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(PAYLOAD)
            conn.recv(1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def _recv(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        piece = sock.recv(n - len(out))
        assert piece, f"closed after {len(out)} bytes"
        out += piece
    return out


def test_a_stall_holds_the_servers_bytes_past_the_count_until_lifted() -> None:
    listener, thread = _server()
    proxy = FaultProxy(listener.getsockname()[:2]).start()
    proxy.stall_after_bytes = 10_000
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client:
            head = _recv(client, 10_000)
            assert head == PAYLOAD[:10_000]
            client.settimeout(0.3)
            try:
                more = client.recv(1)
            except TimeoutError:
                more = b""
            assert more == b"", "a byte past the stall came through"
            client.settimeout(10)
            proxy.stall_after_bytes = None
            assert head + _recv(client, len(PAYLOAD) - 10_000) == PAYLOAD
    finally:
        proxy.close()
        listener.close()
        thread.join(timeout=5)
