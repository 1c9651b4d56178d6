"""The on-the-wire format of one chunk in the object tier.

A chunk written by one replica is read by another, possibly after a format
change, a bit flip on disk, a half-finished upload or a forgery. Every read is
therefore checked before a single byte reaches a KV cache:

    +-------+------------+----------------------+-----------------+
    | magic | header len | msgpack header       | payload         |
    | 4 B   | uint32 LE  | (header len bytes)   | (len bytes)     |
    +-------+------------+----------------------+-----------------+

The header is a msgpack map ``{"v", "key", "dtype", "shape", "len", "xxh"}``
plus an optional ``"sig"``: the format version, the chunk key (an object
stored under the wrong name is caught), the payload's dtype and shape, its
length, its xxh3-128 checksum and an HMAC-SHA256 signature. The signature
covers a canonical encoding of the header without ``"sig"`` and the payload,
so neither can be swapped. Unknown, missing or mistyped header fields are
rejected rather than ignored: a mutated chunk never decodes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import xxhash

from kvtier.errors import (
    ChecksumError,
    CodecError,
    ConfigError,
    KeyMismatchError,
    SignatureError,
    TruncatedError,
)

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig

__all__ = [
    "FORMAT_VERSION", "MAGIC", "Signer", "decode", "encode", "encoded_size", "head_length",
    "verify",
]

FORMAT_VERSION = 1
MAGIC = b"KVTC"
_PREFIX = struct.Struct("<4sI")
#: headers are a few hundred bytes; anything bigger is garbage, not a header
MAX_HEADER = 64 * 1024
_FIELDS = frozenset({"v", "key", "dtype", "shape", "len", "xxh"})
_SIG_LEN = hashlib.sha256().digest_size
_XXH_LEN = 16


def _payload_view(payload: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(payload)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")  # raises TypeError for non-contiguous memory, which is a bug
    return view


class Signer:
    """HMAC-SHA256 signing of chunks: one key signs, several verify (key rotation).

    Without a signer anyone who can write the bucket can feed KV to every
    replica; with one, only holders of a key can.
    """

    __slots__ = ("_sign_key", "_verify_keys")

    def __init__(self, sign_key: bytes | None, verify_keys: Sequence[bytes] = ()) -> None:
        keys = ([sign_key] if sign_key else []) + [k for k in verify_keys if k]
        if not keys:
            raise ValueError("Signer needs a signing key or at least one verify key")
        self._sign_key = sign_key or None
        # the signing key verifies too, so a fresh rotation reads its own writes
        self._verify_keys = tuple(dict.fromkeys(keys))

    def __repr__(self) -> str:  # never the keys themselves
        return f"Signer(signs={self._sign_key is not None}, verify_keys={len(self._verify_keys)})"

    @property
    def can_sign(self) -> bool:
        return self._sign_key is not None

    def sign(self, header: bytes, payload: memoryview) -> bytes:
        if self._sign_key is None:
            raise ValueError("this Signer only verifies; it has no signing key")
        mac = hmac.new(self._sign_key, header, hashlib.sha256)
        mac.update(payload)
        return mac.digest()

    def verify(self, header: bytes, payload: memoryview, sig: bytes) -> bool:
        ok = False
        for key in self._verify_keys:
            mac = hmac.new(key, header, hashlib.sha256)
            mac.update(payload)
            ok |= hmac.compare_digest(mac.digest(), sig)
        return ok

    @classmethod
    def from_config(
        cls, cfg: KVTierConfig, environ: Mapping[str, str] | None = None
    ) -> Signer | None:
        """Build the signer the config asks for; None when no HMAC key is configured.

        A configured but missing or empty key is a startup error (ConfigError
        naming the config key and the variable or file), never a silent switch
        to unsigned chunks. The secret itself never appears in a message.
        """
        env = os.environ if environ is None else environ
        sign_key: bytes | None = None
        if cfg.hmac_key_env:
            sign_key = _env_key(env, "hmac_key_env", cfg.hmac_key_env)
        elif cfg.hmac_key_file:
            sign_key = _file_key("hmac_key_file", cfg.hmac_key_file)
        verify: list[bytes] = []
        if cfg.hmac_verify_keys_env:
            raw = _env_key(env, "hmac_verify_keys_env", cfg.hmac_verify_keys_env)
            verify += [k.strip() for k in raw.split(b",") if k.strip()]
        if cfg.hmac_verify_keys_file:
            raw = _file_key("hmac_verify_keys_file", cfg.hmac_verify_keys_file)
            verify += [k.strip() for k in raw.splitlines() if k.strip()]
        if sign_key is None and not verify:
            return None
        if sign_key is None:
            key = "hmac_verify_keys_env" if cfg.hmac_verify_keys_env else "hmac_verify_keys_file"
            raise ConfigError(
                key,
                getattr(cfg, key),
                "extra verify keys need a signing key too (hmac_key_env or hmac_key_file)",
            )
        return cls(sign_key, verify)


def _env_key(env: Mapping[str, str], cfg_key: str, var: str) -> bytes:
    value = env.get(var, "").strip()
    if not value:
        raise ConfigError(cfg_key, var, "the environment variable it names must be set, non-empty")
    return value.encode()


def _file_key(cfg_key: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            value = f.read().strip()
    except OSError as exc:
        raise ConfigError(cfg_key, path, f"a readable file ({exc.strerror})") from None
    if not value:
        raise ConfigError(cfg_key, path, "a file holding a non-empty key")
    return value


def _canonical(version: int, key: str, dtype: str, shape: list[int], n: int, xxh: bytes) -> bytes:
    """The bytes the signature covers: the header fields in a fixed order, no ``sig``."""
    return msgpack.packb([version, key, dtype, shape, n, xxh], use_bin_type=True)


def encode(
    key: str,
    payload: bytes | bytearray | memoryview,
    *,
    dtype: str,
    shape: Sequence[int],
    signer: Signer | None = None,
) -> list[bytes | memoryview]:
    """Frame ``payload`` as a chunk; returns the parts to write, the payload not copied."""
    view = _payload_view(payload)
    shape_l = [int(d) for d in shape]
    if any(d < 0 for d in shape_l):
        raise ValueError(f"shape {shape_l} has a negative dimension")
    xxh = xxhash.xxh3_128_digest(view)
    header: dict[str, Any] = {
        "v": FORMAT_VERSION,
        "key": key,
        "dtype": dtype,
        "shape": shape_l,
        "len": view.nbytes,
        "xxh": xxh,
    }
    if signer is not None:
        canon = _canonical(FORMAT_VERSION, key, dtype, shape_l, view.nbytes, xxh)
        header["sig"] = signer.sign(canon, view)
    packed = msgpack.packb(header, use_bin_type=True)
    return [_PREFIX.pack(MAGIC, len(packed)) + packed, view]


def encoded_size(parts: Sequence[bytes | memoryview]) -> int:
    """Total bytes of ``parts`` (what a tier will store)."""
    return sum(memoryview(p).nbytes for p in parts)


def _is_int(x: object) -> bool:
    return type(x) is int  # not bool: msgpack's true must not pass for version 1


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
    extra = set(header) - _FIELDS - {"sig"}
    missing = _FIELDS - set(header)
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
        and isinstance(header["xxh"], bytes)
        and len(header["xxh"]) == _XXH_LEN
        and (sig is None and "sig" not in header or isinstance(sig, bytes) and len(sig) == _SIG_LEN)
    ):
        raise CodecError("chunk header has a field of the wrong type")
    return header


def decode(
    blob: bytes | bytearray | memoryview,
    *,
    key: str,
    dtype: str | None = None,
    shape: Sequence[int] | None = None,
    signer: Signer | None = None,
) -> memoryview:
    """Check a stored chunk and return a view of its payload (no copy).

    Raises a :class:`~kvtier.errors.CodecError` subclass for anything that is
    not exactly a chunk for ``key`` (and ``dtype``/``shape`` when given), and
    :class:`~kvtier.errors.SignatureError` when ``signer`` is set and the chunk
    is unsigned or signed with a key it does not accept.
    """
    view = _payload_view(blob)
    total = view.nbytes
    body_at = head_length(view[: _PREFIX.size])
    if total < body_at:
        raise TruncatedError(f"chunk of {total} bytes ends inside its {body_at}-byte header")
    payload = view[body_at:]
    verify(view[:body_at], payload, key=key, dtype=dtype, shape=shape, signer=signer)
    return payload


def head_length(prefix: bytes | bytearray | memoryview) -> int:
    """Bytes before the payload (magic, length, header), from the chunk's first 8 bytes."""
    view = _payload_view(prefix)
    if view.nbytes == 0:
        raise TruncatedError("empty chunk")
    if bytes(view[:4]) != MAGIC[: min(4, view.nbytes)]:
        raise CodecError("not a kvtier chunk (bad magic)")
    if view.nbytes < _PREFIX.size:
        raise TruncatedError(f"chunk of {view.nbytes} bytes is shorter than its prefix")
    _, hlen = _PREFIX.unpack_from(view)
    if hlen > MAX_HEADER:
        raise CodecError(f"chunk header length {hlen} is implausible")
    return _PREFIX.size + hlen


