"""The Redis tier reads a chunk's payload from the socket straight into its slot: no
buffer of the chunk's size and no copy of it (a restart hit reads many of them)."""

from __future__ import annotations

import os
import tracemalloc

import pytest

from kvtier.errors import ObjectTooLarge
from kvtier.objects import codec
from kvtier.objects.remote import MAX_FRAME
from kvtier.objects.tiers.redis import RedisTier

pytestmark = pytest.mark.integration

SLOT = 4 << 20  # one chunk of the bench model
SHAPE, DT = [SLOT // 2], "bfloat16"


def _stored(tier: RedisTier, key: str) -> memoryview:
    payload = memoryview(bytearray(os.urandom(SLOT)))
    tier.put(key, codec.encode(key, payload, dtype=DT, shape=SHAPE, signer=None))
    return payload


def test_a_chunk_lands_in_its_slot_without_a_buffer_of_its_size(redis_url: str) -> None:
    tier = RedisTier(redis_url)
    payload = _stored(tier, "into")
    slot = memoryview(bytearray(SLOT))
    tier.read_into("into", slot, MAX_FRAME)  # connection opened, code paths warm
    slot[:] = bytes(SLOT)
    tracemalloc.start()
    try:
        head = tier.read_into("into", slot, MAX_FRAME)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert head is not None and bytes(slot) == bytes(payload)
    codec.verify(head, slot, key="into", dtype=DT, shape=SHAPE, signer=None)
    assert peak < SLOT // 8, f"{peak} bytes allocated to read a {SLOT}-byte chunk"
    tier.close()


def test_short_long_and_missing_objects_keep_their_answers(redis_url: str) -> None:
    """Shorter than the slot: read whole (a compressed chunk's path), nothing in the
    slot; longer than slot + head: refused; absent: None; the next read is intact."""
    tier = RedisTier(redis_url)
    payload = _stored(tier, "ok")
    tier._client.set("short", b"x" * 1000)
    tier._client.set("long", b"x" * (SLOT + MAX_FRAME + 1))
    slot = memoryview(bytearray(SLOT))
    with pytest.raises(Exception, match="too short|ends inside|bytes"):
        tier.read_into("short", slot, MAX_FRAME)
    assert bytes(slot[:16]) == bytes(16)
    with pytest.raises(ObjectTooLarge):
        tier.read_into("long", slot, MAX_FRAME)
    assert tier.read_into("absent", slot, MAX_FRAME) is None
    head = tier.read_into("ok", slot, MAX_FRAME)
    assert head is not None and bytes(slot) == bytes(payload)
    tier.close()
