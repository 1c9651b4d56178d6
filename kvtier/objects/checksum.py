"""The checksum of a stored chunk's payload: CRC-32, computed with ISA-L.

Apart from the codec because the tiers compute it too, piece by piece as a payload
lands in its slot (:meth:`ObjectTier.read_into_hashed`). CRC-32 rather than the xxh3-128
of older chunks: on the GPU host's CPU ISA-L's CRC-32 ran 1.6-3.2x faster (README,
"Object tier"; on a 2-core VM about as fast), and every byte of every hit is checked. It
guards against accidents (a bit flip, a torn or mixed-up object: a corrupt payload passes
with odds of 2^-32); forgery is the HMAC signature's job.
"""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # the same CRC-32, slower: a platform without an isal wheel
    from zlib import crc32 as _crc32

__all__ = ["CRC_LEN", "crc32_bytes", "payload_crc32"]

#: bytes of a CRC-32 in a chunk's header
CRC_LEN = 4


def payload_crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """The CRC-32 (zlib's) of ``data``, continuing from ``value``: computable piece by
    piece as a payload is read. Releases the GIL while it runs."""
    return _crc32(data, value)


def crc32_bytes(value: int) -> bytes:
    """A CRC-32 as a chunk's header stores it (4 bytes, big-endian)."""
    return value.to_bytes(CRC_LEN, "big")
