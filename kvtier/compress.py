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
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import TYPE_CHECKING

from kvtier.errors import CodecError, ConfigError

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig

__all__ = [
    "Compressor", "FORMS", "FormatError", "decompress_into", "itemsize",
]

#: the compressed forms this build knows (each needs its library to be readable)
FORMS = ("blosc2",)
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

    @classmethod
    def from_config(cls, cfg: KVTierConfig) -> Compressor | None:
        """The compressor ``cfg.compression`` asks for; None for ``none``. A ConfigError
        naming the key when its library is missing (never a silent switch to raw)."""
        if cfg.compression == "none":
            return None
        try:
            return cls()
        except ImportError:
            raise ConfigError(
                "compression", cfg.compression,
                "none, or lossless with python-blosc2 installed (pip install 'kvtier[lossless]')",
            ) from None


def decompress_into(form: str, src: memoryview, dest: memoryview) -> float:
    """Decompress a verified chunk payload of ``form`` into ``dest`` (the host slot),
    which it must fill exactly; returns the seconds it took.

    Raises :class:`FormatError` for a form this engine cannot read and
    :class:`~kvtier.errors.CodecError` for a stream that is not exactly ``dest``'s
    bytes (checked from its header before anything is decompressed) or does not
    decompress; ``dest`` may then hold anything and must not be used.
    """
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
