"""A loopback TCP proxy that injects network faults into real client/server traffic.

Put it between a client (boto3, redis-py) and a real server to get the
failures production sees without patching either side:

    proxy = FaultProxy(("127.0.0.1", redis_port)).start()
    url = f"redis://127.0.0.1:{proxy.port}/0"
    proxy.latency_s = 0.2      # one-way delay on every chunk, both directions
    proxy.bandwidth_bps = 1e6  # throttle each direction of each connection
    proxy.link_bps = 1e6       # throttle what the server sends, all connections together
    proxy.stall_after_bytes = 4 << 20  # the server stops sending after 4 MiB (mid-transfer)
    proxy.blackhole = True     # accept and swallow: the server seems hung
    proxy.refuse = True        # reset new connections at once
    proxy.reset_all()          # RST every open connection now

Every knob can be changed while traffic flows. Latency is modelled as a
delay line (a chunk is forwarded ``latency_s`` after it arrived), so a large
transfer costs one extra latency, not one per chunk, as on a real link.
``link_bps`` is one link every connection shares (a tier's throughput as a client
with several read threads sees it: issue 59's throttled tier); ``stall_after_bytes``
holds the server's bytes past that count until it is set back to None (a tier that
stops sending in the middle of a read).
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time
from collections.abc import Iterator

__all__ = ["FaultProxy"]

_CHUNK = 256 * 1024


def _rst(sock: socket.socket) -> None:
    """Close with a TCP reset instead of a FIN, like a crashed peer or a middlebox."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class _Conn:
    def __init__(self, proxy: FaultProxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.server = server
        self.closed = False
        for src, dst, down in ((client, server, False), (server, client, True)):
            q: queue.Queue[tuple[float, bytes] | None] = queue.Queue()
            threading.Thread(target=self._read, args=(src, q), daemon=True).start()
            threading.Thread(target=self._write, args=(dst, q, down), daemon=True).start()

    def _read(self, src: socket.socket, q: queue.Queue[tuple[float, bytes] | None]) -> None:
        try:
            while True:
                data = src.recv(_CHUNK)
                if not data:
                    break
                if self.proxy.blackhole:
                    continue
                q.put((time.monotonic() + self.proxy.latency_s, data))
        except OSError:
            pass
        q.put(None)

    def _write(
        self, dst: socket.socket, q: queue.Queue[tuple[float, bytes] | None], down: bool
    ) -> None:
        try:
            while True:
                item = q.get()
                if item is None:
                    dst.shutdown(socket.SHUT_WR)
                    return
                due, data = item
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                bw = self.proxy.bandwidth_bps
                if bw:
                    time.sleep(len(data) / bw)
                if not down:
                    dst.sendall(data)
                    continue
                for piece in self.proxy._downstream(data):  # the stall, then the shared link
                    wait = self.proxy._reserve(len(piece), time.monotonic())
                    if wait > 0:
                        time.sleep(wait)
                    dst.sendall(piece)
        except OSError:
            self.close(reset=True)

    def close(self, reset: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        for sock in (self.client, self.server):
            if reset:
                _rst(sock)
            else:
                try:
                    sock.close()
                except OSError:
                    pass


class FaultProxy:
    """Forward 127.0.0.1:``port`` to ``upstream``, with faults that can be set live."""

    def __init__(self, upstream: tuple[str, int], *, host: str = "127.0.0.1", port: int = 0):
        self.upstream = upstream
        #: one-way delay added to every chunk, in both directions
        self.latency_s = 0.0
        #: bytes per second per direction per connection; None = unthrottled
        self.bandwidth_bps: float | None = None
        #: accept connections but forward nothing (a hung server)
        self.blackhole = False
        #: reset new connections as soon as they are accepted (a dead port behind a LB)
        self.refuse = False
        #: bytes per second the server may send, every connection together; None = no bound
        self.link_bps: float | None = None
        #: the server's bytes past this many (counted from when it was set) are held until it
        #: is set back to None; None = no stall
        self._stall_after: int | None = None
        self._sent_down = 0  # server bytes forwarded since stall_after_bytes was set
        self._link_free = 0.0  # when the shared link is next free (time.monotonic)
        self._link = threading.Condition()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(128)
        self.host, self.port = self._listener.getsockname()[:2]
        self._conns: list[_Conn] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True, name="faultproxy")
        self._stopped = False
        self.connections = 0  #: accepted connections so far

    @property
    def stall_after_bytes(self) -> int | None:
        return self._stall_after

    @stall_after_bytes.setter
    def stall_after_bytes(self, n: int | None) -> None:
        with self._link:
            self._stall_after, self._sent_down = n, 0
            self._link.notify_all()

    def _reserve(self, nbytes: int, now: float) -> float:
        """Book ``nbytes`` on the shared link at ``now``: the seconds to wait before they
        are sent (they go after every byte booked before them)."""
        bps = self.link_bps
        if not bps:
            return 0.0
        with self._link:
            start = max(now, self._link_free)
            self._link_free = start + nbytes / bps
            return self._link_free - now

    def _downstream(self, data: bytes) -> Iterator[bytes]:
        """``data`` from the server in the pieces to send: up to the stall at once, the rest
        once the stall is lifted (or the proxy closes)."""
        with self._link:
            limit = self._stall_after
            room = len(data) if limit is None else max(0, limit - self._sent_down)
            head = data[:room]
            self._sent_down += len(head)
        if head:
            yield head
        if len(head) < len(data):
            with self._link:
                self._link.wait_for(lambda: self._stall_after is None or self._stopped)
            yield data[len(head) :]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            if self.refuse:
                _rst(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                _rst(client)  # upstream down: the client sees what a dead server gives
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns = [c for c in self._conns if not c.closed]
                self._conns.append(_Conn(self, client, server))

    def reset_all(self) -> int:
        """Reset every open connection; returns how many there were."""
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            c.close(reset=True)
        return len(conns)

    def clear(self) -> None:
        """Back to a transparent proxy."""
        self.latency_s = 0.0
        self.bandwidth_bps = None
        self.blackhole = False
        self.refuse = False
        self.link_bps = None
        self.stall_after_bytes = None

    def close(self) -> None:
        self._stopped = True
        with self._link:
            self._link.notify_all()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        try:
            self._listener.close()
        except OSError:
            pass
        self.reset_all()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
