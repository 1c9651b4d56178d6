"""Lossless compression of object-tier chunks (the ``compression`` setting).

The object tier is where kvtier pays per byte (S3 storage and egress, Redis memory,
the network of a restart hit), so with ``compression: lossless`` every chunk an
engine uploads is compressed with python-blosc2 (C-Blosc2: a byte shuffle, which
splits 16-bit KV into its exponent and mantissa byte planes, then zstd at level 1)
before it is sealed and signed. Nothing of the codec is written here.

- A compressed chunk's header names its *form* (``"z": "blosc2"``); the AEAD's
  associated data and the HMAC cover the form and the compressed bytes. A chunk
  whose compressed object would not be smaller than the raw payload alone is stored
  raw (no ``"z"``), so a tier may hold a mix, and every engine reads both.
- An engine that cannot read a form (an unknown name, or blosc2 not installed)
  counts a miss of kind ``format`` (:class:`FormatError`), never an exception.
- Decompression writes into the host slot and only there: the output size is the
  slot's, never the object's. A stream that says it holds anything but exactly the
  slot's bytes (a decompression bomb, a truncated stream) is refused before it is
  decompressed, as a :class:`~kvtier.errors.CodecError`; memory stays bounded by the
  slot plus the compressed object.
- Compression and decompression run on RemoteIO's I/O threads only.

``compression: fp8`` is lossy and opt-in: bf16/fp16 KV is stored as fp8 e4m3 with one
float32 scale per block of :data:`FP8_BLOCK` elements (``"z": "fp8e4m3"``) and
dequantised into the slot on read, so a hit's KV differs from what was computed (each
element within 2^-4 of its magnitude plus 2^-10 of its block's scale) and so may its
outputs. KV of any other dtype (already fp8, fp32) is stored as it is. ``lossless``
never changes a byte. Only an engine that chose ``fp8`` reads fp8 chunks
(:data:`LOSSY_FORMS`); to any other engine they are a ``format`` miss.
"""

from __future__ import annotations

import math
import struct
import time
import warnings
from types import ModuleType
from typing import TYPE_CHECKING

from kvtier.errors import CodecError, ConfigError

if TYPE_CHECKING:
    import torch

    from kvtier.config import KVTierConfig

__all__ = [
    "Compressor", "FP8_BLOCK", "Fp8Compressor", "FORMS", "FormatError", "LOSSY_FORMS",
    "decompress_into",
    "itemsize",
]

#: the compressed forms this build knows (each needs its library to be readable)
FORMS = ("blosc2", "fp8e4m3")
#: forms that change the KV: read only by an engine that chose them (``lossy=``)
LOSSY_FORMS = ("fp8e4m3",)
#: elements per fp8 scale: one attention head's row (head_dim 128); finer than a layer's
#: region of a chunk, and the scales add 4 / 128 = 3 % to the fp8 bytes
FP8_BLOCK = 128
#: e4m3's largest finite value: a block's largest magnitude maps to it
_FP8_MAX = 448.0
_FP8_HEAD = struct.Struct("<4sI")  # magic, block size
_FP8_MAGIC = b"F8E4"
#: elements converted per torch call: half torch's parallel grain size (32,768), so each
#: call runs on the calling I/O thread, never on the intra-op pool the model computes on
_FP8_SLICE = 16384
#: blosc2's fixed chunk header: nothing shorter is a stream
_BLOSC2_MIN = 32
#: zstd level: level 1 had the best ratio x speed on bf16 KV (README, Compression)
CLEVEL = 1

_ITEMSIZE = {
    "float64": 8, "int64": 8, "float32": 4, "int32": 4, "bfloat16": 2, "float16": 2,
    "int16": 2, "uint16": 2,
}  # fmt: skip


class FormatError(CodecError):
    """A chunk stored in a compressed form this engine cannot read: a miss."""

    kind = "format"


def itemsize(dtype: str) -> int:
    """The element size of a chunk's (first) KV dtype, for the byte shuffle; 1 when
    unknown or 8-bit (``"bfloat16*1,float8_e4m3fn*3"``: the first run's)."""
    first = dtype.split(",", 1)[0].split("*", 1)[0]
    return _ITEMSIZE.get(first, 1)


