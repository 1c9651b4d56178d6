"""ObjectTier.create_if_absent on every object tier, against real services on loopback:
engines racing to create one key (a generation's manifest: its first writer) find
exactly one winner, whose bytes are stored; every loser stores nothing."""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from local_cluster import RedisCluster

from kvtier.config import load_config
from kvtier.objects import codec
from kvtier.objects.tiers import ObjectTier, open_tier
from kvtier.objects.tiers.redis import RedisTier
from kvtier.objects.tiers.redis_cluster import RedisClusterTier
from kvtier.objects.tiers.s3 import S3Tier

pytestmark = pytest.mark.integration

#: racers per key and keys raced for (each key a race of its own)
RACERS, KEYS = 4, 12


def _claim(key: str, who: int) -> list[bytes | memoryview]:
    """The object racer ``who`` tries to create under ``key`` (its own bytes)."""
    data = f"racer {who} claims {key}".encode() * 8
    return codec.encode(key, data, dtype="u8", shape=[len(data)])


def _joined(parts: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(p) for p in parts)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    c = RedisCluster()
    try:
        c.start()
        yield c
    finally:
        c.cleanup()


@pytest.fixture(params=["file", "s3", "redis", "redis-cluster"])
def url(request: pytest.FixtureRequest, tmp_path) -> str:  # type: ignore[no-untyped-def]
    """The ``remote_url`` of a fresh, empty tier of each kind."""
    if request.param == "file":
        return f"file://{tmp_path}/objects"
    if request.param == "s3":
        return str(request.getfixturevalue("s3_bucket").url)
    if request.param == "redis":
        request.getfixturevalue("redis_server").flush()
        return str(request.getfixturevalue("redis_url"))
    cluster: RedisCluster = request.getfixturevalue("cluster")
    import redis

    for port in cluster.primary_ports():
        redis.Redis(port=port).flushall()
    return cluster.url


def _open(url: str) -> ObjectTier:
    return open_tier(load_config({"remote_url": url}, environ={}))


def test_the_second_create_loses_and_leaves_the_first_bytes(url: str) -> None:
    with _open(url) as tier:
        first, second = _claim("gen-x/manifest", 1), _claim("gen-x/manifest", 2)
        assert tier.create_if_absent("gen-x/manifest", first) is True
        assert tier.create_if_absent("gen-x/manifest", second) is False
        assert tier.get("gen-x/manifest") == _joined(first), "the loser overwrote the winner"
        tier.put("gen-y/manifest", second)  # anything stored there, by any write
        assert tier.create_if_absent("gen-y/manifest", first) is False
        assert tier.get("gen-y/manifest") == _joined(second)
        tier.delete(["gen-x/manifest"])  # gc emptied it: the next engine claims it again
        assert tier.create_if_absent("gen-x/manifest", second) is True
        assert tier.get("gen-x/manifest") == _joined(second)


def _check_one_winner(tier: ObjectTier, wins: dict[str, list[int]]) -> None:
    for i in range(KEYS):
        key = f"gen-{i}/manifest"
        assert len(wins.get(key, [])) == 1, f"{key}: winners {wins.get(key)}"
        assert tier.get(key) == _joined(_claim(key, wins[key][0])), f"{key}: not the winner's"


def test_threads_racing_with_their_own_clients_find_one_winner_per_key(url: str) -> None:
    """Each thread an engine of its own (its own tier, connections and pool), all released
    at once for each key."""
    tiers = [_open(url) for _ in range(RACERS)]
    wins: dict[str, list[int]] = {}
    lock = threading.Lock()
    start = threading.Barrier(RACERS)
    errors: list[BaseException] = []

    def racer(who: int) -> None:
        try:
            for i in range(KEYS):
                key = f"gen-{i}/manifest"
                parts = _claim(key, who)
                start.wait(10)
                if tiers[who].create_if_absent(key, parts):
                    with lock:
                        wins.setdefault(key, []).append(who)
        except BaseException as exc:  # noqa: BLE001  reported by the test below
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=racer, args=(w,)) for w in range(RACERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert errors == []
        _check_one_winner(tiers[0], wins)
    finally:
        for t in tiers:
            t.close()


def _racer_process(url: str, who: int, start: Any, out: Any) -> None:
    tier = _open(url)
    try:
        for i in range(KEYS):
            key = f"gen-{i}/manifest"
            parts = _claim(key, who)
            start.wait(30)
            out.put((key, who, tier.create_if_absent(key, parts)))
    finally:
        tier.close()


def test_processes_racing_find_one_winner_per_key(url: str) -> None:
    """Engines are processes: racers in processes of their own, released at once per key."""
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(RACERS), ctx.Queue()
    procs = [ctx.Process(target=_racer_process, args=(url, w, start, out)) for w in range(RACERS)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in range(RACERS * KEYS)]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    wins: dict[str, list[int]] = {}
    for key, who, won in results:
        if won:
            wins.setdefault(key, []).append(who)
    with _open(url) as tier:
        _check_one_winner(tier, wins)


def test_every_tier_kvtier_opens_creates_atomically_itself() -> None:
    """The base class's create_if_absent raises: every tier open_tier can build has its
    own (a new tier without one would leave every generation without a first writer)."""
    from kvtier.objects.tiers import FileTier
    from kvtier.objects.tiers.base import ObjectTier as Base

    for cls in (FileTier, S3Tier, RedisTier, RedisClusterTier):
        assert cls.create_if_absent is not Base.create_if_absent, cls.__name__


def test_a_directory_without_hard_links_creates_with_o_excl(tmp_path, monkeypatch) -> None:
    """A filesystem that refuses ``link`` (FAT, some FUSE mounts): the name is created with
    O_EXCL instead, still once."""
    import errno

    def no_link(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    with _open(f"file://{tmp_path}/objects") as tier:
        assert tier.create_if_absent("k", _claim("k", 1)) is True
        assert tier.create_if_absent("k", _claim("k", 2)) is False
        assert tier.get("k") == _joined(_claim("k", 1))
        leftovers = [n for _, _, names in os.walk(tmp_path) for n in names if n.startswith(".tmp-")]
        assert leftovers == []
