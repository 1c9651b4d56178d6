"""KV events (connectors/scheduler/events.py) driven through the scheduler side and the facade.

Requests are vLLM's own ``Request`` with vLLM's block hasher, so the hashes the
events carry are the ones vLLM publishes for the GPU blocks; the events are vLLM's
own ``BlockStored``/``BlockRemoved``. The real engine and a ZMQ subscriber are in
tests/e2e/test_kv_events.py.
"""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request

from kvtier.config import load_config
from kvtier.connectors.engine_shape import EngineShape
from kvtier.connectors.metadata import KVTierMetadata, KVTierWorkerMeta
from kvtier.connectors.scheduler.events import ChunkEvents
from kvtier.connectors.scheduler.side import SchedulerSide
from kvtier.connectors.vllm import KVTierConnector
from kvtier.keys import Namespace
from kvtier.ops import StoreOp

BS, CHUNK = 32, 256
BPC = CHUNK // BS
init_none_hash(sha256)
_ids = itertools.count()


def make_request(seed: int, n_tokens: int, salt: str | None = None) -> Request:
    tokens = [(i * 7919 + seed * 104729) % 480 + 5 for i in range(n_tokens)]
    return Request(
        f"r{next(_ids)}",
        tokens,
        SamplingParams(max_tokens=4),
        None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(BS, sha256),
    )


class FakeManager:
    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return (self.blocks[req_id],)


def make_connector(
    cpu_bytes: str = "512KiB",
    extra: dict[str, Any] | None = None,
    world_size: int = 1,
    max_events: int = 4096,
) -> tuple[KVTierConnector, SchedulerSide, ChunkEvents]:
    """The facade's scheduler role around a real SchedulerSide (2 layers x 4 KiB a
    block: a 64 KiB slot per chunk, so 512 KiB = 8 slots), with events on."""
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BS, cpu_offload_gb=0),
        parallel_config=SimpleNamespace(tensor_parallel_size=world_size, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model="/nonexistent/model"),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192),
        offload_config=None,
    )
    kv_cache_config = SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(
                kv_cache_spec=SimpleNamespace(page_size_bytes=4096), layer_names=["l0", "l1"]
            )
        ]
    )
    cfg = load_config(
        {"cpu_bytes": cpu_bytes, "cpu_headroom_bytes": 0, **(extra or {})}, environ={}
    )
    ns = Namespace(
        model="m",
        revision=None,
        dtype="bfloat16",
        kv_cache_dtype="auto",
        block_size=BS,
        chunk_size=CHUNK,
        tp_size=world_size,
    )
    shape = EngineShape.from_vllm(vllm_config, kv_cache_config)  # type: ignore[arg-type]
    side = SchedulerSide(cfg, shape, ns)
    side.bind_kv_cache_manager(FakeManager())  # type: ignore[arg-type]
    events = ChunkEvents(
        block_size=BS,
        blocks_per_chunk=BPC,
        max_events=max_events,
        world_size=world_size,
        kv_cache_spec_kind="full_attention",
    )
    side.attach_events(events)
    conn = KVTierConnector.__new__(KVTierConnector)
    conn._scheduler, conn._worker = side, None
    return conn, side, events


