"""``ObjectTier.read_into_hashed``: the slot read and its CRC-32, computed while the bytes
land, against every backend's real service on loopback. The CRC is what ``codec.verify``
trusts instead of checksumming the slot again, so it must be the CRC of exactly the bytes
in the slot, at every size and after every failure; and a chunk whose bytes changed on
disk is still a counted miss."""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator

import pytest
from kit import collect, open_loopback_tier, xxh3_framed

from kvtier.errors import ChecksumError, ObjectTooLarge, TruncatedError
from kvtier.objects import codec
from kvtier.objects.codec import HASH_PIECE
from kvtier.objects.health import ConstantBackoff
from kvtier.objects.remote import MAX_FRAME, RemoteIO
from kvtier.objects.tiers import FileTier, ObjectTier

pytestmark = pytest.mark.integration


@pytest.fixture(params=["file", "s3", "redis"])
def tier(request: pytest.FixtureRequest, tmp_path) -> Iterator[ObjectTier]:
    t = open_loopback_tier(request.param, request, tmp_path)
    yield t
    t.close()


SIZES = [1, 4096, HASH_PIECE - 1, HASH_PIECE, HASH_PIECE + 1, 3 * HASH_PIECE + 12345]


@pytest.mark.parametrize("n", SIZES)
def test_the_digest_is_of_the_bytes_in_the_slot(tier: ObjectTier, n: int) -> None:
    data = os.urandom(n)
    parts = codec.encode("k", data, dtype="uint8", shape=[n])
    tier.put("k", parts)
    slot = memoryview(bytearray(n))
    got = tier.read_into_hashed("k", slot, MAX_FRAME)
    assert got is not None
    head, crc = got
    assert bytes(slot) == data and crc == zlib.crc32(data)
    assert head == bytes(memoryview(parts[0]))  # the same head read_into returns
    again = memoryview(bytearray(n))
    assert tier.read_into("k", again, MAX_FRAME) == head and bytes(again) == data
    codec.verify(head, slot, key="k", dtype="uint8", shape=[n], payload_crc=crc)


def test_the_slot_is_checksummed_as_it_lands_not_after(
    tier: ObjectTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every backend checksums a chunk piece by piece while it is read (each piece still in
    the CPU's cache), never in a second pass over the whole slot once it is in: no one
    checksum call covers more than a piece and what the last read brought with it."""
    sizes: list[int] = []
    real = codec.payload_crc32

    def counted(data: memoryview, value: int = 0) -> int:
        sizes.append(memoryview(data).nbytes)
        return real(data, value)

    n = 4 * HASH_PIECE + 777
    data = os.urandom(n)
    tier.put("k", codec.encode("k", data, dtype="uint8", shape=[n]))
    monkeypatch.setattr(codec, "payload_crc32", counted)  # the read's checksum calls only
    got = tier.read_into_hashed("k", memoryview(bytearray(n)), MAX_FRAME)
    assert got is not None and got[1] == zlib.crc32(data)
    assert sum(sizes) == n and len(sizes) >= 4, sizes
    assert max(sizes) < 2 * HASH_PIECE, sizes


def test_a_missing_key_is_none(tier: ObjectTier) -> None:
    assert tier.read_into_hashed("nope", memoryview(bytearray(64)), MAX_FRAME) is None


def test_wrong_sizes_fail_as_read_into_fails(tier: ObjectTier) -> None:
    n = HASH_PIECE + 7
    tier.put("k", codec.encode("k", os.urandom(n), dtype="uint8", shape=[n]))
    with pytest.raises(TruncatedError):  # a slot larger than the stored payload
        tier.read_into_hashed("k", memoryview(bytearray(n + 1000)), MAX_FRAME)
    with pytest.raises(ObjectTooLarge):  # one much smaller
        tier.read_into_hashed("k", memoryview(bytearray(n - MAX_FRAME - 1)), MAX_FRAME)


def test_a_wrong_crc_is_a_checksum_error() -> None:
    data = os.urandom(1000)
    parts = codec.encode("k", data, dtype="uint8", shape=[1000])
    head = bytes(memoryview(parts[0]))
    with pytest.raises(ChecksumError):
        codec.verify(
            head,
            memoryview(bytearray(data)),
            key="k",
            dtype="uint8",
            shape=[1000],
            payload_crc=zlib.crc32(b"other"),
        )


@pytest.mark.parametrize("where", [0, HASH_PIECE - 1, HASH_PIECE, 2 * HASH_PIECE + 5])
def test_a_byte_flipped_on_disk_in_any_piece_is_a_counted_miss(tmp_path, where: int) -> None:
    """Through RemoteIO, as the worker reads (no encryption key: the hashed path)."""
    n = 3 * HASH_PIECE + 99
    tier = FileTier(str(tmp_path / "t"))
    data = os.urandom(n)
    tier.put("k", codec.encode("k", data, dtype="uint8", shape=[n]))
    path = tier.path("k")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # the payload is the file's last n bytes
        f.seek(size - n + where)
        b = f.read(1)
        f.seek(size - n + where)
        f.write(bytes([b[0] ^ 0x01]))
    rio = RemoteIO(
        tier, threads=2, queue_depth=4, timeout_s=5.0, signer=None, backoff=ConstantBackoff(0.1)
    )
    try:
        rio.submit_get_into(1, "k", memoryview(bytearray(n)), dtype="uint8", shape=[n])
        r = collect(rio, 1)[1]
        assert not r.ok and r.error_kind == "checksum", r
        assert rio.counters()["errors_checksum"] == 1
    finally:
        rio.close()


def test_a_chunk_stored_with_the_older_xxh3_checksum_is_read_and_checked(
    tier: ObjectTier,
) -> None:
    """A replica upgraded over a tier older kvtier filled: its chunks are still hits, read
    the way a hit reads (into the slot, with the CRC computed as they land), and checked
    with the xxh3-128 they carry; one whose bytes changed is a counted checksum miss."""
    n = HASH_PIECE + 4321
    data = os.urandom(n)
    tier.put("old", xxh3_framed("old", data, dtype="uint8", shape=[n]))
    bad = bytearray(data)
    bad[n // 2] ^= 0x10
    header, _ = xxh3_framed("old-bad", data, dtype="uint8", shape=[n])
    tier.put("old-bad", [header, bytes(bad)])  # the checksum of other bytes than stored
    rio = RemoteIO(
        tier, threads=2, queue_depth=4, timeout_s=5.0, signer=None, backoff=ConstantBackoff(0.1)
    )
    try:
        slot = memoryview(bytearray(n))
        rio.submit_get_into(1, "old", slot, dtype="uint8", shape=[n])
        assert collect(rio, 1)[1].ok and bytes(slot) == data
        rio.submit_get_into(2, "old-bad", memoryview(bytearray(n)), dtype="uint8", shape=[n])
        r = collect(rio, 1)[2]
        assert not r.ok and r.error_kind == "checksum", r
    finally:
        rio.close()  # closes the tier too (the fixture's close again is harmless)
