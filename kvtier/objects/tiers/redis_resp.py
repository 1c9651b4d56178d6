"""RESP on the wire for the Redis tiers: bounded reply parsing, framing a SET from parts.

redis-py reads a reply whole before its caller sees it, so a server (or a man in the
middle) could make kvtier buffer anything it sends. The parser here checks every length
line before reading what it announces, reads a chunk-sized bulk reply straight into one
buffer (or the caller's slot), and the SET of a chunk is framed around its parts without
joining them. Kept apart from :mod:`kvtier.objects.tiers.redis` (the tier: URL, pool, the
error mapping, the commands), which the cluster tier shares too.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import redis
from redis._parsers import _RESP2Parser
from redis._parsers.socket import SocketBuffer
from redis.utils import SENTINEL

from kvtier.objects import checksum
from kvtier.objects.tiers.base import Found, Parts

__all__ = ["ReplyTooLarge"]

#: parts smaller than this are merged into one buffer before they are sent
_SMALL = 64 * 1024
#: the longest status, error or length line read from the server (a real one is < 1 KiB)
_LINE_CAP = 64 * 1024
#: the largest bulk reply to anything but a bounded read (EXISTS, SET, DEL answer integers
#: and "OK"; only GET without a bound may be larger, and it lifts the cap)
_REPLY_CAP = 64 * 1024
#: the most elements of one array reply (kvtier sends no command that returns an array)
_ARRAY_CAP = 1024
#: bulk replies from this size on are read straight into their own buffer
_DIRECT_BYTES = 64 * 1024
_INT_LINE = re.compile(rb"-?[0-9]{1,20}")


class ReplyTooLarge(redis.exceptions.RedisError):
    """A bulk reply longer than the caller's bound: refused from its length line, before
    its bytes are read (the connection is dropped, not drained)."""


class _Bound(threading.local):
    """The largest bulk reply this thread's current command may read (None: no bound).

    Replies are parsed on the calling thread, which holds its pooled connection for
    the whole command, so a thread-local bound is the command's bound."""

    limit: int | None = _REPLY_CAP
    #: a slot the command's bulk reply ends in (``RedisTier.read_into``): a reply at least
    #: its size is read with its last ``into.nbytes`` bytes straight into it, and only
    #: the bytes before them (the chunk's head) are returned; ``landed`` says it was
    into: memoryview | None = None
    landed = False
    #: ``into``'s checksum, computed as the reply lands there (``read_into_hashed``)
    landing: checksum.LandingCrc | None = None
    #: ``into`` takes the whole reply at its front instead (``RedisTier.get_into``): a
    #: reply no longer than ``into`` lands there, and ``front_n`` says how long it was
    front = False
    front_n: int | None = None
    #: the last integer reply of the command (read_into's STRLEN, which comes before the
    #: GETRANGE): a value it shows to be oversize is never read into the slot
    last_int: int | None = None
    #: ``read_into``'s :data:`~kvtier.objects.tiers.base.Found`: called (then cleared) as
    #: a reply that goes into ``into`` begins, before its bytes are read
    found: Found = None


class _BoundedBuffer(SocketBuffer):
    """redis-py's socket buffer with a bound on a line: a server that never sends CRLF
    must not make the client buffer everything it sends."""

    def readline(self, timeout: float | object = SENTINEL) -> bytes:
        buf = self._buffer
        data = buf.readline()
        while not data.endswith(b"\r\n"):
            if len(data) > _LINE_CAP:
                raise redis.exceptions.InvalidResponse(
                    f"Protocol Error: a reply line longer than {_LINE_CAP} bytes"
                )
            self._read_from_socket(timeout=timeout)
            data += buf.readline()
        return data[:-2]


