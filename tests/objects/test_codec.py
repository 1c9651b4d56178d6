"""The chunk format: round trips, every malformation, signing, and fuzzing."""

from __future__ import annotations

import struct
import time
import zlib

import msgpack
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import xxh3_framed

from kvtier.config import load_config
from kvtier.errors import (
    ChecksumError,
    CodecError,
    ConfigError,
    KeyMismatchError,
    SignatureError,
    TruncatedError,
)
from kvtier.objects import codec
from kvtier.objects.codec import Signer, crc32_bytes, decode, encode, payload_crc32
from kvtier.objects.remote import RemoteIO
from kvtier.objects.tiers.base import ObjectTier
from kvtier.ops import OpResult

PAYLOAD = bytes(range(256)) * 16
KEY = "model-x/tp1r0/00ab"


def blob(payload: bytes = PAYLOAD, key: str = KEY, signer: Signer | None = None, **kw) -> bytes:
    kw.setdefault("dtype", "bfloat16")
    kw.setdefault("shape", [2, len(payload) // 4])
    return b"".join(bytes(p) for p in encode(key, payload, signer=signer, **kw))


def header_of(b: bytes) -> tuple[dict, int]:
    _, hlen = struct.unpack_from("<4sI", b)
    return msgpack.unpackb(b[8 : 8 + hlen]), hlen


def rebuild(header: dict, payload: bytes) -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    return struct.pack("<4sI", codec.MAGIC, len(packed)) + packed + payload


def test_round_trip_no_copy() -> None:
    src = bytearray(PAYLOAD)
    parts = encode(KEY, memoryview(src), dtype="bfloat16", shape=[2, 1024])
    assert parts[1].obj is src  # the payload part is a view, not a copy
    out = decode(b"".join(bytes(p) for p in parts), key=KEY, dtype="bfloat16", shape=(2, 1024))
    assert isinstance(out, memoryview) and bytes(out) == PAYLOAD


def test_round_trip_empty_and_typed_views() -> None:
    assert bytes(decode(blob(b"", shape=[0]), key=KEY)) == b""
    typed = memoryview(bytearray(64)).cast("f")  # a float32 view is framed as its bytes
    b = b"".join(bytes(p) for p in encode(KEY, typed, dtype="float32", shape=[16]))
    assert decode(b, key=KEY, dtype="float32", shape=[16]).nbytes == 64


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), ChecksumError),  # flipped payload byte
        (lambda b: b[:-100], TruncatedError),
        (lambda b: b[:20], TruncatedError),  # ends inside the header
        (lambda b: b[:6], TruncatedError),  # ends inside the prefix
        (lambda b: b"", TruncatedError),
        (lambda b: b + b"x", CodecError),  # trailing bytes
        (lambda b: b"XXXX" + b[4:], CodecError),  # bad magic
        (lambda b: b"\x00" * len(b), CodecError),
        (lambda b: b[:8] + b"\xc1" * (len(b) - 8), CodecError),  # garbage header
        (lambda b: b[:4] + struct.pack("<I", 2**31) + b[8:], CodecError),  # absurd header length
    ],
)
def test_malformed_chunks(mutate, error) -> None:
    with pytest.raises(error):
        decode(mutate(blob()), key=KEY, dtype="bfloat16", shape=[2, 1024])


def test_wrong_key() -> None:
    with pytest.raises(KeyMismatchError):
        decode(blob(key="other"), key=KEY)


def test_unknown_version() -> None:
    header, _ = header_of(blob())
    header["v"] = codec.FORMAT_VERSION + 1
    with pytest.raises(CodecError, match="version"):
        decode(rebuild(header, PAYLOAD), key=KEY)
    header["v"] = True  # msgpack true == 1 in Python; still not a version
    with pytest.raises(CodecError, match="version"):
        decode(rebuild(header, PAYLOAD), key=KEY)


@pytest.mark.parametrize(
    "change",
    [
        {"extra": 1},
        {"len": "4096"},
        {"shape": [2, -1]},
        {"crc": b"short"},
        {"crc": 12345},
        {"xxh": bytes(16)},  # both checksums: neither format
        {"sig": b"x" * 5},
        {"key": b"model-x/tp1r0/00ab"},
    ],
)
def test_header_fields_are_strict(change: dict) -> None:
    header, _ = header_of(blob())
    header.update(change)
    with pytest.raises(CodecError):
        decode(rebuild(header, PAYLOAD), key=KEY)


