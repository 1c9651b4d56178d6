"""fp8 (lossy, opt-in) on edge values: property tests of the error bound and the refusals.

Values are drawn as bit patterns of bf16 and fp16, so blocks hold subnormals, signed
zeros, the dtypes' largest values and mixes of magnitudes far apart; every finite chunk
must come back within the documented bound (2^-4 of each magnitude plus 2^-10 of its
block's scale, plus half an ulp of the output dtype), zeros bit-exact, signs kept, every
value finite. Chunks with inf or NaN are stored raw. A stream no compressor writes (a
NaN code, a scale that is not positive or would carry values past the dtype's range) is
refused, so whatever an fp8 read puts in a slot is finite.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvtier.errors import CodecError
from kvtier.objects.compress import FP8_BLOCK, Fp8Compressor, decompress_into

TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16}
MANTISSA = {"bfloat16": 7, "float16": 10}
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))


@st.composite
def finite_chunks(draw: st.DrawFn) -> tuple[str, list[int]]:
    """(dtype, bit patterns): finite values whose exponents spread around a base, from
    all subnormal to the dtype's largest, any length (a short last block too)."""
    dtype = draw(st.sampled_from(sorted(TORCH)))
    m = MANTISSA[dtype]
    emax = (1 << (15 - m)) - 2  # the largest finite exponent field
    base = draw(st.integers(0, emax))
    spread = draw(st.integers(0, emax))
    n = draw(st.integers(1, 3 * FP8_BLOCK + 5))
    el = st.tuples(
        st.integers(0, 1),
        st.integers(max(0, base - spread), min(emax, base + spread)),
        st.integers(0, (1 << m) - 1),
    )
    return dtype, [
        (s << 15) | (e << m) | f for s, e, f in draw(st.lists(el, min_size=n, max_size=n))
    ]


def as_tensor(dtype: str, bits: list[int]) -> torch.Tensor:
    return torch.tensor([b - 65536 if b > 32767 else b for b in bits], dtype=torch.int16).view(
        TORCH[dtype]
    )


def round_trip(x: torch.Tensor, dtype: str) -> tuple[bytes, torch.Tensor] | None:
    raw = x.view(torch.uint8).numpy().tobytes()
    got = Fp8Compressor().compress_chunk(memoryview(raw), dtype)
    if got is None:
        return None
    out = bytearray(len(raw))
    decompress_into(got[0], memoryview(got[1]), memoryview(out), dtype)
    return got[1], torch.frombuffer(out, dtype=TORCH[dtype])


def reference(stream: bytes, n: int, dtype: str) -> torch.Tensor:
    """The stream dequantised the plain way: every code times its block's scale."""
    _, block = struct.unpack_from("<4sI", stream)
    nb = math.ceil(n / block)
    scale = torch.frombuffer(bytearray(stream[8 : 8 + 4 * nb]), dtype=torch.float32)
    q = torch.frombuffer(bytearray(stream[8 + 4 * nb :]), dtype=torch.float8_e4m3fn)
    return (q.float() * scale.repeat_interleave(block)[:n]).to(TORCH[dtype])


def stream_of(block: int, scales: list[float], codes: bytes) -> bytes:
    return struct.pack("<4sI", b"F8E4", block) + struct.pack(f"<{len(scales)}f", *scales) + codes


@SETTINGS
@given(finite_chunks())
@example(("bfloat16", [0] * 300))  # all zero
@example(("float16", [0x8000] * 130))  # all -0
@example(("bfloat16", [0x7F7F, 0xFF7F, 1, 0x8001] * 40))  # bf16's largest and smallest
@example(("float16", [0x7BFF, 0xFBFF, 1, 0x8001, 0x0400] * 40))  # fp16's largest, smallest
@example(("bfloat16", [1, 2, 3, 0x7F] * 32))  # a block of bf16 subnormals only
def test_fp8_error_bound_on_any_finite_values(chunk: tuple[str, list[int]]) -> None:
    dtype, bits = chunk
    x = as_tensor(dtype, bits)
    got = round_trip(x, dtype)
    assert got is not None
    stream, y = got
    assert torch.equal(y.view(torch.int16), reference(stream, x.numel(), dtype).view(torch.int16))
    xf, yf = x.float(), y.float()
    assert bool(torch.isfinite(yf).all())
    n = xf.numel()
    amax = torch.nn.functional.pad(xf.abs(), (0, -n % FP8_BLOCK)).view(-1, FP8_BLOCK).amax(1)
    scale = (amax / 448).repeat_interleave(FP8_BLOCK)[:n]
    fi = torch.finfo(TORCH[dtype])
    half_ulp = torch.clamp(yf.abs(), min=fi.smallest_normal) * fi.eps / 2
    bound = xf.abs() * 2**-4 + scale * 2**-10 + half_ulp * 1.0001
    err = (yf - xf).abs()
    assert bool((err <= bound).all()), (xf[err > bound][:4], yf[err > bound][:4])
    zero = xf == 0
    assert torch.equal(x.view(torch.int16)[zero], y.view(torch.int16)[zero])  # -0 stays -0
    assert bool(((yf == 0) | (yf.sign() == xf.sign())).all())


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(finite_chunks(), st.data())
def test_fp8_chunks_holding_inf_or_nan_are_stored_raw(
    chunk: tuple[str, list[int]], data: st.DataObject
) -> None:
    dtype, bits = chunk
    m = MANTISSA[dtype]
    at = data.draw(st.integers(0, len(bits) - 1))
    frac = data.draw(st.integers(0, (1 << m) - 1))  # 0: inf, else NaN
    bits[at] = (data.draw(st.integers(0, 1)) << 15) | (((1 << (15 - m)) - 1) << m) | frac
    assert round_trip(as_tensor(dtype, bits), dtype) is None


