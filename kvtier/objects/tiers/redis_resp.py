"""RESP on the wire for the Redis tiers: bounded reply parsing, framing a SET from parts.

redis-py reads a reply whole before its caller sees it, so a server (or a man in the
middle) could make kvtier buffer anything it sends. The parser here knows which command
each reply answers (every connection records the names of the commands it sends) and
what that command can answer (:data:`_SHAPES`): its type, how deep its arrays nest, how
many elements and bytes the whole reply may hold. It checks every length line before
reading what it announces, reads a chunk-sized bulk reply straight into one buffer (or
the caller's slot), and the SET of a chunk is framed around its parts without joining
them. Every socket wait (reads, and the connect of a new connection) ends by the
calling thread's deadline (:func:`kvtier.objects.tiers.policy.call_deadline`). Kept
apart from :mod:`kvtier.objects.tiers.redis` (the tier: URL, pool, the error mapping,
the commands), which the cluster tier shares too.
"""

from __future__ import annotations

import collections
import re
import threading
from dataclasses import dataclass
from typing import Any

import redis
from redis._parsers import _RESP2Parser
from redis._parsers.socket import SocketBuffer
from redis.utils import SENTINEL

from kvtier.objects import codec
from kvtier.objects.tiers import policy
from kvtier.objects.tiers.base import Found, Parts

__all__ = [
    "REPLY_CAP",
    "BoundedParser",
    "ReplyBound",
    "ReplyTooLarge",
    "WrongReply",
    "bounded_connection",
    "command_frame",
    "command_name",
    "expect_reply",
    "pool_connection",
    "set_frame",
]

#: parts smaller than this are merged into one buffer before they are sent
_SMALL = 64 * 1024
#: the longest status, error or length line read from the server (a real one is < 1 KiB)
_LINE_CAP = 64 * 1024
#: the most bytes of a reply to a command :data:`_SHAPES` does not name
REPLY_CAP = 64 * 1024
#: the most elements of one array in a reply to a command :data:`_SHAPES` does not name
_ARRAY_CAP = 1024
#: bulk replies from this size on are read straight into their own buffer
_DIRECT_BYTES = 64 * 1024
_INT_LINE = re.compile(rb"-?[0-9]{1,20}")
#: hash slots of a Redis Cluster: CLUSTER SLOTS has at most one range per slot
_CLUSTER_SLOTS = 16384


class ReplyTooLarge(redis.exceptions.RedisError):
    """A bulk reply longer than the caller's bound: refused from its length line, before
    its bytes are read (the connection is dropped, not drained)."""


class WrongReply(redis.exceptions.DataError):
    """A reply its command cannot give (an array for STRLEN, arrays nested deeper or
    longer than the command's replies can be): refused where it shows, before the rest
    is read (the connection is dropped); that object's miss, like a key of the wrong
    type."""


@dataclass(frozen=True, slots=True)
class _Shape:
    """What a command's reply can be, as a bound on the whole reply."""

    #: the types it may have: b":" integer, b"$" bulk string, b"+" status, b"*" array
    #: (an error reply is always possible)
    kinds: bytes
    #: it may be nil ($-1 / *-1)
    nil: bool = False
    #: a stored value: its one bulk string is bounded by the caller's bound
    #: (:attr:`ReplyBound.limit`) and may land in the caller's slot
    value: bool = False
    #: every byte of the reply on the wire, lines included (None: the caller's bound)
    max_bytes: int | None = REPLY_CAP
    #: the longest bulk string in it, but a stored value's (the caller's bound)
    bulk_cap: int = REPLY_CAP
    #: arrays inside arrays (0: none; 1: an array of scalars)
    depth: int = 0
    #: elements of any one array
    array_cap: int = 0
    #: elements of all its arrays together
    max_elements: int = 0


