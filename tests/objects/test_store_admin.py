"""``kvtier store``'s listing, usage, gc and verify on real backends: a directory, S3
(moto's server and SeaweedFS's S3 gateway on loopback), one Redis node and a Redis
Cluster, holding generations that kvtier's own object-tier code wrote (:mod:`store_kit`)."""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from faketier import FakeTier
from local_cluster import RedisCluster
from store_kit import NS, NS_B, Engine, SeaweedS3, fetch, file_objects, hits, write_engine

from kvtier.config import load_config
from kvtier.errors import CodecError, TierUnavailable
from kvtier.keys import ANY_RANK, KeySpace
from kvtier.objects import codec, store_admin
from kvtier.objects.manifest import (
    Manifest,
    ManifestWriter,
    manifest_key,
    read_manifest,
    write_manifest,
)
from kvtier.objects.store_admin import UNKNOWN, StoreError, parse_object_key
from kvtier.objects.tiers import ObjectTier, open_tier
from kvtier.objects.tiers.base import StoredObject

pytestmark = pytest.mark.integration

DAY = 86400.0
HMAC_VAR = "KVT_STORE_TEST_HMAC"
HMAC = {HMAC_VAR: "k" * 64}


@dataclass
class Backend:
    kind: str
    extra: dict[str, Any]
    #: key -> bytes, as the backend holds them, read with its own client
    objects: Callable[[], dict[str, int]]
    #: a write's or read's recency has a resolution of a second
    coarse: bool = True

    def tier(self) -> ObjectTier:
        return open_tier(load_config(self.extra, environ={}))


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    c = RedisCluster(primaries=3, replicas=0)
    try:
        c.start()
        yield c
    finally:
        c.cleanup()


def _redis_objects(clients: list[redis.Redis]) -> Callable[[], dict[str, int]]:
    def objects() -> dict[str, int]:
        out = {}
        for r in clients:
            for k in r.scan_iter(count=1000):
                out[k.decode()] = int(r.memory_usage(k, samples=0))
        return out

    return objects


def make_backend(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if kind == "file":
        root = tmp_path / "kv"
        root.mkdir()
        return Backend(
            kind, {"remote_url": f"file://{root}"}, lambda: file_objects(root), coarse=False
        )
    if kind in ("s3", "seaweedfs"):
        if kind == "s3":
            bucket = request.getfixturevalue("s3_bucket")
        else:  # a real S3 implementation: credentials from s3_env, endpoint its own
            request.getfixturevalue("s3_env")
            request.getfixturevalue("monkeypatch").delenv("AWS_SESSION_TOKEN")  # not STS
            server: SeaweedS3 = request.getfixturevalue("seaweed")
            bucket = server.bucket(f"kv-{uuid.uuid4().hex[:12]}")
        client = bucket.server.client()

        def listed() -> dict[str, int]:
            pages = client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket.name, Prefix=bucket.prefix + "/"
            )
            return {
                o["Key"].removeprefix(bucket.prefix + "/"): o["Size"]
                for p in pages
                for o in p.get("Contents", ())
            }

        return Backend(
            "s3", {"remote_url": bucket.url, "s3_endpoint_url": bucket.endpoint_url}, listed
        )
    if kind == "redis":
        url = request.getfixturevalue("redis_url")
        return Backend(kind, {"remote_url": url}, _redis_objects([redis.Redis.from_url(url)]))
    c: RedisCluster = request.getfixturevalue("cluster")
    nodes = [redis.Redis(port=p) for p in c.primary_ports()]
    for n in nodes:
        n.flushall()
    return Backend(kind, {"remote_url": c.url}, _redis_objects(nodes))