def schedule_prompt(conn: KVTierConnector, req: Request) -> KVTierMetadata:
    side = conn._scheduler
    assert side is not None
    while side.get_num_new_matched_tokens(req, 0)[0] is None:  # an object-tier lookup:
        for run in side.lookups.take_runs():  # the tier holds none of it
            report(conn, {op.op_id: [False] for op in run})
    side.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]
    side._kv_cache_manager.blocks[req.request_id] = list(  # type: ignore[union-attr]
        range(100, 100 + -(-req.num_tokens // BS))
    )
    so = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={req.request_id: req.num_tokens},
        scheduled_spec_decode_tokens={},
    )
    meta = conn.build_connector_meta(so)  # type: ignore[arg-type]
    assert isinstance(meta, KVTierMetadata)
    return meta


def report(conn: KVTierConnector, results: dict[int, list[bool]]) -> None:
    conn.update_connector_output(  # type: ignore[arg-type]
        SimpleNamespace(kv_connector_worker_meta=KVTierWorkerMeta(steps=[], results=results))
    )


def all_ops(meta: KVTierMetadata) -> dict[int, list[bool]]:
    ids = [op.op_id for op in meta.stores] + [
        op.upload_op_id for op in meta.stores if op.upload_op_id is not None
    ]
    return {i: [True] for i in ids + [op.op_id for op in meta.uploads]}


def vllm_hashes(req: Request, c: int) -> list[Any]:
    """What vLLM publishes for chunk ``c``'s blocks (its GPU events' hash format)."""
    return [maybe_convert_block_hash(h) for h in req.block_hashes[c * BPC : (c + 1) * BPC]]


def store_prompt(conn: KVTierConnector, req: Request) -> KVTierMetadata:
    meta = schedule_prompt(conn, req)
    report(conn, all_ops(meta))
    return meta


# ---- BlockStored -----------------------------------------------------------------------------
def test_a_stored_chunk_is_one_block_stored_with_vllms_hashes() -> None:
    conn, _side, events = make_connector()
    req = make_request(1, 2 * CHUNK + 40, salt="tenant-a")
    meta = schedule_prompt(conn, req)
    assert len(meta.stores) == 2
    assert list(conn.take_events()) == [], "nothing before the workers report the stores"
    report(conn, all_ops(meta))
    evs = list(conn.take_events())
    assert [type(e) for e in evs] == [BlockStored, BlockStored]
    for c, ev in enumerate(evs):
        assert isinstance(ev, BlockStored)
        assert ev.block_hashes == vllm_hashes(req, c)
        assert ev.parent_block_hash == (
            maybe_convert_block_hash(req.block_hashes[c * BPC - 1]) if c else None
        )
        assert ev.token_ids == req.all_token_ids[c * CHUNK : (c + 1) * CHUNK]
        assert ev.block_size == BS
        assert ev.medium == "CPU" and ev.locality == "LOCAL" and ev.group_idx == 0
        assert ev.kv_cache_spec_kind == "full_attention"
        assert ev.lora_id is None and ev.lora_name is None
    # cache_salt is in the first block's extra keys only, as in vLLM's GPU events
    assert evs[0].extra_keys == [("tenant-a",)] + [None] * (BPC - 1)
    assert evs[1].extra_keys == [None] * BPC  # vLLM's to_event_extra_keys, as on the GPU
    assert list(conn.take_events()) == [], "taken once"


def test_a_failed_store_emits_nothing_and_leaves_no_state() -> None:
    conn, side, events = make_connector()
    req = make_request(2, 3 * CHUNK + 1)
    meta = schedule_prompt(conn, req)
    results = all_ops(meta)
    results[meta.stores[1].op_id] = [False]
    report(conn, results)
    evs = list(conn.take_events())
    assert [e.block_hashes for e in evs] == [vllm_hashes(req, 0), vllm_hashes(req, 2)]
    assert events.tracked() == 2 == side.index.used_slots


def test_a_store_settles_only_when_every_worker_reported() -> None:
    conn, _side, _events = make_connector(cpu_bytes="256KiB", world_size=2)
    req = make_request(3, CHUNK + 1)
    meta = schedule_prompt(conn, req)
    op = meta.stores[0].op_id
    report(conn, {op: [True]})
    assert list(conn.take_events()) == []
    report(conn, {op: [True]})
    assert len(list(conn.take_events())) == 1


# ---- BlockRemoved ----------------------------------------------------------------------------
def test_eviction_emits_block_removed_for_the_evicted_chunks() -> None:
    conn, side, events = make_connector()  # 8 slots
    a, b = make_request(4, 5 * CHUNK + 1), make_request(5, 5 * CHUNK + 1)
    store_prompt(conn, a)
    list(conn.take_events())
    store_prompt(conn, b)  # 5 new chunks, 3 free slots: a's two oldest go
    evs = list(conn.take_events())
    removed = [e for e in evs if isinstance(e, BlockRemoved)]
    assert len(removed) == 1, "the step's removals are merged into one event"
    assert removed[0].block_hashes == vllm_hashes(a, 0) + vllm_hashes(a, 1)
    assert removed[0].medium == "CPU" and removed[0].locality == "LOCAL"
    assert sum(isinstance(e, BlockStored) for e in evs) == 5
    assert events.tracked() == side.index.used_slots == 8


def test_reset_emits_one_block_removed_and_drops_in_flight_chunks_when_they_settle() -> None:
    conn, side, events = make_connector()
    a, b = make_request(6, 2 * CHUNK + 1), make_request(7, CHUNK + 1)
    store_prompt(conn, a)
    meta_b = schedule_prompt(conn, b)  # b's store is in flight during the reset
    list(conn.take_events())
    assert conn.reset_cache() is True
    evs = list(conn.take_events())
    assert len(evs) == 1 and isinstance(evs[0], BlockRemoved)
    assert evs[0].block_hashes == vllm_hashes(a, 0) + vllm_hashes(a, 1)
    # b's store lands after the reset: not a hit, no BlockStored, its slot is freed
    report(conn, all_ops(meta_b))
    assert list(conn.take_events()) == []
    assert side.index.used_slots == 0 and events.tracked() == 0
    side.index.check()


def test_a_chunk_that_leaves_and_returns_keeps_its_events_in_order() -> None:
    conn, _side, _events = make_connector(cpu_bytes="64KiB")  # one slot
    a, b = make_request(8, CHUNK + 1), make_request(9, CHUNK + 1)
    store_prompt(conn, a)
    store_prompt(conn, b)
    store_prompt(conn, make_request(8, CHUNK + 1))  # a's prompt again
    evs = list(conn.take_events())
    kinds = [(type(e).__name__, e.block_hashes[0]) for e in evs]
    h_a, h_b = vllm_hashes(a, 0)[0], vllm_hashes(b, 0)[0]
    assert kinds == [
        ("BlockStored", h_a),
        ("BlockRemoved", h_a),
        ("BlockStored", h_b),
        ("BlockRemoved", h_b),
        ("BlockStored", h_a),
    ]


# ---- the object tier -------------------------------------------------------------------------
def test_an_upload_is_a_storage_block_stored_after_the_cpu_one() -> None:
    conn, _side, _events = make_connector(extra={"remote_url": "file:///nonexistent/kv"})
    req = make_request(10, 2 * CHUNK + 1)
    meta = schedule_prompt(conn, req)
    stores = {op.op_id: [True] for op in meta.stores}
    uploads = {op.upload_op_id: [True] for op in meta.stores if op.upload_op_id is not None}
    assert len(uploads) == 2
    report(conn, stores | uploads)
    evs = list(conn.take_events())
    assert [(e.medium, e.locality) for e in evs] == [
        ("CPU", "LOCAL"),
        ("CPU", "LOCAL"),
        ("STORAGE", "REMOTE"),
        ("STORAGE", "REMOTE"),
    ]
    assert evs[2].block_hashes == vllm_hashes(req, 0)
    assert evs[2].token_ids == evs[0].token_ids and evs[2].parent_block_hash is None


def test_an_upload_of_a_chunk_whose_store_failed_emits_nothing() -> None:
    conn, side, _events = make_connector(extra={"remote_url": "file:///nonexistent/kv"})
    req = make_request(11, CHUNK + 1)
    meta = schedule_prompt(conn, req)
    op = meta.stores[0]
    assert op.upload_op_id is not None
    report(conn, {op.op_id: [False], op.upload_op_id: [True]})
    assert list(conn.take_events()) == []
    assert side.index.used_slots == 0


def test_a_failed_upload_emits_no_storage_event() -> None:
    conn, _side, _events = make_connector(extra={"remote_url": "file:///nonexistent/kv"})
    req = make_request(12, CHUNK + 1)
    meta = schedule_prompt(conn, req)
    op = meta.stores[0]
    assert op.upload_op_id is not None
    report(conn, {op.op_id: [True], op.upload_op_id: [False]})
    assert [e.medium for e in conn.take_events()] == ["CPU"]


def test_write_back_upload_then_eviction_in_one_report() -> None:
    """write_back uploads a chunk as it is evicted: the upload's STORAGE event comes
    before the BlockRemoved its settling causes (the payload outlives the index entry)."""
    conn, side, _events = make_connector(
        cpu_bytes="64KiB",
        extra={"remote_url": "file:///nonexistent/kv", "write_policy": "write_back"},
    )
    a, b = make_request(13, CHUNK + 1), make_request(14, CHUNK + 1)
    store_prompt(conn, a)
    list(conn.take_events())
    meta_b = schedule_prompt(conn, b)  # the only slot is a's: its write-back begins
    assert not meta_b.stores and len(meta_b.uploads) == 1
    report(conn, {meta_b.uploads[0].op_id: [True]})
    evs = list(conn.take_events())
    assert [(type(e).__name__, e.medium) for e in evs] == [
        ("BlockStored", "STORAGE"),
        ("BlockRemoved", "CPU"),
    ]
    assert evs[0].block_hashes == evs[1].block_hashes == vllm_hashes(a, 0)
    assert side.index.used_slots == 0


def test_a_fetched_chunk_is_a_cpu_block_stored_and_no_storage_one() -> None:
    conn, side, _events = make_connector(extra={"remote_url": "file:///nonexistent/kv"})
    req = make_request(15, 2 * CHUNK + 1)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # lookup runs
    runs = side.lookups.take_runs()
    assert [len(r) for r in runs] == [2]
    report(conn, {runs[0][0].op_id: [True], runs[0][1].op_id: [False]})
    evs = list(conn.take_events())
    assert len(evs) == 1 and isinstance(evs[0], BlockStored)
    assert evs[0].medium == "CPU" and evs[0].block_hashes == vllm_hashes(req, 0)
    assert side.get_num_new_matched_tokens(req, 0) == (CHUNK, False)
    assert list(conn.take_events()) == [], "vLLM's re-asks record nothing twice"


# ---- bounds and cost -------------------------------------------------------------------------
def test_the_queue_is_bounded_and_counts_what_it_dropped() -> None:
    conn, _side, events = make_connector(max_events=3)
    reqs = [make_request(20 + i, CHUNK + 1) for i in range(5)]
    for r in reqs:
        store_prompt(conn, r)
    evs = list(conn.take_events())
    assert len(evs) == 3 and events.dropped == 2
    assert [e.block_hashes for e in evs] == [vllm_hashes(r, 0) for r in reqs[2:]], "newest kept"


def test_decode_steps_cost_nothing_and_record_nothing() -> None:
    """Events add work per chunk, never per token: a decode step that completes no chunk
    leaves the events untouched."""
    conn, _side, events = make_connector(cpu_bytes="4MiB")
    req = make_request(30, 16 * CHUNK + 1)
    store_prompt(conn, req)
    list(conn.take_events())
    for _ in range(50):
        req.append_output_token_ids(7)
        so = SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[req.request_id], num_computed_tokens=[req.num_tokens - 1]
            ),
            num_scheduled_tokens={req.request_id: 1},
            scheduled_spec_decode_tokens={},
        )
        assert not conn.build_connector_meta(so).stores  # type: ignore[arg-type, union-attr]
    assert list(conn.take_events()) == [] and events.emitted == 16