class _BoundedParser(_RESP2Parser):
    """RESP2 parsing that checks every length line before it reads what it announces.

    redis-py (and hiredis) read a bulk reply whole before the caller sees it: a server
    that ignores GETRANGE's range and sends 512 MiB would cost 1 GiB before any size
    check. Here a bulk reply longer than the thread's :class:`_Bound` raises
    :class:`ReplyTooLarge` from its length line, and malformed length lines are
    protocol errors (not ``ValueError``); redis-py then drops the connection.
    """

    bound: _Bound  # set on the per-tier subclass
    _buffer: Any  # redis-py's SocketBuffer (here a _BoundedBuffer), None when disconnected
    _sock: Any

    def on_connect(self, connection: Any) -> None:
        super().on_connect(connection)  # type: ignore[no-untyped-call]
        self._buffer = _BoundedBuffer(self._sock, self.socket_read_size, connection.socket_timeout)

    def _read_response(self, disable_decoding: bool = False, timeout: object = SENTINEL) -> Any:
        pos = self._buffer.get_pos()
        raw = self._buffer.readline(timeout=timeout)
        kind, rest = raw[:1], raw[1:]
        if kind in (b"$", b"*", b":"):
            if not _INT_LINE.fullmatch(rest):
                raise redis.exceptions.InvalidResponse(f"Protocol Error: {raw[:80]!r}")
            n = int(rest)
            if kind == b":":
                self.bound.last_int = n
            if kind == b"$" and self.bound.limit is not None and n > self.bound.limit:
                raise ReplyTooLarge(f"a reply of {n} bytes, at most {self.bound.limit} expected")
            if kind == b"*" and n > _ARRAY_CAP:
                raise redis.exceptions.InvalidResponse(
                    f"Protocol Error: an array of {n} elements, at most {_ARRAY_CAP} expected"
                )
            if kind == b"$" and n >= _DIRECT_BYTES:
                return self._read_bulk(n, timeout)
        self._buffer.rewind(pos)  # the line was only looked at: redis-py parses it
        return super()._read_response(disable_decoding=disable_decoding, timeout=timeout)

    def _read_bulk(self, n: int, timeout: object) -> bytearray:
        """A chunk-sized bulk reply read straight from the socket into one buffer of its
        size: no growing buffer and two copies (the pure-Python parser's way), as fast
        as hiredis. With a slot to read into (:attr:`_Bound.into`) no larger than the
        reply, the reply's end goes straight into the slot: no buffer of the chunk's
        size, no copy of it; with :attr:`_Bound.front`, a whole reply that fits goes to
        the front of ``into``."""
        into, size, limit = self.bound.into, self.bound.last_int, self.bound.limit
        oversize = size is not None and limit is not None and size > limit
        if into is not None and self.bound.front:
            if n <= into.nbytes and not oversize:
                crlf = bytearray(2)
                self._fill([into[:n], memoryview(crlf)], timeout)
                _check_crlf(crlf)
                self.bound.front_n = n
                return bytearray()
            into = None  # oversize: read into its own buffer, refused after the reply
        if into is not None and into.nbytes <= n and not oversize:
            self.bound.landed = False
            found, self.bound.found = self.bound.found, None
            if found is not None:  # a stored chunk: its length line is read, its bytes not
                found()
            head, crlf = bytearray(n - into.nbytes), bytearray(2)
            landing = self.bound.landing
            if landing is not None:
                landing.restart()  # (a command redis-py retried reads its reply again)
            self._fill([memoryview(head), into, memoryview(crlf)], timeout, landing)
            _check_crlf(crlf)
            self.bound.landed = True
            return head
        out = bytearray(n + 2)
        view = memoryview(out)
        try:
            self._fill([view], timeout)
        finally:
            view.release()
        _check_crlf(out[n:])
        del out[n:]  # shrinks in place
        return out

    def _fill(
        self, views: list[memoryview], timeout: object, landing: checksum.LandingCrc | None = None
    ) -> None:
        """Fill ``views`` in order: first from what the socket buffer holds, then from
        the socket; ``landing`` checksums the view it was made for as it fills."""
        sock = self._sock
        if timeout is not SENTINEL:
            sock.settimeout(timeout)
        try:
            for view in views:
                track = landing if landing is not None and view is landing.view else None
                got = self._buffer._buffer.readinto(view)  # what the buffer holds already
                while got < view.nbytes:
                    end = view.nbytes
                    if track is not None:
                        track.landed(got)
                        # a read never crosses the end of the piece being checksummed:
                        # a slow reader's full socket buffer lands a piece at a time
                        end = min(end, track.done + checksum.HASH_PIECE)
                    k = sock.recv_into(view[got:end])
                    if not k:
                        raise redis.ConnectionError("Connection closed by server.")
                    got += k
                if track is not None:
                    track.landed(got)
        finally:
            if timeout is not SENTINEL:
                sock.settimeout(self._buffer.socket_timeout)


def _check_crlf(end: bytes | bytearray) -> None:
    """A bulk reply ends in CRLF; anything else is a protocol error (the connection is
    dropped)."""
    if end != b"\r\n":
        raise redis.exceptions.InvalidResponse("Protocol Error: a bulk reply without CRLF")


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


def _set_frame(key: str, parts: Parts, ttl_s: int | None) -> list[bytes | memoryview]:
    """The RESP frame of ``SET key <parts> [EX ttl_s]`` around the parts, not joining them."""
    total = sum(memoryview(p).nbytes for p in parts)
    name = key.encode()
    extra = [b"EX", b"%d" % ttl_s] if ttl_s else []
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
        3 + len(extra),
        len(name),
        name,
        total,
    )
    tail = b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in extra)
    return _coalesce([head, *parts, tail])


def _connection(pool: redis.ConnectionPool) -> redis.connection.Connection:
    try:
        return pool.get_connection()  # redis-py >= 5.3 warns when given a command name
    except TypeError:  # redis-py < 5.3 requires one
        return pool.get_connection("SET")

