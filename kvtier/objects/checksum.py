"""The checksum of a stored chunk's payload: CRC-32, computed with ISA-L.

Apart from the codec because the tiers compute it too, piece by piece as a payload
lands in its slot (:meth:`ObjectTier.read_into_hashed`). CRC-32 rather than the xxh3-128
of older chunks: on the GPU host's CPU ISA-L's CRC-32 ran 1.6-3.2x faster (docs/cuda.md,
"Object tier"; on a 2-core VM about as fast), and every byte of every hit is checked. It
guards against accidents (a bit flip, a torn or mixed-up object: a corrupt payload passes
with odds of 2^-32); forgery is the HMAC signature's job.
"""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # the same CRC-32, slower: a platform without an isal wheel
    from zlib import crc32 as _crc32

__all__ = ["CRC_LEN", "HASH_PIECE", "LandingCrc", "crc32_bytes", "payload_crc32"]

#: bytes of a CRC-32 in a chunk's header
CRC_LEN = 4
#: bytes checksummed at a time as a payload lands: a piece is still in the CPU's cache
#: when it is checksummed, and each costs a few Python calls under the GIL. With 8 read
#: threads on a 16-core GPU host, 1 MiB pieces read a Llama-3-8B restart hit (32 MiB
#: chunks) 20 % faster than 256 KiB ones (4 MiB: no better); with 2 on a 2-core VM, 8 %
#: slower (bench/gpu_restart.py --hash-piece-kib)
HASH_PIECE = 1 << 20


def payload_crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """The CRC-32 (zlib's) of ``data``, continuing from ``value``: computable piece by
    piece as a payload is read. Releases the GIL while it runs."""
    return _crc32(data, value)


def crc32_bytes(value: int) -> bytes:
    """A CRC-32 as a chunk's header stores it (4 bytes, big-endian)."""
    return value.to_bytes(CRC_LEN, "big")


class LandingCrc:
    """The CRC-32 of a buffer filled front to back in pieces of any size (socket reads,
    a streamed body): each :data:`HASH_PIECE` is checksummed as soon as it has landed,
    while it is still in the CPU's cache, so reading and checking are one pass over
    memory instead of a read and then a checksum pass."""

    __slots__ = ("done", "value", "view")

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.done = 0  # bytes checksummed so far
        self.value = 0

    def restart(self) -> None:
        """The buffer is filled again from its start (a command retried after a drop)."""
        self.done = self.value = 0

    def landed(self, upto: int) -> None:
        """Bytes ``[0, upto)`` of the buffer hold their final contents."""
        if upto - self.done >= HASH_PIECE or (upto == self.view.nbytes and upto > self.done):
            self.value = payload_crc32(self.view[self.done : upto], self.value)
            self.done = upto

    def result(self) -> int:
        """The CRC-32 of the whole buffer (what has not been checksummed yet, now)."""
        self.landed(self.view.nbytes)
        return self.value
