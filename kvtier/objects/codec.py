"""The on-the-wire format of one chunk in the object tier.

A chunk written by one replica is read by another, possibly after a format
change, a bit flip on disk, a half-finished upload or a forgery. Every read is
therefore checked before a single byte reaches a KV cache:

    +-------+------------+----------------------+-----------------+
    | magic | header len | msgpack header       | payload         |
    | 4 B   | uint32 LE  | (header len bytes)   | (len bytes)     |
    +-------+------------+----------------------+-----------------+

The header is a msgpack map ``{"v", "key", "dtype", "shape", "len", "crc"}``
plus an optional ``"sig"``: the format version, the chunk key (an object
stored under the wrong name is caught), the payload's dtype and shape, its
length, its CRC-32 (4 bytes, big-endian) and an HMAC-SHA256 signature. A chunk
written before kvtier checked CRC-32 carries ``"xxh"``, its xxh3-128, instead; it
is still read (and checked with xxh3-128). The checksum is against accidents (a
bit flip, a torn or mixed-up object: a corrupt chunk passes with odds of 2^-32);
forgery is the signature's job. The signature
covers a canonical encoding of the header without ``"sig"`` and the payload,
so neither can be swapped. Unknown, missing or mistyped header fields are
rejected rather than ignored: a mutated chunk never decodes.

A **sealed** chunk (an encryption key is configured, see :mod:`kvtier.objects.sealing`)
has the same frame; its payload is the AES-256-GCM ciphertext of the KV bytes
(as long as they are) and its header ``{"v", "key", "dtype", "shape", "len",
"kid", "nonce", "tag"}`` (plus ``"sig"``) replaces the checksum with the key id,
the nonce and the GCM tag. No checksum of the plaintext is stored: a keyless
hash of the KV would let a bucket reader confirm a guessed prompt. The
associated data is ``[v, key, dtype, shape, len]``, so a sealed chunk with any of
them changed (moved to another chunk key's name) does not open; the tag also
catches bit flips. With an HMAC key as well, the signature covers the sealed
header and the ciphertext (encrypt-then-MAC) and is checked before decryption.

A **compressed** chunk (``compression: lossless``, see :mod:`kvtier.objects.compress`)
adds ``"z"``, the name of its form, to either header; its payload (and ``len``)
is the compressed stream, which the checksum, the HMAC and the AEAD cover (they
also cover the form: compress, then seal and sign). It is read by verifying first,
then decompressing into the slot, whose size (never the object's) bounds the
output. A chunk is stored compressed only when its whole compressed object is
shorter than the raw payload alone, so a tier's ``read_into`` of a slot refuses it
unread (too short) and the reader knows to read it whole.

The payload's checksum is CRC-32, computed with ISA-L (:func:`payload_crc32`). The tiers
compute it too, piece by piece as a payload lands in its slot
(:meth:`ObjectTier.read_into_hashed`, :class:`LandingCrc`). CRC-32 rather than the
xxh3-128 of older chunks: on the GPU host's CPU ISA-L's CRC-32 ran 1.6-3.2x faster
(docs/cuda.md, "Object tier"; on a 2-core VM about as fast), and every byte of every hit
is checked.

This module is the chunk format in one place: the frame (prefix, header fields and their
parsing, the canonical bytes a signature or an AEAD covers), the checksum, and encode,
decode and verify. The keys are :mod:`kvtier.objects.sealing`'s (:class:`Signer` is
re-exported here).
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Sequence
from typing import Any

import msgpack
import xxhash  # the checksum of chunks written before CRC-32

try:
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # the same CRC-32, slower: a platform without an isal wheel
    from zlib import crc32 as _crc32

from kvtier.errors import (
    ChecksumError,
    CodecError,
    KeyMismatchError,
    SealedError,
    SignatureError,
    TruncatedError,
)
from kvtier.objects.compress import LOSSY_FORMS, FormatError, ThreadScratch, decompress_into
from kvtier.objects.sealing import (
    HMAC_KEY_MIN_BYTES,
    KID_BYTES,
    NONCE_BYTES,
    TAG_BYTES,
    Seal,
    Signer,
)

__all__ = [
    "CRC_LEN",
    "FORMAT_VERSION",
    "HASH_PIECE",
    "HMAC_KEY_MIN_BYTES",
    "MAGIC",
    "MAX_HEADER",
    "SMALL_HASH_PIECE",
    "LandingCrc",
    "SignatureError",
    "Signer",
    "crc32_bytes",
    "decode",
    "encode",
    "encoded_size",
    "hash_piece",
    "head_length",
    "is_compressed",
    "parse_header",
    "payload_crc32",
    "verify",
]

# -- the checksum

#: bytes of a CRC-32 in a chunk's header
CRC_LEN = 4
#: bytes checksummed at a time as a payload lands: a piece is still in the CPU's cache
#: when it is checksummed, and each costs a few Python calls under the GIL. With 8 read
#: threads on a 16-core GPU host, 1 MiB pieces read a Llama-3-8B restart hit (32 MiB
#: chunks) 20 % faster than 256 KiB ones (4 MiB: no better); with 2 on a 2-core VM, 8 %
#: slower (bench/gpu_restart.py --hash-piece-kib): the piece with more than 2 read threads
HASH_PIECE = 1 << 20
#: the piece where a tier reads on at most 2 threads (:func:`hash_piece`): each piece
#: rarely waits for the GIL there, and one of 256 KiB is still in L2 when it is checksummed.
#: A warm-up of 64 chunks of 4 MiB from the page cache (bench/warmup.py, 2 read threads,
#: Sapphire Rapids) costs ~5 % less CPU than in 1 MiB pieces
SMALL_HASH_PIECE = 256 << 10


def hash_piece(read_threads: int) -> int:
    """The piece a tier read on ``read_threads`` threads checksums as it lands:
    :data:`SMALL_HASH_PIECE` on up to 2, else :data:`HASH_PIECE` (with 8 threads 1 MiB
    pieces are faster: fewer GIL hand-offs, docs/cuda.md)."""
    return SMALL_HASH_PIECE if read_threads <= 2 else HASH_PIECE


def payload_crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """The CRC-32 (zlib's) of ``data``, continuing from ``value``: computable piece by
    piece as a payload is read. Releases the GIL while it runs."""
    return _crc32(data, value)


def crc32_bytes(value: int) -> bytes:
    """A CRC-32 as a chunk's header stores it (4 bytes, big-endian)."""
    return value.to_bytes(CRC_LEN, "big")


class LandingCrc:
    """The CRC-32 of a buffer filled front to back in pieces of any size (socket reads,
    a streamed body): each :data:`HASH_PIECE` is checksummed as soon as it has landed,
    while it is still in the CPU's cache, so reading and checking are one pass over
    memory instead of a read and then a checksum pass."""

    __slots__ = ("done", "piece", "value", "view")

    def __init__(self, view: memoryview, piece: int = 0) -> None:
        self.view = view
        self.piece = piece or HASH_PIECE  # bytes checksummed at a time
        self.done = 0  # bytes checksummed so far
        self.value = 0

    def restart(self) -> None:
        """The buffer is filled again from its start (a command retried after a drop)."""
        self.done = self.value = 0

    def landed(self, upto: int) -> None:
        """Bytes ``[0, upto)`` of the buffer hold their final contents."""
        if upto - self.done >= self.piece or (upto == self.view.nbytes and upto > self.done):
            self.value = payload_crc32(self.view[self.done : upto], self.value)
            self.done = upto

    def result(self) -> int:
        """The CRC-32 of the whole buffer (what has not been checksummed yet, now)."""
        self.landed(self.view.nbytes)
        return self.value


# -- the frame

FORMAT_VERSION = 1
MAGIC = b"KVTC"
_PREFIX = struct.Struct("<4sI")
#: headers are a few hundred bytes; anything bigger is garbage, not a header
MAX_HEADER = 64 * 1024
_FIELDS = frozenset({"v", "key", "dtype", "shape", "len", "crc"})
#: a chunk written before kvtier checked CRC-32: its xxh3-128 instead (still read)
_XXH_FIELDS = frozenset({"v", "key", "dtype", "shape", "len", "xxh"})
_SEALED_FIELDS = frozenset({"v", "key", "dtype", "shape", "len", "kid", "nonce", "tag"})
_SEAL_LENS = {"kid": KID_BYTES, "nonce": NONCE_BYTES, "tag": TAG_BYTES}
_SIG_LEN = hashlib.sha256().digest_size
#: the longest compressed-form name a header may carry
_FORM_MAX = 32
_XXH_LEN = 16
#: the checksum field of a plain chunk's header and its length in bytes
_SUMS = {_FIELDS: ("crc", CRC_LEN), _XXH_FIELDS: ("xxh", _XXH_LEN)}


_PACKERS = threading.local()


def _packb(obj: object) -> bytes:
    """``msgpack.packb(obj, use_bin_type=True)`` through this thread's Packer: packb makes
    a 256 KiB buffer per call (one or more per chunk read or written); a Packer keeps a
    small one, grown to the largest header it packed."""
    packer: msgpack.Packer | None = getattr(_PACKERS, "p", None)
    if packer is None:
        packer = _PACKERS.p = msgpack.Packer(use_bin_type=True, buf_size=1024)
    packed: bytes = packer.pack(obj)
    return packed


def _payload_view(payload: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(payload)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")  # raises TypeError for non-contiguous memory, which is a bug
    return view


def _canonical(version: int, key: str, dtype: str, shape: list[int], n: int, *rest: bytes) -> bytes:
    """The bytes the signature covers: the header fields in a fixed order, no ``sig``
    (``rest``: the checksum, or a sealed chunk's key id, nonce and tag)."""
    packed: bytes = _packb([version, key, dtype, shape, n, *rest])
    return packed


def _aad(version: int, key: str, dtype: str, shape: list[int], n: int, *form: bytes) -> bytes:
    """A sealed chunk's associated data: what it is and where it belongs (and, compressed,
    its form)."""
    packed: bytes = _packb([version, key, dtype, shape, n, *form])
    return packed


def _header(
    key: str, dtype: str, shape: list[int], n: int, form: str, sealed: bool, signed: bool
) -> dict[str, Any]:
    """A header with placeholder bytes of the real lengths (its packed size is the real
    one's: every bytes field has a fixed length)."""
    header: dict[str, Any] = {
        "v": FORMAT_VERSION,
        "key": key,
        "dtype": dtype,
        "shape": shape,
        "len": n,
        "z": form,
    }
    if sealed:
        header.update({f: bytes(k) for f, k in _SEAL_LENS.items()})
    else:
        header["crc"] = bytes(CRC_LEN)
    if signed:
        header["sig"] = bytes(_SIG_LEN)
    return header


def encoded_size(parts: Sequence[bytes | memoryview]) -> int:
    """Total bytes of ``parts`` (what a tier will store)."""
    return sum(memoryview(p).nbytes for p in parts)


def _is_int(x: object) -> bool:
    return type(x) is int  # not bool: msgpack's true must not pass for version 1


def _form_ok(form: object, present: bool) -> bool:
    """A compressed form's name, when there is one: a short non-empty string."""
    return not present or isinstance(form, str) and 0 < len(form) <= _FORM_MAX


def parse_header(raw: bytes) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types for garbage; all mean the same
        raise CodecError(f"garbage chunk header ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise CodecError("chunk header is not a map")
    version = header.get("v")
    if not _is_int(version) or version != FORMAT_VERSION:
        raise CodecError(f"unknown chunk format version {version!r} (this build reads 1)")
    fields = _SEALED_FIELDS if "nonce" in header else _XXH_FIELDS if "xxh" in header else _FIELDS
    extra = set(header) - fields - {"sig", "z"}
    missing = fields - set(header)
    if extra or missing:
        raise CodecError(
            f"chunk header fields wrong (unknown {sorted(extra)}, missing {sorted(missing)})"
        )
    shape = header["shape"]
    sig = header.get("sig")
    if not (
        isinstance(header["key"], str)
        and isinstance(header["dtype"], str)
        and isinstance(shape, list)
        and all(_is_int(d) and d >= 0 for d in shape)
        and _is_int(header["len"])
        and header["len"] >= 0
        and all(
            isinstance(header[f], bytes) and len(header[f]) == n
            for f, n in (_SEAL_LENS.items() if fields is _SEALED_FIELDS else [_SUMS[fields]])
        )
        and (sig is None and "sig" not in header or isinstance(sig, bytes) and len(sig) == _SIG_LEN)
        and _form_ok(header.get("z", ""), "z" in header)
    ):
        raise CodecError("chunk header has a field of the wrong type")
    return header


def is_compressed(head: bytes | bytearray | memoryview) -> bool:
    """Whether a chunk's head (magic, length, header) says its payload is compressed;
    False for a head that does not parse (:func:`verify` then says why)."""
    view = _payload_view(head)
    try:
        body_at = head_length(view[: _PREFIX.size])
        if view.nbytes < body_at:
            return False
        return "z" in parse_header(bytes(view[_PREFIX.size : body_at]))
    except CodecError:
        return False


def head_length(prefix: bytes | bytearray | memoryview) -> int:
    """Bytes before the payload (magic, length, header), from the chunk's first 8 bytes."""
    view = _payload_view(prefix)
    if view.nbytes == 0:
        raise TruncatedError("empty chunk")
    if bytes(view[:4]) != MAGIC[: min(4, view.nbytes)]:
        raise CodecError("not a kvtier chunk (bad magic)")
    if view.nbytes < _PREFIX.size:
        raise TruncatedError(f"chunk of {view.nbytes} bytes is shorter than its prefix")
    hlen: int = _PREFIX.unpack_from(view)[1]
    if hlen > MAX_HEADER:
        raise CodecError(f"chunk header length {hlen} is implausible")
    return _PREFIX.size + hlen


# -- encode, decode, verify

#: where :func:`decode` opens a sealed compressed payload it was handed read-only
_OPEN_SCRATCH = ThreadScratch()


def encode(
    key: str,
    payload: bytes | bytearray | memoryview,
    *,
    dtype: str,
    shape: Sequence[int],
    signer: Signer | None = None,
    compressed: tuple[str, bytes | bytearray | memoryview] | None = None,
) -> list[bytes | memoryview]:
    """Frame ``payload`` as a chunk; returns the parts to write, the payload not copied.

    With a sealer in ``signer`` the payload part is its ciphertext, in this thread's
    scratch buffer: write the parts before this thread encodes again.

    ``compressed`` is ``(form, stream)``, ``payload`` compressed: the chunk is framed
    compressed when its whole object is shorter than ``payload`` alone (then, and only
    then, :func:`encoded_size` of the parts is below ``payload``'s size), else raw.
    """
    view = _payload_view(payload)
    shape_l = [int(d) for d in shape]
    if any(d < 0 for d in shape_l):
        raise ValueError(f"shape {shape_l} has a negative dimension")
    sealer = signer.sealer if signer is not None else None
    signs = signer is not None and signer.hmac
    form: str | None = None
    if compressed is not None:
        form, stream = compressed[0], _payload_view(compressed[1])
        if not form or len(form) > _FORM_MAX:
            raise ValueError(f"compressed form name {form!r} is empty or too long")
        # fixed-length fields: the header's size is known before sealing or signing
        probe = _header(key, dtype, shape_l, stream.nbytes, form, sealer is not None, signs)
        if _PREFIX.size + len(_packb(probe)) + stream.nbytes < (view.nbytes + _PREFIX.size):
            view = stream
        else:
            form = None
    n = view.nbytes
    header: dict[str, Any] = {
        "v": FORMAT_VERSION,
        "key": key,
        "dtype": dtype,
        "shape": shape_l,
        "len": n,
    }
    extra: tuple[bytes, ...] = ()
    if form is not None:
        header["z"] = form
        extra = (form.encode(),)
    if sealer is not None:
        aad = _aad(FORMAT_VERSION, key, dtype, shape_l, n, *extra)
        seal, body = sealer.seal(aad, view)
        header.update(kid=seal.kid, nonce=seal.nonce, tag=seal.tag)
        rest: tuple[bytes, ...] = (seal.kid, seal.nonce, seal.tag)
    else:
        body = view
        header["crc"] = crc32_bytes(payload_crc32(view))
        rest = (header["crc"],)
    if signs:
        assert signer is not None
        canon = _canonical(FORMAT_VERSION, key, dtype, shape_l, n, *rest, *extra)
        header["sig"] = signer.sign(canon, body)
    packed = _packb(header)
    return [_PREFIX.pack(MAGIC, len(packed)) + packed, body]


def decode(
    blob: bytes | bytearray | memoryview,
    *,
    key: str,
    dtype: str | None = None,
    shape: Sequence[int] | None = None,
    signer: Signer | None = None,
    out: memoryview | None = None,
    lossy: bool = False,
) -> memoryview:
    """Check a stored chunk and return a view of its payload (no copy of a plain chunk;
    a sealed one is decrypted in place when ``blob`` is writable, else in a copy: in
    ``out`` when it is the payload's size, else a new buffer).
    A compressed chunk is decompressed into ``out`` (its size is the only bound on the
    output) and ``out`` is returned; without ``out`` it is a :class:`CodecError`. A
    sealed compressed chunk of a read-only ``blob`` opens in this thread's scratch
    buffer (:class:`kvtier.objects.compress.ThreadScratch`, reused by every such read, never
    longer than the largest ``out``): reading into ``out`` allocates no buffer per read.

    Raises a :class:`~kvtier.errors.CodecError` subclass for anything that is
    not exactly a chunk for ``key`` (and ``dtype``/``shape`` when given),
    :class:`~kvtier.errors.SignatureError` when ``signer`` is set and the chunk
    is unsigned or signed with a key it does not accept (or, with a sealer, not
    sealed or not opening), and :class:`~kvtier.errors.SealedError` for a sealed
    chunk this ``signer`` holds no key for.
    """
    view = _payload_view(blob)
    total = view.nbytes
    body_at = head_length(view[: _PREFIX.size])
    if total < body_at:
        raise TruncatedError(f"chunk of {total} bytes ends inside its {body_at}-byte header")
    payload = view[body_at:]
    header = parse_header(bytes(view[_PREFIX.size : body_at]))
    compressed = "z" in header
    if payload.readonly and "nonce" in header:  # a sealed chunk opens in place: where?
        if out is not None and compressed:  # only decompressed from: a reused buffer
            if payload.nbytes > out.nbytes:  # never stored: a compressed form is shorter
                raise CodecError(
                    f"compressed chunk of {payload.nbytes} bytes is longer than "
                    f"its {out.nbytes}-byte slot"
                )
            scratch = _OPEN_SCRATCH.view(payload.nbytes)
            scratch[:] = payload
            payload = scratch
        elif out is not None and out.nbytes == payload.nbytes:  # in the caller's slot
            out[:] = payload
            payload = out
        else:  # the caller keeps the plaintext
            payload = memoryview(bytearray(payload))
    verify(
        view[:body_at],
        payload,
        key=key,
        dtype=dtype,
        shape=shape,
        signer=signer,
        out=out,
        lossy=lossy,
    )
    return payload if out is None or not compressed else out


def verify(
    head: bytes | bytearray | memoryview,
    payload: memoryview,
    *,
    key: str,
    dtype: str | None = None,
    shape: Sequence[int] | None = None,
    signer: Signer | None = None,
    out: memoryview | None = None,
    lossy: bool = False,
    payload_crc: int | None = None,
) -> float:
    """Check a chunk read as its head (magic, length, header) and its payload, where the
    payload already is where it will be used (a host slot): nothing is copied. A sealed
    chunk is decrypted in place (``payload`` must then be writable), so on success the
    payload holds the plaintext. A compressed chunk is checked as stored (compressed,
    and sealed) and then decompressed into ``out``, which it must fill exactly (a
    compressed chunk without ``out`` is a :class:`CodecError`). Raises like
    :func:`decode`; on any error the payload's and ``out``'s bytes must not be used.
    Returns the seconds spent decompressing (0.0 for a raw chunk). A chunk in a lossy
    form (fp8) is read only with ``lossy`` (an engine that chose ``compression: fp8``);
    any other engine counts it a miss of kind ``format``: its hits stay exact.
    ``payload_crc``: the payload's CRC-32, computed while it was read
    (:meth:`ObjectTier.read_into_hashed`), so that it is not computed again."""
    head_v = _payload_view(head)
    body_at = head_length(head_v[: _PREFIX.size])
    if head_v.nbytes < body_at:
        raise TruncatedError(f"chunk ends inside its {body_at}-byte header")
    if head_v.nbytes > body_at:
        raise CodecError("chunk head and payload do not line up")
    header = parse_header(bytes(head_v[_PREFIX.size : body_at]))
    if header["key"] != key:
        raise KeyMismatchError("object holds a different chunk key than its name")
    if dtype is not None and header["dtype"] != dtype:
        raise CodecError(f"chunk dtype {header['dtype']!r}, expected {dtype!r}")
    if shape is not None and header["shape"] != [int(d) for d in shape]:
        raise CodecError(f"chunk shape {header['shape']}, expected {list(shape)}")
    form: str | None = header.get("z")
    if form in LOSSY_FORMS and not lossy:
        raise FormatError(
            f"chunk is stored in the lossy form {form!r}, which an engine reads "
            "only with compression: fp8"
        )
    if form is not None and out is None:
        raise CodecError("chunk is compressed and was read where it cannot be decompressed")
    n = header["len"]
    have = payload.nbytes
    if have < n:
        raise TruncatedError(f"chunk payload has {have} of {n} bytes")
    if have > n:
        raise CodecError(f"chunk has {have - n} bytes after its payload")
    sealer = signer.sealer if signer is not None else None
    sealed = "nonce" in header
    if sealed:
        if sealer is None:
            raise SealedError("chunk is sealed (encrypted) and this engine has no encryption key")
        if not sealer.can_open(header["kid"]):
            raise SealedError("chunk is sealed with an encryption key this engine does not hold")
        if payload.readonly:
            raise ValueError("a sealed chunk is opened in place: its payload must be writable")
        rest: tuple[bytes, ...] = (header["kid"], header["nonce"], header["tag"])
    else:
        if sealer is not None:
            raise SignatureError("chunk is not sealed but an encryption key is configured")
        if "xxh" in header:  # written before CRC-32
            rest = (header["xxh"],)
            ok = xxhash.xxh3_128_digest(payload) == rest[0]
        else:
            rest = (header["crc"],)
            crc = payload_crc if payload_crc is not None else payload_crc32(payload)
            ok = crc32_bytes(crc) == rest[0]
        if not ok:
            raise ChecksumError("chunk payload does not match its checksum")
    extra = () if form is None else (form.encode(),)
    if signer is not None and signer.hmac:
        sig = header.get("sig")
        if sig is None:
            raise SignatureError("chunk is not signed but a signing key is configured")
        canon = _canonical(
            header["v"], header["key"], header["dtype"], header["shape"], n, *rest, *extra
        )
        if not signer.verify(canon, payload, sig):
            raise SignatureError("chunk signature does not match any accepted key")
    if sealer is not None:  # sealed: checked above
        aad = _aad(header["v"], header["key"], header["dtype"], header["shape"], n, *extra)
        sealer.open_into(Seal(header["kid"], header["nonce"], header["tag"]), aad, payload)
    if form is None:
        return 0.0
    assert out is not None
    return decompress_into(form, payload, out, header["dtype"])
