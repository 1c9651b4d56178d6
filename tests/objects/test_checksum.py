"""``codec.LandingCrc``: the CRC-32 of a buffer computed as it fills, in pieces of any
size, equals zlib's CRC of the whole; a fill that starts over is checksummed afresh."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.objects.codec import HASH_PIECE, SMALL_HASH_PIECE, LandingCrc


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


def test_the_piece_follows_the_read_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to 2 read threads a directory tier's reads checksum 256 KiB pieces (each still in
    L2), more read 1 MiB ones (fewer GIL hand-offs); RemoteIO sets the tier's piece, and the
    CRC is the whole payload's either way."""
    from kvtier.objects import codec
    from kvtier.objects.remote import MAX_FRAME, RemoteIO
    from kvtier.objects.tiers import FileTier

    assert [codec.hash_piece(n) for n in (1, 2, 3, 8)] == [SMALL_HASH_PIECE] * 2 + [HASH_PIECE] * 2
    n = 2 * HASH_PIECE + 777
    data = os.urandom(n)
    sizes: list[int] = []
    real = codec.payload_crc32

    def counted(view: memoryview, value: int = 0) -> int:
        sizes.append(memoryview(view).nbytes)
        return real(view, value)

    for threads, piece in ((4, SMALL_HASH_PIECE), (16, HASH_PIECE)):
        tier = FileTier(str(tmp_path / str(threads)), background_sweep=False)
        rio = RemoteIO(tier, threads=threads, queue_depth=4, timeout_s=5.0, signer=None)
        try:
            assert tier.hash_piece == piece
            tier.put("k", codec.encode("k", data, dtype="uint8", shape=[n]))
            sizes.clear()
            monkeypatch.setattr(codec, "payload_crc32", counted)
            got = tier.read_into_hashed("k", memoryview(bytearray(n)), MAX_FRAME)
            monkeypatch.setattr(codec, "payload_crc32", real)
            assert got is not None and got[1] == zlib.crc32(data)
            assert max(sizes) == piece and sum(sizes) == n, sizes
        finally:
            rio.close()


def test_a_landing_checksums_in_its_own_piece() -> None:
    data = os.urandom(3 * SMALL_HASH_PIECE + 5)
    landing = LandingCrc(memoryview(bytearray(len(data))), SMALL_HASH_PIECE)
    fill(landing, data[: SMALL_HASH_PIECE + 10], [SMALL_HASH_PIECE + 10])
    assert landing.done == SMALL_HASH_PIECE + 10  # checksummed at a small piece, not 1 MiB
    fill(landing, data, [len(data)])
    assert landing.result() == zlib.crc32(data)
