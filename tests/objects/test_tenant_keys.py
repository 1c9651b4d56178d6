"""Who uploaded which chunk (issue 60): the per-tenant lists a generation's manifest holds
(kvtier.objects.tenant_keys), merged by its writers, bounded, parsed strictly."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import CodecError, TierUnavailable
from kvtier.keys import KeySpace, Namespace
from kvtier.objects import tenant_keys
from kvtier.objects.manifest import Manifest, ManifestWriter, read_manifest
from kvtier.objects.tenant_keys import OTHER, Pins, TenantKeys, fingerprint, merge, merge_pins
from kvtier.objects.tiers import FileTier

NS = Namespace(
    model="org/tiny",
    revision=None,
    dtype="bfloat16",
    kv_cache_dtype="auto",
    block_size=16,
    chunk_size=64,
    tp_size=1,
    fingerprint="a" * 32,
    layers="L0",
)
SPACE = KeySpace.worker(NS, 0, 0)


def keys(n: int) -> list[str]:
    return [SPACE.key(os.urandom(16)) for _ in range(n)]


def fps(ks: list[str]) -> set[bytes]:
    return {fp for k in ks if (fp := fingerprint(k)) is not None}


def test_a_chunk_is_the_tenant_that_uploaded_it_last() -> None:
    a, b = keys(3), keys(2)
    stored = TenantKeys.of({"team-a": a, "team-b": b})
    assert stored.owners() == {**dict.fromkeys(fps(a), "team-a"), **dict.fromkeys(fps(b), "team-b")}
    later = TenantKeys.of({"team-b": [a[0]]})  # b stored a's first chunk again, and uploaded it
    owners = merge(stored, later).owners()
    assert owners[fingerprint(a[0])] == "team-b"  # type: ignore[index]
    assert [owners[fp] for fp in fps(a[1:])] == ["team-a", "team-a"]
    assert len(merge(stored, later)) == 5, "a chunk counts once"
    assert fingerprint("gen-0123456789abcdef/manifest") is None
    assert fingerprint(a[0]) == bytes.fromhex(a[0].rpartition("/")[2][:16])


def test_tenants_past_the_bound_are_other_and_the_stored_ones_keep_their_place() -> None:
    stored = TenantKeys.of({f"t{i}": keys(1) for i in range(5)})
    late = TenantKeys.of({"new-1": keys(1), "new-2": keys(2), "t0": keys(1)})
    got = merge(stored, late, tenants=7)
    assert [label for label, _ in got.lists] == ["t0", "t1", "t2", "t3", "t4", "new-1", OTHER]
    assert len(dict(got.lists)[OTHER]) == 2 and len(dict(got.lists)["t0"]) == 2
    assert len(merge(got, TenantKeys.of({"new-3": keys(1)}), tenants=7).lists) == 7


def test_past_the_limit_the_longest_list_loses_its_oldest_uploads_first() -> None:
    flood = keys(50)
    short = keys(5)
    got = merge(
        TenantKeys.of({"crawl": flood[:30], "chat": short}),
        TenantKeys.of({"crawl": flood[30:]}),
        limit=25,
    )
    lists = dict(got.lists)
    assert len(got) <= 25
    assert set(lists["chat"]) == fps(short), "a short list is kept whole"
    newest = [fingerprint(k) for k in reversed(flood)][: len(lists["crawl"])]
    assert list(lists["crawl"]) == newest and len(lists["crawl"]) == 20


def test_the_lists_round_trip_through_a_manifest() -> None:
    tk = TenantKeys.of({"team-a": keys(4), "untagged": keys(2)})
    m = Manifest.of(NS, 1000.0, tenants=tk)
    back = Manifest.from_bytes(m.to_bytes())
    assert back.tenants == tk and back == m
    old = json.loads(m.to_bytes())
    del old["tenants"]  # a manifest of an older kvtier
    assert Manifest.from_bytes(json.dumps(old).encode()).tenants == TenantKeys()


def _b64(*parts: bytes) -> str:
    return base64.b64encode(b"".join(parts)).decode()


@pytest.mark.parametrize(
    "raw, why",
    [
        ([], "not an object"),
        ({f"t{i}": _b64(i.to_bytes(8, "big")) for i in range(33)}, "33 tenant lists"),
        ({"bad name!": _b64(b"x" * 8)}, "label"),
        ({"other": 5}, "short string"),
        ({"a": "not base64!"}, "not base64"),
        ({"a": _b64(b"x" * 7)}, "whole fingerprints"),
        ({"a": _b64(b"x" * 8), "b": _b64(b"x" * 8)}, "twice"),
        ({"a": _b64(b"x" * 8, b"x" * 8)}, "twice"),
        ({"a": _b64(*(i.to_bytes(8, "big") for i in range(tenant_keys.LIMIT + 1)))}, "short"),
        (
            {
                "a": _b64(*(i.to_bytes(8, "big") for i in range(tenant_keys.LIMIT))),
                "b": _b64(b"y" * 8),
            },
            "more than",
        ),
    ],
)
def test_a_forged_list_is_a_bad_manifest(raw: Any, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        TenantKeys.from_json(raw)
    doc = json.loads(Manifest.of(NS, 1000.0).to_bytes()) | {"tenants": raw}
    with pytest.raises(CodecError, match="'tenants'"):
        Manifest.from_bytes(json.dumps(doc).encode())


class Flaky(FileTier):
    """A directory whose next ``fail`` puts fail."""

    fail = 0

    def put(self, key: str, parts: Any) -> None:
        if self.fail:
            self.fail -= 1
            raise TierUnavailable("down")
        super().put(key, parts)


def test_writers_add_their_own_uploads_and_a_failed_write_keeps_them(tmp_path: Path) -> None:
    tier = Flaky(str(tmp_path), background_sweep=False)
    one = ManifestWriter(tier, None, lambda: NS)
    two = ManifestWriter(tier, None, lambda: NS)  # another replica of the model
    a, b, c = keys(3), keys(2), keys(1)
    one.add_tenants(TenantKeys.of({"team-a": a}))
    assert one.refresh() is not None
    two.add_tenants(TenantKeys.of({"team-b": b}))
    tier.fail = 1
    assert two.refresh() is None  # the tier is down: b's uploads wait for the next write
    two.add_tenants(TenantKeys.of({"team-b": c}))
    assert two.refresh() is not None
    assert one.refresh() is not None  # nothing new: the stored lists stay
    stored = read_manifest(tier, NS.generation(), None)
    assert stored is not None
    owners = stored.tenants.owners()
    assert owners == {**dict.fromkeys(fps(a), "team-a"), **dict.fromkeys(fps(b + c), "team-b")}
    tier.close()


def test_unsent_deltas_are_folded_and_stay_bounded(tmp_path: Path) -> None:
    w = ManifestWriter(FileTier(str(tmp_path), background_sweep=False), None, lambda: NS)
    for _ in range(20):
        w.add_tenants(TenantKeys.of({"team-a": keys(3)}))
    assert len(w._tenants) <= 9 and sum(len(d) for d in w._tenants) == 60
    w.tier.close()


# ---- pins ----------------------------------------------------------------------------


def test_pins_keep_each_chunks_latest_deadline_drop_the_expired_and_stay_bounded() -> None:
    a, b, c = keys(3)
    first = Pins.of({a: 2000.0, b: 1500.0})
    renewed = Pins.of({a: 1800.0, b: 2500.0, c: 900.0})
    got = merge_pins(first, renewed, now=1000.0)
    assert dict(got.until) == {fingerprint(a): 2000.0, fingerprint(b): 2500.0}
    assert got.live(2200.0) == {fingerprint(b)} and got.live(3000.0) == frozenset()
    many = Pins.of({k: 5000.0 + i for i, k in enumerate(keys(20))})
    kept = merge_pins(many, limit=5)
    assert sorted(t for _, t in kept.until) == [5015.0 + i for i in range(5)], "not the latest"


def test_pins_round_trip_through_a_manifest() -> None:
    p = Pins.of({k: 1_900_000_000.5 for k in keys(3)})
    back = Manifest.from_bytes(Manifest.of(NS, 1000.0, pins=p).to_bytes()).pins
    assert {fp for fp, _ in back.until} == {fp for fp, _ in p.until}
    assert {t for _, t in back.until} == {1_900_000_001.0}, "deadlines rounded up"


@pytest.mark.parametrize(
    "raw, why",
    [
        ([], "not an object"),
        ({_b64(b"x" * 8): "soon"}, "not a time"),
        ({_b64(b"x" * 8): float(2**34)}, "not a time"),
        ({_b64(b"x" * 8): True}, "not a time"),
        ({_b64(b"x" * 7): 5}, "fingerprint"),
        ({"!!": 5}, "fingerprint"),
        ({_b64(i.to_bytes(8, "big")): 5 for i in range(tenant_keys.PINS_LIMIT + 1)}, "pins"),
    ],
)
def test_forged_pins_are_a_bad_manifest(raw: Any, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        Pins.from_json(raw)
    doc = json.loads(Manifest.of(NS, 1000.0).to_bytes()) | {"pins": raw}
    with pytest.raises(CodecError, match="'pins'"):
        Manifest.from_bytes(json.dumps(doc).encode())


def test_the_writer_adds_pins_to_the_stored_ones_and_drops_the_expired(tmp_path: Path) -> None:
    tier = Flaky(str(tmp_path), background_sweep=False)
    now = [1000.0]
    w = ManifestWriter(tier, None, lambda: NS, clock=lambda: now[0])
    a, b = keys(2)
    w.add_pins(Pins.of({a: 1100.0}))
    assert w.refresh() is not None
    tier.fail = 1
    w.add_pins(Pins.of({b: 5000.0}))
    assert w.refresh() is None  # kept for the next write
    now[0] = 1200.0  # a's pin has expired
    assert w.refresh() is not None
    stored = read_manifest(tier, NS.generation(), None)
    assert stored is not None and dict(stored.pins.until) == {fingerprint(b): 5000.0}
    tier.close()


def test_a_full_manifest_stays_within_what_older_kvtier_versions_read() -> None:
    """Hot list, tenant lists and pins at their bounds (32-byte hot keys): under 512 KiB,
    the most a kvtier before the tenant lists reads (it would call a larger one bad)."""
    from kvtier import hotset

    hot = hotset.HotList(
        1000.0, tuple((i.to_bytes(32, "big"), 1e6 + i) for i in range(hotset.LIMIT))
    )
    names = [f"gen-{NS.generation()}/{i:016x}{'0' * 24}" for i in range(tenant_keys.LIMIT)]
    per = tenant_keys.LIMIT // tenant_keys.TENANTS
    tk = TenantKeys.of(
        {f"team-{t}": names[t * per : (t + 1) * per] for t in range(tenant_keys.TENANTS)}
    )
    pins = Pins.of(
        {
            f"gen-x/{i + 10**6:016x}{'0' * 24}": 1_900_000_000.0 + i
            for i in range(tenant_keys.PINS_LIMIT)
        }
    )
    assert len(tk) == tenant_keys.LIMIT and len(pins) == tenant_keys.PINS_LIMIT
    size = len(Manifest.of(NS, 1000.0, hot=hot, tenants=tk, pins=pins).to_bytes())
    assert size < 512 * 1024, size
