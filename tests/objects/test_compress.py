"""Lossless compression of object-tier chunks: round trips, mixed tiers, bombs, forgeries."""

from __future__ import annotations

import resource
import struct
import time

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.config import load_config
from kvtier.errors import CodecError, ConfigError, SignatureError, TruncatedError
from kvtier.objects import codec, compress
from kvtier.objects.codec import Signer, crc32_bytes, decode, encode, payload_crc32
from kvtier.objects.compress import Compressor, FormatError, Fp8Compressor
from kvtier.objects.remote import RemoteIO
from kvtier.objects.sealing import Sealer
from kvtier.objects.tiers import FileTier, ObjectTier
from kvtier.objects.tiers.redis import RedisTier
from kvtier.objects.tiers.s3 import S3Tier
from kvtier.ops import OpResult

KEY = "model-x/tp1r0/00ab"
HMAC_KEY = b"k" * 32
DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}
SIGNERS = {
    "plain": lambda: None,
    "hmac": lambda: Signer(HMAC_KEY),
    "sealed": lambda: Signer(sealer=Sealer(b"s" * 32)),
    "sealed+hmac": lambda: Signer(HMAC_KEY, sealer=Sealer(b"s" * 32)),
}


def kv(dtype: str = "bfloat16", n: int = 8192, seed: int = 0) -> bytes:
    """KV-like bytes: K/V values are roughly normal, a few channels much larger."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n // 64, 64, generator=g) * (torch.rand(64, generator=g) * 3 + 0.1)
    if dtype == "uint8":
        t = (x * 20 + 128).clamp(0, 255).to(torch.uint8)
    else:
        t = x.to(DTYPES[dtype])
    return t.view(torch.uint8).numpy().tobytes()


def framed(
    payload: bytes,
    signer: Signer | None = None,
    dtype: str = "bfloat16",
    z: tuple[str, bytes] | None | str = "auto",
    key: str = KEY,
) -> bytes:
    if z == "auto":
        z = Compressor().compress(memoryview(payload), compress.itemsize(dtype))[0], None
        z = ("blosc2", z[0])
    parts = encode(key, payload, dtype=dtype, shape=[len(payload)], signer=signer, compressed=z)
    return b"".join(bytes(p) for p in parts)


def header_of(b: bytes) -> tuple[dict, int]:
    _, hlen = struct.unpack_from("<4sI", b)
    return msgpack.unpackb(b[8 : 8 + hlen]), 8 + hlen


def rebuild(header: dict, payload: bytes) -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    return struct.pack("<4sI", codec.MAGIC, len(packed)) + packed + payload


@pytest.mark.parametrize("how", list(SIGNERS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_round_trip_every_dtype(dtype: str, how: str) -> None:
    raw = kv(dtype)
    signer = SIGNERS[how]()
    b = framed(raw, signer, dtype)
    slot = bytearray(len(raw))
    out = decode(b, key=KEY, dtype=dtype, shape=[len(raw)], signer=signer, out=memoryview(slot))
    assert bytes(out) == raw and bytes(slot) == raw
    if compress.itemsize(dtype) > 1:  # 16- and 32-bit KV: the exponent plane compresses
        assert codec.is_compressed(b[: header_of(b)[1]])
        assert len(b) < 0.95 * len(raw), (dtype, len(b) / len(raw))


def test_incompressible_chunk_is_stored_raw_and_read_without_a_slot() -> None:
    raw = (
        torch.randint(
            0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
        )
        .numpy()
        .tobytes()
    )
    b = framed(raw, dtype="uint8")
    assert not codec.is_compressed(b[: header_of(b)[1]]) and len(b) > len(raw)
    assert bytes(decode(b, key=KEY, dtype="uint8")) == raw


def test_compressed_chunk_needs_a_slot() -> None:
    with pytest.raises(CodecError, match="cannot be decompressed"):
        decode(framed(kv()), key=KEY)


@pytest.mark.parametrize("claimed", [2**31, 8192 * 2 - 2])
def test_bomb_is_refused_before_decompressing(claimed: int) -> None:
    """A stream that says it holds more than the slot (2 GiB, or 2 bytes more) is refused
    from its header; nothing near its claimed size is ever allocated."""
    bomb = (
        Compressor().compress(memoryview(bytes(claimed)), 1)[0]
        if claimed < 2**20
        else (Compressor().compress(memoryview(bytearray(2**20)), 1)[0])
    )
    if claimed >= 2**20:  # forge the claim in blosc2's header (nbytes, little endian, at 4)
        bomb = bomb[:4] + struct.pack("<i", claimed - 1) + bomb[8:]
    b = framed(kv(n=8192), z=("blosc2", bomb))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    slot = memoryview(bytearray(8192 * 2))
    with pytest.raises(CodecError, match="its slot has"):
        decode(b, key=KEY, out=slot)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB


def test_short_stream_and_garbage_stream_are_codec_errors() -> None:
    raw = kv()
    short = Compressor().compress(memoryview(raw[:-2]), 2)[0]
    with pytest.raises(CodecError, match="its slot has"):
        decode(framed(raw, z=("blosc2", short)), key=KEY, out=memoryview(bytearray(len(raw))))
    good = Compressor().compress(memoryview(raw), 2)[0]
    bad = good[:40] + bytes(b ^ 0x5A for b in good[40:])  # header intact, stream garbage
    with pytest.raises(CodecError):
        decode(framed(raw, z=("blosc2", bad)), key=KEY, out=memoryview(bytearray(len(raw))))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_streams_never_escape_as_other_errors(data: st.DataObject) -> None:
    """Mutated compressed streams (with a matching checksum: no key, a writer of the
    bucket) are refused as CodecErrors or decode to exactly the slot's size."""
    raw = kv(n=4096)
    good = bytearray(Compressor().compress(memoryview(raw), 2)[0])
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(good) - 1))
        good[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(16, len(good)))
    slot = memoryview(bytearray(len(raw)))
    try:
        decode(framed(raw, z=("blosc2", bytes(good[:cut]))), key=KEY, out=slot)
    except CodecError:
        pass


