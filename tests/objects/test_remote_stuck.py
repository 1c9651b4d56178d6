"""RemoteIO against a fake tier whose calls block on events: who owns a slot while its read
is in flight, a slow or hung tier, uploads of objects that exist, and the shutdown flush.

No servers and no sleeps standing in for an order of events: each interleaving is
forced with events, and each deadline is made short and then waited past.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest
from faketier import DT, SHAPE, SIZE, WAIT, FakeTier, collect, frame, make_rio, payload, until

from kvtier.objects import codec
from kvtier.objects.health import ConstantBackoff, ExponentialBackoff
from kvtier.objects.remote import RemoteIO
from kvtier.objects.sealing import Sealer
from kvtier.ops import OpKind, OpResult


class HookedLock:
    """A lock that runs ``hook(thread)`` before the first acquire by each thread: how a
    test makes two threads meet at one op's lock in the order it chooses."""

    def __init__(self, hook: Callable[[threading.Thread], None]) -> None:
        self._lock = threading.Lock()
        self._hook = hook
        self._seen: set[int] = set()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        if me not in self._seen:
            self._seen.add(me)
            self._hook(threading.current_thread())
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def op_of(rio: RemoteIO, op_id: int):
    return next(op for op in rio.queue._inflight.values() if op.op_id == op_id)


# ---- a slot is written only while it belongs to the read that writes it -------------------


def test_a_read_that_starts_while_poll_times_it_out_is_never_reported_before_it_is_over() -> None:
    """The I/O thread picks a get up before its deadline; poll() snapshots it as expired
    and not started; the thread then starts reading into the slot; only then does poll()
    take the op's lock. Reporting it then (a timeout) frees a slot that is being written:
    the next store takes it (the free list is LIFO) and the late read overwrites it."""
    tier = FakeTier()
    tier.objects["a"] = frame("a", 1)
    tier.objects["b"] = frame("b", 2)
    tier.hold["a"], tier.hold["b"] = threading.Event(), threading.Event()
    rio = make_rio(tier, timeout_s=0.3)
    rio.submit_get_into(1, "a", memoryview(bytearray(SIZE)), dtype=DT, shape=SHAPE)
    until(lambda: "a" in tier.entered, "a's read to begin")  # the one read thread is busy
    slot_b = memoryview(bytearray(SIZE))
    rio.submit_get_into(2, "b", slot_b, dtype=DT, shape=SHAPE)
    op_b = op_of(rio, 2)
    io_at_lock, poll_at_lock = threading.Event(), threading.Event()

    def meet(thread: threading.Thread) -> None:
        if thread is threading.main_thread():  # poll(), after choosing what expired
            poll_at_lock.set()
            until(lambda: "b" in tier.entered or op_b.done, "the I/O thread's decision")
        else:  # the I/O thread, before its deadline, about to start b
            io_at_lock.set()
            assert poll_at_lock.wait(WAIT)

    op_b.lock = HookedLock(meet)
    tier.hold["a"].set()
    assert io_at_lock.wait(WAIT)
    until(lambda: time.monotonic() > op_b.deadline, "b's deadline")
    first = {r.op_id: r for r in rio.poll()}
    # the invariant: no result for b while its read into the slot is still running
    assert not (2 in first and "b" in tier.active), f"b reported while being read: {first[2]}"
    tier.hold["b"].set()
    rest = collect(rio, 2 - len(first))
    results = {**first, **rest}
    assert set(results) == {1, 2} and rio.poll() == []  # one result per op
    if results[2].ok:  # it started: reported when over, with its own bytes in its slot
        assert bytes(slot_b) == bytes(payload(2))
    else:  # it timed out before it started: its slot was never written
        assert results[2].error_kind == "timeout" and bytes(slot_b) == bytes(SIZE)
    rio.close()


# ---- a slow or hung tier -----------------------------------------------------------------------