def test_recording_a_chunk_is_cheap() -> None:
    """The per-chunk cost the scheduler pays with events on (a slice of hashes and
    tokens, one event): far below a millisecond, against a chunk's host copy."""
    events = ChunkEvents(block_size=BS, blocks_per_chunk=BPC, max_events=1 << 16)
    req = make_request(31, 64 * CHUNK + 1)
    st = SimpleNamespace(request=req, chunk_hashes=req.block_hashes[BPC - 1 :: BPC])
    ops = [StoreOp(i, i, [], h) for i, h in enumerate(st.chunk_hashes)]
    t0 = time.perf_counter()
    events.record_stores(st, ops)  # type: ignore[arg-type]
    for h in st.chunk_hashes:
        events.chunk_ready(SimpleNamespace(block_hash=h))  # type: ignore[arg-type]
    assert len(events.take_events()) == 64
    per_chunk = (time.perf_counter() - t0) / 64
    assert per_chunk < 250e-6, f"{per_chunk * 1e6:.0f} us per chunk"


def test_payloads_held_per_chunk_give_the_garbage_collector_nothing_to_walk() -> None:
    """A payload lives as long as its chunk is in the host tier (one per slot, maybe a
    million): after vLLM's start-up freeze, recording chunks adds no object a full
    collection walks, and the events still carry vLLM's values (lists, as vLLM's)."""
    import gc

    events = ChunkEvents(block_size=BS, blocks_per_chunk=BPC, max_events=1 << 16)
    req = make_request(33, 64 * CHUNK + 1, salt="tenant-b")
    gc.collect()
    gc.freeze()
    try:
        before = len(gc.get_objects())
        st = SimpleNamespace(request=req, chunk_hashes=req.block_hashes[BPC - 1 :: BPC])
        for c in range(64):
            events.record(st, c, st.chunk_hashes[c])  # type: ignore[arg-type]
        gc.collect()
        grown = len(gc.get_objects()) - before
    finally:
        gc.unfreeze()
    assert events.tracked() == 64 and grown < 10, f"{grown} objects to walk"
    events.chunk_ready(SimpleNamespace(block_hash=req.block_hashes[BPC - 1]))  # type: ignore[arg-type]
    (ev,) = events.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.token_ids == req.all_token_ids[:CHUNK] and type(ev.token_ids) is list
    assert ev.extra_keys == [("tenant-b",)] + [None] * (BPC - 1)
    assert type(ev.block_hashes) is list and ev.block_hashes == vllm_hashes(req, 0)