_INT = _Shape(b":", max_bytes=256, bulk_cap=0)
_STATUS = _Shape(b"+", nil=True, max_bytes=4096, bulk_cap=0)  # SET answers nil under NX / XX
_VALUE = _Shape(b"$", nil=True, value=True, max_bytes=None)
#: a reply kvtier did not expect to see (it sends no other command): small and flat
_OTHER = _Shape(b":$+*", nil=True, depth=2, array_cap=_ARRAY_CAP, max_elements=_ARRAY_CAP)
#: what a command's reply can be, by the command's name (its first word and, for a
#: container command, its second); redis-py's own commands included: the handshake of
#: a new connection, and the cluster client's CLUSTER SLOTS and COMMAND
_SHAPES: dict[str, _Shape] = {
    **dict.fromkeys(["EXISTS", "STRLEN", "DEL", "UNLINK", "DBSIZE"], _INT),
    **dict.fromkeys(["GET", "GETRANGE"], _VALUE),
    **dict.fromkeys(
        [
            "SET",
            "AUTH",
            "SELECT",
            "PING",
            "READONLY",
            "READWRITE",
            "ASKING",
            "QUIT",
            "CLIENT SETINFO",
            "CLIENT SETNAME",
        ],
        _STATUS,
    ),
    "INFO": _Shape(b"$", max_bytes=1 << 20, bulk_cap=1 << 20),
    # one range per slot at most; a range: start, end, its nodes (host, port, id, and a
    # flat array of metadata since Redis 7), each string a name or an id; 32 MiB is ~10
    # times a real 16,384-range reply of 3 nodes each
    "CLUSTER SLOTS": _Shape(
        b"*",
        depth=4,
        array_cap=_CLUSTER_SLOTS,
        max_elements=1 << 20,
        max_bytes=32 << 20,
        bulk_cap=4096,
    ),
    "CLUSTER SHARDS": _Shape(
        b"*",
        depth=5,
        array_cap=_CLUSTER_SLOTS,
        max_elements=1 << 20,
        max_bytes=32 << 20,
        bulk_cap=4096,
    ),
    # the command table (the cluster client reads where each command's keys are): Redis
    # 7.0 answers 240 commands, their subcommands' key specs 8 arrays deep, 90 KB
    "COMMAND": _Shape(b"*", depth=12, array_cap=4096, max_elements=1 << 20, max_bytes=16 << 20),
}
_CONTAINERS = frozenset({"CLUSTER", "CLIENT", "CONFIG", "COMMAND", "MEMORY", "OBJECT"})
_WHAT = {b":": "an integer", b"$": "a bulk string", b"+": "a status", b"*": "an array"}


def _text(arg: object) -> str:
    if isinstance(arg, bytes | bytearray | memoryview):
        return bytes(arg[:32]).decode("ascii", "replace")
    return str(arg)[:32]


def command_name(args: tuple[Any, ...]) -> str:
    """The name :data:`_SHAPES` knows a command by: ``("CLUSTER SLOTS",)`` and
    ``("CLUSTER", "SLOTS")`` are both ``CLUSTER SLOTS``; ``("GET", key)`` is ``GET``."""
    if not args:
        return ""
    words = _text(args[0]).upper().split()
    if len(words) == 1 and words[0] in _CONTAINERS and len(args) > 1:
        words.append(_text(args[1]).upper())
    return " ".join(words[:2])


class _Reply:
    """One reply being parsed: its command's shape and what is left of its bounds."""

    __slots__ = ("name", "shape", "bytes_left", "elements_left", "depth", "started")

    def __init__(self, name: str | None) -> None:
        self.name = name or "a command"
        self.shape = _SHAPES.get(name or "", _OTHER)
        self.bytes_left = self.shape.max_bytes
        self.elements_left = self.shape.max_elements
        self.depth = 0
        self.started = False

    def spend(self, n: int) -> None:
        if self.bytes_left is not None:
            self.bytes_left -= n
            if self.bytes_left < 0:
                raise WrongReply(f"{self.name} replied with more than {self.shape.max_bytes} bytes")


