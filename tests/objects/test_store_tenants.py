"""``kvtier store`` per tenant (issue 60) on real backends: a directory, S3 (moto's server)
and one Redis node. Chunks uploaded by kvtier's own object-tier code (RemoteIO under a
worker's KeySpace), attributed to tenants by the manifest writer as rank 0 does
(:meth:`ManifestWriter.add_tenants`): usage per tenant, and gc trimming a tenant over its
quota by its own least recently used chunks, never another tenant's."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from kit import collect, payload
from store_kit import DT, NS, NS_B, SHAPE, file_objects, hits

from kvtier.config import load_config
from kvtier.keys import KeySpace, Namespace
from kvtier.objects import store_admin
from kvtier.objects.manifest import ManifestWriter, manifest_key
from kvtier.objects.remote import RemoteIO
from kvtier.objects.tenant_keys import Pins, TenantKeys
from kvtier.objects.tiers import ObjectTier, open_tier

pytestmark = pytest.mark.integration

DAY = 86400.0


@dataclass
class Backend:
    kind: str
    extra: dict[str, Any]
    objects: Callable[[], dict[str, int]]
    #: recency in whole seconds (S3 LastModified, Redis IDLETIME)
    coarse: bool = True

    def tier(self) -> ObjectTier:
        return open_tier(load_config(self.extra, environ={}))


@pytest.fixture(params=["file", "s3", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "file":
        root = tmp_path / "kv"
        root.mkdir()
        return Backend(
            "file", {"remote_url": f"file://{root}"}, lambda: file_objects(root), coarse=False
        )
    if request.param == "s3":
        bucket = request.getfixturevalue("s3_bucket")
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
    url = request.getfixturevalue("redis_url")
    r = redis.Redis.from_url(url)
    return Backend(
        "redis", {"remote_url": url}, lambda: {k.decode(): 1 for k in r.scan_iter(count=1000)}
    )


class Fleet:
    """Two generations' uploads, each chunk attributed as rank 0's manifest writer does."""

    def __init__(self, b: Backend, ordered: bool) -> None:
        self.b = b
        self.ordered = ordered
        self.rio = RemoteIO.from_config(load_config(b.extra, environ={}), environ={})
        self.writers: dict[str, ManifestWriter] = {}
        self.op = 0
        #: name -> object key
        self.keys: dict[str, str] = {}

    def upload(self, ns: Namespace, tenant: str | None, *names: str) -> None:
        """Upload a chunk per name, as ``tenant``'s (None: attributed to no one)."""
        gen = ns.generation()
        writer = self.writers.get(gen)
        if writer is None:
            writer = self.writers[gen] = ManifestWriter(self.rio.tier, self.rio.signer, lambda: ns)
        space = KeySpace.worker(ns, 0, 0)
        for name in names:
            self.op += 1
            key = self.keys[name] = space.key(name.encode() * 8)
            assert self.rio.submit_put(self.op, key, payload(self.op), dtype=DT, shape=SHAPE)
        assert self.rio.flush(10.0) == 0
        if tenant is not None:
            writer.add_tenants(TenantKeys.of({tenant: [self.keys[n] for n in names]}))
        if self.ordered:  # the next upload is more recent
            time.sleep(1.1 if self.b.coarse else 0.02)

    def close(self) -> None:
        assert all(r.ok for r in collect(self.rio, self.op).values())
        for w in self.writers.values():
            assert w.refresh() is not None
        self.rio.close()


def fleet(b: Backend, ordered: bool = False, pins: dict[str, float] | None = None) -> Fleet:
    """Oldest first: u0 (no one's), h0 (chat), o0 o1 (other: tenants past the bound), c0;
    then c1 h1; c2; c3 c4 in the second generation. crawl's chunks span both. ``ordered``:
    each upload more recent than the last, as the backend records it."""
    f = Fleet(b, ordered)
    f.upload(NS, None, "u0")
    f.upload(NS, "chat", "h0")
    f.upload(NS, "other", "o0", "o1")
    f.upload(NS, "crawl", "c0")
    f.upload(NS, "crawl", "c1")
    f.upload(NS, "chat", "h1")
    f.upload(NS, "crawl", "c2")
    f.upload(NS_B, "crawl", "c3", "c4")
    for name, until in (pins or {}).items():  # pinned in a host tier, as rank 0 records it
        ns = NS_B if name in ("c3", "c4") else NS
        f.writers[ns.generation()].add_pins(Pins.of({f.keys[name]: until}))
    f.close()
    return f


