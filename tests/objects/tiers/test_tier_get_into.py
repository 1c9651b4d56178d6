"""``ObjectTier.get_into``: a whole object read into the front of a caller's buffer (a
compressed chunk, shorter than its slot, read into a reused buffer), against every
backend's real service on loopback: no buffer of the object's size per read, the exact
bytes, None for a missing key, and an oversize object refused as ``get`` refuses it,
``buf`` untouched and nothing written past it."""

from __future__ import annotations

import os
import stat
import tracemalloc
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from kit import open_loopback_tier

from kvtier.config import load_config
from kvtier.errors import ObjectError, ObjectTooLarge
from kvtier.objects import codec
from kvtier.objects.codec import HASH_PIECE
from kvtier.objects.tiers import FileTier, ObjectTier, open_tier
from kvtier.objects.tiers.base import ObjectTier as Base

if TYPE_CHECKING:
    from conftest import S3Bucket

pytestmark = pytest.mark.integration

BIG = 3 << 20  # a compressed chunk of the bench model's 4 MiB slot
SENTINEL = 0xA5
#: what a read may allocate beyond a few small objects, per backend: S3's body is read in
#: the checksum's pieces, each of which urllib3 reads into a new bytes object of its size
#: (the slot itself is never allocated); the others read straight into the buffer
PIECE_ALLOWED = {"s3": HASH_PIECE}


@pytest.fixture(params=["file", "s3", "redis"])
def tier(request: pytest.FixtureRequest, tmp_path) -> Iterator[ObjectTier]:
    t = open_loopback_tier(request.param, request, tmp_path)
    yield t
    t.close()


def _guarded(size: int, tail: int = 4096) -> tuple[bytearray, memoryview]:
    """A buffer of ``size`` bytes at the front of a larger one filled with a sentinel:
    what is written past the buffer shows in the tail."""
    whole = bytearray([SENTINEL]) * (size + tail)
    return whole, memoryview(whole)[:size]


def _untouched_from(whole: bytearray, start: int) -> bool:
    return whole[start:] == bytearray([SENTINEL]) * (len(whole) - start)


@pytest.mark.parametrize("n", [1000, 200_000, BIG], ids=["small", "direct", "big"])
def test_get_into_reads_the_exact_bytes_to_the_front(tier: ObjectTier, n: int) -> None:
    data = os.urandom(n)
    tier.put("obj", [data[:100], data[100:]])
    whole, buf = _guarded(n + 5000)
    assert tier.get_into("obj", buf) == n
    assert whole[:n] == data
    assert _untouched_from(whole, n + 5000), "written past the buffer"
    before = bytes(whole)
    assert tier.get("obj") == data and tier.get("obj", max_bytes=n) == data
    assert bytes(whole) == before, "a later read wrote into the buffer"
    # an object exactly the buffer's size fits
    exact = memoryview(bytearray(n))
    assert tier.get_into("obj", exact) == n and exact == data


def test_get_into_a_missing_key_is_none(tier: ObjectTier) -> None:
    whole, buf = _guarded(10_000)
    assert tier.get_into("absent", buf) is None
    assert _untouched_from(whole, 0)


@pytest.mark.parametrize("n", [5000, BIG], ids=["small", "big"])
def test_get_into_refuses_an_oversize_object_as_get_does(tier: ObjectTier, n: int) -> None:
    data = os.urandom(n)
    tier.put("obj", [data])
    whole, buf = _guarded(n - 1)
    with pytest.raises(ObjectTooLarge) as got_into:
        tier.get_into("obj", buf)
    with pytest.raises(ObjectTooLarge) as got:
        tier.get("obj", max_bytes=n - 1)
    assert type(got_into.value) is type(got.value)
    assert _untouched_from(whole, 0), "the buffer was written for a refused object"
    assert tier.get_into("obj", memoryview(bytearray(n))) == n  # the next read is intact


def test_get_into_allocates_no_buffer_of_the_objects_size(tier: ObjectTier) -> None:
    data = os.urandom(BIG)
    tier.put("obj", [data])
    buf = memoryview(bytearray(BIG + 4096))
    assert tier.get_into("obj", buf) == BIG  # connections opened, code paths warm
    buf[:] = bytes(len(buf))
    tracemalloc.start()
    try:
        n = tier.get_into("obj", buf)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == BIG and buf[:BIG] == data
    allowed = BIG // 8 + PIECE_ALLOWED.get(tier.name, 0)
    assert peak < allowed, f"{peak} bytes allocated to read a {BIG}-byte object"