class ReplyBound(threading.local):
    """The largest bulk reply this thread's current command may read (None: no bound).

    Replies are parsed on the calling thread, which holds its pooled connection for
    the whole command, so a thread-local bound is the command's bound."""

    limit: int | None = REPLY_CAP
    #: a slot the command's bulk reply ends in (``RedisTier.read_into``): a reply at least
    #: its size is read with its last ``into.nbytes`` bytes straight into it, and only
    #: the bytes before them (the chunk's head) are returned; ``landed`` says it was
    into: memoryview | None = None
    landed = False
    #: ``into``'s checksum, computed as the reply lands there (``read_into_hashed``)
    landing: codec.LandingCrc | None = None
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


def _wait_s(base: float | object | None) -> float | object | None:
    """A socket wait of ``base`` (SENTINEL: the socket's own timeout) shortened to what
    is left of this thread's deadline; TimeoutError once it has passed."""
    left = policy.time_left()
    if left is None:
        return base
    if left <= 0:
        raise redis.TimeoutError("the call's deadline passed")
    if base is SENTINEL or base is None:
        return left
    assert isinstance(base, int | float)
    return min(float(base), left)


class _BoundedBuffer(SocketBuffer):
    """redis-py's socket buffer with a bound on a line (a server that never sends CRLF
    must not make the client buffer everything it sends) and on every wait (the calling
    thread's deadline)."""

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

    def _read_from_socket(
        self,
        length: int | None = None,
        timeout: float | object = SENTINEL,
        raise_on_timeout: bool | None = True,
    ) -> bool:
        if policy.time_left() is not None:
            try:
                wait = _wait_s(self.socket_timeout if timeout is SENTINEL else timeout)
            except redis.TimeoutError:
                if not raise_on_timeout:  # a poll (can_read): nothing there in time
                    return False
                raise
            timeout = wait if wait is not None else SENTINEL
        got: bool = super()._read_from_socket(length, timeout, raise_on_timeout)
        return got