def test_usage_by_tenant_joins_the_manifests_lists_with_the_listing(backend: Backend) -> None:
    f = fleet(backend)
    tier = backend.tier()
    try:
        found = store_admin.usage(tier, None)
    finally:
        tier.close()
    doc = found.to_json(by_tenant=True)
    sizes = {o.key: o.size for g in found.generations for o in g.chunks}
    chunks = {
        g["id"]: {t: n["chunks"] for t, n in g["tenants"].items()} for g in doc["generations"]
    }
    assert chunks == {
        NS.generation(): {"chat": 2, "crawl": 3, "other": 2, "unattributed": 1},
        NS_B.generation(): {"crawl": 2},
    }
    crawl = sum(sizes[f.keys[c]] for c in ("c0", "c1", "c2", "c3", "c4"))
    assert doc["tenants"]["crawl"] == {"bytes": crawl, "chunks": 5}
    assert sum(n["bytes"] for n in doc["tenants"].values()) == sum(sizes.values())
    assert "tenants" not in found.to_json(), "only --by tenant adds them"


def test_gc_trims_a_tenant_over_its_quota_by_its_own_lru_only(backend: Backend) -> None:
    f = fleet(backend, ordered=True)
    before = backend.objects()
    tier = backend.tier()
    try:
        size = max(o.size for o in tier.list_objects() if o.key in f.keys.values())
        # crawl keeps two chunks, any other tenant one (untagged and other included)
        quotas = {"crawl": 2 * size, "*": size}
        dry = store_admin.gc(tier, None, dead_after_s=7 * DAY, tenant_quotas=quotas, dry_run=True)
        assert backend.objects() == before, "--dry-run deleted something"
        plan = store_admin.gc(tier, None, dead_after_s=7 * DAY, tenant_quotas=quotas)
        again = store_admin.gc(tier, None, dead_after_s=7 * DAY, tenant_quotas=quotas)
    finally:
        tier.close()
    assert dry.to_json() | {"dry_run": False} == plan.to_json()
    name = {k: n for n, k in f.keys.items()}
    deleted = {name[o.key] for d in plan.deleted for o in d.objects}
    assert deleted == {"c0", "c1", "c2", "h0"}, "not each tenant's own oldest"
    assert {d.reason for d in plan.deleted} == {"tenant_quota"}
    doc = plan.to_json()
    assert {t: n["chunks"] for t, n in doc["deleted_by_tenant"].items()} == {"crawl": 3, "chat": 1}
    assert doc["deleted_chunks"] == 4 and again.deleted == []
    left = backend.objects()
    assert {f.keys[n] for n in ("u0", "o0", "o1", "h1", "c3", "c4")} <= set(left)
    assert manifest_key(NS.generation()) in left and manifest_key(NS_B.generation()) in left
    kept = ["u0", "o0", "o1", "h1", "c3", "c4"]
    assert hits(backend.extra, [f.keys[n] for n in kept]) == [True] * 6
    assert hits(backend.extra, [f.keys[n] for n in sorted(deleted)]) == [False] * 4


def test_gc_without_quotas_or_under_them_deletes_nothing_of_a_tenants(backend: Backend) -> None:
    f = fleet(backend)
    before = backend.objects()
    tier = backend.tier()
    try:
        roomy = store_admin.gc(tier, None, dead_after_s=7 * DAY, tenant_quotas={"*": 1 << 40})
        plain = store_admin.gc(tier, None, dead_after_s=7 * DAY)
    finally:
        tier.close()
    assert roomy.deleted == [] and plain.deleted == [] and backend.objects() == before
    assert len(f.keys) == 10


def test_gc_keeps_a_chunk_pinned_in_its_manifest_until_the_pin_expires(backend: Backend) -> None:
    f = fleet(backend, ordered=True, pins={"c0": time.time() + 3600})
    name = {k: n for n, k in f.keys.items()}

    def names(plan: store_admin.GcPlan) -> set[str]:
        return {name.get(o.key, o.key) for d in plan.deleted for o in d.objects}

    tier = backend.tier()
    try:
        size = max(o.size for o in tier.list_objects() if o.key in f.keys.values())
        # both generations dead: all goes but the pinned chunk and its manifest
        dead = store_admin.gc(tier, None, dead_after_s=1, now=time.time() + 10, dry_run=True)
        assert names(dead) == (set(f.keys) - {"c0"}) | {manifest_key(NS_B.generation())}
        assert dead.to_json()["kept_pinned_chunks"] == 1
        # the pinned chunk counts to crawl's quota, and crawl's oldest unpinned go
        plan = store_admin.gc(
            tier, None, dead_after_s=7 * DAY, tenant_quotas={"crawl": 3 * size, "*": size}
        )
        assert names(plan) == {"c1", "c2", "h0"}
        lru = store_admin.gc(tier, None, dead_after_s=7 * DAY, max_bytes=1, dry_run=True)
        assert names(lru) == {"u0", "o0", "o1", "h1", "c3", "c4"}
        assert f.keys["c0"] in backend.objects()  # (a read would make it the most recent)
        later = store_admin.gc(
            tier,
            None,
            dead_after_s=7 * DAY,
            now=time.time() + 7200,
            tenant_quotas={"crawl": 2 * size},
        )
        assert names(later) == {"c0"} and later.kept_pinned == 0, "an expired pin still holds"
    finally:
        tier.close()
    assert hits(backend.extra, [f.keys["c0"]]) == [False]
