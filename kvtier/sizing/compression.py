"""What the object tier stores per chunk under kvtier's ``compression`` setting.

``kvtier size`` and ``kvtier size --trace`` size the object tier in stored bytes: the
raw KV of a chunk times a ratio (stored ÷ raw). The host tier is never compressed and
is sized raw whatever the setting.

- ``none``: 1.
- ``fp8``: exact, from the format (kvtier.objects.compress): bf16/fp16 KV is stored as one byte
  per value plus a float32 scale per :data:`FP8_BLOCK` values, after an
  :data:`FP8_HEADER_BYTES`-byte header, in every rank's object of a chunk. KV that is
  not 16-bit (already fp8 in vLLM, or fp32) is stored as it is.
- ``lossless``: python-blosc2's byte shuffle + zstd-1 has no fixed ratio, so the planner
  uses :data:`LOSSLESS_RATIO`, measured (docs/performance.md, Compression), or the operator's own
  ``--compression-ratio`` (a running tier's ``kvtier:compress_stored_bytes_total`` ÷
  ``kvtier:compress_raw_bytes_total``). The measurement is of 16-bit KV; KV of another
  width is sized raw unless a ratio is given.
- ``auto``: stored compressed only where the engine measured that reads are faster so
  (kvtier.objects.compress), which no plan can know: sized raw, the most it can take,
  unless ``--compression-ratio`` gives a running tier's measured ratio.

Only the standard library: this is imported by ``kvtier size``, which must start fast
(kvtier.objects.compress itself needs torch for fp8, so its format is restated here and a test
checks the two agree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: the ``compression`` values kvtier's config accepts
COMPRESSIONS = ("none", "lossless", "auto", "fp8")
#: fp8: values per float32 scale (kvtier.objects.compress.FP8_BLOCK)
FP8_BLOCK = 128
#: fp8: bytes per scale
FP8_SCALE_BYTES = 4
#: fp8: the stream's header, magic and block size (kvtier.objects.compress._FP8_HEAD)
FP8_HEADER_BYTES = 8
#: lossless: stored ÷ raw of 16-bit KV under blosc2 shuffle + zstd-1, the larger of the two
#: measurements in docs/performance.md's Compression table (0.690 on the random-weight test
#: model's bf16 KV from a real engine's host slab, 0.705 on synthetic KV-like bf16), so
#: the plan does not promise more than was measured. No trained model's KV was measured.
LOSSLESS_RATIO = 0.705
LOSSLESS_SOURCE = (
    "measured: blosc2 shuffle + zstd-1 on bf16 KV (docs/performance.md, Compression: 0.690 on the "
    "random-weight test model, 0.705 on synthetic KV; the larger is used; no trained "
    "model measured); pass --compression-ratio with your own "
    "kvtier:compress_stored_bytes_total / kvtier:compress_raw_bytes_total "
    '(direction="write")'
)


@dataclass(frozen=True, slots=True)
class ObjectCompression:
    """How one object of a chunk (one rank's share) shrinks when stored."""

    setting: str
    #: bytes per KV value (1 fp8, 2 bf16/fp16, 4 fp32)
    itemsize: int
    #: lossless only: stored ÷ raw
    lossless_ratio: float = 1.0
    source: str = "no compression"

    @property
    def fp8_applies(self) -> bool:
        return self.setting == "fp8" and self.itemsize == 2

    def stored_bytes(self, raw: int) -> int:
        """Bytes one object of ``raw`` KV bytes takes in the object tier."""
        if self.fp8_applies:
            n = raw // 2
            return FP8_HEADER_BYTES + FP8_SCALE_BYTES * math.ceil(n / FP8_BLOCK) + n
        if self.setting in ("lossless", "auto"):
            return min(raw, math.ceil(raw * self.lossless_ratio))  # never above raw: stored raw
        return raw

    def ratio(self, raw: int) -> float:
        """Stored ÷ raw for objects of ``raw`` bytes: lossless's ratio as given, fp8's
        exact for that object size (headers and scales included)."""
        if self.setting in ("lossless", "auto"):
            return self.lossless_ratio
        return self.stored_bytes(raw) / raw if raw else 1.0

    def summary(self, raw_object_bytes: int, objects: int) -> dict[str, Any]:
        """The JSON block: the setting, the ratio for these objects and where it comes from."""
        return {
            "setting": self.setting,
            "ratio": self.ratio(raw_object_bytes),
            "ratio_source": self.source,
            "raw_chunk_bytes": raw_object_bytes * objects,
            "stored_chunk_bytes": self.stored_bytes(raw_object_bytes) * objects,
        }


def check_ratio(value: float) -> str | None:
    """Why ``--compression-ratio`` cannot be ``value``, or None."""
    if not math.isfinite(value) or not 0 < value <= 1:
        return (
            f"--compression-ratio {value:g}: must be stored / raw, greater than 0 and at "
            "most 1 (a chunk that would not shrink is stored raw)"
        )
    return None


def resolve(setting: str, itemsize: int, ratio: float | None = None) -> ObjectCompression:
    """The compression of one setting for KV of ``itemsize`` bytes per value; a bad
    setting or ratio is a ValueError naming the flag."""
    if setting not in COMPRESSIONS:
        raise ValueError(f"--compression {setting!r}: one of {', '.join(COMPRESSIONS)}")
    if ratio is not None:
        if setting not in ("lossless", "auto"):
            raise ValueError(
                f"--compression-ratio applies to --compression lossless or auto only; {setting}'s "
                "size " + ("follows from its format" if setting == "fp8" else "is the raw KV")
            )
        if err := check_ratio(ratio):
            raise ValueError(err)
    if setting == "none":
        return ObjectCompression("none", itemsize)
    if setting == "fp8":
        if itemsize == 2:
            src = (
                f"exact: fp8 e4m3, 1 byte per value + {FP8_SCALE_BYTES} bytes per "
                f"{FP8_BLOCK} values + an {FP8_HEADER_BYTES}-byte header per object"
            )
        else:
            src = (
                f"KV of {itemsize} bytes per value is stored as it is (fp8 converts "
                "bf16/fp16 KV only)"
            )
        return ObjectCompression("fp8", itemsize, source=src)
    if ratio is not None:
        return ObjectCompression(setting, itemsize, ratio, "--compression-ratio")
    if setting == "auto":
        return ObjectCompression(
            "auto",
            itemsize,
            1.0,
            (
                "auto stores a chunk compressed only where the engine measured its reads faster "
                "so: sized raw, the most it can take; pass --compression-ratio with a running "
                "tier's kvtier:compress_stored_bytes_total / kvtier:compress_raw_bytes_total "
                '(direction="write")'
            ),
        )
    if itemsize == 2:
        return ObjectCompression("lossless", itemsize, LOSSLESS_RATIO, LOSSLESS_SOURCE)
    return ObjectCompression(
        "lossless",
        itemsize,
        1.0,
        (
            f"not measured for KV of {itemsize} bytes per value: sized raw; pass "
            "--compression-ratio with your own kvtier:compress_stored_bytes_total / "
            'kvtier:compress_raw_bytes_total (direction="write")'
        ),
    )