def test_dtype_and_shape_mismatch() -> None:
    b = blob()
    with pytest.raises(CodecError, match="dtype"):
        decode(b, key=KEY, dtype="float16")
    with pytest.raises(CodecError, match="shape"):
        decode(b, key=KEY, shape=[1024, 2])
    decode(b, key=KEY)  # not asked, not checked


def test_checksum_lie_in_header() -> None:
    header, _ = header_of(blob())
    header["crc"] = bytes(4)
    with pytest.raises(ChecksumError):
        decode(rebuild(header, PAYLOAD), key=KEY)


def test_the_checksum_is_zlibs_crc32_of_the_payload_and_catches_a_flipped_bit() -> None:
    header, _ = header_of(blob())
    assert set(header) == {"v", "key", "dtype", "shape", "len", "crc"}
    assert header["crc"] == zlib.crc32(PAYLOAD).to_bytes(4, "big")
    # computed piece by piece as a tier reads a payload: the same value
    crc = 0
    for at in range(0, len(PAYLOAD), 1000):
        crc = payload_crc32(PAYLOAD[at : at + 1000], crc)
    assert crc32_bytes(crc) == header["crc"]
    for bit in (0, 7, 8 * len(PAYLOAD) - 1):
        bad = bytearray(PAYLOAD)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(ChecksumError):
            decode(rebuild(header, bytes(bad)), key=KEY)
        assert (
            codec.verify(
                blob()[: len(blob()) - len(PAYLOAD)],
                memoryview(PAYLOAD),
                key=KEY,
                payload_crc=zlib.crc32(PAYLOAD),
            )
            == 0.0
        )
        with pytest.raises(ChecksumError):  # a checksum computed while reading the bad bytes
            codec.verify(
                blob()[: len(blob()) - len(PAYLOAD)],
                memoryview(bytes(bad)),
                key=KEY,
                payload_crc=zlib.crc32(bad),
            )


