"""``compression: auto``: store a chunk compressed only where that makes its reads faster.

Lossless compression saves bytes on every tier, but a restart hit is a read: the
compressed chunk's bytes arrive sooner and must then be decompressed (about 2 ms per
4 MiB bf16 chunk per core with blosc2). On a local disk, loopback Redis or S3 that is
slower than reading the raw chunk; over a thin network it is faster. Which one holds
depends on the tier and the machine, so ``auto`` measures it instead of guessing:

- Every read this engine does of the object tier is timed per raw byte, from the
  tier call to the chunk verified (and decompressed) in its slot, and kept as a moving
  average per form (raw, compressed).
- Uploads are stored in the form whose reads are faster; compressed wins only when its
  reads are at least :data:`MARGIN` faster, so a tie costs no CPU. Until both forms have
  :data:`MIN_READS` timed reads, chunks are stored raw (never slower than ``none``).
- One upload in :data:`EXPLORE_EVERY` is stored in the other form, so both averages
  keep being measured as the tier's load changes; at most that share of reads is in
  the slower form.

A tier then holds a mix, which every engine reads (the chunk header names the form).
Operators who want the fewest bytes whatever the speed choose ``lossless``.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError
from kvtier.objects.compress import Compressor, Fp8Compressor

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig

__all__ = ["AutoCompressor", "EXPLORE_EVERY", "MARGIN", "MIN_READS", "from_config"]

log = logging.getLogger("kvtier.compression")

#: one upload in this many is stored in the form not chosen, to keep measuring it
EXPLORE_EVERY = 16
#: timed reads of each form before the choice may leave raw
MIN_READS = 3
#: compressed must read this much faster (per raw byte) than raw to be chosen
MARGIN = 0.05
#: weight of the newest read in each form's moving average
ALPHA = 0.25


class AutoCompressor:
    """A lossless :class:`Compressor` behind a measured choice of form (thread-safe).

    The object tier's I/O threads call :meth:`compress_chunk` for each upload (None:
    store it raw) and :meth:`observe_read` after each verified read.
    """

    form = Compressor.form

    def __init__(self, compressor: Compressor | None = None) -> None:
        self._z = compressor if compressor is not None else Compressor()
        self._lock = threading.Lock()
        #: seconds per raw byte of a read, moving average: [raw, compressed]
        self._cost: list[float | None] = [None, None]
        self._reads = [0, 0]
        self._uploads = 0
        self._compressing = False

    def __repr__(self) -> str:
        return f"AutoCompressor(compressing={self._compressing}, reads={self._reads})"

    @property
    def reads_raw_first(self) -> bool:
        """Most objects this engine stores are raw now: read a chunk straight into its
        slot first (one read), whole only when it turns out shorter (compressed)."""
        return not self._compressing

    @property
    def compressing(self) -> bool:
        """Whether uploads are stored compressed now (apart from the exploring ones)."""
        return self._compressing

    def costs(self) -> tuple[float | None, float | None]:
        """Measured read seconds per raw byte: (raw, compressed); None until read."""
        with self._lock:
            return self._cost[0], self._cost[1]

    def compress_chunk(self, data: memoryview, dtype: str) -> tuple[str, bytes, float] | None:
        """``(form, stream, seconds)`` when this upload is to be stored compressed, else
        None (stored raw, and nothing spent compressing it)."""
        with self._lock:
            self._uploads += 1
            explore = self._uploads % EXPLORE_EVERY == 0
            compress = self._compressing != explore
        return self._z.compress_chunk(data, dtype) if compress else None

    def observe_read(self, raw_bytes: int, seconds: float, compressed: bool) -> None:
        """One verified read of a chunk of ``raw_bytes`` that took ``seconds`` from the
        tier call to its slot filled; ``compressed``: it was stored compressed."""
        if raw_bytes <= 0 or seconds < 0:
            return
        i = int(compressed)
        per_byte = seconds / raw_bytes
        with self._lock:
            old = self._cost[i]
            self._cost[i] = per_byte if old is None else old + ALPHA * (per_byte - old)
            self._reads[i] += 1
            raw, z = self._cost
            was = self._compressing
            if min(self._reads) >= MIN_READS and raw is not None and z is not None:
                self._compressing = z <= raw * (1 - MARGIN)
            now = self._compressing
        if now != was:
            log.info("compression auto: storing chunks %s (reads: %.2f ms/MiB raw, %.2f ms/MiB "
                     "compressed)", "compressed" if now else "raw",
                     (raw or 0) * 2**20 * 1e3, (z or 0) * 2**20 * 1e3)  # fmt: skip


def from_config(cfg: KVTierConfig) -> Compressor | Fp8Compressor | AutoCompressor | None:
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
            "(pip install 'kvtier[lossless]')",
        ) from None
    return AutoCompressor(z) if cfg.compression == "auto" else z
