"""The hot list (kvtier.hotset): decayed hit counts per chunk key, bounded, merged by every
engine sharing a generation through its manifest, and parsed as untrusted input."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from kvtier import hotset
from kvtier.errors import CodecError
from kvtier.hotset import HitCounter, HotList, merge, plan_warmup, top
from kvtier.keys import Namespace
from kvtier.objects.manifest import Manifest, ManifestWriter, read_manifest
from kvtier.objects.tiers import FileTier

NS = Namespace("", None, "bfloat16", "auto", 32, 128, 1, fingerprint="f" * 32, label="m")
H = hotset.HALF_LIFE_S
T0 = 1_000_000.0


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def heats(hot: HotList) -> dict[bytes, float]:
    return dict(hot.entries)


def test_heat_halves_every_half_life_and_lists_of_other_times_add_up() -> None:
    a = HotList(T0, ((k(1), 8.0), (k(2), 2.0)))
    b = HotList(T0 + H, ((k(2), 3.0),))
    got = merge(a, b, now=T0 + H)
    assert got.at == T0 + H
    assert heats(got) == {k(1): 4.0, k(2): 4.0}
    assert got.entries[0][0] == k(1), "ties go by key: the same order on every engine"
    later = merge(got, now=T0 + 3 * H)
    assert heats(later) == {k(1): 1.0, k(2): 1.0}
    assert merge(a, now=T0 + 30 * H).entries == (), "below MIN_HEAT: dropped"
    # a list from the future (another host's clock) is not heated up
    assert heats(merge(HotList(T0 + 100, ((k(1), 5.0),)), now=T0)) == {k(1): 5.0}


def test_a_merged_list_is_bounded_to_its_hottest() -> None:
    many = HotList(T0, tuple((k(i), float(i)) for i in range(1, 101)))
    got = merge(many, HotList(T0, ((k(3), 1000.0),)), now=T0, limit=10)
    assert len(got) == 10
    assert [key for key, _ in got.entries] == [k(3)] + [k(i) for i in range(100, 91, -1)]
    full = top({k(i): 1.0 + i for i in range(hotset.LIMIT + 500)}, T0)
    assert len(full) == hotset.LIMIT
    assert full.entries[0][0] == k(hotset.LIMIT + 499)


def test_the_hit_counter_costs_a_dict_update_and_stays_bounded() -> None:
    c = HitCounter(limit=4)
    assert c.take(T0) is None, "nothing hit: nothing sent"
    for _ in range(5):
        c.hit(k(1))
    for i in range(2, 9):  # 8 keys: at the bound, nothing pruned yet
        c.hit(k(i))
    assert len(c) == 8
    c.hit(k(9))  # past 2 * limit: the 4 most hit kept
    assert len(c) == 4 and k(1) in {key for key, _ in (c.take(T0) or HotList()).entries}
    assert len(c) == 0
    c.hit(k(1))
    delta = c.take(T0 + H)
    assert delta is not None and heats(delta) == {k(1): 1.0}
    assert heats(c.own)[k(1)] == pytest.approx(5.0 / 2 + 1.0), "its own heat, decayed"


def _writer(tier: FileTier, clock: list[float]) -> ManifestWriter:
    return ManifestWriter(tier, None, lambda: NS, clock=lambda: clock[0])


def test_several_engines_merge_their_hits_into_one_list(tmp_path: Path) -> None:
    """Each refresh adds only the hits since that engine's last write: engine A's hits
    are counted once however often it refreshes, and B's add to A's."""
    clock = [T0]
    with FileTier(str(tmp_path)) as tier:
        a, b = _writer(tier, clock), _writer(tier, clock)
        a.add_heat(HotList(T0, ((k(1), 4.0), (k(2), 1.0))))
        assert a.refresh() is not None
        clock[0] = T0 + H
        b.add_heat(HotList(T0 + H, ((k(2), 2.0), (k(3), 1.0))))
        assert b.refresh() is not None
        assert a.refresh() is not None, "A refreshes with nothing new: adds nothing"
        stored = read_manifest(tier, NS.generation(), None)
        assert stored is not None
        assert heats(stored.hot) == {k(1): 2.0, k(2): 2.5, k(3): 1.0}
        assert [key for key, _ in stored.hot.entries] == [k(2), k(1), k(3)]


def test_a_write_that_fails_keeps_its_hits_for_the_next(tmp_path: Path) -> None:
    clock = [T0]

    class Failing(FileTier):
        fail = True

        def put(self, key, parts):  # type: ignore[no-untyped-def]
            if self.fail:
                from kvtier.errors import TierUnavailable

                raise TierUnavailable("down")
            super().put(key, parts)

    with Failing(str(tmp_path)) as tier:
        w = _writer(tier, clock)
        w.add_heat(HotList(T0, ((k(1), 3.0),)))
        assert w.refresh() is None
        tier.fail = False
        assert w.refresh() is not None
        stored = read_manifest(tier, NS.generation(), None)
        assert stored is not None and heats(stored.hot) == {k(1): 3.0}


def test_overlapping_writers_lose_one_interval_of_one_writer_never_older_heat(
    tmp_path: Path,
) -> None:
    """A and B both read the manifest before either writes: the later write keeps its
    own delta and what was stored before, and loses only the other's last interval."""
    clock = [T0]
    with FileTier(str(tmp_path)) as tier:
        a, b = _writer(tier, clock), _writer(tier, clock)
        a.add_heat(HotList(T0, ((k(1), 10.0),)))
        assert a.refresh() is not None  # the fleet's history: k(1) 10
        a.add_heat(HotList(T0, ((k(2), 1.0),)))
        b.add_heat(HotList(T0, ((k(3), 1.0),)))
        stored_before = read_manifest(tier, NS.generation(), None)
        real = b._stored
        b._stored = lambda gen: stored_before  # type: ignore[method-assign]  # B read first
        assert a.refresh() is not None
        assert b.refresh() is not None  # writes over A's write
        b._stored = real  # type: ignore[method-assign]
        got = heats(read_manifest(tier, NS.generation(), None).hot)  # type: ignore[union-attr]
        assert got == {k(1): 10.0, k(3): 1.0}, "A's last interval lost, nothing older"


