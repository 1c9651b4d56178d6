"""``codec.LandingCrc``: the CRC-32 of a buffer computed as it fills, in pieces of any
size, equals zlib's CRC of the whole; a fill that starts over is checksummed afresh."""

from __future__ import annotations

import os
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.objects.codec import HASH_PIECE, LandingCrc


def fill(landing: LandingCrc, data: bytes, steps: list[int]) -> None:
    """Copy ``data`` into the landing's buffer in reads of the sizes in ``steps`` (cycled),
    telling it after each, as a socket reader does."""
    got, i = 0, 0
    while got < len(data):
        k = min(steps[i % len(steps)], len(data) - got)
        landing.view[got : got + k] = data[got : got + k]
        got += k
        i += 1
        landing.landed(got)


@settings(max_examples=40, deadline=None)
@given(
    n=st.sampled_from([0, 1, HASH_PIECE - 1, HASH_PIECE, HASH_PIECE + 1, 2 * HASH_PIECE + 3]),
    steps=st.lists(st.integers(1, 3 * HASH_PIECE), min_size=1, max_size=5),
)
def test_any_read_sizes_give_the_crc_of_the_whole(n: int, steps: list[int]) -> None:
    data = os.urandom(n)
    landing = LandingCrc(memoryview(bytearray(n)))
    fill(landing, data, steps)
    assert landing.result() == zlib.crc32(data)


def test_pieces_are_checksummed_as_they_land() -> None:
    """Small reads accumulate to a piece before it is checksummed; bytes not yet landed are
    never read (they would be checksummed before their final contents)."""
    n = 3 * HASH_PIECE
    landing = LandingCrc(memoryview(bytearray(n)))
    landing.landed(HASH_PIECE - 1)
    assert landing.done == 0
    landing.landed(HASH_PIECE + 10)
    assert landing.done == HASH_PIECE + 10
    landing.landed(2 * HASH_PIECE)
    assert landing.done == HASH_PIECE + 10  # less than a piece since: waits
    landing.landed(n)
    assert landing.done == n  # the end is checksummed whatever its size


def test_a_fill_that_starts_over_is_checksummed_afresh() -> None:
    """A retried command reads its reply into the same buffer again: what the first try
    brought (other bytes, perhaps of a value replaced in between) must not count."""
    n = 2 * HASH_PIECE + 5
    first, second = os.urandom(n), os.urandom(n)
    landing = LandingCrc(memoryview(bytearray(n)))
    fill(landing, first[: HASH_PIECE + 100], [64 * 1024])
    assert landing.done > 0
    landing.restart()
    fill(landing, second, [100_000])
    assert landing.result() == zlib.crc32(second)