def _blosc2() -> ModuleType | None:
    try:
        import blosc2
    except ImportError:
        return None
    module: ModuleType = blosc2
    return module


class Compressor:
    """Compresses one chunk's payload (lossless); thread-safe (a context per call)."""

    form = "blosc2"

    __slots__ = ("_b",)

    def __init__(self) -> None:
        b = _blosc2()
        if b is None:
            raise ImportError("blosc2 is not installed")
        self._b = b

    def __repr__(self) -> str:
        return f"Compressor(form={self.form!r}, clevel={CLEVEL})"

    def compress(self, data: memoryview, typesize: int) -> tuple[bytes, float]:
        """The compressed bytes of ``data`` and the seconds it took."""
        b = self._b
        t0 = time.perf_counter()
        out: bytes = b.compress2(
            data, codec=b.Codec.ZSTD, clevel=CLEVEL, typesize=typesize,
            filters=[b.Filter.SHUFFLE], filters_meta=[0], nthreads=1,
        )  # fmt: skip
        return out, time.perf_counter() - t0

    def compress_chunk(self, data: memoryview, dtype: str) -> tuple[str, bytes, float] | None:
        """``(form, stream, seconds)`` for one chunk of ``dtype``; None: store it raw."""
        out, secs = self.compress(data, itemsize(dtype))
        return self.form, out, secs

    @classmethod
    def from_config(cls, cfg: KVTierConfig) -> Compressor | Fp8Compressor | None:
        """The compressor ``cfg.compression`` asks for; None for ``none``. A ConfigError
        naming the key when its library is missing (never a silent switch to raw)."""
        if cfg.compression == "none":
            return None
        if cfg.compression == "fp8":
            return Fp8Compressor()
        try:
            return cls()
        except ImportError:
            raise ConfigError(
                "compression", cfg.compression,
                "none, fp8, or lossless with python-blosc2 installed "
                "(pip install 'kvtier[lossless]')",
            ) from None


def _torch_dtype(dtype: str) -> torch.dtype | None:
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)


def _tensor(buf: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``buf``'s bytes (no copy; torch warns about read-only buffers,
    which are only read here)."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype)


class Fp8Compressor:
    """Lossy: bf16/fp16 chunks as fp8 e4m3 with a float32 scale per block (opt-in)."""

    form = "fp8e4m3"

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Fp8Compressor(block={FP8_BLOCK})"

    def compress_chunk(self, data: memoryview, dtype: str) -> tuple[str, bytes, float] | None:
        """``(form, stream, seconds)``; None (stored raw) for KV that is not bf16/fp16
        (already fp8, or fp32) or holds a non-finite value."""
        import torch

        tdt = _torch_dtype(dtype)
        if tdt is None or data.nbytes % 2:
            return None
        t0 = time.perf_counter()
        x = _tensor(data, tdt)
        n = x.numel()
        nb = math.ceil(n / FP8_BLOCK)
        scale = torch.empty(nb, dtype=torch.float32)
        q = torch.empty(n, dtype=torch.float8_e4m3fn)
        step = _FP8_SLICE // FP8_BLOCK
        for b0 in range(0, nb, step):
            b1 = min(nb, b0 + step)
            part = x[b0 * FP8_BLOCK : b1 * FP8_BLOCK].float()
            if part.numel() < (b1 - b0) * FP8_BLOCK:  # the last block, short
                part = torch.nn.functional.pad(part, (0, (b1 - b0) * FP8_BLOCK - part.numel()))
            blocks = part.view(b1 - b0, FP8_BLOCK)
            amax = blocks.abs().amax(1)
            if not bool(torch.isfinite(amax).all()):
                return None
            s = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
            scale[b0:b1] = s
            qb = (blocks / s[:, None]).to(torch.float8_e4m3fn).view(-1)
            q[b0 * FP8_BLOCK : b1 * FP8_BLOCK] = qb[: min(n, b1 * FP8_BLOCK) - b0 * FP8_BLOCK]
        out = b"".join((_FP8_HEAD.pack(_FP8_MAGIC, FP8_BLOCK), scale.numpy().tobytes(),
                        q.view(torch.uint8).numpy().tobytes()))  # fmt: skip
        return self.form, out, time.perf_counter() - t0


