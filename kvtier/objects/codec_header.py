"""The stored chunk's frame: its prefix, its header's fields and their parsing.

What a chunk *is* on the wire (:mod:`kvtier.objects.codec`'s docstring draws it): the
magic and header length, the msgpack header and which fields it must hold with which
types, and the canonical bytes a signature or an AEAD covers. Apart from the codec
(encode, decode, verify: what is done with a chunk) so the format is read in one place;
the codec re-exports its public names.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Sequence
from typing import Any

import msgpack

from kvtier.errors import CodecError, TruncatedError
from kvtier.objects.checksum import CRC_LEN
from kvtier.objects.seal import KID_BYTES, NONCE_BYTES, TAG_BYTES

__all__ = [
    "FORMAT_VERSION", "MAGIC", "MAX_HEADER", "encoded_size", "head_length", "is_compressed",
]  # fmt: skip

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
    header: dict[str, Any] = {"v": FORMAT_VERSION, "key": key, "dtype": dtype, "shape": shape,
                              "len": n, "z": form}  # fmt: skip
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


def _parse_header(raw: bytes) -> dict[str, Any]:
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
        return "z" in _parse_header(bytes(view[_PREFIX.size : body_at]))
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