def _forged(hot: object, hot_at: object = T0) -> bytes:
    raw = json.loads(Manifest.of(NS, T0).to_bytes())
    return json.dumps(raw | {"hot": hot, "hot_at": hot_at}).encode()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


BAD_HOT = {
    "too-long": [[b64(k(i)), 1.0] for i in range(hotset.LIMIT + 1)],
    "not-a-list": {"a": 1},
    "not-a-pair": [[b64(k(1)), 1.0, 2.0]],
    "key-not-base64": [["***", 1.0]],
    "key-too-long": [[b64(b"x" * (hotset.MAX_KEY_BYTES + 1)), 1.0]],
    "key-empty": [["", 1.0]],
    "key-a-number": [[7, 1.0]],
    "heat-a-string": [[b64(k(1)), "1"]],
    "heat-a-bool": [[b64(k(1)), True]],
    "heat-negative": [[b64(k(1)), -1.0]],
    "heat-zero": [[b64(k(1)), 0]],
    "heat-huge": [[b64(k(1)), 1e300]],
    "key-twice": [[b64(k(1)), 1.0], [b64(k(1)), 2.0]],
    "deep": [[[[[[b64(k(1))]]]], 1.0]],
}


@pytest.mark.parametrize("case", sorted(BAD_HOT))
def test_a_forged_or_oversized_hot_list_is_a_bad_manifest(case: str) -> None:
    with pytest.raises(CodecError, match="hot"):
        Manifest.from_bytes(_forged(BAD_HOT[case]))


