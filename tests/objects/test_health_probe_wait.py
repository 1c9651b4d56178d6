"""An upload queued behind the one probe after a backoff waits for the probe's report
(BackoffState.admit_waiting) instead of failing fast: a backend that came back must not
lose the uploads that arrived while its probe was out; one still down fails them fast."""

from __future__ import annotations

import threading
import time

from kvtier.objects.health import BackoffState, ConstantBackoff
from kvtier.objects.remote import RemoteIO
from kvtier.objects.tiers.file import FileTier
from kvtier.ops import OpResult


def backed_off_then_over() -> BackoffState:
    """A state whose backoff (50 ms) has just ended: the next op is the probe."""
    state = BackoffState(ConstantBackoff(0.05))
    state.failed()
    time.sleep(0.06)
    return state


def admit_in_thread(state: BackoffState, timeout: float) -> tuple[threading.Thread, list]:
    got: list = []
    t = threading.Thread(target=lambda: got.append(state.admit_waiting(timeout)))
    t.start()
    return t, got


def test_a_waiting_upload_goes_once_the_probe_succeeds() -> None:
    state = backed_off_then_over()
    probe = state.admit()
    assert probe  # the probe's token
    assert state.admit() is None  # a read behind it fails fast
    t, got = admit_in_thread(state, 5.0)
    time.sleep(0.05)
    assert t.is_alive() and not got  # it waits for the probe
    state.succeeded()
    t.join(2.0)
    assert got == [0]  # admitted: the backend is back


def test_a_waiting_upload_fails_fast_once_the_probe_fails() -> None:
    state = backed_off_then_over()
    assert state.admit()
    t, got = admit_in_thread(state, 5.0)
    time.sleep(0.05)
    state.failed()  # the probe found the backend still down: a new backoff
    t.join(2.0)
    assert got == [None]


def test_a_probe_over_without_a_verdict_lets_the_waiting_upload_probe() -> None:
    state = backed_off_then_over()
    probe = state.admit()
    t, got = admit_in_thread(state, 5.0)
    time.sleep(0.05)
    state.probe_over(probe)  # an error about one object: no verdict on the backend
    t.join(2.0)
    assert len(got) == 1 and got[0] and got[0] != probe  # the next probe


def test_the_wait_is_bounded() -> None:
    state = backed_off_then_over()
    assert state.admit()
    t0 = time.monotonic()
    assert state.admit_waiting(0.1) is None  # the probe never reported
    assert time.monotonic() - t0 < 2.0


# -- the entry point: RemoteIO.submit_put while the probe is out ------------------------------


class _SlowBack(FileTier):
    """A directory tier that holds its first put until released: the probe after a
    backoff, out while the engine stores (and submits) more chunks."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.first_put = threading.Event()
        self.release = threading.Event()

    def put(self, key: str, parts: object) -> None:
        if not self.first_put.is_set():
            self.first_put.set()
            self.release.wait(5)
        super().put(key, parts)  # type: ignore[arg-type]


def _collect(rio: RemoteIO, n: int, timeout: float = 15.0) -> dict[int, OpResult]:
    out: list[OpResult] = []
    end = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < end:
        out += rio.poll()
        time.sleep(0.002)
    assert len(out) == n, f"expected {n} results, got {len(out)}"
    return {r.op_id: r for r in out}


def test_uploads_submitted_while_the_probe_is_out_are_written(tmp_path) -> None:
    """The object store came back after an outage: the first upload after the backoff is
    the probe, and the chunks stored while it is out are queued behind it and written
    once it succeeds. Failing them at submit (as ``writes_down`` did while a probe was
    out) lost 15 of 64 chunks right after a Redis restart in the outage test."""
    tier = _SlowBack(str(tmp_path))
    rio = RemoteIO(
        tier, threads=4, queue_depth=64, timeout_s=5.0, signer=None, backoff=ConstantBackoff(0.05)
    )
    rio.health.writes.failed()  # the outage: writes backed off, and then the backoff ends
    time.sleep(0.06)
    shape, n = [2, 8, 64], 2 * 8 * 64 * 2
    rio.submit_put(0, "probe", memoryview(bytearray(n)), dtype="bfloat16", shape=shape)
    assert tier.first_put.wait(5), "the probe never reached the tier"
    for i in range(1, 9):
        assert rio.submit_put(i, f"k{i}", memoryview(bytearray(n)), dtype="bfloat16", shape=shape)
    tier.release.set()
    got = _collect(rio, 9)
    assert {i: r.error_kind for i, r in got.items() if not r.ok} == {}
    assert tier.exists([f"k{i}" for i in range(1, 9)]) == [True] * 8
    rio.close()


def test_uploads_submitted_while_backing_off_still_fail_fast(tmp_path) -> None:
    """The other half of the rule: during the backoff itself an upload is refused at once
    (counted unreachable) and never reaches the tier."""
    tier = _SlowBack(str(tmp_path))
    tier.release.set()
    rio = RemoteIO(
        tier, threads=2, queue_depth=16, timeout_s=5.0, signer=None, backoff=ConstantBackoff(30.0)
    )
    rio.health.writes.failed()
    rio.submit_put(0, "k", memoryview(bytearray(2048)), dtype="bfloat16", shape=[2, 8, 64])
    got = _collect(rio, 1)
    assert got[0].error_kind == "unreachable" and not tier.first_put.is_set()
    rio.close()
