"""``kvtier.threads.FetchSwitches``: Python's switch interval is short exactly while an
object-tier read is in flight, process-wide, and comes back as it was after the last."""

from __future__ import annotations

import sys
import threading

import pytest
from faketier import DT, SHAPE, SIZE, FakeTier, collect, frame, make_rio, until

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.objects.remote import RemoteIO
from kvtier.threads import FETCH_SWITCH_S, FetchSwitches


@pytest.fixture(autouse=True)
def interval():
    """Every test starts at 1 ms (what kvtier's worker sets) and leaves it as it was."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    yield 0.001
    sys.setswitchinterval(old)


def test_the_interval_is_short_while_any_holder_has_a_read_in_flight() -> None:
    a, b = FetchSwitches(50e-6), FetchSwitches(50e-6)
    a.hold(True)
    assert sys.getswitchinterval() == pytest.approx(50e-6)
    a.hold(True)  # said twice: still one holder
    b.hold(True)
    a.hold(False)
    assert sys.getswitchinterval() == pytest.approx(50e-6), "b still reads"
    b.hold(False)
    assert sys.getswitchinterval() == pytest.approx(0.001)
    b.hold(False)  # said twice: nothing to give back
    a.hold(True)
    assert sys.getswitchinterval() == pytest.approx(50e-6), "counted right after the repeats"
    a.hold(False)
    assert sys.getswitchinterval() == pytest.approx(0.001)


def test_zero_or_a_longer_interval_leaves_it_as_it_is() -> None:
    for asked in (0.0, 0.01):
        s = FetchSwitches(asked)
        s.hold(True)
        assert sys.getswitchinterval() == pytest.approx(0.001)
        s.hold(False)


def _blocked_read(rio: RemoteIO, tier: FakeTier, key: str) -> threading.Event:
    tier.objects[key] = frame(key, 1)
    gate = tier.hold[key] = threading.Event()
    rio.submit_get_into(1, key, memoryview(bytearray(SIZE)), dtype=DT, shape=SHAPE)
    until(tier.entered.setdefault(key, threading.Event()).is_set, "the read to begin")
    return gate


def test_a_remote_io_holds_the_short_interval_from_submit_to_the_reads_report() -> None:
    tier = FakeTier()
    rio = make_rio(tier, timeout_s=5.0)
    try:
        assert rio.switches.interval_s == FETCH_SWITCH_S
        gate = _blocked_read(rio, tier, "k1")
        assert sys.getswitchinterval() == pytest.approx(FETCH_SWITCH_S)
        gate.set()
        assert collect(rio, 1)[1].ok
        assert sys.getswitchinterval() == pytest.approx(0.001)
        # a miss is over as soon as it is reported too
        rio.submit_get_into(2, "absent", memoryview(bytearray(SIZE)), dtype=DT, shape=SHAPE)
        assert not collect(rio, 1)[2].ok
        assert sys.getswitchinterval() == pytest.approx(0.001)
    finally:
        rio.close(0.5)


def test_uploads_leave_the_interval_alone() -> None:
    tier = FakeTier()
    gate = tier.hold["up"] = threading.Event()
    rio = make_rio(tier, timeout_s=5.0)
    try:
        assert rio.submit_put(1, "up", memoryview(bytearray(SIZE)), dtype=DT, shape=SHAPE)
        until(tier.entered.setdefault("up", threading.Event()).is_set, "the put to begin")
        assert sys.getswitchinterval() == pytest.approx(0.001)
        gate.set()
        assert collect(rio, 1)[1].ok
    finally:
        rio.close(0.5)


def test_closing_with_a_read_stuck_in_its_call_gives_the_interval_back() -> None:
    tier = FakeTier()
    rio = make_rio(tier, timeout_s=5.0)
    gate = _blocked_read(rio, tier, "stuck")
    assert sys.getswitchinterval() == pytest.approx(FETCH_SWITCH_S)
    rio.close(0.1)
    assert sys.getswitchinterval() == pytest.approx(0.001)
    gate.set()  # the left-behind read returns; its report must not release twice
    until(lambda: not tier.active, "the stuck read to return")
    other = FetchSwitches(FETCH_SWITCH_S)
    other.hold(True)
    assert sys.getswitchinterval() == pytest.approx(FETCH_SWITCH_S)
    other.hold(False)
    assert sys.getswitchinterval() == pytest.approx(0.001)


def test_fetch_switch_us_sets_the_interval_and_is_checked(tmp_path) -> None:
    assert load_config({}).fetch_switch_us == 50
    # the config's default and the one a RemoteIO built without a config gets are one
    assert load_config({}).fetch_switch_us / 1e6 == pytest.approx(FETCH_SWITCH_S)
    cfg = load_config({"fetch_switch_us": 0, "remote_url": f"file://{tmp_path}"})
    rio = RemoteIO.from_config(cfg)
    try:
        assert rio.switches.interval_s == 0.0
    finally:
        rio.close(0.5)
    for bad in (-1, 1_000_001, "fast"):
        with pytest.raises(ConfigError, match="fetch_switch_us"):
            load_config({"fetch_switch_us": bad})
