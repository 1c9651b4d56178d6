"""An upload queued behind the one probe after a backoff waits for the probe's report
(BackoffState.admit_waiting) instead of failing fast: a backend that came back must not
lose the uploads that arrived while its probe was out; one still down fails them fast."""

from __future__ import annotations

import threading
import time

from kvtier.objects.health import BackoffState, ConstantBackoff


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