def _xxh3_chunk(payload: bytes, signer: Signer | None = None) -> bytes:
    """A chunk as kvtier framed it before CRC-32: an ``xxh`` field, its xxh3-128."""
    return b"".join(
        xxh3_framed(KEY, payload, dtype="bfloat16", shape=[2, len(payload) // 4], signer=signer)
    )


def test_chunks_written_with_an_xxh3_checksum_are_still_read_and_checked() -> None:
    assert bytes(decode(_xxh3_chunk(PAYLOAD), key=KEY)) == PAYLOAD
    signed = _xxh3_chunk(PAYLOAD, Signer(K1))
    assert bytes(decode(signed, key=KEY, signer=Signer(K1))) == PAYLOAD
    with pytest.raises(SignatureError):
        decode(signed, key=KEY, signer=Signer(K2))
    header, _ = header_of(_xxh3_chunk(PAYLOAD))
    bad = bytearray(PAYLOAD)
    bad[100] ^= 4
    with pytest.raises(ChecksumError):
        decode(rebuild(header, bytes(bad)), key=KEY)
    # a CRC-32 handed in by the reader does not stand in for the xxh3 this chunk carries
    head = _xxh3_chunk(PAYLOAD)[: -len(PAYLOAD)]
    with pytest.raises(ChecksumError):
        codec.verify(head, memoryview(bytes(bad)), key=KEY, payload_crc=zlib.crc32(PAYLOAD))
    # the field's length is the algorithm's: a 4-byte xxh or a 16-byte crc is no chunk
    for field, n in (("xxh", 4), ("crc", 16)):
        h = {k: v for k, v in header.items() if k != "xxh"}
        h[field] = bytes(n)
        with pytest.raises(CodecError, match="wrong type"):
            decode(rebuild(h, PAYLOAD), key=KEY)


def test_a_signature_over_a_crc_chunk_does_not_carry_over_to_an_xxh3_header() -> None:
    """The signed canonical bytes hold the checksum: swapping the checksum kind (with a
    checksum valid for the payload) breaks the signature."""
    signed = blob(signer=Signer(K1))
    header, _ = header_of(signed)
    swapped = {k: v for k, v in header.items() if k != "crc"}
    swapped["xxh"] = xxhash.xxh3_128_digest(PAYLOAD)
    assert bytes(decode(rebuild(swapped, PAYLOAD), key=KEY)) == PAYLOAD  # unsigned reader
    with pytest.raises(SignatureError):
        decode(rebuild(swapped, PAYLOAD), key=KEY, signer=Signer(K1))


K1, K2, K3 = b"key-one-secret", b"key-two-secret", b"key-three-secret"


def test_signed_round_trip_and_wrong_key() -> None:
    signed = blob(signer=Signer(K1))
    assert bytes(decode(signed, key=KEY, signer=Signer(K1))) == PAYLOAD
    with pytest.raises(SignatureError):
        decode(signed, key=KEY, signer=Signer(K2))


def test_unsigned_rejected_when_key_set_and_signed_accepted_without() -> None:
    with pytest.raises(SignatureError, match="not signed"):
        decode(blob(), key=KEY, signer=Signer(K1))
    assert bytes(decode(blob(signer=Signer(K1)), key=KEY)) == PAYLOAD


def test_rotation() -> None:
    old_chunk = blob(signer=Signer(K1))
    rotated = Signer(K2, verify_keys=[K1])
    new_chunk = blob(signer=rotated)
    assert bytes(decode(old_chunk, key=KEY, signer=rotated)) == PAYLOAD
    assert bytes(decode(new_chunk, key=KEY, signer=rotated)) == PAYLOAD
    with pytest.raises(SignatureError):
        decode(new_chunk, key=KEY, signer=Signer(K1))  # not-yet-rotated reader
    with pytest.raises(SignatureError):
        decode(blob(signer=Signer(K3)), key=KEY, signer=rotated)


def test_signature_covers_header_and_payload() -> None:
    signer = Signer(K1)
    header, _ = header_of(blob(signer=signer))
    forged = blob(b"\x00" * len(PAYLOAD), signer=Signer(K2))  # valid checksum, foreign sig
    fh, _ = header_of(forged)
    fh["sig"] = header["sig"]  # transplant a genuine signature onto other content
    with pytest.raises(SignatureError):
        decode(rebuild(fh, b"\x00" * len(PAYLOAD)), key=KEY, signer=signer)
    header["dtype"] = "float16"  # edit a signed header field
    with pytest.raises(SignatureError):
        decode(rebuild(header, PAYLOAD), key=KEY, signer=signer)


def test_signer_repr_has_no_secret() -> None:
    assert "key-one" not in repr(Signer(K1, [K2]))
    with pytest.raises(ValueError):
        Signer(None)


def test_signer_from_config(tmp_path) -> None:
    pad = "-" + "x" * 24  # HMAC keys from config are at least 32 bytes
    assert Signer.from_config(load_config({}, environ={}), environ={}) is None
    cfg = load_config({"hmac_key_env": "MY_KEY", "hmac_verify_keys_env": "OLD_KEYS"}, environ={})
    env = {"MY_KEY": f"k2-secret{pad}\n", "OLD_KEYS": f"k1-secret{pad}, k0-secret{pad}"}
    s = Signer.from_config(cfg, environ=env)
    chunk = blob(signer=Signer(f"k0-secret{pad}".encode()))
    assert bytes(decode(chunk, key=KEY, signer=s)) == PAYLOAD
    key_file = tmp_path / "hmac.key"
    key_file.write_text(f"file-secret{pad}\n")
    verify_file = tmp_path / "old.keys"
    verify_file.write_text(f"a-secret{pad}\n\nb-secret{pad}\n")
    cfg = load_config(
        {"hmac_key_file": str(key_file), "hmac_verify_keys_file": str(verify_file)}, environ={}
    )
    s = Signer.from_config(cfg, environ={})
    for key in (f"b-secret{pad}", f"file-secret{pad}"):
        assert bytes(decode(blob(signer=Signer(key.encode())), key=KEY, signer=s)) == PAYLOAD


@pytest.mark.parametrize(
    ("extra", "env", "names"),
    [
        ({"hmac_key_env": "UNSET_VAR"}, {}, "hmac_key_env"),
        ({"hmac_key_env": "EMPTY"}, {"EMPTY": "  "}, "hmac_key_env"),
        ({"hmac_key_file": "/nonexistent/kvtier.key"}, {}, "hmac_key_file"),
        (
            {"hmac_key_env": "K", "hmac_verify_keys_env": "NOPE"},
            {"K": "x" * 32},
            "hmac_verify_keys_env",
        ),
        ({"hmac_verify_keys_env": "V"}, {"V": "the-secret"}, "hmac_verify_keys_env"),
    ],
)
def test_signer_config_errors_name_the_key_not_the_secret(extra, env, names) -> None:
    with pytest.raises(ConfigError) as info:
        Signer.from_config(load_config(extra, environ={}), environ=env)
    assert info.value.key == names
    assert "the-secret" not in str(info.value)


def test_empty_key_file(tmp_path) -> None:
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="hmac_key_file"):
        Signer.from_config(load_config({"hmac_key_file": str(empty)}, environ={}), environ={})


# -- fuzzing -------------------------------------------------------------------------------
#
# Every decode below asks for the dtype and shape the blob really has, and each test first
# checks that the undamaged blob decodes under exactly that call: a rejection must come from
# the damage (checksum, signature, framing), never from a mismatch the test itself set up.

SIGNER = Signer(K1)
FUZZ_PAYLOAD = bytes(range(200))
FUZZ_SHAPE = [2, 50]
SIGNED = blob(FUZZ_PAYLOAD, signer=SIGNER, shape=FUZZ_SHAPE)
UNSIGNED = blob(FUZZ_PAYLOAD, shape=FUZZ_SHAPE)
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))


