"""Encrypted chunks (kvtier.objects.sealing + kvtier.objects.codec): keys, sealing, rejection,
and the tiers."""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack
import pytest

from kvtier import metrics
from kvtier.config import load_config
from kvtier.errors import (
    ChecksumError,
    CodecError,
    ConfigError,
    KeyMismatchError,
    SealedError,
    SignatureError,
)
from kvtier.objects import codec, remote
from kvtier.objects.remote import RemoteIO
from kvtier.objects.sealing import Sealer, key_id, parse_key
from kvtier.objects.tiers import FileTier, ObjectTier
from kvtier.objects.tiers.redis import RedisTier
from kvtier.objects.tiers.s3 import S3Tier

if TYPE_CHECKING:
    from conftest import S3Bucket

KEY = bytes(range(32))
OTHER = bytes(range(100, 132))
HEX = KEY.hex()
B64 = base64.b64encode(KEY).decode()
VAR = "KVTIER_TEST_ENC_KEY"
SHAPE = [2, 8, 256]
N = 2 * 8 * 256 * 2  # bfloat16 bytes
DT = "bfloat16"


def plaintext(seed: int = 1, n: int = N) -> bytes:
    """KV-like bytes: structured, not random, so a leak of them would show."""
    return bytes((seed * 7 + i // 3) % 251 for i in range(n))


def sealed_signer(*keys: bytes, hmac: bytes | None = None) -> codec.Signer:
    return codec.Signer(hmac, sealer=Sealer(keys[0], keys[1:]))


def blob_of(key: str, data: bytes, signer: codec.Signer | None) -> bytes:
    return b"".join(bytes(p) for p in codec.encode(key, data, dtype=DT, shape=SHAPE, signer=signer))


def split(blob: bytes) -> tuple[dict[str, Any], bytes]:
    at = codec.head_length(blob[:8])
    return msgpack.unpackb(blob[8:at], raw=False), blob[at:]


def join(header: dict[str, Any], payload: bytes) -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    return codec.MAGIC + len(packed).to_bytes(4, "little") + packed + payload


def assert_no_window(plain: bytes, stored: bytes, window: int = 4096) -> None:
    """No ``window``-byte run of ``plain`` appears in ``stored``: every such run holds an
    aligned block of half its size, so checking those blocks covers every offset."""
    half = window // 2
    for at in range(0, len(plain) - half + 1, half):
        assert plain[at : at + half] not in stored, f"plaintext bytes {at}..{at + half} stored"


# -- keys -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [HEX, HEX.upper(), B64, B64.rstrip("="), base64.urlsafe_b64encode(KEY).decode(), f"  {HEX}\n"],
)
def test_key_forms(text: str) -> None:
    assert parse_key("encryption_key_env", VAR, text.encode()) == KEY


@pytest.mark.parametrize(
    "text",
    [
        HEX[:-1],  # 63 hex digits
        HEX + "00",  # 33 bytes
        "g" + HEX[1:],
        base64.b64encode(KEY[:31]).decode(),  # 31 bytes
        base64.b64encode(KEY + b"x").decode(),  # 33 bytes
        "correct horse battery staple",  # a passphrase is not a key
        B64[:-2] + "!=",
        "",
        "é" * 64,
    ],
)
def test_anything_else_is_a_config_error_naming_the_key(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_key("encryption_key_env", VAR, text.encode())
    assert err.value.key == "encryption_key_env"
    assert "64 hex characters" in str(err.value) and "base64 of 32 bytes" in str(err.value)
    if len(text) > 8:
        assert text.strip() not in str(err.value) and text.strip() not in repr(err.value.args)


def test_from_config_env_file_and_rotation(tmp_path) -> None:
    keyfile = tmp_path / "key"
    keyfile.write_text(B64 + "\n")
    old = tmp_path / "old"
    old.write_text(f"{OTHER.hex()}\n\n{bytes(32).hex()}\n")
    env = {VAR: HEX, "OLD": f"{OTHER.hex()}, {base64.b64encode(bytes(32)).decode()}"}
    remote_url = f"file://{tmp_path}/t"
    for extra in (
        {"encryption_key_env": VAR, "encryption_decrypt_keys_env": "OLD"},
        {"encryption_key_file": str(keyfile), "encryption_decrypt_keys_file": str(old)},
    ):
        cfg = load_config({"remote_url": remote_url, **extra}, environ={})
        signer = codec.Signer.from_config(cfg, env)
        assert signer is not None and not signer.hmac and signer.sealer is not None
        assert signer.sealer.kid == key_id(KEY)
        assert all(signer.sealer.can_open(key_id(k)) for k in (KEY, OTHER, bytes(32)))
        assert not signer.sealer.can_open(key_id(bytes(range(1, 33))))
    # the KVTIER_* override of the setting itself, like every key
    cfg = load_config({"remote_url": remote_url}, environ={"KVTIER_ENCRYPTION_KEY_ENV": VAR})
    assert cfg.encryption_key_env == VAR
    assert codec.Signer.from_config(cfg, env).sealer.kid == key_id(KEY)  # type: ignore[union-attr]
    # with an HMAC key too, both apply
    cfg = load_config({"hmac_key_env": "H", "encryption_key_env": VAR}, environ={})
    both = codec.Signer.from_config(cfg, {**env, "H": "hmac-key-" + "x" * 24})
    assert both is not None and both.hmac and both.can_sign and both.sealer is not None
    assert codec.Signer.from_config(load_config({}, environ={}), env) is None


@pytest.mark.parametrize(
    ("extra", "env", "bad_key"),
    [
        ({"encryption_key_env": VAR}, {}, "encryption_key_env"),  # not set
        ({"encryption_key_env": VAR}, {VAR: "  "}, "encryption_key_env"),  # empty
        ({"encryption_key_env": VAR}, {VAR: HEX[:32]}, "encryption_key_env"),  # 128 bits
        ({"encryption_key_file": "/nonexistent/kvtier-key"}, {}, "encryption_key_file"),
        ({"encryption_key_file": "EMPTY"}, {}, "encryption_key_file"),
        (
            {"encryption_key_env": VAR, "encryption_decrypt_keys_env": "OLD"},
            {VAR: HEX},
            "encryption_decrypt_keys_env",
        ),
        (
            {"encryption_key_env": VAR, "encryption_decrypt_keys_env": "OLD"},
            {VAR: HEX, "OLD": f"{OTHER.hex()},nope"},
            "encryption_decrypt_keys_env",
        ),
        (
            {"encryption_decrypt_keys_env": "OLD"},
            {"OLD": OTHER.hex()},
            "encryption_decrypt_keys_env",
        ),
    ],
)
def test_a_configured_key_that_is_missing_empty_or_bad_stops_startup(
    tmp_path, extra: dict[str, str], env: dict[str, str], bad_key: str
) -> None:
    if extra.get("encryption_key_file") == "EMPTY":
        (tmp_path / "empty").write_text("\n")
        extra = {"encryption_key_file": str(tmp_path / "empty")}
    cfg = load_config(extra, environ={})
    with pytest.raises(ConfigError) as err:
        codec.Signer.from_config(cfg, env)
    assert err.value.key == bad_key
    for secret in (HEX, HEX[:32], OTHER.hex()):
        assert secret not in str(err.value) and secret not in repr(err.value.__reduce__())


def test_env_and_file_together_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not both") as err:
        load_config({"encryption_key_env": VAR, "encryption_key_file": "/k"}, environ={})
    assert err.value.key == "encryption_key_file"


def test_keys_never_shown(caplog, tmp_path) -> None:
    """Not in repr, the redacted config (what kvtier logs and doctor prints), or errors, even
    when the key itself is pasted where the variable's name belongs."""
    cfg = load_config(
        {"encryption_key_env": "a" + HEX[1:], "remote_url": f"file://{tmp_path}"}, environ={}
    )
    shown = [repr(cfg), str(cfg.redacted())]
    with pytest.raises(ConfigError) as err:
        codec.Signer.from_config(cfg, {})
    shown.append(str(err.value))
    signer = sealed_signer(KEY, OTHER, hmac=b"hmac-secret-value")
    shown += [repr(signer), repr(signer.sealer), str(signer.__slots__)]
    text = "\n".join(shown)
    for secret in (HEX[1:], B64, OTHER.hex(), "hmac-secret-value"):
        assert secret not in text, text


# -- sealing --------------------------------------------------------------------------------


def test_round_trip_hides_the_payload() -> None:
    signer = sealed_signer(KEY)
    data = plaintext()
    blob = blob_of("ns/k1", data, signer)
    header, payload = split(blob)
    assert set(header) == {"v", "key", "dtype", "shape", "len", "kid", "nonce", "tag"}
    assert header["kid"] == key_id(KEY) and len(payload) == len(data)
    assert_no_window(data, blob, window=64)  # much stronger than the 4 KiB asked for
    # the plain chunk does hold it, so the check above can fail
    with pytest.raises(AssertionError):
        assert_no_window(data, blob_of("ns/k1", data, None), window=64)
    assert bytes(codec.decode(blob, key="ns/k1", dtype=DT, shape=SHAPE, signer=signer)) == data
    # a readable blob is opened in place, without a copy
    buf = bytearray(blob)
    view = codec.decode(buf, key="ns/k1", signer=signer)
    assert bytes(view) == data and view.obj is buf


def test_fresh_nonce_per_object_and_the_host_side_stays_plaintext() -> None:
    signer = sealed_signer(KEY)
    data = bytearray(plaintext())
    a, b = blob_of("k", bytes(data), signer), blob_of("k", bytes(data), signer)
    (ha, pa), (hb, pb) = split(a), split(b)
    assert ha["nonce"] != hb["nonce"] and pa != pb and ha["tag"] != hb["tag"]
    parts = codec.encode("k", data, dtype=DT, shape=SHAPE, signer=signer)
    assert bytes(data) == plaintext()  # the host slot is read, never encrypted in place
    assert parts[1] is not data


def test_rotation_old_chunks_open_new_ones_need_the_new_key() -> None:
    old_blob = blob_of("k", plaintext(), sealed_signer(OTHER))
    rotated = sealed_signer(KEY, OTHER)
    assert bytes(codec.decode(old_blob, key="k", signer=rotated)) == plaintext()
    new_blob = blob_of("k", plaintext(2), rotated)
    assert split(new_blob)[0]["kid"] == key_id(KEY)
    with pytest.raises(SealedError):
        codec.decode(new_blob, key="k", signer=sealed_signer(OTHER))


@pytest.mark.parametrize("reader", ["none", "other_key", "hmac_only"])
def test_without_the_key_a_sealed_chunk_is_sealed_error(reader: str) -> None:
    blob = blob_of("k", plaintext(), sealed_signer(KEY, hmac=b"h"))
    signer = {"none": None, "other_key": sealed_signer(OTHER), "hmac_only": codec.Signer(b"h")}
    with pytest.raises(SealedError) as err:
        codec.decode(blob, key="k", signer=signer[reader])
    assert err.value.kind == "sealed"


def test_moved_to_another_name_does_not_open() -> None:
    signer = sealed_signer(KEY)
    blob = blob_of("ns/chunk-a", plaintext(), signer)
    with pytest.raises(KeyMismatchError):  # copied as is: the header names its own key
        codec.decode(blob, key="ns/chunk-b", signer=signer)
    header, payload = split(blob)
    header["key"] = "ns/chunk-b"  # and with the header rewritten to match the new name
    with pytest.raises(SignatureError, match="does not open"):
        codec.decode(join(header, payload), key="ns/chunk-b", signer=signer)


@pytest.mark.parametrize(
    ("field", "value"),
    [("dtype", "float16"), ("shape", [2, 16, 128]), ("nonce", bytes(12)), ("tag", bytes(16))],
)
def test_every_bound_header_field_is_checked(field: str, value: Any) -> None:
    signer = sealed_signer(KEY)
    header, payload = split(blob_of("k", plaintext(), signer))
    header[field] = value
    with pytest.raises(SignatureError):
        codec.decode(join(header, payload), key="k", signer=signer)


def test_one_flipped_byte_anywhere_is_rejected() -> None:
    signer = sealed_signer(KEY)
    blob = blob_of("k", plaintext(), signer)
    at = codec.head_length(blob[:8])
    for pos in [*range(at, len(blob), 509), len(blob) - 1]:
        bad = bytearray(blob)
        bad[pos] ^= 0x01
        with pytest.raises(SignatureError):
            codec.decode(bytes(bad), key="k", signer=signer)
    for pos in range(8, at):  # in the header: never loaded, whatever the field
        bad = bytearray(blob)
        bad[pos] ^= 0x01
        with pytest.raises(CodecError):
            codec.decode(bytes(bad), key="k", signer=signer)


def test_an_unsealed_chunk_is_refused_where_a_key_is_set() -> None:
    plain = blob_of("k", plaintext(), None)
    with pytest.raises(SignatureError, match="not sealed"):
        codec.decode(plain, key="k", signer=sealed_signer(KEY))
    # and a sealed header stripped of its seal is a plain chunk without a checksum
    header, payload = split(blob_of("k", plaintext(), sealed_signer(KEY)))
    for f in ("kid", "nonce", "tag"):
        header.pop(f)
    with pytest.raises(CodecError, match="fields wrong"):
        codec.decode(join(header, payload), key="k")


def test_encryption_and_hmac_combine() -> None:
    """Both set: sealed, then signed over the sealed header and ciphertext; checked in
    that order, so each key is needed."""
    both = sealed_signer(KEY, hmac=b"h1")
    blob = blob_of("k", plaintext(), both)
    header, payload = split(blob)
    assert "sig" in header and "crc" not in header and "xxh" not in header
    assert bytes(codec.decode(blob, key="k", signer=both)) == plaintext()
    assert bytes(codec.decode(blob, key="k", signer=sealed_signer(KEY))) == plaintext()
    with pytest.raises(SignatureError, match="signature"):
        codec.decode(blob, key="k", signer=sealed_signer(KEY, hmac=b"h2"))
    with pytest.raises(SignatureError, match="not signed"):
        codec.decode(blob_of("k", plaintext(), sealed_signer(KEY)), key="k", signer=both)


def test_plain_chunks_are_unchanged() -> None:
    """No key: the format is what it was (a checksum, no seal)."""
    blob = blob_of("k", plaintext(), None)
    header, _ = split(blob)
    assert set(header) == {"v", "key", "dtype", "shape", "len", "crc"}
    bad = bytearray(blob)
    bad[-1] ^= 1
    with pytest.raises(ChecksumError):
        codec.decode(bytes(bad), key="k")


def test_sealed_is_a_counted_error_kind() -> None:
    assert SealedError("x").kind == "sealed"
    assert "sealed" in metrics.ERROR_KINDS and "sealed" in remote.ERROR_KINDS


# -- the three object tiers -----------------------------------------------------------------


@pytest.fixture(params=["file", "s3", "redis"])
def open_tier(request: pytest.FixtureRequest, tmp_path) -> Callable[[], ObjectTier]:
    """Opens a new client of one store (each RemoteIO closes its own)."""
    if request.param == "file":
        return lambda: FileTier(str(tmp_path / "objects"), background_sweep=False)
    if request.param == "s3":
        bucket: S3Bucket = request.getfixturevalue("s3_bucket")
        return lambda: S3Tier(bucket.url)
    url = request.getfixturevalue("redis_url")
    return lambda: RedisTier(url)


def raw_object(tier: ObjectTier, key: str) -> bytes:
    blob = tier.get(key)
    assert blob is not None
    return blob


def stored(open_tier: Callable[[], ObjectTier], key: str) -> bytes:
    with open_tier() as tier:
        return raw_object(tier, key)


@pytest.mark.integration
def test_each_tier_stores_only_ciphertext_and_reads_into_the_slot(
    open_tier: Callable[[], ObjectTier],
) -> None:
    tier = open_tier()
    signer = sealed_signer(KEY)
    data = plaintext(3, 4 << 20)  # a 4 MiB chunk
    shape = [len(data) // 2]
    tier.put("ns/c0", codec.encode("ns/c0", data, dtype=DT, shape=shape, signer=signer))
    tier.put("ns/p0", codec.encode("ns/p0", data, dtype=DT, shape=shape))
    assert_no_window(data, raw_object(tier, "ns/c0"))
    with pytest.raises(AssertionError):
        assert_no_window(data, raw_object(tier, "ns/p0"))
    slot = memoryview(bytearray(len(data)))
    head = tier.read_into("ns/c0", slot, remote.MAX_FRAME)
    assert head is not None and bytes(slot) != data  # ciphertext lands in the slot ...
    codec.verify(head, slot, key="ns/c0", dtype=DT, shape=shape, signer=signer)
    assert bytes(slot) == data  # ... and is opened there
    head = tier.read_into("ns/c0", slot, remote.MAX_FRAME)
    assert head is not None
    with pytest.raises(SealedError):
        codec.verify(head, slot, key="ns/c0", dtype=DT, shape=shape, signer=None)
    tier.close()


def collect(rio: RemoteIO, n: int, timeout: float = 20.0) -> dict[int, Any]:
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += rio.poll()
        time.sleep(0.002)
    assert len(out) == n, out
    return {r.op_id: r for r in out}


@pytest.mark.integration
def test_remote_io_seals_and_counts_what_it_cannot_open(
    open_tier: Callable[[], ObjectTier], caplog: pytest.LogCaptureFixture
) -> None:
    """Through RemoteIO as the worker uses it: a keyless or foreign-key replica misses and
    counts ``sealed``; a tampered object counts ``signature``; nothing leaks to the log."""
    caplog.set_level(logging.DEBUG)
    tier = open_tier()
    data = [plaintext(i) for i in range(3)]
    rio = RemoteIO(tier, threads=2, queue_depth=8, timeout_s=10.0, signer=sealed_signer(KEY))
    for i, d in enumerate(data):
        assert rio.submit_put(i, f"k{i}", memoryview(bytearray(d)), dtype=DT, shape=SHAPE)
    assert rio.flush(20) == 0
    assert all(r.ok for r in collect(rio, 3).values())
    for i in range(3):
        assert_no_window(data[i], stored(open_tier, f"k{i}"), window=64)
    blob = bytearray(stored(open_tier, "k2"))
    blob[-100] ^= 0x80
    with open_tier() as writer:
        writer.put("k2", [bytes(blob)])
    slots = [memoryview(bytearray(N)) for _ in range(3)]
    for i in range(3):
        rio.submit_get_into(10 + i, f"k{i}", slots[i], dtype=DT, shape=SHAPE)
    got = collect(rio, 3)
    assert [got[10 + i].ok for i in range(3)] == [True, True, False]
    assert got[12].error_kind == "signature"
    assert [bytes(s) for s in slots[:2]] == data[:2]
    assert rio.counters()["errors_signature"] == 1
    rio.close(timeout_s=5)
    for signer in (None, sealed_signer(OTHER)):
        other = RemoteIO(open_tier(), threads=2, queue_depth=8, timeout_s=10.0, signer=signer)
        dest = memoryview(bytearray(N))
        other.submit_get_into(1, "k0", dest, dtype=DT, shape=SHAPE)
        res = collect(other, 1)[1]
        assert not res.ok and res.error_kind == "sealed"
        assert other.counters()["errors_sealed"] == 1
        assert bytes(dest) != data[0]
        other.close(timeout_s=5)
    for secret in (HEX, B64):
        assert secret not in caplog.text
    assert "rejected (sealed)" in caplog.text  # the rejection is logged, by kind