def test_get_into_a_chunk_decodes(tier: ObjectTier) -> None:
    """A framed chunk read into a reused buffer verifies like one read with get."""
    payload = os.urandom(8192)
    parts = codec.encode("c", payload, dtype="uint8", shape=[8192])
    tier.put("c", parts)
    buf = memoryview(bytearray(codec.encoded_size(parts) + 100))
    n = tier.get_into("c", buf)
    assert n == codec.encoded_size(parts)
    out = codec.decode(buf[:n], key="c", dtype="uint8", shape=[8192])
    assert bytes(out) == payload


def test_get_into_takes_a_buffer_of_any_format(tier: ObjectTier) -> None:
    tier.put("obj", [b"abcdef"])
    buf = memoryview(bytearray(16)).cast("H")
    assert tier.get_into("obj", buf) == 6
    assert buf.cast("B")[:6] == b"abcdef"


# -- the file tier: what get refuses, get_into refuses ----------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_file_get_into_refuses_what_is_not_a_regular_file(tmp_path, kind: str) -> None:
    tier = FileTier(str(tmp_path / "objects"), background_sweep=False)
    tier.put("k", [b"x" * 100])  # the fan-out directory exists
    path = tier.path("k")
    os.unlink(path)
    target = tmp_path / "secret"
    target.write_bytes(b"not kv")
    {
        "fifo": lambda: os.mkfifo(path),
        "directory": lambda: os.mkdir(path),
        "symlink": lambda: os.symlink(target, path),
    }[kind]()
    whole, buf = _guarded(1000)
    with pytest.raises(ObjectError) as got_into:
        tier.get_into("k", buf)
    with pytest.raises(ObjectError) as got:
        tier.get("k")
    assert type(got_into.value) is type(got.value)
    assert _untouched_from(whole, 0)
    if kind == "fifo":
        assert stat.S_ISFIFO(os.lstat(path).st_mode)  # opened without blocking, refused
    tier.close()


# -- the default, for a backend that does not override it --------------------------------------


class _GetOnly(Base):
    """A tier with only ``get``: the base class's get_into reads through it."""

    name = "get-only"

    def __init__(self, blobs: dict[str, bytes]) -> None:
        self.blobs = blobs

    def exists(self, keys):  # type: ignore[no-untyped-def]
        return [k in self.blobs for k in keys]

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        blob = self.blobs.get(key)
        if blob is not None and max_bytes is not None and len(blob) > max_bytes:
            raise ObjectTooLarge(f"{len(blob)} > {max_bytes}")
        return blob

    def put(self, key, parts):  # type: ignore[no-untyped-def]
        self.blobs[key] = b"".join(parts)

    def delete(self, keys):  # type: ignore[no-untyped-def]
        for k in keys:
            self.blobs.pop(k, None)

    def close(self) -> None:
        pass


def test_the_default_get_into_reads_through_get() -> None:
    tier = _GetOnly({"a": b"hello", "big": b"y" * 50})
    whole, buf = _guarded(20)
    assert tier.get_into("a", buf) == 5 and whole[:5] == b"hello"
    assert tier.get_into("absent", buf) is None
    with pytest.raises(ObjectTooLarge):
        tier.get_into("big", buf)
    assert _untouched_from(whole, 20)


def test_s3_read_into_allocates_no_buffer_of_the_slots_size(s3_bucket: S3Bucket) -> None:
    """read_into streams the body as get_into does: urllib3 reads each ``readinto`` into a
    new bytes object of the size asked, so the slot is filled in pieces."""
    from kvtier.objects.remote import MAX_FRAME

    tier = open_tier(load_config({"remote_url": s3_bucket.url}, environ={}))
    payload = memoryview(bytearray(os.urandom(BIG)))
    tier.put("c", codec.encode("c", payload, dtype="uint8", shape=[BIG]))
    slot = memoryview(bytearray(BIG))
    assert tier.read_into("c", slot, MAX_FRAME) is not None  # warm
    slot[:] = bytes(BIG)
    tracemalloc.start()
    try:
        head = tier.read_into("c", slot, MAX_FRAME)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert head is not None and slot == payload
    allowed = BIG // 8 + PIECE_ALLOWED["s3"]
    assert peak < allowed, f"{peak} bytes allocated to read a {BIG}-byte chunk"
    tier.close()
