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
- Compression and decompression run on RemoteIO's I/O threads only, and what a read
  goes through before its slot is made once per thread and reused (:class:`ThreadScratch`
  for a sealed compressed payload, a float32 work slice for fp8): no buffer per read.

``compression: fp8`` is lossy and opt-in: bf16/fp16 KV is stored as fp8 e4m3 with one
float32 scale per block of :data:`FP8_BLOCK` elements (``"z": "fp8e4m3"``) and
dequantised into the slot on read, so a hit's KV differs from what was computed (each
element within 2^-4 of its magnitude plus 2^-10 of its block's scale) and so may its
outputs. KV of any other dtype (already fp8, fp32), and a chunk holding inf or NaN, is
stored as it is. A stream no compressor writes (an fp8 NaN code; a scale that is not
positive, or would carry a value past the dtype's range) is a :class:`CodecError`, so an
fp8 read never puts a non-finite value in a slot. ``lossless``
never changes a byte. Only an engine that chose ``fp8`` reads fp8 chunks
(:data:`LOSSY_FORMS`); to any other engine they are a ``format`` miss.

``compression: auto``: store a chunk compressed only where that makes its reads faster.

Lossless compression saves bytes on every tier, but a restart hit is a read: the
compressed chunk's bytes arrive sooner and must then be decompressed (about 2 ms per
4 MiB bf16 chunk per core with blosc2). On a local disk, loopback Redis or S3 that is
slower than reading the raw chunk; over a thin network it is faster. Which one holds
depends on the tier and the machine, so ``auto`` measures it instead of guessing:

- Every read this engine does of the object tier is timed per raw byte, from the
  tier call to the chunk verified (and decompressed) in its slot, and kept as a moving
  average per form (raw, compressed).
- One upload in :data:`SAMPLE_EVERY` is also compressed and decompressed on its write
  thread (and stored raw all the same), which measures the ratio and the decompression
  time on this engine's own KV. Until compressed chunks have been read, a compressed
  read is predicted from them: the raw read's time scaled by the ratio, plus the
  decompression.
- Uploads are stored compressed only when a compressed read (measured, else predicted)
  is at least :data:`MARGIN` faster than a raw one, after :data:`MIN_READS` timed raw
  reads. So an engine that never found compression faster never stores a compressed
  chunk: its hits cost what ``none``'s do. While it compresses, one upload in
  :data:`SAMPLE_EVERY` is stored raw, so raw reads keep being measured as the tier's
  load changes.