@pytest.mark.parametrize("at", ["1", -1, True, None])
def test_a_hot_list_time_that_is_no_time_is_refused(at: object) -> None:
    with pytest.raises(CodecError, match="hot"):
        Manifest.from_bytes(_forged([], at))


def test_nan_and_infinity_in_a_hot_list_are_refused() -> None:
    text = _forged([[b64(k(1)), 1.5]]).decode()
    for bad in ("NaN", "Infinity", "1e400"):
        with pytest.raises(CodecError):
            Manifest.from_bytes(text.replace("1.5", bad).encode())


def test_a_full_hot_list_reads_back_and_its_size() -> None:
    """The size the hot list adds to a manifest: ~57 bytes a 32-byte key, so ~250 KB
    at the bound, within MAX_MANIFEST (64-byte keys too)."""
    from kvtier.objects.manifest import MAX_MANIFEST

    hot = top({k(i): 1_000_000.123 + i for i in range(hotset.LIMIT)}, T0)
    m = Manifest.of(NS, T0, hot=hot)
    data = m.to_bytes()
    assert Manifest.from_bytes(data) == m
    assert 200_000 < len(data) - len(Manifest.of(NS, T0).to_bytes()) < 260_000
    widest = {
        i.to_bytes(hotset.MAX_KEY_BYTES, "big"): hotset.MAX_HEAT - i - 0.123
        for i in range(hotset.LIMIT)
    }
    assert len(Manifest.of(NS, T0, hot=top(widest, T0)).to_bytes()) < MAX_MANIFEST


def test_a_manifest_without_a_hot_list_reads_as_an_empty_one() -> None:
    raw = json.loads(Manifest.of(NS, T0).to_bytes())
    old = {name: v for name, v in raw.items() if name not in ("hot", "hot_at")}
    assert Manifest.from_bytes(json.dumps(old).encode()).hot == HotList()


def test_warmup_fetches_the_hottest_that_fit_hottest_first() -> None:
    hot = HotList(T0, tuple((k(i), 100.0 - i) for i in range(10)))
    assert plan_warmup(hot, chunk_bytes=10, host_bytes=1000, warmup_bytes=35) == [k(0), k(1), k(2)]
    assert plan_warmup(hot, chunk_bytes=10, host_bytes=20, warmup_bytes=1000) == [k(0), k(1)]
    assert plan_warmup(
        hot, chunk_bytes=10, host_bytes=1000, warmup_bytes=40, have={k(0), k(2)}
    ) == [k(1), k(3), k(4), k(5)]
    assert plan_warmup(hot, chunk_bytes=10, host_bytes=1000, warmup_bytes=0) == []
    assert plan_warmup(HotList(), chunk_bytes=10, host_bytes=1000, warmup_bytes=100) == []
    with pytest.raises(ValueError):
        plan_warmup(hot, chunk_bytes=0, host_bytes=1, warmup_bytes=1)


def test_hits_kept_while_nothing_is_written_stay_bounded_and_add_up(tmp_path: Path) -> None:
    """An engine that does not trust its generation yet writes nothing: the deltas its
    scheduler sends are folded into one past a few, and none is lost once it writes."""
    from kvtier.objects import manifest

    clock = [T0]
    trusted = [False]
    with FileTier(str(tmp_path)) as tier:
        w = ManifestWriter(
            tier, None, lambda: NS, clock=lambda: clock[0], active=lambda: trusted[0]
        )
        for i in range(3 * manifest._MAX_DELTAS):
            w.add_heat(HotList(T0, ((k(i % 5), 1.0),)))
            assert w.refresh() is None
            assert len(w._heat) <= manifest._MAX_DELTAS
        trusted[0] = True
        assert w.refresh() is not None
        stored = read_manifest(tier, NS.generation(), None)
        assert stored is not None
        n = 3 * manifest._MAX_DELTAS
        assert heats(stored.hot) == {k(i): float(len(range(i, n, 5))) for i in range(5)}
