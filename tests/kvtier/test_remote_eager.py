"""A run's reads queued at once on a tier whose reads are known to be quick, the first
chunk alone on one that is unknown or slow (RemoteIO.submit_get_run, EAGER_READ_S).

The order of events is forced with the fake tier's events, never with sleeps.
"""

from __future__ import annotations

import threading

from faketier import DT, SHAPE, SIZE, FakeTier, collect, frame, make_rio, payload, until

from kvtier import remote
from kvtier.errors import TierUnavailable
from kvtier.remote import RemoteIO


def _store(tier: FakeTier, *names: str) -> None:
    for i, k in enumerate(names):
        tier.objects[k] = frame(k, i)


def _run(rio: RemoteIO, first_id: int, keys: list[str]) -> list[memoryview]:
    dests = [memoryview(bytearray(SIZE)) for _ in keys]
    rio.submit_get_run([(first_id + i, k, d) for i, (k, d) in enumerate(zip(keys, dests,
                                                                            strict=True))],
                       dtype=DT, shape=SHAPE)  # fmt: skip
    return dests


def _warm(rio: RemoteIO, tier: FakeTier) -> None:
    """One answered read: the tier's read latency is known from here on."""
    _store(tier, "warm")
    _run(rio, 1, ["warm"])
    assert collect(rio, 1)[1].ok
    assert rio.read_call_s is not None


def test_a_quick_tier_reads_a_runs_chunks_at_once() -> None:
    """Known quick: the second chunk's read begins while the first is still being read
    (first-alone would start it only once the first was found: this waits forever)."""
    tier = FakeTier()
    rio = make_rio(tier, threads=4)  # two read threads
    _warm(rio, tier)
    keys = ["q0", "q1", "q2", "q3"]
    _store(tier, *keys)
    tier.hold["q0"] = threading.Event()
    dests = _run(rio, 10, keys)
    until(lambda: tier.entered.get("q1", threading.Event()).is_set(),
          "the second chunk's read, while the first is held")  # fmt: skip
    assert "q0" in tier.active
    tier.hold["q0"].set()
    res = collect(rio, 4)
    assert all(res[10 + i].ok for i in range(4))
    assert [bytes(d) for d in dests] == [bytes(payload(i)) for i in range(4)]
    assert tier.calls["read"] == 5  # the warm-up and each chunk once
    rio.close()


def test_an_unknown_tier_asks_once_for_a_prompt_it_lacks() -> None:
    """Nothing read yet: the first chunk goes alone, and its miss ends the run."""
    tier = FakeTier()
    rio = make_rio(tier, threads=4)
    assert rio.read_call_s is None
    _store(tier, "u1", "u2", "u3")
    _run(rio, 10, ["u0", "u1", "u2", "u3"])
    res = collect(rio, 4)
    assert not any(r.ok for r in res.values())
    assert tier.calls["read"] == 1
    assert rio.take_counters()["gets_skipped"] == 3
    rio.close()


def test_a_slow_tier_asks_once_for_a_prompt_it_lacks(monkeypatch) -> None:
    """Reads known but slower than EAGER_READ_S: first chunk alone, as on an unknown tier."""
    monkeypatch.setattr(remote, "EAGER_READ_S", -1.0)  # every read is "slow"
    tier = FakeTier()
    rio = make_rio(tier, threads=4)
    _warm(rio, tier)
    _store(tier, "s1", "s2", "s3")
    _run(rio, 10, ["s0", "s1", "s2", "s3"])
    res = collect(rio, 4)
    assert not any(r.ok for r in res.values())
    assert tier.calls["read"] == 2  # the warm-up, then the first chunk only
    rio.close()


def test_a_failed_read_forgets_that_the_tier_was_quick(monkeypatch) -> None:
    """After a read that could not reach the tier, runs go first chunk alone again."""
    tier = FakeTier()
    rio = make_rio(tier, threads=4)
    _warm(rio, tier)
    real = tier.read_into

    def unreachable(key: str, dest: memoryview, max_head: int) -> bytes | None:
        monkeypatch.setattr(tier, "read_into", real)
        raise TierUnavailable("fake: connection refused")

    monkeypatch.setattr(tier, "read_into", unreachable)
    _run(rio, 5, ["gone"])
    assert collect(rio, 1)[5].error_kind == "unreachable"
    assert rio.read_call_s is None
    reads = tier.calls["read"]
    _store(tier, "f1", "f2")
    _run(rio, 10, ["f0", "f1", "f2"])
    collect(rio, 3)
    assert tier.calls["read"] == reads + 1
    rio.close()


def test_a_quick_runs_miss_skips_what_has_not_started() -> None:
    """Queued at once, the first chunk missing: the chunk already being read finishes
    (verified, in its own slot), those not started are misses without a read, each get
    is reported once, and no skipped slot is written."""
    tier = FakeTier()
    rio = make_rio(tier, threads=4)  # two read threads: one takes e0, the other e1
    _warm(rio, tier)
    _store(tier, "e0", "e1", "e2", "e3")
    del tier.objects["e0"]
    tier.hold["e0"], tier.hold["e1"] = threading.Event(), threading.Event()
    dests = _run(rio, 10, ["e0", "e1", "e2", "e3"])
    until(lambda: {"e0", "e1"} <= tier.active, "e0 and e1 in their reads")
    tier.hold["e0"].set()  # e0: not stored
    until(lambda: rio.counters()["gets_skipped"] == 2, "e2 and e3 skipped")
    tier.hold["e1"].set()
    res = collect(rio, 4)
    assert not res[10].ok and res[10].error_kind is None
    assert res[11].ok and bytes(dests[1]) == bytes(payload(1))
    assert [res[12].ok, res[13].ok] == [False, False]
    assert bytes(dests[2]) == bytes(dests[3]) == bytes(SIZE)
    assert "e2" not in tier.entered and "e3" not in tier.entered
    rio.close()