A tier then holds a mix, which every engine reads (the chunk header names the form).
Operators who want the fewest bytes whatever the speed choose ``lossless``.
"""

from __future__ import annotations

import logging
import math
import struct
import threading
import time
import warnings
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

from kvtier.errors import CodecError, ConfigError
from kvtier.extras import install_hint

if TYPE_CHECKING:
    import torch

    from kvtier.config import KVTierConfig

__all__ = [
    "ChunkCompressor",
    "Compressor",
    "FP8_BLOCK",
    "Fp8Compressor",
    "FORMS",
    "FormatError",
    "LOSSY_FORMS",
    "ThreadScratch",
    "decompress_into",
    "fp8_work_allocations",
    "itemsize",
    "AutoCompressor",
    "MARGIN",
    "MIN_READS",
    "SAMPLE_EVERY",
    "from_config",
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
#: zstd level: level 1 had the best ratio x speed on bf16 KV (docs/performance.md, Compression)
CLEVEL = 1

_ITEMSIZE = {
    "float64": 8,
    "int64": 8,
    "float32": 4,
    "int32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int16": 2,
    "uint16": 2,
}


class ChunkCompressor(Protocol):
    """What the object tier's I/O threads ask of a ``compression`` setting's compressor
    (:class:`Compressor`, :class:`Fp8Compressor`, :class:`AutoCompressor`)."""

    @property
    def reads_raw_first(self) -> bool:
        """Read a chunk straight into its slot first (most objects are raw)."""
        ...

    def compress_chunk(self, data: memoryview, dtype: str) -> tuple[str, bytes, float] | None:
        """``(form, stream, seconds)`` for one upload; None: store it raw."""
        ...

    def observe_read(self, raw_bytes: int, seconds: float, compressed: bool) -> None:
        """One verified read, timed from the tier call to the slot filled."""
        ...


class FormatError(CodecError):
    """A chunk stored in a compressed form this engine cannot read: a miss."""

    kind = "format"


class ThreadScratch:
    """A reusable buffer per thread for the bytes a read goes through before its slot
    (a compressed payload to open in place, then decompress): no buffer per read.

    :meth:`view` gives the calling thread's buffer, grown only when a longer view is
    asked for (at most ``limit`` bytes: a longer one is a :class:`CodecError`, never an
    allocation). Each thread has its own, so two concurrent reads never share bytes; a
    view stays valid until the same thread asks again. :attr:`allocations` counts the
    buffers made, all threads together.
    """

    __slots__ = ("_local", "_lock", "allocations", "limit")

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.allocations = 0
        self._local = threading.local()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ThreadScratch(limit={self.limit}, allocations={self.allocations})"

    def view(self, nbytes: int) -> memoryview:
        """A writable view of ``nbytes`` bytes of this thread's buffer (contents undefined)."""
        if nbytes < 0 or self.limit is not None and nbytes > self.limit:
            raise CodecError(
                f"a read of {nbytes} bytes does not fit the {self.limit}-byte scratch buffer"
            )
        buf: bytearray | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            # grow by half again at least, so payloads of varying sizes settle at once
            want = nbytes if buf is None else max(nbytes, len(buf) * 3 // 2)
            buf = bytearray(want if self.limit is None else min(want, self.limit))
            self._local.buf = buf
            with self._lock:
                self.allocations += 1
        return memoryview(buf)[:nbytes]


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
            data,
            codec=b.Codec.ZSTD,
            clevel=CLEVEL,
            typesize=typesize,
            filters=[b.Filter.SHUFFLE],
            filters_meta=[0],
            nthreads=1,
        )
        return out, time.perf_counter() - t0

    def compress_chunk(self, data: memoryview, dtype: str) -> tuple[str, bytes, float] | None:
        """``(form, stream, seconds)`` for one chunk of ``dtype``; None: store it raw."""
        out, secs = self.compress(data, itemsize(dtype))
        return self.form, out, secs

    #: most objects are compressed (shorter than a raw chunk): read them whole, not first
    #: into the slot as if raw
    reads_raw_first = False

    def observe_read(self, raw_bytes: int, seconds: float, compressed: bool) -> None:
        """A timed read (used by ``compression: auto`` only)."""


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

    reads_raw_first = False

    def observe_read(self, raw_bytes: int, seconds: float, compressed: bool) -> None:
        """A timed read (used by ``compression: auto`` only)."""

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
            # within +-448 already (|x| <= amax); the clamp keeps a float32 rounding past
            # it from becoming NaN where a torch build does not saturate
            qb = (blocks / s[:, None]).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
            qb = qb.view(-1)
            q[b0 * FP8_BLOCK : b1 * FP8_BLOCK] = qb[: min(n, b1 * FP8_BLOCK) - b0 * FP8_BLOCK]
        out = b"".join(
            (
                _FP8_HEAD.pack(_FP8_MAGIC, FP8_BLOCK),
                scale.numpy().tobytes(),
                q.view(torch.uint8).numpy().tobytes(),
            )
        )
        return self.form, out, time.perf_counter() - t0


#: the float32 slice each I/O thread dequantises through (one per thread, reused)
_FP8_WORK = threading.local()
_fp8_work_made = [0]
_fp8_work_lock = threading.Lock()


def fp8_work_allocations() -> int:
    """How many dequantisation work buffers were made, all threads together (one per
    thread that read an fp8 chunk)."""
    return _fp8_work_made[0]


