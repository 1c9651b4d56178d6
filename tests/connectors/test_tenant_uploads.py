"""Who uploaded which chunk, from the scheduler to the manifest (issue 60): the scheduler
sends each step's uploads per tenant label (KVTierMetadata.tenant_uploads), rank 0's
worker adds their object keys to its generation's manifest, and ``kvtier store usage
--by tenant`` joins them with the tier's listing."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from copyfakes import make_caches

from kvtier.config import load_config
from kvtier.connectors.metadata import KVTierMetadata, StoreOp, UploadOp
from kvtier.connectors.scheduler.tenants import uploads_by_tenant
from kvtier.connectors.worker import side as worker_mod
from kvtier.host.index import ChunkIndex, State
from kvtier.host.tenants import Tenancy
from kvtier.keys import Namespace
from kvtier.objects import store_admin
from kvtier.objects.manifest import read_manifest
from kvtier.objects.remote import RemoteIO
from kvtier.objects.tenant_keys import fingerprint
from kvtier.objects.tiers import FileTier
from tests.connectors.scheduler.test_scheduler_side import (
    empty_step,
    make_side,
    report,
    schedule_new,
)
from tests.connectors.scheduler.test_tenants import req

NUM_BLOCKS, BS, BPC = 40, 32, 4
KV_FIRST = (2, NUM_BLOCKS, BS, 4, 16)


def key(c: str) -> bytes:
    return c.encode() * 32


def test_a_steps_uploads_are_sent_per_tenant_label() -> None:
    index = ChunkIndex(8)
    tenancy = Tenancy(8, metrics_max=1)  # one name, then "other"
    index.tenancy = tenancy
    a, b = tenancy.tenant_id("team-a"), tenancy.tenant_id("team-b")
    for k, t in (("a", a), ("b", b), ("c", a), ("u", 0)):
        assert index.begin(key(k), State.STORING, tenant=t) is not None
    meta = KVTierMetadata(
        stores=[
            StoreOp(1, 0, [0], key("a"), upload_op_id=2),
            StoreOp(3, 1, [1], key("b")),
            StoreOp(4, 2, [2], key("u"), upload_op_id=5),
        ],
        uploads=[UploadOp(6, 3, key("c")), UploadOp(7, 4, key("b"))],
    )
    assert uploads_by_tenant(index, tenancy, meta) == {
        "team-a": [key("a"), key("c")],
        "untagged": [key("u")],
        "other": [key("b")],
    }
    assert uploads_by_tenant(index, tenancy, KVTierMetadata(stores=meta.stores[1:2])) is None


def _run(side: Any, r: Any) -> list[Any]:
    """Look up, schedule and finish one request as vLLM does: the steps' metadata."""
    metas = []
    while side.get_num_new_matched_tokens(r, 0) == (None, False):
        meta = empty_step(side)
        report(side, meta, results={op.op_id: [False] for run in meta.fetches for op in run})
        metas.append(meta)
    side.update_state_after_alloc(r, None, 0)
    metas.append(schedule_new(side, r, 0, r.num_tokens, first_block=100))
    report(side, metas[-1])
    side.request_finished(r, [])
    return metas


def test_the_scheduler_sends_its_pins_with_their_time_left_every_send() -> None:
    side = make_side(
        "1MiB",
        {
            "remote_url": "file:///nonexistent",
            "write_policy": "write_back",
            "pin_tenants": ["chat"],
        },
    )
    assert side.tenants is not None
    now = [0.0]
    side.tenants.clock = lambda: now[0]
    metas = _run(side, req("sys", 1, "chat", ttl=600))
    assert all(m.pins is None for m in metas), "sent before its time"
    pinned = {op.block_hash for m in metas for op in m.stores}
    assert pinned
    now[0] = side.tenants.pins_send_s
    sent = empty_step(side).pins
    assert sent is not None and set(sent) == pinned
    assert all(590 < left <= 600 for left in sent.values()), sent
    assert empty_step(side).pins is None, "sent again before its time"
    quiet = make_side(
        "1MiB",
        {
            "remote_url": "file:///nonexistent",
            "write_policy": "write_back",
            "tenant_quotas": {"*": "512KiB"},
        },
    )
    assert quiet.tenants is not None and not quiet.tenants.sends_pins


