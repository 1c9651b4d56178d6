"""Loads before stores: an upload waits (at most ``UPLOAD_YIELD_S``) for the reads in
flight before it starts, so an upload nobody waits on does not take the link from a lookup
that waits on its reads; bounded, so steady lookups slow uploads but never stop them. A
real directory tier, reads slowed to stand for a slow link."""

from __future__ import annotations

import threading
import time

from kit import PAYLOAD_SIZE, before_reads, collect, payload

from kvtier.objects import codec, io_queue
from kvtier.objects.health import ConstantBackoff
from kvtier.objects.remote import RemoteIO
from kvtier.objects.tiers import FileTier

SHAPE = [2, 8, 64]
DT = "bfloat16"
READ_S = 0.3  # each read of the tier


def make_rio(tier: FileTier) -> RemoteIO:
    return RemoteIO(
        tier,
        threads=2,
        queue_depth=16,
        timeout_s=5.0,
        signer=codec.Signer(b"k"),
        backoff=ConstantBackoff(60),
    )


def writes_at(monkeypatch, tier: FileTier) -> list[float]:
    """When each upload reached the tier."""
    at: list[float] = []
    real = FileTier.put

    def put(self, key, parts):
        at.append(time.monotonic())
        return real(self, key, parts)

    monkeypatch.setattr(FileTier, "put", put)
    return at


def test_an_upload_starts_once_the_reads_in_flight_are_over(tmp_path, monkeypatch) -> None:
    tier = FileTier(str(tmp_path / "t"))
    rio = make_rio(tier)
    assert rio.submit_put(1, "stored", payload(1), dtype=DT, shape=SHAPE)
    collect(rio, 1)
    read_over: list[float] = []

    def slow_read(key: str) -> None:
        time.sleep(READ_S)
        read_over.append(time.monotonic())

    before_reads(monkeypatch, FileTier, slow_read)
    wrote = writes_at(monkeypatch, tier)
    dest = memoryview(bytearray(PAYLOAD_SIZE))
    rio.submit_get_run([(2, "stored", dest)], dtype=DT, shape=SHAPE)
    time.sleep(0.05)  # the read thread is in its (slow) read
    assert rio.submit_put(3, "new", payload(2), dtype=DT, shape=SHAPE)
    res = collect(rio, 2)
    assert res[2].ok and res[3].ok and bytes(dest) == bytes(payload(1)), res
    assert len(wrote) == 1 and len(read_over) == 1
    assert wrote[0] >= read_over[0], "the upload reached the tier while a read was in flight"
    assert rio.counters()["writes_yielded"] == 1
    rio.close()


def test_steady_reads_slow_uploads_but_never_stop_them(tmp_path, monkeypatch) -> None:
    """Reads in flight all the time: each upload starts after at most UPLOAD_YIELD_S."""
    monkeypatch.setattr(io_queue, "UPLOAD_YIELD_S", 0.2)
    tier = FileTier(str(tmp_path / "t"))
    rio = make_rio(tier)
    assert rio.submit_put(1, "stored", payload(1), dtype=DT, shape=SHAPE)
    collect(rio, 1)
    before_reads(monkeypatch, FileTier, lambda key: time.sleep(READ_S))
    stop = threading.Event()

    def lookups() -> None:  # one read always in flight (and queued behind it)
        op = 100
        while not stop.is_set():
            for _ in range(2):
                rio.submit_get_run(
                    [(op, "stored", memoryview(bytearray(PAYLOAD_SIZE)))], dtype=DT, shape=SHAPE
                )
                op += 1
            time.sleep(READ_S)

    reader = threading.Thread(target=lookups, daemon=True)
    reader.start()
    time.sleep(0.05)
    for i in range(3):
        assert rio.submit_put(10 + i, f"n{i}", payload(i), dtype=DT, shape=SHAPE)
    try:
        assert rio.flush(10) == 0, "uploads stopped behind steady reads"
    finally:
        stop.set()
        reader.join()
    assert rio.counters()["writes_yielded"] >= 3  # each waited, none for good
    rio.close()