@pytest.fixture(params=["file", "s3", "seaweedfs", "redis", "redis_cluster"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return make_backend(request.param, request, tmp_path)


@pytest.fixture(params=["file", "s3", "seaweedfs", "redis"])
def one_node(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return make_backend(request.param, request, tmp_path)


def _gen_bytes(held: dict[str, int], gen: str) -> int:
    return sum(n for k, n in held.items() if k.startswith(f"gen-{gen}/"))


def two_engines(b: Backend) -> tuple[Engine, Engine]:
    """Engine A ran ten days ago and stopped; engine B (other weights) runs now."""
    dead = time.time() - 10 * DAY
    a = write_engine(b.extra, NS, seed=1, clock=lambda: dead)
    live = write_engine(b.extra, NS_B, seed=2)
    return a, live


# -- keys and manifests ------------------------------------------------------------------


def test_every_key_of_an_engine_names_one_generation_across_ranks_and_stages() -> None:
    gen = NS.generation()
    h = os.urandom(16)
    keys = {KeySpace.worker(NS, r, s).key(h) for r in (0, 1) for s in (0, 1)}
    assert len(keys) == 4, "ranks and stages keep their own objects"
    assert all(parse_object_key(k) == (gen, False) for k in keys)
    # the layers a worker holds are in it, as in every chunk key (keys that never meet
    # never share a claim), but not a pipeline's: its stages hold other layers
    assert dataclasses.replace(NS, layers="other").generation() != gen
    pp = dataclasses.replace(NS, pp_size=2)
    assert dataclasses.replace(pp, layers="other").generation() == pp.generation()
    assert KeySpace(NS.digest(ANY_RANK, ANY_RANK), gen).key(h).startswith(f"gen-{gen}/")
    # what makes old chunks useless starts another one
    for change in (
        {"fingerprint": "c" * 32},
        {"namespace": "tenant-2"},
        {"dtype": "float16"},
        {"tp_size": 2},
        {"layout_version": NS.layout_version + 1},
    ):
        assert dataclasses.replace(NS, **change).generation() != gen, change
    assert NS.after_weight_change(b"salt").generation() != gen
    named = dataclasses.replace(NS, label="served-name")  # what the manifest shows, only
    assert named.generation() == gen and named.digest(0, 0) == NS.digest(0, 0)
    assert Manifest.of(dataclasses.replace(named, model=""), 0.0).model == "served-name"
    assert parse_object_key(manifest_key(gen)) == (gen, True)
    assert parse_object_key("ab" * 20) == (None, False)  # a bare chunk key (before)
    assert parse_object_key("session:42") is None  # another application's key
    assert parse_object_key(f"gen-{gen}/notachunk") is None


def test_a_manifest_is_sealed_like_a_chunk(tmp_path: Path) -> None:
    from kvtier.objects.sealing import Sealer

    tier = open_tier(load_config({"remote_url": f"file://{tmp_path}"}, environ={}))
    sealed = codec.Signer(b"h" * 32, sealer=Sealer(b"s" * 32))
    m = Manifest.of(NS, 1000.0)
    write_manifest(tier, m, sealed)
    raw = tier.get(manifest_key(m.id))
    assert raw is not None and b"tiny-a" not in raw, "the model name is sealed"
    assert read_manifest(tier, m.id, sealed) == m
    with pytest.raises(CodecError):  # no key: refused, never read in clear
        read_manifest(tier, m.id, None)
    with pytest.raises(CodecError):
        read_manifest(tier, m.id, codec.Signer(b"h" * 32, sealer=Sealer(b"t" * 32)))
    tier.close()


def test_the_writer_refreshes_follows_a_weight_change_and_keeps_first_seen(
    tmp_path: Path,
) -> None:
    tier = open_tier(load_config({"remote_url": f"file://{tmp_path}"}, environ={}))
    now = [5000.0]
    write_manifest(tier, Manifest.of(NS, 1000.0), None)  # another replica, earlier
    current = [NS]
    w = ManifestWriter(tier, None, lambda: current[0], interval_s=0.2, clock=lambda: now[0])
    w.start()
    deadline = time.monotonic() + 5
    while w.writes < 3 and time.monotonic() < deadline:  # at start, then every 0.2 s
        time.sleep(0.05)
    assert w.writes >= 3
    got = read_manifest(tier, NS.generation(), None)
    assert got is not None and got.first_seen == 1000.0 and got.last_seen == 5000.0
    current[0] = NS.after_weight_change(b"epoch-1")  # a weight update: a new generation
    now[0] = 6000.0
    deadline = time.monotonic() + 5
    while read_manifest(tier, current[0].generation(), None) is None:
        assert time.monotonic() < deadline, "no manifest for the new generation"
        time.sleep(0.05)
    now[0] = 7000.0
    w.close()
    new = read_manifest(tier, current[0].generation(), None)
    assert new is not None and new.first_seen == 6000.0 and new.last_seen == 7000.0
    old = read_manifest(tier, NS.generation(), None)
    assert old is not None and old.last_seen < 6000.0, "the old generation is not seen again"
    tier.close()


# -- usage -------------------------------------------------------------------------------


def test_usage_shows_each_generation_as_the_backend_holds_it(backend: Backend) -> None:
    a, b = two_engines(backend)
    held = backend.objects()
    tier = backend.tier()
    try:
        found = store_admin.usage(tier, None)
    finally:
        tier.close()
    doc = found.to_json()
    assert set(doc) == {"total_bytes", "total_chunks", "generations"}
    assert doc["total_bytes"] == sum(held.values()) > 0
    assert doc["total_chunks"] == 16 == len(held) - 2  # and a manifest per generation
    rows = {g["id"]: g for g in doc["generations"]}
    assert list(rows) == [b.generation, a.generation], "the most recently seen first"
    for eng, model in ((a, "org/tiny-a"), (b, "org/tiny-b")):
        row = rows[eng.generation]
        assert set(row) == {
            "id",
            "model",
            "namespace",
            "bytes",
            "chunks",
            "first_seen",
            "last_seen",
            "hot_chunks",
        }
        assert row["hot_chunks"] == 0, "no engine counted a hit"
        assert row["model"] == model and row["namespace"] == ""
        assert row["chunks"] == 8 and row["bytes"] == _gen_bytes(held, eng.generation)
    assert rows[a.generation]["last_seen"] < rows[b.generation]["last_seen"]


def test_chunks_without_a_readable_manifest_are_one_unknown_generation(
    one_node: Backend,
) -> None:
    a, b = two_engines(one_node)
    tier = one_node.tier()
    try:
        tier.delete([manifest_key(a.generation)])
        other = codec.Signer(b"x" * 32)  # B's manifest forged: signed by a stranger
        write_manifest(tier, Manifest.of(NS_B, time.time()), other)
        with pytest.raises(StoreError, match="--config"):  # signed, and no key to check it
            store_admin.usage(tier, None)
        found = store_admin.usage(tier, codec.Signer(b"k" * 32))
    finally:
        tier.close()
    assert [g.id for g in found.generations] == [UNKNOWN]
    assert found.bad_manifests == {b.generation: "signature"}
    row = found.to_json()["generations"][0]
    assert row["chunks"] == 16 and row["model"] is None and row["last_seen"] is None


# -- gc ----------------------------------------------------------------------------------


def test_gc_dead_after_deletes_the_stopped_generation_only(backend: Backend) -> None:
    a, b = two_engines(backend)
    before = backend.objects()
    tier = backend.tier()
    try:
        dry = store_admin.gc(tier, None, dead_after_s=7 * DAY, dry_run=True)
        assert backend.objects() == before, "--dry-run deleted something"
        plan = store_admin.gc(tier, None, dead_after_s=7 * DAY)
        again = store_admin.gc(tier, None, dead_after_s=7 * DAY)  # nothing left to do
    finally:
        tier.close()
    assert dry.to_json() | {"dry_run": False} == plan.to_json()
    assert [d["id"] for d in plan.to_json()["generations"]] == [a.generation]
    assert plan.to_json()["generations"][0]["reason"] == "dead"
    assert plan.deleted_chunks == 8 and plan.deleted_bytes == _gen_bytes(before, a.generation)
    left = backend.objects()
    assert set(left) == {*b.keys, manifest_key(b.generation)}
    assert again.deleted == []
    assert hits(backend.extra, a.keys) == [False] * 8, "the first model still hits"
    assert hits(backend.extra, b.keys) == [True] * 8, "the second model lost chunks"


def test_gc_max_bytes_deletes_the_least_recently_used_first(one_node: Backend) -> None:
    b = one_node

    def age(i: int) -> None:
        if b.coarse:
            time.sleep(1.1)  # S3 LastModified and Redis IDLETIME count seconds

    eng = write_engine(b.extra, NS_B, seed=3, between=age)
    if b.kind == "file":  # prompt i last used 1000 - 100 i seconds ago
        tier = b.tier()
        for i, prompt in enumerate(eng.prompts):
            t = time.time() - 1000 + 100 * i
            for key in prompt:
                os.utime(tier.path(key), (t, t))  # type: ignore[attr-defined]
        tier.close()
    # the first prompt is read again: the most recently used one where reads count
    assert hits(b.extra, eng.prompts[0]) == [True, True]
    total = sum(b.objects().values())
    budget = total // 2
    tier = b.tier()
    try:
        listed = {o.key: o.used for o in tier.list_objects()}
        plan = store_admin.gc(tier, None, dead_after_s=7 * DAY, max_bytes=budget)
    finally:
        tier.close()
    left = b.objects()
    assert sum(left.values()) <= budget < sum(left.values()) + 2 * max(left.values())
    deleted = {o.key for d in plan.deleted for o in d.objects}
    assert deleted == set(listed) - set(left) and manifest_key(eng.generation) in left
    assert max(listed[k] for k in deleted) <= min(listed[k] for k in left if k in eng.keys), (
        "not LRU first"
    )
    if b.kind == "s3":  # S3 records writes only: the first prompt written is the oldest
        mru, lru = eng.prompts[3], eng.prompts[0]
    else:
        mru, lru = eng.prompts[0], eng.prompts[1]
    assert hits(b.extra, mru) == [True, True], "the most recently used prompt was deleted"
    assert hits(b.extra, lru) == [False, False], "the least recently used prompt survived"


def test_gc_beside_a_reading_engine_is_a_miss_never_a_failure(one_node: Backend) -> None:
    eng = write_engine(one_node.extra, NS_B, seed=4, clock=lambda: time.time() - 10 * DAY)
    import threading

    got: list[list[bool]] = []
    failed: list[str] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            results = fetch(one_node.extra, eng.keys)
            got.append([r.ok for r in results])
            failed.extend(str(r.error_kind) for r in results if r.error_kind is not None)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        time.sleep(0.2)
        tiers = [one_node.tier(), one_node.tier()]
        runs = [
            threading.Thread(
                target=store_admin.gc, args=(t, None), kwargs={"dead_after_s": 7 * DAY}
            )
            for t in tiers
        ]
        for r in runs:  # two gc runs at once
            r.start()
        for r in runs:
            r.join()
        for t in tiers:
            t.close()
        time.sleep(0.2)
    finally:
        stop.set()
        reader.join()
    assert got and got[-1] == [False] * 8, "gc left chunks of the dead generation"
    assert failed == [], "a read beside gc failed instead of missing"
    assert one_node.objects() == {}


# -- verify ------------------------------------------------------------------------------


def test_verify_finds_corrupt_truncated_moved_and_foreign_chunks(one_node: Backend) -> None:
    extra = {**one_node.extra, "hmac_key_env": HMAC_VAR}
    eng = write_engine(extra, NS, seed=5, environ=HMAC)
    signer = codec.Signer.from_config(load_config(extra, environ={}), HMAC)
    k = eng.keys
    tier = one_node.tier()
    try:
        good = store_admin.verify(tier, signer)
        assert good.checked == 9 and good.bad == {}, good.bad  # 8 chunks and the manifest
        blob = bytearray(tier.get(k[0]) or b"")
        blob[-1] ^= 0xFF
        tier.put(k[0], [bytes(blob)])  # a bit flip on the disk
        tier.put(k[1], [(tier.get(k[1]) or b"")[:-100]])  # a torn write
        tier.put(k[3], [tier.get(k[2]) or b""])  # one chunk copied over another's name
        parts = codec.encode(
            k[4], bytes(2048), dtype="bfloat16", shape=[2, 8, 64], signer=codec.Signer(b"z" * 32)
        )
        tier.put(k[4], parts)  # written by someone without the engines' key
        sample = store_admin.verify(tier, signer, sample=3, seed=1)
        assert sample.checked == 3
        found = store_admin.verify(tier, signer)
        assert found.bad == {
            k[0]: "checksum",
            k[1]: "truncated",
            k[3]: "wrong_key",
            k[4]: "signature",
        }
        assert one_node.objects().keys() >= set(k), "verify without --delete-bad deleted"
        store_admin.verify(tier, signer, delete_bad=True)
    finally:
        tier.close()
    # the forged chunk fails for a key reason: reported, kept (an engine never loads it)
    assert set(one_node.objects()) == {*k, manifest_key(eng.generation)} - {k[0], k[1], k[3]}
    assert hits(extra, [k[2], k[5]], environ=HMAC) == [True, True]


def test_a_long_listing_shows_its_progress_on_a_terminal_only() -> None:
    import io

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    class Listing(FakeTier):
        def list_objects(self, prefix="", *, keep=None):
            return (StoredObject("ab" * 20, 10, 0.0) for _ in range(2500))

        def delete_many(self, keys) -> None:
            raise AssertionError("usage deletes nothing")

    assert store_admin.progress_printer(io.StringIO()) is None
    out = Tty()
    show = store_admin.progress_printer(out)
    assert show is not None
    found = store_admin.usage(Listing(), None, progress=show)
    assert found.total_chunks == 2500 and found.total_bytes == 25000
    assert out.getvalue() == "\rlisted 1,000 objects\rlisted 2,000 objects"


def test_verify_delete_bad_keeps_what_fails_for_no_fault_of_its_own(tmp_path: Path) -> None:
    """Only corruption is deleted: an object the backend failed to serve this once
    (unreachable, a timeout) or that fails for a key reason is reported and kept, and
    a manifest is never deleted by verify (gc deals with its generation)."""
    extra = {"remote_url": f"file://{tmp_path}", "hmac_key_env": HMAC_VAR}
    eng = write_engine(extra, NS, seed=6, environ=HMAC)
    signer = codec.Signer.from_config(load_config(extra, environ={}), HMAC)
    k = eng.keys
    tier = open_tier(load_config(extra, environ={}))
    try:
        real_get = tier.get

        def flaky(key: str, max_bytes: int | None = None) -> bytes | None:
            if key == k[0]:
                raise TierUnavailable("file tier get: timed out")
            return real_get(key, max_bytes)

        tier.put(k[1], [(tier.get(k[1]) or b"")[:-100]])  # a torn write: deleted
        tier.put(
            manifest_key(eng.generation), [(tier.get(manifest_key(eng.generation)) or b"")[:-5]]
        )
        tier.get = flaky  # type: ignore[method-assign]
        report = store_admin.verify(tier, signer, delete_bad=True)
    finally:
        tier.close()
    assert report.bad == {
        k[0]: "unreachable",
        k[1]: "truncated",
        manifest_key(eng.generation): "truncated",
    }
    assert report.deleted == 1 and report.to_json()["deleted"] == 1
    left = file_objects(tmp_path)
    assert k[1] not in left and k[0] in left and manifest_key(eng.generation) in left


def test_verify_refuses_a_signed_tier_without_its_key(tmp_path: Path) -> None:
    """A signed chunk checked without the key passes its checksum with its signature
    unchecked: that is no verification, so verify refuses (StoreError names the
    setting) before it reads further or deletes anything."""
    extra = {"remote_url": f"file://{tmp_path}", "hmac_key_env": HMAC_VAR}
    write_engine(extra, NS, seed=7, environ=HMAC)
    before = file_objects(tmp_path)
    tier = open_tier(load_config({"remote_url": f"file://{tmp_path}"}, environ={}))
    try:
        with pytest.raises(StoreError, match="hmac_key_env"):
            store_admin.verify(tier, None, delete_bad=True)
    finally:
        tier.close()
    assert file_objects(tmp_path) == before