def test_the_scheduler_sends_the_uploads_of_each_tenant() -> None:
    """Write-back: the chunks evicted are uploaded first; each is sent as its storer's."""
    side = make_side(
        "768KiB",
        {
            "remote_url": "file:///nonexistent",
            "write_policy": "write_back",
            "tenant_quotas": {"*": "384KiB"},
        },
    )
    sent: dict[bytes, str] = {}
    stored: dict[bytes, str] = {}
    for i in range(8):
        tenant = "team-a" if i % 2 else "team-b"
        r = req(f"r{i}", 10 + i, tenant)
        metas = []
        while side.get_num_new_matched_tokens(r, 0) == (None, False):
            meta = empty_step(side)
            report(side, meta, results={op.op_id: [False] for run in meta.fetches for op in run})
            metas.append(meta)
        side.update_state_after_alloc(r, None, 0)
        meta = schedule_new(side, r, 0, r.num_tokens, first_block=100)
        metas.append(meta)
        stored.update(dict.fromkeys((op.block_hash for op in meta.stores), tenant))
        report(side, meta)
        side.request_finished(r, [])
        for m in metas:
            uploaded = [op.block_hash for op in m.uploads]
            labels = {k: t for t, ks in (m.tenant_uploads or {}).items() for k in ks}
            assert set(labels) == set(uploaded), "an upload sent without its tenant"
            sent.update(labels)
    assert len(sent) >= 8 and {sent[k] for k in sent} == {"team-a", "team-b"}
    assert all(stored[k] == t for k, t in sent.items()), "an upload sent as another tenant's"


def test_rank_0_records_its_uploads_per_tenant_in_the_manifest(tmp_path: Path) -> None:
    cfg = load_config(
        {
            "cpu_bytes": "64MiB",
            "chunk_size": BPC * BS,
            "write_policy": "write_through",
            "remote_url": f"file://{tmp_path}",
        },
        environ={},
    )
    ns = Namespace("", None, "bfloat16", "auto", BS, BPC * BS, 1, fingerprint="f" * 32, label="m")
    w = worker_mod.WorkerSide(cfg, ns, NUM_BLOCKS, lambda c: RemoteIO.from_config(c))
    w.register_kv_caches(make_caches(KV_FIRST, layers=2), rank=0, stage=0)
    assert w.slab is not None and w.manifests is not None
    stores = [
        StoreOp(2 * i + 1, i, [4 * i + j for j in range(4)], key(c), upload_op_id=2 * i + 2)
        for i, c in enumerate("abc")
    ]
    tenants: dict[str, Any] = {"team-a": [key("a"), key("c")], "team-b": [key("b")]}
    meta = KVTierMetadata(
        step=1,
        host_bytes=w.slab.nbytes,
        stores=stores,
        tenant_uploads=tenants,
        pins={key("b"): 600.0},
    )
    sent_at = time.time()
    w.start_load_kv(meta)
    w.wait_for_save(meta)
    w.shutdown()  # flushes the uploads, writes the manifest once more
    tier = FileTier(str(tmp_path), background_sweep=False)
    try:
        m = read_manifest(tier, w.namespace.generation(), None)
        assert m is not None
        owners = m.tenants.owners()
        assert {c: owners.get(fingerprint(w._object_key(key(c))) or b"") for c in "abc"} == {
            "a": "team-a",
            "b": "team-b",
            "c": "team-a",
        }
        pins = dict(m.pins.until)
        assert list(pins) == [fingerprint(w._object_key(key("b")))]
        assert sent_at + 599 <= next(iter(pins.values())) <= time.time() + 601
        found = store_admin.usage(tier, None)
        rows = {g.id: g.by_tenant() for g in found.generations}
        size = next(o.size for g in found.generations for o in g.chunks)
        assert rows == {
            w.namespace.generation(): {
                "team-a": {"bytes": 2 * size, "chunks": 2},
                "team-b": {"bytes": size, "chunks": 1},
            }
        }
    finally:
        tier.close()


def test_pins_left_counts_ready_and_pending_pins_and_keeps_the_longest() -> None:
    now = [100.0]
    tenancy = Tenancy(8, pin_tenants=frozenset({"chat"}), clock=lambda: now[0])
    index = ChunkIndex(8)
    index.tenancy = tenancy
    chat = tenancy.tenant_id("chat")
    for k in "abc":
        assert index.begin(key(k), State.STORING, tenant=chat) is not None
    for k in "ab":
        assert index.commit(key(k), True) is not None
    assert index.soft_pin(key("a"), 60, chat) and index.soft_pin(key("b"), 300, chat)
    assert index.soft_pin(key("c"), 600, chat)  # not ready yet: pinned as it turns ready
    now[0] += 30
    assert tenancy.pins_left(8) == {key("a"): 30.0, key("b"): 270.0, key("c"): 600.0}
    assert tenancy.pins_left(2) == {key("b"): 270.0, key("c"): 600.0}
    now[0] += 40
    assert key("a") not in tenancy.pins_left(8), "an expired pin is sent"