def _fp8_into(src: memoryview, dest: memoryview, dtype: str) -> None:
    """Dequantise an fp8e4m3 stream into ``dest`` (bf16/fp16), checking every size first."""
    import torch

    tdt = _torch_dtype(dtype)
    if tdt is None or dest.nbytes % 2:
        raise CodecError(f"fp8 chunk of dtype {dtype!r}: only bf16/fp16 KV is stored as fp8")
    if src.nbytes < _FP8_HEAD.size:
        raise CodecError("fp8 chunk shorter than its header")
    magic, block = _FP8_HEAD.unpack_from(src)
    if magic != _FP8_MAGIC or not 1 <= block <= 2**20:
        raise CodecError("fp8 chunk header garbled")
    n = dest.nbytes // 2
    nb = math.ceil(n / block)
    if src.nbytes != _FP8_HEAD.size + 4 * nb + n:
        raise CodecError(f"fp8 chunk of {src.nbytes} bytes does not hold its slot's {n} values")
    at = _FP8_HEAD.size
    scale = _tensor(src[at : at + 4 * nb], torch.float32)
    if not bool(torch.isfinite(scale).all()):
        raise CodecError("fp8 chunk has a non-finite scale")
    q = _tensor(src[at + 4 * nb :], torch.float8_e4m3fn)
    out = _tensor(dest, tdt)
    step = max(1, _FP8_SLICE // block)
    for b0 in range(0, nb, step):
        b1 = min(nb, b0 + step)
        lo, hi = b0 * block, min(n, b1 * block)
        part = q[lo:hi].float()
        if hi - lo < (b1 - b0) * block:  # the last block, short
            part = torch.nn.functional.pad(part, (0, (b1 - b0) * block - (hi - lo)))
        y = part.view(b1 - b0, block) * scale[b0:b1, None]
        out[lo:hi] = y.view(-1)[: hi - lo]


def decompress_into(form: str, src: memoryview, dest: memoryview, dtype: str = "") -> float:
    """Decompress a verified chunk payload of ``form`` into ``dest`` (the host slot),
    which it must fill exactly; returns the seconds it took.

    Raises :class:`FormatError` for a form this engine cannot read and
    :class:`~kvtier.errors.CodecError` for a stream that is not exactly ``dest``'s
    bytes (checked from its header before anything is decompressed) or does not
    decompress; ``dest`` may then hold anything and must not be used.
    """
    if form == "fp8e4m3":
        t0 = time.perf_counter()
        _fp8_into(src, dest, dtype)
        return time.perf_counter() - t0
    b = _blosc2() if form == "blosc2" else None
    if b is None:
        why = "python-blosc2 is not installed" if form == "blosc2" else "unknown form"
        raise FormatError(f"chunk is stored compressed as {form!r}, which this engine cannot "
                          f"read ({why})")  # fmt: skip
    t0 = time.perf_counter()
    if src.nbytes < _BLOSC2_MIN:
        raise CodecError(f"compressed chunk of {src.nbytes} bytes is shorter than its header")
    try:
        nbytes, cbytes, _ = b.get_cbuffer_sizes(src)
    except Exception as exc:  # noqa: BLE001  # garbage: any error means the same
        raise CodecError(f"compressed chunk header unreadable ({type(exc).__name__})") from None
    if nbytes != dest.nbytes:
        raise CodecError(
            f"compressed chunk says it holds {nbytes} bytes, its slot has {dest.nbytes}"
        )
    if cbytes != src.nbytes:
        raise CodecError(f"compressed chunk says it is {cbytes} bytes long, it is {src.nbytes}")
    try:
        b.decompress2(src, dst=dest, nthreads=1)  # the I/O threads are the parallelism
    except Exception as exc:  # noqa: BLE001  # a corrupt stream: any error means the same
        raise CodecError(f"compressed chunk does not decompress ({type(exc).__name__})") from None
    return time.perf_counter() - t0
