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

A **sealed** chunk (an encryption key is configured, see :mod:`kvtier.objects.seal`)
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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import xxhash  # the checksum of chunks written before CRC-32

from kvtier.errors import (
    ChecksumError,
    CodecError,
    KeyMismatchError,
    SealedError,
    SignatureError,
    TruncatedError,
)
from kvtier.objects.checksum import crc32_bytes, payload_crc32
from kvtier.objects.codec_header import (
    _FORM_MAX,
    _PREFIX,
    FORMAT_VERSION,
    MAGIC,
    MAX_HEADER,
    _aad,
    _canonical,
    _header,
    _packb,
    _parse_header,
    _payload_view,
    encoded_size,
    head_length,
    is_compressed,
)
from kvtier.objects.codec_signer import HMAC_KEY_MIN_BYTES, Signer
from kvtier.objects.compress import LOSSY_FORMS, FormatError, ThreadScratch, decompress_into
from kvtier.objects.seal import Seal

# the frame (codec_header.py) and the keys (codec_signer.py): their public names are read
# from here too
__all__ = [
    "FORMAT_VERSION", "HMAC_KEY_MIN_BYTES", "MAGIC", "MAX_HEADER", "SignatureError", "Signer",
    "decode", "encode", "encoded_size", "head_length", "is_compressed", "verify",
]  # fmt: skip

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
        if _PREFIX.size + len(_packb(probe)) + stream.nbytes < (
            view.nbytes + _PREFIX.size
        ):
            view = stream
        else:
            form = None
    n = view.nbytes
    header: dict[str, Any] = {"v": FORMAT_VERSION, "key": key, "dtype": dtype, "shape": shape_l,
                              "len": n}  # fmt: skip
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
    header = _parse_header(bytes(view[_PREFIX.size : body_at]))
    compressed = "z" in header
    if payload.readonly and "nonce" in header:  # a sealed chunk opens in place: where?
        if out is not None and compressed:  # only decompressed from: a reused buffer
            if payload.nbytes > out.nbytes:  # never stored: a compressed form is shorter
                raise CodecError(f"compressed chunk of {payload.nbytes} bytes is longer than "
                                 f"its {out.nbytes}-byte slot")  # fmt: skip
            scratch = _OPEN_SCRATCH.view(payload.nbytes)
            scratch[:] = payload
            payload = scratch
        elif out is not None and out.nbytes == payload.nbytes:  # in the caller's slot
            out[:] = payload
            payload = out
        else:  # the caller keeps the plaintext
            payload = memoryview(bytearray(payload))
    verify(view[:body_at], payload, key=key, dtype=dtype, shape=shape, signer=signer, out=out,
           lossy=lossy)
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
    header = _parse_header(bytes(head_v[_PREFIX.size : body_at]))
    if header["key"] != key:
        raise KeyMismatchError("object holds a different chunk key than its name")
    if dtype is not None and header["dtype"] != dtype:
        raise CodecError(f"chunk dtype {header['dtype']!r}, expected {dtype!r}")
    if shape is not None and header["shape"] != [int(d) for d in shape]:
        raise CodecError(f"chunk shape {header['shape']}, expected {list(shape)}")
    form: str | None = header.get("z")
    if form in LOSSY_FORMS and not lossy:
        raise FormatError(f"chunk is stored in the lossy form {form!r}, which an engine reads "
                          "only with compression: fp8")  # fmt: skip
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