def _decode(b: bytes, signer: Signer | None) -> memoryview:
    return decode(b, key=KEY, dtype="bfloat16", shape=FUZZ_SHAPE, signer=signer)


def test_fuzz_bases_decode() -> None:
    """The fuzz tests' baselines are valid chunks under the very calls the fuzzers make."""
    assert bytes(_decode(SIGNED, SIGNER)) == FUZZ_PAYLOAD
    assert bytes(_decode(SIGNED, None)) == FUZZ_PAYLOAD
    assert bytes(_decode(UNSIGNED, None)) == FUZZ_PAYLOAD
    with pytest.raises(SignatureError):
        _decode(UNSIGNED, SIGNER)


def _decode_all_ways(b: bytes) -> None:
    """Every decode of a damaged blob must end in a CodecError subclass."""
    for signer in (None, SIGNER):
        try:
            _decode(b, signer)
        except CodecError:
            continue
        raise AssertionError("a damaged chunk decoded")


@FUZZ
@given(st.binary(max_size=600))
def test_fuzz_random_blobs(data: bytes) -> None:
    for candidate in (
        data,
        codec.MAGIC + data,
        UNSIGNED[:8] + data,
        SIGNED[: len(SIGNED) - 200] + data,
    ):
        for signer in (None, SIGNER):
            try:
                out = _decode(candidate, signer)
            except CodecError:
                continue
            # only the genuine payload behind the genuine header can pass
            assert candidate in (SIGNED, UNSIGNED) and bytes(out) == FUZZ_PAYLOAD


@st.composite
def mutations(draw, base: bytes) -> bytes:
    b = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "delete", "insert", "truncate", "swap"]))
        if not b:
            break
        i = draw(st.integers(0, len(b) - 1))
        if op == "flip":
            b[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            b[i] = draw(st.integers(0, 255).filter(lambda v, old=b[i]: v != old))
        elif op == "delete":
            del b[i : i + draw(st.integers(1, 8))]
        elif op == "insert":
            b[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "truncate":
            del b[i:]
        else:
            j = draw(st.integers(0, len(b) - 1))
            b[i], b[j] = b[j], b[i]
    return bytes(b)


@FUZZ
@given(mutations(SIGNED))
def test_fuzz_mutated_signed_blob(b: bytes) -> None:
    if b == SIGNED:
        return
    try:
        _decode(b, SIGNER)
    except CodecError:
        return
    raise AssertionError("a mutated signed chunk decoded")


@FUZZ
@given(mutations(UNSIGNED))
def test_fuzz_mutated_unsigned_blob(b: bytes) -> None:
    if b == UNSIGNED:
        return
    _decode_all_ways(b)


_ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=40),
    st.lists(st.integers(-5, 300), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(-5, 5), max_size=2),
)