class BoundedParser(_RESP2Parser):
    """RESP2 parsing that knows each reply's command and bounds the whole reply by it.

    redis-py (and hiredis) read a bulk reply whole before the caller sees it: a server
    that ignores GETRANGE's range and sends 512 MiB would cost 1 GiB before any size
    check, and an array of 1,024 slot-sized strings for a STRLEN 1,024 slots. Here a
    reply of a type its command never gives, or with arrays deeper, longer or more
    bytes than its command's (:data:`_SHAPES`), raises :class:`WrongReply` where it
    shows; a stored value longer than the thread's :class:`ReplyBound` raises
    :class:`ReplyTooLarge` from its length line; malformed length lines are protocol
    errors (not ``ValueError``). redis-py then drops the connection.
    """

    bound: ReplyBound  # set on the per-tier subclass
    _buffer: Any  # redis-py's SocketBuffer (here a _BoundedBuffer), None when disconnected
    _sock: Any
    #: the names of the commands sent on this connection whose replies are not read yet
    _sent: collections.deque[str] | None = None
    _reply: _Reply | None = None

    def on_connect(self, connection: Any) -> None:
        super().on_connect(connection)  # type: ignore[no-untyped-call]
        self._buffer = _BoundedBuffer(self._sock, self.socket_read_size, connection.socket_timeout)
        self._sent = getattr(connection, "_kv_sent", None)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        """One reply, bounded by the shape of the oldest command not answered yet."""
        sent = self._sent
        self._reply = _Reply(sent[0] if sent else None)
        try:
            result = super().read_response(*args, **kwargs)
        finally:
            self._reply = None
        if sent:
            sent.popleft()
        return result

    def _read_response(self, disable_decoding: bool = False, timeout: object = SENTINEL) -> Any:
        reply = self._reply
        if reply is None:  # (a read that did not come through read_response)
            reply = self._reply = _Reply(None)
        top, reply.started = not reply.started, True
        shape = reply.shape
        pos = self._buffer.get_pos()
        raw = self._buffer.readline(timeout=timeout)
        kind, rest = raw[:1], raw[1:]
        if not (top and kind == b"-"):  # (an error reply is one line, bounded as a line)
            reply.spend(len(raw) + 2)
        if kind in (b"$", b"*", b":"):
            if not _INT_LINE.fullmatch(rest) or (kind != b":" and int(rest) < -1):
                raise redis.exceptions.InvalidResponse(f"Protocol Error: {raw[:80]!r}")
            n = int(rest)
            nil = kind != b":" and n == -1
            if top and not (nil and shape.nil) and (nil or kind not in shape.kinds):
                what = "nil" if nil else _WHAT[bytes(kind)]
                kinds = (shape.kinds[i : i + 1] for i in range(len(shape.kinds)))
                expected = " or ".join(_WHAT[k] for k in kinds)
                raise WrongReply(f"{reply.name} replied with {what}, {expected} expected")
            if kind == b":":
                if top:
                    self.bound.last_int = n
            elif kind == b"*" and not nil:
                return self._read_array(reply, n, disable_decoding, timeout)
            elif kind == b"$" and not nil:
                if not shape.value and n > shape.bulk_cap:
                    raise WrongReply(
                        f"{reply.name} replied with a string of {n} bytes, at most "
                        f"{shape.bulk_cap} expected"
                    )
                limit = self.bound.limit if shape.value else None
                if limit is not None and n > limit:
                    raise ReplyTooLarge(f"a reply of {n} bytes, at most {limit} expected")
                reply.spend(n + 2)
                if top and shape.value and n >= _DIRECT_BYTES:
                    return self._read_bulk(n, timeout)
        elif top and kind == b"+" and b"+" not in shape.kinds:
            expected = _WHAT[shape.kinds[:1]]
            raise WrongReply(f"{reply.name} replied with a status, {expected} expected")
        self._buffer.rewind(pos)  # the line was only looked at: redis-py parses it
        return super()._read_response(disable_decoding=disable_decoding, timeout=timeout)

    def _read_array(
        self, reply: _Reply, n: int, disable_decoding: bool, timeout: object
    ) -> list[Any]:
        """An array's elements, within its command's depth and element bounds."""
        shape = reply.shape
        if reply.depth >= shape.depth:
            raise WrongReply(f"{reply.name} replied with arrays nested deeper than {shape.depth}")
        if n > shape.array_cap:
            raise WrongReply(
                f"{reply.name} replied with an array of {n} elements, at most "
                f"{shape.array_cap} expected"
            )
        reply.elements_left -= n
        if reply.elements_left < 0:
            raise WrongReply(
                f"{reply.name} replied with more than {shape.max_elements} elements in all"
            )
        reply.depth += 1
        try:
            return [self._read_response(disable_decoding, timeout) for _ in range(n)]
        finally:
            reply.depth -= 1

    def _read_bulk(self, n: int, timeout: object) -> bytearray:
        """A chunk-sized bulk reply read straight from the socket into one buffer of its
        size: no growing buffer and two copies (the pure-Python parser's way), as fast
        as hiredis. With a slot to read into (:attr:`ReplyBound.into`) no larger than the
        reply, the reply's end goes straight into the slot: no buffer of the chunk's
        size, no copy of it; with :attr:`ReplyBound.front`, a whole reply that fits goes to
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
        self, views: list[memoryview], timeout: object, landing: codec.LandingCrc | None = None
    ) -> None:
        """Fill ``views`` in order: first from what the socket buffer holds, then from
        the socket, each wait within the thread's deadline; ``landing`` checksums the
        view it was made for as it fills."""
        sock = self._sock
        base = self._buffer.socket_timeout if timeout is SENTINEL else timeout
        timed = timeout is not SENTINEL or policy.time_left() is not None
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
                        end = min(end, track.done + codec.HASH_PIECE)
                    if timed:
                        sock.settimeout(_wait_s(base))
                    k = sock.recv_into(view[got:end])
                    if not k:
                        raise redis.ConnectionError("Connection closed by server.")
                    got += k
                if track is not None:
                    track.landed(got)
        finally:
            if timed:
                sock.settimeout(self._buffer.socket_timeout)


class _Sent:
    """A command packer that notes the name of each command it packs (``_kv_packed``);
    the connection moves the names to ``_kv_sent`` once the bytes are sent."""

    def __init__(self, packer: Any, packed: list[str]) -> None:
        self.packer = packer
        self.packed = packed

    def pack(self, *args: Any) -> Any:
        self.packed.append(command_name(args))
        return self.packer.pack(*args)


_CONNECTION_CLASSES: dict[type[Any], type[Any]] = {}
_CLASSES_LOCK = threading.Lock()


def bounded_connection(base: type[Any]) -> type[Any]:
    """``base`` (redis-py's Connection or SSLConnection) as a connection that records the
    commands it sends (for :class:`BoundedParser` to know what each reply answers) and
    connects within the calling thread's deadline."""
    with _CLASSES_LOCK:
        cls = _CONNECTION_CLASSES.get(base)
        if cls is None:
            cls = _CONNECTION_CLASSES[base] = type(
                f"Bounded{base.__name__}", (_ConnectionMixin, base), {}
            )
    return cls


class _ConnectionMixin:
    """See :func:`bounded_connection`."""

    _kv_packed: list[str]
    _kv_sent: collections.deque[str]
    socket_timeout: float | None
    socket_connect_timeout: float | None

    def _construct_command_packer(self, packer: Any) -> Any:
        self._kv_packed = []
        self._kv_sent = collections.deque()
        return _Sent(super()._construct_command_packer(packer), self._kv_packed)  # type: ignore[misc]

    def expect_reply(self, name: str) -> None:
        """The next :meth:`send_packed_command` sends a frame kvtier packed itself."""
        self._kv_packed.append(name)

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        # the names packed for ``command``; what a connect or a health check sends on
        # the way records its own
        names = self._kv_packed[:]
        self._kv_packed.clear()
        super().send_packed_command(command, check_health)  # type: ignore[misc]
        self._kv_sent.extend(names)

    def disconnect(self, *args: Any, **kwargs: Any) -> None:
        self._kv_sent.clear()  # the replies still due died with the socket
        super().disconnect(*args, **kwargs)  # type: ignore[misc]

    def _connect(self) -> Any:
        """Open the socket (and TLS) within what is left of the thread's deadline."""
        left = policy.time_left()
        if left is None:
            return super()._connect()  # type: ignore[misc]
        if left <= 0:
            raise TimeoutError("the call's deadline passed")  # (socket.timeout)
        connect_s, reply_s = self.socket_connect_timeout, self.socket_timeout
        self.socket_connect_timeout = left if connect_s is None else min(connect_s, left)
        self.socket_timeout = left if reply_s is None else min(reply_s, left)
        try:
            sock = super()._connect()  # type: ignore[misc]
        finally:
            self.socket_connect_timeout, self.socket_timeout = connect_s, reply_s
        sock.settimeout(reply_s)
        return sock


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


def command_frame(*args: str | int) -> bytes:
    """The RESP frame of one small command (``STRLEN key``, ``GETRANGE key 0 n``)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg.encode() if isinstance(arg, str) else b"%d" % arg
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def set_frame(key: str, parts: Parts, ttl_s: int | None) -> list[bytes | memoryview]:
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


def expect_reply(conn: Any, name: str) -> None:
    """``conn`` is about to send a frame kvtier packed itself (a SET from its parts)."""
    note = getattr(conn, "expect_reply", None)
    if note is not None:
        note(name)


def pool_connection(pool: redis.ConnectionPool) -> redis.connection.Connection:
    try:
        return pool.get_connection()  # redis-py >= 5.3 warns when given a command name
    except TypeError:  # redis-py < 5.3 requires one
        return pool.get_connection("SET")