# ---- wiring ----------------------------------------------------------------------------------
def test_events_follow_vllms_kv_events_config() -> None:
    on = SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=True))
    off = SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=False))
    assert EngineShape.from_vllm(on).kv_events is True  # type: ignore[arg-type]
    assert EngineShape.from_vllm(off).kv_events is False  # type: ignore[arg-type]
    no_config = SimpleNamespace(kv_events_config=None)
    assert EngineShape.from_vllm(no_config).kv_events is False  # type: ignore[arg-type]
    conn = KVTierConnector.__new__(KVTierConnector)
    conn._scheduler = None
    assert list(conn.take_events()) == []


def test_chunk_events_reject_nonsense_sizes() -> None:
    with pytest.raises(ValueError):
        ChunkEvents(block_size=BS, blocks_per_chunk=0, max_events=10)
    with pytest.raises(ValueError):
        ChunkEvents(block_size=BS, blocks_per_chunk=BPC, max_events=0)


@pytest.mark.parametrize("as_int", ["1", "0"])
def test_hashes_are_converted_exactly_as_vllm_converts_them(
    as_int: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvtier decides the format once (vLLM's function reads the environment per call)."""
    from kvtier.connectors.scheduler.events import hash_converter

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", as_int)
    convert = hash_converter()
    req = make_request(40, 4 * BS)
    for h in req.block_hashes:
        assert convert(h) == maybe_convert_block_hash(h)
    assert isinstance(convert(req.block_hashes[0]), int if as_int == "1" else bytes)


def test_a_hash_format_kvtier_does_not_know_falls_back_to_vllms_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvtier.connectors.scheduler import events as events_mod

    def other(h: bytes) -> int:
        return int.from_bytes(h[:4], "little")

    monkeypatch.setattr(events_mod, "maybe_convert_block_hash", other)
    convert = events_mod.hash_converter()
    assert convert is other


def test_chunks_under_tagged_keys_are_described_by_vllms_block_hashes() -> None:
    """A LoRA request's index keys are vLLM's hashes tagged with the adapter's version
    (``tagged_key``): its stored chunks still produce events, and the events carry
    vLLM's own block hashes (what a router matches), not kvtier's keys."""
    from kvtier.connectors.scheduler.requests import tagged_key

    events = ChunkEvents(block_size=BS, blocks_per_chunk=BPC, max_events=1 << 10)
    req = make_request(41, 2 * CHUNK + 1)
    tag = b"\x07" * 32
    keys = [tagged_key(tag, h) for h in req.block_hashes[BPC - 1 :: BPC]]
    st = SimpleNamespace(request=req, chunk_hashes=keys)
    events.record_stores(st, [StoreOp(i, i, [], k) for i, k in enumerate(keys)])  # type: ignore[arg-type]
    for k in keys:
        events.chunk_ready(SimpleNamespace(block_hash=k))  # type: ignore[arg-type]
    stored = events.take_events()
    assert len(stored) == 2 and all(isinstance(ev, BlockStored) for ev in stored)
    assert [ev.block_hashes[-1] for ev in stored] == [
        events._convert(h) for h in req.block_hashes[BPC - 1 :: BPC]
    ]


# ---- hybrid models: one event per KV cache group -------------------------------------------
def test_a_hybrid_chunk_is_one_event_per_group_with_the_blocks_kvtier_stores_of_it() -> None:
    """A model with a recurrent-state group (vLLM's group 0 here, as for GraniteMoeHybrid),
    a sliding-window group keeping the chunk's last 2 blocks, and a full-attention group:
    each group's event names the blocks kvtier stores of it, with its parent; the state's
    is the chunk's last block with no token ids (the state at the chunk's end, as vLLM's
    own offloading events announce it). Its removal is one event per group too."""
    from kvtier.connectors.scheduler.events import GroupEvents

    groups = (
        GroupEvents(0, "mamba", None, blocks=1, state=True),
        GroupEvents(1, "sliding_window", 64, blocks=2),
        GroupEvents(2, "full_attention", None),
    )
    events = ChunkEvents(block_size=BS, blocks_per_chunk=BPC, max_events=64, groups=groups)
    req = make_request(41, 2 * CHUNK + 1)
    st = SimpleNamespace(request=req, chunk_hashes=req.block_hashes[BPC - 1 :: BPC])
    events.record(st, 1, st.chunk_hashes[1])  # type: ignore[arg-type]
    events.chunk_ready(SimpleNamespace(block_hash=st.chunk_hashes[1]))  # type: ignore[arg-type]
    state, sliding, full = events.take_events()
    hashes = vllm_hashes(req, 1)
    assert [e.group_idx for e in (state, sliding, full)] == [0, 1, 2]
    assert isinstance(state, BlockStored) and isinstance(full, BlockStored)
    assert isinstance(sliding, BlockStored)
    assert state.block_hashes == hashes[-1:] and state.parent_block_hash == hashes[-2]
    assert state.token_ids == [] and state.kv_cache_spec_kind == "mamba"
    assert sliding.block_hashes == hashes[-2:] and sliding.parent_block_hash == hashes[-3]
    assert sliding.token_ids == req.all_token_ids[2 * CHUNK - 2 * BS : 2 * CHUNK]
    assert sliding.kv_cache_spec_sliding_window == 64
    assert full.block_hashes == hashes and full.parent_block_hash == vllm_hashes(req, 0)[-1]
    assert full.token_ids == req.all_token_ids[CHUNK : 2 * CHUNK]
    events.chunk_dropped(SimpleNamespace(block_hash=st.chunk_hashes[1]))  # type: ignore[arg-type]
    removed = events.take_events()
    assert [(e.group_idx, e.block_hashes) for e in removed] == [
        (0, hashes[-1:]),
        (1, hashes[-2:]),
        (2, hashes),
    ]
    assert all(isinstance(e, BlockRemoved) for e in removed)
