"""Each backend's own listing and bulk deletes (:meth:`ObjectTier.list_objects`,
``list_keys``, ``delete_many``: what ``kvtier store`` stands on) on real backends: a
directory, S3 (moto on loopback), one Redis node and a Redis Cluster."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from faketier import FakeTier
from kit import open_loopback_tier
from local_cluster import RedisCluster

from kvtier.config import load_config
from kvtier.objects import store_admin
from kvtier.objects.tiers import ObjectTier, open_tier
from kvtier.objects.tiers.base import StoredObject
from kvtier.objects.tiers.redis import LIST_BATCH
from kvtier.objects.tiers.s3 import DELETE_BATCH

pytestmark = pytest.mark.integration

GEN_A = "gen-" + "a" * 16 + "/"
GEN_B = "gen-" + "b" * 16 + "/"
#: a key whose name holds every character a Redis glob pattern reads as its own
GLOBBY = "odd*?[x]\\key"


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    c = RedisCluster(primaries=3, replicas=0)
    try:
        c.start()
        yield c
    finally:
        c.cleanup()


@pytest.fixture(params=["file", "s3", "redis", "redis-cluster"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectTier]:
    if request.param == "redis-cluster":
        c: RedisCluster = request.getfixturevalue("cluster")
        for port in c.primary_ports():
            redis.Redis(port=port).flushall()
        t = open_tier(load_config({"remote_url": c.url}, environ={}))
    else:
        t = open_loopback_tier(request.param, request, tmp_path)
    try:
        yield t
    finally:
        t.close()


def _fill(tier: ObjectTier) -> dict[str, bytes]:
    stored = {f"{GEN_A}{i:040x}": b"a" * (100 + i) for i in range(5)}
    stored |= {f"{GEN_B}{i:040x}": b"b" * 50 for i in range(3)}
    stored |= {"bare": b"c" * 10, GLOBBY: b"d"}
    for key, value in stored.items():
        tier.put(key, [value])
    return stored


def test_list_objects_names_every_object_with_its_size_and_last_use(tier: ObjectTier) -> None:
    before = time.time()
    stored = _fill(tier)
    listed = {o.key: o for o in tier.list_objects()}
    assert set(listed) == set(stored)
    for key, obj in listed.items():
        assert isinstance(obj, StoredObject)
        if tier.name == "redis":  # what the server spends on it: at least the value
            assert obj.size >= len(stored[key])
        else:
            assert obj.size == len(stored[key])
        assert before - 2.0 <= obj.used <= time.time() + 2.0  # whole seconds on S3 and Redis


def test_list_objects_under_a_prefix_and_only_the_keys_kept(tier: ObjectTier) -> None:
    _fill(tier)
    assert sorted(o.key for o in tier.list_objects(GEN_B)) == [f"{GEN_B}{i:040x}" for i in range(3)]
    assert [o.key for o in tier.list_objects(GLOBBY)] == [GLOBBY]  # no glob read into it
    asked: list[str] = []

    def keep(key: str) -> bool:
        asked.append(key)
        return key.startswith(GEN_A)

    kept = sorted(o.key for o in tier.list_objects(keep=keep))
    assert kept == [f"{GEN_A}{i:040x}" for i in range(5)]
    assert "bare" in asked and "bare" not in kept


def test_list_keys_under_a_prefix(tier: ObjectTier) -> None:
    stored = _fill(tier)
    assert sorted(tier.list_keys(GEN_A)) == sorted(k for k in stored if k.startswith(GEN_A))
    assert sorted(tier.list_keys("")) == sorted(stored)
    assert list(tier.list_keys("gen-" + "c" * 16 + "/")) == []
    assert list(tier.list_keys(GLOBBY)) == [GLOBBY]


def test_delete_many_deletes_past_one_batch_and_ignores_missing_keys(
    tier: ObjectTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert (LIST_BATCH, DELETE_BATCH) == (256, 1000)
    monkeypatch.setattr("kvtier.objects.tiers.redis.LIST_BATCH", 4)  # SCAN pages too
    monkeypatch.setattr("kvtier.objects.tiers.s3.DELETE_BATCH", 4)
    keys = [f"{GEN_A}{i:040x}" for i in range(11)]
    for key in keys:
        tier.put(key, [b"x"])
    tier.put("kept", [b"y"])
    tier.delete_many([*keys, "never-written"])
    assert sorted(tier.list_keys("")) == ["kept"]
    tier.delete_many([])
    assert [o.key for o in tier.list_objects()] == ["kept"]


def test_the_store_stands_on_the_listing(tier: ObjectTier) -> None:
    """holds_chunks lists the generation's keys alone; usage lists kvtier's keys only."""
    _fill(tier)
    assert store_admin.holds_chunks(tier, "a" * 16)
    assert not store_admin.holds_chunks(tier, "c" * 16)
    found = store_admin.usage(tier, None)
    listed = {o.key for g in found.generations for o in (*g.chunks, *g.manifests)}
    assert listed == {f"{GEN_A}{i:040x}" for i in range(5)} | {f"{GEN_B}{i:040x}" for i in range(3)}


def test_a_tier_that_cannot_be_listed_is_a_store_error() -> None:
    tier = FakeTier()
    with pytest.raises(NotImplementedError):
        tier.list_objects()
    with pytest.raises(store_admin.StoreError, match="cannot list a fake tier"):
        store_admin.usage(tier, None)
    with pytest.raises(store_admin.StoreError, match="cannot list a fake tier"):
        store_admin.holds_chunks(tier, "a" * 16)
    tier.objects["k"] = b"v"
    tier.delete_many(["k"])  # the default: the tier's own delete
    assert tier.objects == {}