def _fp8_work() -> torch.Tensor:
    """This thread's float32 work slice of :data:`_FP8_SLICE` elements."""
    import torch

    work: torch.Tensor | None = getattr(_FP8_WORK, "t", None)
    if work is None:
        work = torch.empty(_FP8_SLICE, dtype=torch.float32)
        _FP8_WORK.t = work
        with _fp8_work_lock:
            _fp8_work_made[0] += 1
    return work


def _fp8_scale_limit(tdt: torch.dtype) -> float:
    """The largest scale a compressor writes for KV of ``tdt``: the dtype's largest
    finite value over 448 (and a float32 rounding of it); 448 x a larger scale would
    dequantise past the dtype's range."""
    import torch

    return float(torch.finfo(tdt).max) / _FP8_MAX * (1 + 2.0**-20)


def _fp8_into(src: memoryview, dest: memoryview, dtype: str) -> None:
    """Dequantise an fp8e4m3 stream into ``dest`` (bf16/fp16), checking every size first.

    Runs through this thread's work slice (:func:`_fp8_work`): no buffer per read. A
    stream a compressor did not write (a scale that is not positive, or that would carry
    a value past the dtype's range; an fp8 NaN code) is a :class:`CodecError`, so every
    value a read puts in the slot is finite.
    """
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
    if nb and not 0.0 < float(scale.min()) <= float(scale.max()) <= _fp8_scale_limit(tdt):
        raise CodecError("fp8 chunk has a scale that is not positive, finite and in range")
    q = _tensor(src[at + 4 * nb :], torch.float8_e4m3fn)
    out = _tensor(dest, tdt)
    work = _fp8_work()
    lo = 0
    while lo < n:
        b0 = lo // block
        if block <= _FP8_SLICE:  # whole blocks, as many as fit the work slice
            hi = min(n, (b0 + _FP8_SLICE // block) * block)
        else:  # part of one block
            hi = min(n, lo + _FP8_SLICE, (b0 + 1) * block)
        w = work[: hi - lo]
        w.copy_(q[lo:hi])
        if not math.isfinite(float(w.sum())):  # |sum| <= 448 x 16384: only a NaN code
            raise CodecError("fp8 chunk holds a NaN code, which no compressor writes")
        if block > _FP8_SLICE:
            w.mul_(scale[b0])
        else:
            full = (hi - lo) // block
            w[: full * block].view(full, block).mul_(scale[b0 : b0 + full, None])
            if full * block < hi - lo:  # the chunk ends inside its last block
                w[full * block :].mul_(scale[b0 + full])
        out[lo:hi].copy_(w)
        lo = hi


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
        why = (
            f"python-blosc2 is not installed: {install_hint('lossless')}"
            if form == "blosc2"
            else "unknown form"
        )
        raise FormatError(
            f"chunk is stored compressed as {form!r}, which this engine cannot read ({why})"
        )
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


# -- compression: auto, and which compressor the config asks for

log = logging.getLogger("kvtier.compression")

#: one upload in this many is sampled (compressed and decompressed, stored raw) while
#: storing raw, or stored raw while compressing
SAMPLE_EVERY = 16
#: timed reads (raw; compressed, to be trusted over the prediction) before a choice
MIN_READS = 3
#: compressed must read this much faster (per raw byte) than raw to be chosen
MARGIN = 0.05
#: weight of the newest sample in each moving average
ALPHA = 0.25


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


class AutoCompressor:
    """A lossless :class:`Compressor` behind a measured choice of form (thread-safe).

    The object tier's I/O threads call :meth:`compress_chunk` for each upload (None:
    store it raw) and :meth:`observe_read` after each verified read.
    """

    form = Compressor.form

    def __init__(self, compressor: Compressor | None = None) -> None:
        self._z = compressor if compressor is not None else Compressor()
        self._lock = threading.Lock()
        self._scratch = ThreadScratch()
        #: seconds per raw byte of a read, moving average: [raw, compressed]
        self._cost: list[float | None] = [None, None]
        self._reads = [0, 0]
        #: from the samples: stored / raw, and decompression seconds per raw byte
        self._ratio: float | None = None
        self._decompress: float | None = None
        self._uploads = 0
        self._compressing = False

    def __repr__(self) -> str:
        return (
            f"AutoCompressor(compressing={self._compressing}, reads={self._reads}, "
            f"ratio={self._ratio})"
        )

    @property
    def compressing(self) -> bool:
        """Whether uploads are stored compressed now (apart from one in SAMPLE_EVERY)."""
        return self._compressing

    @property
    def reads_raw_first(self) -> bool:
        """Most objects this engine stores are raw now: read a chunk straight into its
        slot first (one read), whole only when it turns out shorter (compressed)."""
        return not self._compressing

    def costs(self) -> tuple[float | None, float | None]:
        """Read seconds per raw byte: (raw measured, compressed measured or predicted);
        None while unknown."""
        with self._lock:
            return self._cost[0], self._z_cost()

    def compress_chunk(self, data: memoryview, dtype: str) -> tuple[str, bytes, float] | None:
        """``(form, stream, seconds)`` when this upload is to be stored compressed, else
        None (stored raw)."""
        with self._lock:
            self._uploads += 1
            turn = self._uploads % SAMPLE_EVERY == 1
            compressing = self._compressing
        if compressing:
            return None if turn else self._z.compress_chunk(data, dtype)
        if turn:
            self._sample(data, dtype)
        return None

    def _sample(self, data: memoryview, dtype: str) -> None:
        """Compress and decompress one raw upload here: the ratio and decompression time
        a compressed read of this engine's KV would have."""
        form, stream, _ = self._z.compress_chunk(data, dtype) or (None, b"", 0.0)
        if form is None or not data.nbytes:
            return
        secs = decompress_into(form, memoryview(stream), self._scratch.view(data.nbytes), dtype)
        with self._lock:
            self._ratio = _ewma(self._ratio, min(1.0, len(stream) / data.nbytes))
            self._decompress = _ewma(self._decompress, secs / data.nbytes)
            self._decide()

    def observe_read(self, raw_bytes: int, seconds: float, compressed: bool) -> None:
        """One verified read of a chunk of ``raw_bytes`` that took ``seconds`` from the
        tier call to its slot filled; ``compressed``: it was stored compressed."""
        if raw_bytes <= 0 or seconds < 0:
            return
        i = int(compressed)
        with self._lock:
            self._cost[i] = _ewma(self._cost[i], seconds / raw_bytes)
            self._reads[i] += 1
            self._decide()

    def _z_cost(self) -> float | None:
        """A compressed read's seconds per raw byte: measured once read often enough,
        else predicted from the raw reads and the samples (caller holds the lock)."""
        if self._reads[1] >= MIN_READS:
            return self._cost[1]
        raw = self._cost[0]
        if raw is None or self._ratio is None or self._decompress is None:
            return None
        return raw * self._ratio + self._decompress

    def _decide(self) -> None:
        """Choose the form (caller holds the lock); log when it changes."""
        raw, z = self._cost[0], self._z_cost()
        if self._reads[0] < MIN_READS or raw is None or z is None:
            return
        now = z <= raw * (1 - MARGIN)
        if now != self._compressing:
            self._compressing = now
            log.info(
                "compression auto: storing chunks %s (reads: %.2f ms/MiB raw, %.2f ms/MiB "
                "compressed, %s)",
                "compressed" if now else "raw",
                raw * 2**20 * 1e3,
                z * 2**20 * 1e3,
                "measured" if self._reads[1] >= MIN_READS else "predicted",
            )


def from_config(cfg: KVTierConfig) -> ChunkCompressor | None:
    """The compressor ``cfg.compression`` asks for; None for ``none``. A ConfigError
    naming the key when its library is missing (never a silent switch to raw)."""
    if cfg.compression == "none":
        return None
    if cfg.compression == "fp8":
        return Fp8Compressor()
    try:
        z = Compressor()
    except ImportError:
        raise ConfigError(
            "compression",
            cfg.compression,
            "none, fp8, or lossless/auto with python-blosc2 installed "
            f"({install_hint('lossless')})",
        ) from None
    return AutoCompressor(z) if cfg.compression == "auto" else z
