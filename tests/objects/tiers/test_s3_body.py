"""The S3 tier reads a GET's body into its slot one checksum piece at a time, so each
piece is checked as it lands (while still in the CPU's cache), never all at the end."""

from __future__ import annotations

import os
import zlib

from kvtier.objects.codec import HASH_PIECE, LandingCrc
from kvtier.objects.tiers.s3 import _read_upto


class _Body:
    """A streamed body over ``data`` that records, at each read, its size and how much
    of the slot was checksummed by then."""

    def __init__(self, data: bytes, landing: LandingCrc) -> None:
        self.data, self.landing, self.pos = data, landing, 0
        self.asked: list[int] = []
        self.checked_before: list[int] = []

    def readinto(self, b: memoryview) -> int:
        self.asked.append(len(b))
        self.checked_before.append(self.landing.done)
        n = min(len(b), len(self.data) - self.pos)
        b[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def test_a_body_is_read_and_checked_a_piece_at_a_time() -> None:
    data = os.urandom(3 * HASH_PIECE + 5)
    slot = memoryview(bytearray(len(data)))
    landing = LandingCrc(slot)
    body = _Body(data, landing)
    assert _read_upto(body, slot, landing) == len(data)
    assert max(body.asked) == HASH_PIECE  # never a buffer of the object's size
    # each read starts once the piece before it was checksummed
    assert body.checked_before == [0, HASH_PIECE, 2 * HASH_PIECE, 3 * HASH_PIECE]
    assert bytes(slot) == data
    assert landing.result() == zlib.crc32(data)


def test_a_short_body_reads_what_there_is() -> None:
    data = os.urandom(HASH_PIECE // 2)
    slot = memoryview(bytearray(HASH_PIECE))
    landing = LandingCrc(slot[: len(data)])
    assert _read_upto(_Body(data, landing), slot, None) == len(data)
    assert bytes(slot[: len(data)]) == data
