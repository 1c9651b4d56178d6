"""``compression: auto``: store a chunk compressed only where that makes its reads faster.

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
import threading
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError
from kvtier.extras import install_hint
from kvtier.objects.compress import (
    ChunkCompressor,
    Compressor,
    Fp8Compressor,
    ThreadScratch,
    decompress_into,
)

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig

__all__ = ["AutoCompressor", "MARGIN", "MIN_READS", "SAMPLE_EVERY", "from_config"]

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
        return (f"AutoCompressor(compressing={self._compressing}, reads={self._reads}, "
                f"ratio={self._ratio})")  # fmt: skip

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
            log.info("compression auto: storing chunks %s (reads: %.2f ms/MiB raw, %.2f ms/MiB "
                     "compressed, %s)", "compressed" if now else "raw", raw * 2**20 * 1e3,
                     z * 2**20 * 1e3,
                     "measured" if self._reads[1] >= MIN_READS else "predicted")  # fmt: skip


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
            "compression", cfg.compression,
            "none, fp8, or lossless/auto with python-blosc2 installed "
            f"({install_hint('lossless')})",
        ) from None
    return AutoCompressor(z) if cfg.compression == "auto" else z