@FUZZ
@given(
    st.sampled_from(["v", "key", "dtype", "shape", "len", "crc", "xxh", "sig", "extra"]),
    st.one_of(st.just("delete"), _ANY_VALUE),
    st.sampled_from(["signed", "unsigned"]),
)
def test_fuzz_header_fields(field: str, value: object, which: str) -> None:
    """Well-formed msgpack, one header field changed, removed or added: a signed reader
    loads nothing; a reader without a key loads only a chunk whose header still says
    exactly what the original said (an unsigned chunk carries no secret to protect)."""
    base = SIGNED if which == "signed" else UNSIGNED
    header, _ = header_of(base)
    original = dict(header)
    if value == "delete":
        header.pop(field, None)
    else:
        header[field] = value
    mutated = rebuild(header, FUZZ_PAYLOAD)
    if header == original:
        return
    try:
        _decode(mutated, SIGNER)
    except CodecError:
        pass
    else:
        raise AssertionError(f"a chunk with header {header!r} decoded under the signing key")
    try:
        out = _decode(mutated, None)
    except CodecError:
        return
    # without a key, dropping or replacing only the signature is not detectable by design
    assert {k: v for k, v in header.items() if k != "sig"} == {
        k: v for k, v in original.items() if k != "sig"
    }, header
    assert bytes(out) == FUZZ_PAYLOAD


class _OneBlobTier(ObjectTier):
    """An object tier that answers every get with one fixed blob."""

    name = "file"

    def __init__(self) -> None:
        self.blob = b""

    def exists(self, keys):  # pragma: no cover - not used
        return [True for _ in keys]

    def get(self, key, max_bytes=None):
        return self.blob

    def put(self, key, parts):  # pragma: no cover - not used
        raise AssertionError("no writes here")

    def delete(self, keys):  # pragma: no cover - not used
        pass

    def close(self):
        pass


@pytest.fixture(scope="module")
def fuzz_rio():
    tier = _OneBlobTier()
    rio = RemoteIO(tier, threads=2, queue_depth=4, timeout_s=10.0, signer=SIGNER)
    yield rio
    rio.close()


def _fetch(rio: RemoteIO, blob_bytes: bytes) -> tuple[OpResult, bytes]:
    rio.tier.blob = blob_bytes
    dest = bytearray(b"\xee" * len(FUZZ_PAYLOAD))
    rio.submit_get_into(1, KEY, memoryview(dest), dtype="bfloat16", shape=FUZZ_SHAPE)
    deadline = time.monotonic() + 10
    results: list[OpResult] = []
    while not results and time.monotonic() < deadline:
        results = rio.poll()
        time.sleep(0.0005)
    assert len(results) == 1, results
    return results[0], bytes(dest)


def test_fetch_of_genuine_chunk_loads(fuzz_rio: RemoteIO) -> None:
    res, dest = _fetch(fuzz_rio, SIGNED)
    assert res.ok and res.error_kind is None and dest == FUZZ_PAYLOAD


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(mutations(SIGNED), mutations(UNSIGNED), st.binary(max_size=400)))
def test_fuzz_fetch_never_loads(fuzz_rio: RemoteIO, b: bytes) -> None:
    """Through the I/O path the worker uses: a damaged object is reported as one of the
    defined error kinds, never as a good chunk. (Its bytes may have been read into the
    slot, which is verified in place: a failed fetch's slot is freed, never loaded.)"""
    if b == SIGNED:
        return
    res, _dest = _fetch(fuzz_rio, b)
    assert not res.ok, "a damaged chunk was loaded"
    assert res.error_kind in {"checksum", "truncated", "signature", "wrong_key", "malformed"}, res