def test_a_started_read_past_its_deadline_is_stuck_counted_and_keeps_its_slot(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.remote")
    tier = FakeTier()
    tier.objects["s"] = frame("s", 3)
    tier.hold["s"] = threading.Event()
    rio = make_rio(tier, timeout_s=0.05, backoff=ConstantBackoff(60))
    slot = memoryview(bytearray(SIZE))
    rio.submit_get_into(1, "s", slot, dtype=DT, shape=SHAPE)
    until(lambda: "s" in tier.entered, "the read to begin")
    until(lambda: time.monotonic() > op_of(rio, 1).deadline, "the deadline")
    assert rio.poll() == []  # its read has not returned: its slot is not given back
    # a timeout counts against the tier: reads go down, the next lookup fails at once
    assert rio.reads_down
    rio.submit_get_into(2, "s", memoryview(bytearray(SIZE)), dtype=DT, shape=SHAPE)
    assert collect(rio, 1)[2].error_kind == "unreachable"
    assert tier.calls["read"] == 1
    assert rio.stuck_reads == 1 and rio.counters()["reads_stuck"] == 1
    assert "object tier fake is timing out (1 failures in a row), reads fail fast" in caplog.text
    tier.hold["s"].set()
    res = collect(rio, 1)[1]  # reported once its read is over, verified in its slot
    assert res.ok and bytes(slot) == bytes(payload(3))
    assert rio.stuck_reads == 0 and rio.counters()["reads_stuck"] == 1
    assert rio.reads_down  # an answer after the deadline is a timeout, not a recovery
    rio.close()


def test_a_hung_tier_costs_one_timeout_per_lookup_until_down_then_nothing() -> None:
    """Every read blocks for good. Lookups (each waits for its result or its deadline,
    as the scheduler does) pay the deadline only until the tier is marked down; after
    that they are answered at once, and nothing grows: threads, stuck reads, slots."""
    tier = FakeTier()
    tier.hold_all = threading.Event()
    timeout = 0.1
    rio = make_rio(
        tier, threads=4, timeout_s=timeout, backoff=ExponentialBackoff(base=0.02, cap=60.0)
    )
    threads_before = threading.active_count()
    waited: list[float] = []
    slots_out = 0  # slots not given back (their fetch not reported)
    for i in range(40):
        t0 = time.monotonic()
        rio.submit_get_into(i, f"k{i}", memoryview(bytearray(SIZE)), dtype=DT, shape=SHAPE)
        got: list[OpResult] = []
        while not got and time.monotonic() - t0 <= timeout:
            got += rio.poll()
            time.sleep(0.002)
        waited.append(time.monotonic() - t0)
        slots_out += not got
    slow = [w for w in waited if w > timeout]
    # the read threads each take one stuck read; each such lookup pays one deadline
    assert len(slow) <= rio.read_threads + 1, waited
    assert max(waited[-20:]) < timeout / 2, waited  # down: answered at once
    assert rio.stuck_reads == rio.read_threads == tier.calls["read"]
    assert rio.reads_down_s >= timeout  # what the worker tells the scheduler
    assert slots_out <= rio.read_threads + 1
    assert len(rio.queue._inflight) == rio.read_threads  # only the stuck reads are still out
    assert threading.active_count() == threads_before
    tier.hold_all.set()  # the mount comes back: the stuck reads are reported (misses)
    rio.close()


def test_a_hung_tier_stops_taking_uploads_and_gives_back_their_slots() -> None:
    tier = FakeTier()
    tier.hold_all = threading.Event()
    rio = make_rio(tier, write_stall_s=0.05, backoff=ConstantBackoff(60))
    for i in range(3):
        assert rio.submit_put(i, f"w{i}", payload(i), dtype=DT, shape=SHAPE)
    until(lambda: "w0" in tier.entered, "the first write to begin")
    time.sleep(0.06)  # past write_stall_s
    res = {r.op_id: r for r in rio.poll()}
    # the one write thread is stuck: the queued uploads are reported, their slots go back
    assert {k: r.error_kind for k, r in res.items()} == {1: "unreachable", 2: "unreachable"}
    assert rio.writes_down and rio.stuck_writes == 1 and rio.counters()["writes_stuck"] == 1
    assert rio.submit_put(9, "w9", payload(9), dtype=DT, shape=SHAPE)
    assert collect(rio, 1)[9].error_kind == "unreachable"
    assert rio.pending_writes == 1 and tier.calls["put"] == 1
    tier.hold_all.set()
    assert collect(rio, 1)[0].ok
    assert rio.stuck_writes == 0
    rio.close()


# ---- uploads of objects that exist ---------------------------------------------------------


def test_an_object_that_exists_is_not_sealed_or_written_again() -> None:
    sealer = Sealer(bytes(range(32)))
    tier = FakeTier()
    rio = make_rio(tier, signer=codec.Signer(sealer=sealer))
    assert rio.submit_put(1, "c", payload(1), dtype=DT, shape=SHAPE)
    assert collect(rio, 1)[1].ok
    for i in range(2, 5):  # write-through stores the same chunk again (another request)
        assert rio.submit_put(i, "c", payload(1), dtype=DT, shape=SHAPE)
    assert all(r.ok for r in collect(rio, 3).values())
    assert tier.calls["put"] == 1 and sealer.seals == rio.seals == 1
    assert rio.counters()["puts_existing"] == 3
    rio.close()


def test_an_object_whose_fetch_was_rejected_is_written_again() -> None:
    tier = FakeTier()
    good = frame("c", 1)
    tier.objects["c"] = good[:-1] + bytes([good[-1] ^ 0xFF])  # corrupt: a checksum miss
    rio = make_rio(tier)
    rio.submit_get_into(1, "c", memoryview(bytearray(SIZE)), dtype=DT, shape=SHAPE)
    assert collect(rio, 1)[1].error_kind == "checksum"
    assert rio.submit_put(2, "c", payload(1), dtype=DT, shape=SHAPE)  # recomputed, stored
    assert collect(rio, 1)[2].ok and tier.calls["put"] == 1  # repaired, not skipped
    slot = memoryview(bytearray(SIZE))
    rio.submit_get_into(3, "c", slot, dtype=DT, shape=SHAPE)
    assert collect(rio, 1)[3].ok and bytes(slot) == bytes(payload(1))
    assert rio.submit_put(4, "c", payload(1), dtype=DT, shape=SHAPE)
    assert collect(rio, 1)[4].ok and tier.calls["put"] == 1  # good now: not again
    rio.close()


# ---- the shutdown flush ------------------------------------------------------------------------


def test_the_shutdown_flush_accounts_for_every_pending_upload(caplog) -> None:
    """Each upload pending at shutdown is written, or reported with why it was not:
    failed (by kind), still queued when the flush ended (dropped), or still in a backend
    call (left behind)."""
    tier = FakeTier()
    tier.fail_put.add("bad")
    tier.hold["slow"], tier.hold["hang"] = threading.Event(), threading.Event()
    rio = make_rio(tier)  # one write thread: the uploads go one after the other
    for i, key in enumerate(["slow", "bad", "ok0", "hang", "ok1", "ok2"]):
        assert rio.submit_put(i, key, payload(i), dtype=DT, shape=SHAPE)
    until(lambda: "slow" in tier.entered, "the first write")  # all six pending from here
    with caplog.at_level(logging.WARNING, logger="kvtier.remote"):
        threading.Timer(0.02, tier.hold["slow"].set).start()  # lands during the flush
        missing = rio.flush(0.5)
        report = rio.last_flush
        assert report is not None
        assert (report.pending, report.written, report.failed) == (6, 2, {"object": 1})
        assert (report.queued, report.writing, missing) == (2, 1, 4)
        rio.close(timeout_s=0.2)
    text = caplog.text
    assert "6 pending: 2 written, 1 failed (object: 1), 2 still queued" in text
    assert "1 still in a backend call" in text
    assert "2 queued writes dropped" in text and "1 writes still in a fake call" in text
    assert rio.counters()["writes_dropped"] == 2
    tier.hold["hang"].set()


@pytest.mark.parametrize("n", [0, 3])
def test_a_flush_with_everything_written_reports_nothing_missing(n: int, caplog) -> None:
    tier = FakeTier()
    rio = make_rio(tier)
    for i in range(n):
        assert rio.submit_put(i, f"k{i}", payload(i), dtype=DT, shape=SHAPE)
    with caplog.at_level(logging.WARNING, logger="kvtier.remote"):
        assert rio.flush(WAIT) == 0
    # the report counts what was pending when the flush began (a write thread may have
    # written some before): every one of those written, nothing left
    report = rio.last_flush
    assert report is not None and report.pending <= n
    assert (report.written, report.failed, report.queued, report.writing) == (
        report.pending,
        {},
        0,
        0,
    )
    assert "not written" not in caplog.text
    assert {r.kind for r in collect(rio, n).values()} <= {OpKind.UPLOAD}
    rio.close()