@pytest.mark.parametrize("dtype", sorted(TORCH))
@pytest.mark.parametrize("n", [1, FP8_BLOCK, 5 * FP8_BLOCK + 1, 40_000])
def test_fp8_all_zero_chunks_round_trip_exactly(dtype: str, n: int) -> None:
    for z in (torch.zeros(n), -torch.zeros(n)):
        x = z.to(TORCH[dtype])
        got = round_trip(x, dtype)
        assert got is not None
        stream, y = got
        assert torch.equal(y.view(torch.int16), x.view(torch.int16))
        nb = math.ceil(n / FP8_BLOCK)
        assert struct.unpack_from(f"<{nb}f", stream, 8) == (1.0,) * nb


@pytest.mark.parametrize("dtype", sorted(TORCH))
def test_fp8_blocks_longer_than_a_work_slice_read_in_parts(dtype: str) -> None:
    """A stream with blocks longer than the work slice (a header may say up to 2^20) is
    dequantised like any other, in parts of one block."""
    n, block = 100_000, 40_000
    g = torch.Generator().manual_seed(3)
    codes = (torch.randn(n, generator=g) * 50).to(torch.float8_e4m3fn)
    stream = stream_of(block, [0.5, 2.0**-12, 3.0], codes.view(torch.uint8).numpy().tobytes())
    out = bytearray(2 * n)
    decompress_into("fp8e4m3", memoryview(stream), memoryview(out), dtype)
    y = torch.frombuffer(out, dtype=TORCH[dtype])
    assert torch.equal(y.view(torch.int16), reference(stream, n, dtype).view(torch.int16))


@pytest.mark.parametrize("dtype", sorted(TORCH))
@pytest.mark.parametrize(
    "case",
    ["nan code", "-nan code", "zero scale", "negative scale", "inf scale", "scale past range"],
)
def test_fp8_streams_no_compressor_writes_are_refused(dtype: str, case: str) -> None:
    """A NaN code or a scale past the dtype's range put NaN or inf into the slot before
    these checks; a zero or negative scale (zeroed or sign-flipped blocks) is as foreign."""
    n = 3 * FP8_BLOCK
    codes = bytearray((torch.randn(n) * 50).to(torch.float8_e4m3fn).view(torch.uint8).numpy())
    scales = [0.25, 1.0, 2.0]
    too_big = float(torch.finfo(TORCH[dtype]).max) / 448 * 1.01
    if case == "nan code":
        codes[200] = 0x7F
    elif case == "-nan code":
        codes[n - 1] = 0xFF
    else:
        scales[1] = {
            "zero scale": 0.0,
            "negative scale": -1.0,
            "inf scale": math.inf,
            "scale past range": too_big,
        }[case]
    with pytest.raises(CodecError):
        decompress_into(
            "fp8e4m3",
            memoryview(stream_of(FP8_BLOCK, scales, bytes(codes))),
            memoryview(bytearray(2 * n)),
            dtype,
        )


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.sampled_from(sorted(TORCH)),
    st.lists(
        st.tuples(st.integers(0, 4 * 3 + 3 * FP8_BLOCK - 1), st.integers(0, 255)),
        min_size=1,
        max_size=8,
    ),
)
def test_fp8_mutated_streams_are_refused_or_finite(
    dtype: str, flips: list[tuple[int, int]]
) -> None:
    """Bytes of a valid stream's scales and codes overwritten at random: the read is a
    CodecError or every value it wrote is finite."""
    x = torch.randn(3 * FP8_BLOCK, generator=torch.Generator().manual_seed(5)) * 4
    raw = x.to(TORCH[dtype]).view(torch.uint8).numpy().tobytes()
    got = Fp8Compressor().compress_chunk(memoryview(raw), dtype)
    assert got is not None
    stream = bytearray(got[1])
    for at, value in flips:
        stream[8 + at] = value
    out = bytearray(len(raw))
    try:
        decompress_into("fp8e4m3", memoryview(bytes(stream)), memoryview(out), dtype)
    except CodecError:
        return
    assert bool(torch.isfinite(torch.frombuffer(out, dtype=TORCH[dtype]).float()).all())


def test_fp8_scale_limit_admits_every_scale_a_compressor_writes() -> None:
    """The dtypes' largest values make the largest scales; they read back (not refused)
    and stay finite."""
    for dtype, tdt in TORCH.items():
        x = torch.full((FP8_BLOCK,), torch.finfo(tdt).max, dtype=tdt)
        got = round_trip(x, dtype)
        assert got is not None
        assert torch.equal(got[1], x)