def verify(
    head: bytes | bytearray | memoryview,
    payload: memoryview,
    *,
    key: str,
    dtype: str | None = None,
    shape: Sequence[int] | None = None,
    signer: Signer | None = None,
) -> None:
    """Check a chunk read as its head (magic, length, header) and its payload, where the
    payload already is where it will be used (a host slot): nothing is copied. Raises
    like :func:`decode`; on any error the payload's bytes must not be used."""
    head_v = _payload_view(head)
    body_at = head_length(head_v[: _PREFIX.size])
    if head_v.nbytes < body_at:
        raise TruncatedError(f"chunk ends inside its {body_at}-byte header")
    if head_v.nbytes > body_at:
        raise CodecError("chunk head and payload do not line up")
    header = _parse_header(bytes(head_v[_PREFIX.size : body_at]))
    if header["key"] != key:
        raise KeyMismatchError("object holds a different chunk key than its name")
    if dtype is not None and header["dtype"] != dtype:
        raise CodecError(f"chunk dtype {header['dtype']!r}, expected {dtype!r}")
    if shape is not None and header["shape"] != [int(d) for d in shape]:
        raise CodecError(f"chunk shape {header['shape']}, expected {list(shape)}")
    n = header["len"]
    have = payload.nbytes
    if have < n:
        raise TruncatedError(f"chunk payload has {have} of {n} bytes")
    if have > n:
        raise CodecError(f"chunk has {have - n} bytes after its payload")
    if xxhash.xxh3_128_digest(payload) != header["xxh"]:
        raise ChecksumError("chunk payload does not match its checksum")
    if signer is not None:
        sig = header.get("sig")
        if sig is None:
            raise SignatureError("chunk is not signed but a signing key is configured")
        canon = _canonical(
            header["v"], header["key"], header["dtype"], header["shape"], n, header["xxh"]
        )
        if not signer.verify(canon, payload, sig):
            raise SignatureError("chunk signature does not match any accepted key")