@pytest.mark.parametrize("how", ["hmac", "sealed", "sealed+hmac"])
def test_keys_cover_the_compressed_bytes_and_the_form(how: str) -> None:
    raw = kv()
    signer = SIGNERS[how]()
    b = framed(raw, signer)
    header, body_at = header_of(b)
    assert header["z"] == "blosc2" and header["len"] == len(b) - body_at < len(raw)
    slot = memoryview(bytearray(len(raw)))
    # a flipped bit in the compressed stream (with its checksum fixed up when there is one)
    stream = bytearray(b[body_at:])
    stream[len(stream) // 2] ^= 1
    h = dict(header)
    if "crc" in h:
        h["crc"] = crc32_bytes(payload_crc32(bytes(stream)))
    with pytest.raises(SignatureError):
        decode(rebuild(h, bytes(stream)), key=KEY, signer=signer, out=slot)
    # another form name: the HMAC and the AEAD's associated data both cover it
    with pytest.raises(SignatureError):
        decode(rebuild({**header, "z": "blosc3"}, b[body_at:]), key=KEY, signer=signer, out=slot)
    # the form dropped (claimed raw): not the chunk that was signed or sealed
    no_z = {k: v for k, v in header.items() if k != "z"}
    with pytest.raises((SignatureError, TruncatedError)):
        decode(rebuild(no_z, b[body_at:]), key=KEY, signer=signer, out=slot)
    assert bytes(decode(b, key=KEY, signer=signer, out=slot)) == raw


def test_sealed_compressed_payload_is_ciphertext() -> None:
    raw = kv()
    plain, sealed = framed(raw), framed(raw, SIGNERS["sealed"]())
    stream = plain[header_of(plain)[1] :]
    cipher = sealed[header_of(sealed)[1] :]
    assert len(cipher) == len(stream) and cipher != stream  # compressed, then encrypted


def test_unknown_form_is_a_format_miss() -> None:
    raw = kv()
    b = framed(raw, z=("zfp-v9", b"\0" * 100))
    with pytest.raises(FormatError) as err:
        decode(b, key=KEY, out=memoryview(bytearray(len(raw))))
    assert err.value.kind == "format"


def test_engine_without_blosc2_reads_raw_and_misses_compressed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raw = kv()
    b = framed(raw)
    monkeypatch.setattr(compress, "_blosc2", lambda: None)
    with pytest.raises(FormatError, match="not installed"):
        decode(b, key=KEY, out=memoryview(bytearray(len(raw))))
    assert bytes(decode(framed(raw, z=None), key=KEY)) == raw
    with pytest.raises(ConfigError, match="compression"):
        compress.from_config(load_config({"compression": "lossless"}))


def test_config() -> None:
    assert load_config({}).compression == "none"
    assert compress.from_config(load_config({})) is None
    assert compress.from_config(load_config({"compression": "lossless"})) is not None
    with pytest.raises(ConfigError, match="compression.*one of none, lossless"):
        load_config({"compression": "zstd"})


# -- RemoteIO: every tier, a mix of forms, misses counted by kind --------------------------

SHAPE = [16384]


def collect(rio: RemoteIO, n: int, timeout: float = 10.0) -> dict[int, OpResult]:
    out: list[OpResult] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += rio.poll()
        time.sleep(0.002)
    assert len(out) == n, f"expected {n} results, got {out}"
    return {r.op_id: r for r in out}


def make_rio(
    tier: ObjectTier, compressor: Compressor | None, signer: Signer | None = None
) -> RemoteIO:
    return RemoteIO(
        tier, threads=2, queue_depth=16, timeout_s=5.0, signer=signer, compressor=compressor
    )


@pytest.fixture(
    params=[
        "file",
        pytest.param("s3", marks=pytest.mark.integration),
        pytest.param("redis", marks=pytest.mark.integration),
    ]
)
def tier_pair(request, tmp_path) -> tuple[ObjectTier, ObjectTier]:
    """Two clients of one tier (two engines)."""
    if request.param == "file":
        return FileTier(str(tmp_path / "o")), FileTier(str(tmp_path / "o"))
    if request.param == "s3":
        url = request.getfixturevalue("s3_bucket").url
        return S3Tier(url), S3Tier(url)
    url = request.getfixturevalue("redis_url")
    return RedisTier(url), RedisTier(url)


@pytest.mark.parametrize("how", ["plain", "sealed+hmac"])
def test_a_tier_holding_both_forms_is_read_by_every_engine(tier_pair, how: str) -> None:
    """Engine z compresses, engine r does not; each reads what both wrote, bit-exact,
    into its slots (r: a compressed object is too short for its slot, read again whole)."""
    signer = SIGNERS[how]()
    z = make_rio(tier_pair[0], Compressor(), signer)
    r = make_rio(tier_pair[1], None, signer)
    chunks = {f"k{i}": kv(n=16384, seed=i) for i in range(4)}
    for i, (key, data) in enumerate(chunks.items()):
        (z if i % 2 == 0 else r).submit_put(i, key, memoryview(data), dtype="bfloat16", shape=SHAPE)
    assert z.flush(10) == 0 and r.flush(10) == 0
    assert all(x.ok for x in collect(z, 2).values()) and all(x.ok for x in collect(r, 2).values())
    wz, wr = z.take_compression()["write"], r.take_compression()["write"]
    assert wz[0] == 2 * 16384 * 2 and wz[1] < 0.95 * wz[0] and wz[2] > 0
    assert wr[0] == wr[1] == 2 * 16384 * 2 and wr[2] == 0
    try:
        for rio in (z, r):
            slots = {key: memoryview(bytearray(len(d))) for key, d in chunks.items()}
            for i, key in enumerate(chunks):
                rio.submit_get_into(10 + i, key, slots[key], dtype="bfloat16", shape=SHAPE)
            res = collect(rio, len(chunks))
            assert all(x.ok for x in res.values()), res
            assert all(bytes(slots[k]) == d for k, d in chunks.items())
            raw, stored, secs = rio.take_compression()["read"]
            assert raw == 4 * 16384 * 2 and stored < raw and secs > 0
    finally:
        z.close()
        r.close()


def _planted(tier: ObjectTier, key: str, blob: bytes) -> None:
    tier.put(key, [blob])


@pytest.mark.parametrize("compressing", [True, False])
def test_bad_compressed_objects_are_counted_misses(
    tmp_path, compressing: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = FileTier(str(tmp_path / "o"))
    rio = make_rio(tier, Compressor() if compressing else None, Signer(HMAC_KEY))
    raw = kv(n=16384)
    good = framed(raw, Signer(HMAC_KEY), key="cut")
    header, body_at = header_of(good)
    other = framed(raw, Signer(b"o" * 32), key="forged")  # signed with a key this engine lacks
    bomb_stream = Compressor().compress(memoryview(bytes(len(raw) * 4)), 1)[0]
    bomb = framed(raw, z=("blosc2", bomb_stream), key="bomb")
    cases = {
        "cut": (good[:-7], "truncated"),
        "forged": (other, "signature"),
        "bomb": (bomb, "signature"),  # unsigned where a key is set: refused before anything
        "form": (rebuild({**header, "key": "form", "z": "zfp-v9"}, good[body_at:]), "signature"),
    }
    for key, (blob, _) in cases.items():
        _planted(tier, key, blob)
    slots = {key: memoryview(bytearray(len(raw))) for key in cases}
    for i, key in enumerate(cases):
        rio.submit_get_into(i, key, slots[key], dtype="bfloat16", shape=[len(raw)])
    res = collect(rio, len(cases))
    kinds = {key: res[i].error_kind for i, key in enumerate(cases)}
    assert kinds == {key: kind for key, (_, kind) in cases.items()}
    assert not any(r.ok for r in res.values())
    # and a bomb, unsigned, on an engine without keys: refused from its header
    rio.close()
    rio = make_rio(FileTier(str(tmp_path / "o")), Compressor() if compressing else None)
    rio.submit_get_into(9, "bomb", slots["bomb"], dtype="bfloat16", shape=[len(raw)])
    assert collect(rio, 1)[9].error_kind == "malformed"
    # an engine that cannot read the form counts a "format" miss, never raises
    _planted(tier, "ok", framed(raw, key="ok"))
    monkeypatch.setattr(compress, "_blosc2", lambda: None)
    rio.submit_get_into(10, "ok", slots["bomb"], dtype="bfloat16", shape=[len(raw)])
    assert collect(rio, 1)[10].error_kind == "format"
    assert rio.counters()["errors_format"] == 1
    rio.close()


# -- fp8 (lossy, opt-in) ---------------------------------------------------------------

FP8_TOL = {"bfloat16": 2.0**-8, "float16": 2.0**-11}  # half an ulp of the output dtype


def fp8_round_trip(raw: bytes, dtype: str) -> tuple[bytes, bytes]:
    form, stream, _ = Fp8Compressor().compress_chunk(memoryview(raw), dtype)  # type: ignore[misc]
    b = framed(raw, dtype=dtype, z=(form, stream))
    out = memoryview(bytearray(len(raw)))
    decode(b, key=KEY, dtype=dtype, out=out, lossy=True)
    return b, bytes(out)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fp8_round_trip_error_bound_per_element(dtype: str) -> None:
    """Every element within 2^-4 of its magnitude plus 2^-10 of its block's scale (e4m3's
    half ulp, normal and subnormal), plus the output dtype's own rounding: with zeros,
    values far below their block's largest (subnormal in fp8), outlier channels and a
    chunk that ends inside a block."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40_000 - 3, generator=g) * (torch.rand(40_000 - 3, generator=g) * 4)
    x[::97] = 0.0
    x[5::131] *= 1e-4
    x[7::1000] *= 300
    t = x.to(DTYPES[dtype])
    raw = t.view(torch.uint8).numpy().tobytes()
    b, out = fp8_round_trip(raw, dtype)
    assert len(b) < 0.53 * len(raw)  # 1 byte per value + 4 per 128 values + the header
    xs = t.float()
    y = torch.frombuffer(bytearray(out), dtype=DTYPES[dtype]).float()
    n = xs.numel()
    pad = torch.nn.functional.pad(xs.abs(), (0, -n % compress.FP8_BLOCK))
    scale = (pad.view(-1, compress.FP8_BLOCK).amax(1) / 448).repeat_interleave(compress.FP8_BLOCK)[
        :n
    ]
    u = FP8_TOL[dtype]
    bound = xs.abs() * (2**-4 + u * 1.07) + scale * 2**-10 * (1 + u) + 2**-24
    assert bool(((y - xs).abs() <= bound).all()), float(((y - xs).abs() - bound).max())
    assert bool((y[xs == 0] == 0).all())


def test_fp8_leaves_other_dtypes_and_non_finite_kv_raw() -> None:
    c = Fp8Compressor()
    for dtype in ("float8_e4m3fn", "float32", "uint8", "bfloat16*1,float8_e4m3fn*3"):
        assert (
            c.compress_chunk(memoryview(kv(dtype if dtype in DTYPES else "uint8")), dtype) is None
        )
    bad = torch.tensor([1.0, float("inf")] * 64, dtype=torch.bfloat16)
    assert c.compress_chunk(memoryview(bad.view(torch.uint8).numpy().tobytes()), "bfloat16") is None


def test_fp8_streams_that_do_not_fit_their_slot_are_refused() -> None:
    raw = kv(n=4096)
    _, good, _ = Fp8Compressor().compress_chunk(memoryview(raw), "bfloat16")  # type: ignore[misc]
    nan_scale = good[:8] + struct.pack("<f", float("nan")) + good[12:]
    cases = {
        "short": good[:-1],
        "long": good + b"\0",
        "magic": b"XXXX" + good[4:],
        "block": good[:4] + struct.pack("<I", 0) + good[8:],
        "nan": nan_scale,
    }
    for stream in cases.values():
        with pytest.raises(CodecError):
            decode(
                framed(raw, z=("fp8e4m3", stream)),
                key=KEY,
                out=memoryview(bytearray(len(raw))),
                lossy=True,
            )
    with pytest.raises(CodecError, match="only bf16/fp16"):  # an fp8 form on fp32 KV
        decode(
            framed(raw, dtype="float32", z=("fp8e4m3", good)),
            key=KEY,
            out=memoryview(bytearray(len(raw))),
            lossy=True,
        )


def test_fp8_chunks_are_read_only_by_engines_that_chose_fp8(tmp_path) -> None:
    """An fp8 engine's chunks are read (dequantised, within the bound) by another fp8
    engine; an engine with ``none`` or ``lossless`` counts them a ``format`` miss and its
    slot is never reported loaded: lossy KV never reaches an engine that wants exact KV."""
    assert isinstance(compress.from_config(load_config({"compression": "fp8"})), Fp8Compressor)
    w = make_rio(FileTier(str(tmp_path / "o")), Fp8Compressor())
    raw = kv(n=16384)
    w.submit_put(1, "k", memoryview(raw), dtype="bfloat16", shape=SHAPE)
    assert collect(w, 1)[1].ok
    assert w.take_compression()["write"][1] < 0.53 * len(raw)
    expected = fp8_round_trip(raw, "bfloat16")[1]
    for comp in (None, Compressor(), Fp8Compressor()):
        r = make_rio(FileTier(str(tmp_path / "o")), comp)
        slot = memoryview(bytearray(len(raw)))
        r.submit_get_into(2, "k", slot, dtype="bfloat16", shape=SHAPE)
        res = collect(r, 1)[2]
        if isinstance(comp, Fp8Compressor):
            assert res.ok and bytes(slot) == expected
        else:
            assert not res.ok and res.error_kind == "format", res
        r.close()
    w.close()
