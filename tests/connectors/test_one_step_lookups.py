"""One-step lookups (connectors/scheduler/one_step_lookups.py): the scheduler stats a local
directory tier.

Scheduler side with fakes of vLLM's objects (as in test_scheduler_side.py) over a real
directory; worker side with a real directory tier and real copies. The same paths run
inside vLLM in tests/e2e/test_object_tier.py::test_one_step_lookups_on_a_local_directory.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvtier.config import load_config
from kvtier.connectors.engine_shape import EngineShape
from kvtier.connectors.metadata import FetchOp, LoadOp, StoreOp, WorkerKeys
from kvtier.connectors.scheduler.one_step_lookups import LocalProbe, one_step_refusal
from kvtier.connectors.scheduler.side import SchedulerSide
from kvtier.host.index import State
from kvtier.keys import KeySpace, Namespace
from kvtier.objects.tiers import FileTier
from tests.connectors.scheduler.test_scheduler_side import (
    BPC,
    CHUNK,
    FakeManager,
    decode_step,
    report,
    request,
    schedule_new,
)
from tests.connectors.worker.test_worker_side import _pp_worker, blocks_of, step_meta

BS = CHUNK // BPC
NS = Namespace(
    model="",
    revision=None,
    dtype="bfloat16",
    kv_cache_dtype="auto",
    block_size=BS,
    chunk_size=CHUNK,
    tp_size=1,
    fingerprint="w",
    layers="l",
)


def side_on(root: Path, *, policy: str = "recompute", tp: int = 1) -> SchedulerSide:
    """A scheduler side with a directory tier at ``root`` under vLLM's ``policy``."""
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BS, cpu_offload_gb=0),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model="/nonexistent/model"),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192),
        offload_config=None,
        kv_transfer_config=SimpleNamespace(kv_load_failure_policy=policy),
    )
    group = SimpleNamespace(
        kv_cache_spec=SimpleNamespace(page_size_bytes=4096), layer_names=["l0", "l1"]
    )
    kv_cache_config = SimpleNamespace(kv_cache_groups=[group])
    cfg = load_config(
        {
            "cpu_bytes": "4MiB",
            "cpu_headroom_bytes": 0,
            "chunk_size": CHUNK,
            "remote_url": f"file://{root}",
            "write_policy": "none",
        },
        environ={},
    )
    shape = EngineShape.from_vllm(vllm_config, kv_cache_config)  # type: ignore[arg-type]
    side = SchedulerSide(cfg, shape, NS)
    side.bind_kv_cache_manager(FakeManager())
    return side


def store_objects(root: Path, space: KeySpace, hashes: list[bytes]) -> None:
    """Objects for ``hashes`` under ``space``'s keys (the scheduler only stats them)."""
    tier = FileTier(str(root), background_sweep=False)
    for h in hashes:
        path = Path(tier.path(space.key(h)))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"chunk")


def keys_of(rank: int = 0) -> WorkerKeys:
    return WorkerKeys(NS, rank, 0)


def prompt_on(
    side: SchedulerSide, tmp_path: Path, n_tokens: int, stored: dict[WorkerKeys, int]
) -> tuple[SimpleNamespace, list[bytes]]:
    """Request "a" of ``n_tokens`` and its chunk keys, with each worker's first ``stored``
    chunks in the directory under that worker's keys."""
    req = request("a", 1, n_tokens)
    side.keys.refresh(side._state(req))
    hashes = side._reqs["a"].chunk_hashes
    for worker, n in stored.items():
        store_objects(tmp_path, worker.space, hashes[:n])
    return req, hashes


def test_a_stored_prefix_is_answered_in_the_lookups_own_step(tmp_path: Path) -> None:
    """Chunks 0-2 of 4 are stored: the first ask answers 3 chunks (no "ask again"); the
    step's metadata reads them before its loads, each load held to its fetch, and the
    chunk computed in that step is stored only if those loads succeed."""
    side = side_on(tmp_path)
    side.set_worker_keys([keys_of()])
    assert side.lookups.probe is not None
    req, _ = prompt_on(side, tmp_path, 4 * CHUNK + 10, {keys_of(): 3})

    assert side.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, False)
    side._kv_cache_manager.blocks["a"] = list(range(100, 100 + 4 * BPC + 1))
    side.update_state_after_alloc(req, None, 3 * CHUNK)
    meta = schedule_new(side, req, 3 * CHUNK, req.num_tokens - 3 * CHUNK)
    assert meta.fetches == [] and len(meta.fetches_now) == 1
    run = meta.fetches_now[0]
    assert [op.block_hash for op in run] == side._reqs["a"].chunk_hashes[:3]
    assert [op.fetch_op for op in meta.loads] == [op.op_id for op in run]
    assert [op.slot for op in meta.loads] == [op.slot for op in run]
    # chunk 3 is computed in this step, attending to what the loads bring
    assert [op.block_hash for op in meta.stores] == side._reqs["a"].chunk_hashes[3:4]
    assert meta.stores[0].after_loads == tuple(op.op_id for op in meta.loads)
    assert side.totals["one_step_lookups"] == 1
    assert side.totals["hit_tokens_remote"] == 0, "a hit is counted once its load is in"

    assert side._reqs["a"].lookup.done, "allocated: the lookup is over"
    report(side, meta)
    assert side.totals["hit_tokens_remote"] == 3 * CHUNK
    assert all(side.index.is_ready(h) for h in side._reqs["a"].chunk_hashes[:4])
    assert side.pending_ops() == 0 and side.index.total_refs() == 0
    side.index.check()


def test_a_chunk_that_fails_at_the_read_is_recomputed_and_stored_again(tmp_path: Path) -> None:
    """The stat found chunk 1, its read failed: its load (and chunk 2's, skipped behind
    it) fail, nothing of them stays in the host tier, nothing computed in that step is
    kept, and when vLLM rewinds the request to chunk 1 the chunks it computes again are
    stored."""
    side = side_on(tmp_path)
    side.set_worker_keys([keys_of()])
    req, hashes = prompt_on(side, tmp_path, 4 * CHUNK + 10, {keys_of(): 3})
    assert side.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, False)
    side._kv_cache_manager.blocks["a"] = list(range(100, 100 + 4 * BPC + 1))
    side.update_state_after_alloc(req, None, 3 * CHUNK)
    meta = schedule_new(side, req, 3 * CHUNK, req.num_tokens - 3 * CHUNK)
    run, loads = meta.fetches_now[0], meta.loads
    failed = {run[1].op_id, run[2].op_id, loads[1].op_id, loads[2].op_id, meta.stores[0].op_id}
    report(side, meta, results={i: [False] for i in failed})
    assert side.index.is_ready(hashes[0])
    assert not any(h in side.index for h in hashes[1:4])
    assert side.pending_ops() == 0 and side.index.total_refs() == 0
    side.index.check()
    # vLLM recomputes from chunk 1 (its first invalid block) in the next step
    rewound = decode_step(side, {"a": 1 * CHUNK})
    assert rewound.stores == [], "one token: no chunk completes yet"
    so = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["a"], num_computed_tokens=[CHUNK]),
        num_scheduled_tokens={"a": req.num_tokens - CHUNK},
        scheduled_spec_decode_tokens={},
    )
    meta = side.build_connector_meta(so)
    assert [op.block_hash for op in meta.stores] == hashes[1:4]
    assert all(op.after_loads == () for op in meta.stores)


def test_a_chunk_another_op_holds_ends_the_one_step_run(tmp_path: Path) -> None:
    """A chunk the host tier is already fetching for another lookup cannot be loaded in
    this step: the run stops before it (the answer counts what comes before)."""
    side = side_on(tmp_path)
    side.set_worker_keys([keys_of()])
    a, hashes = prompt_on(side, tmp_path, 4 * CHUNK + 10, {keys_of(): 4})
    assert side.index.begin(hashes[2], State.FETCHING) is not None
    assert side.get_num_new_matched_tokens(a, 0) == (2 * CHUNK, False)


def test_an_answer_vllm_did_not_allocate_becomes_a_plain_lookup(tmp_path: Path) -> None:
    """vLLM asks and cannot allocate (no room; vLLM 0.34 asks a waiting request while the
    batch is full): the fetches go out as a plain lookup's run, never read ahead of the
    running batch's step; the next asks wait for them, then the answer is a host hit with
    plain loads."""
    side = side_on(tmp_path)
    side.set_worker_keys([keys_of()])
    req, _ = prompt_on(side, tmp_path, 2 * CHUNK + 10, {keys_of(): 2})
    assert side.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, False)
    step = decode_step(side, {})  # vLLM allocated nothing
    assert step.fetches_now == [] and len(step.fetches) == 1 and len(step.fetches[0]) == 2
    assert side.get_num_new_matched_tokens(req, 0) == (None, False), "its fetches are out"
    report(side, step)  # the fetches, read in that step
    assert side.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, False)
    side._kv_cache_manager.blocks["a"] = list(range(100, 100 + 2 * BPC + 1))
    side.update_state_after_alloc(req, None, 2 * CHUNK)
    meta = schedule_new(side, req, 2 * CHUNK, 10)
    assert meta.fetches_now == [] and [op.fetch_op for op in meta.loads] == [0, 0]
    assert side.totals["one_step_lookups"] == 1


def test_every_worker_must_hold_the_chunk(tmp_path: Path) -> None:
    """TP=2: rank 1 lacks chunk 1, so the stored prefix is chunk 0 alone."""
    side = side_on(tmp_path, tp=2)
    workers = [keys_of(0), keys_of(1)]
    side.set_worker_keys(workers)
    req, _ = prompt_on(side, tmp_path, 3 * CHUNK + 10, {workers[0]: 3, workers[1]: 1})
    assert side.get_num_new_matched_tokens(req, 0) == (CHUNK, False)


def test_replicated_kv_is_probed_once_under_rank_0s_keys(tmp_path: Path) -> None:
    ns = dataclasses.replace(NS, tp_size=2, replicated_kv=True)
    probe = LocalProbe(
        FileTier(str(tmp_path), background_sweep=False),
        [WorkerKeys(ns, 0, 0), WorkerKeys(ns, 1, 0)],
    )
    assert probe.spaces == [KeySpace.worker(ns, 0, 0)]
    store_objects(tmp_path, probe.spaces[0], [b"h0", b"h1"])
    assert probe.stored_run([b"h0", b"h1", b"h2"]) == 2


def test_the_probe_follows_a_weight_change_as_the_workers_do(tmp_path: Path) -> None:
    side = side_on(tmp_path)
    side.set_worker_keys([keys_of()])
    before = side.lookups.probe.spaces
    side.weights_changed("reload_weights")
    # the worker's own rule (WorkerSide._follow_weights) with the salt the step carries
    worker_ns = NS.after_weight_change(side.weights_salt)
    assert side.lookups.probe.spaces == [KeySpace.worker(worker_ns, 0, 0)] != before
    assert side.lookups.probe.workers[0].weights_epoch == side.weights_epoch == 1


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"policy": "fail"}, "kv_load_failure_policy"),
        ({"tp": 2}, "1 of 2 workers"),
    ],
)
def test_lookups_stay_reads_where_one_step_is_not_safe(tmp_path: Path, kw, why, caplog) -> None:
    side = side_on(tmp_path, **kw)
    with caplog.at_level("INFO", logger="kvtier.scheduler"):
        side.set_worker_keys([keys_of()])
    assert side.lookups.probe is None
    assert why in caplog.text
    req = request("a", 1, 2 * CHUNK + 10)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)


def test_keys_of_other_weights_are_refused(tmp_path: Path) -> None:
    side = side_on(tmp_path)
    side.set_worker_keys([WorkerKeys(NS, 0, 0, weights_epoch=1)])
    assert side.lookups.probe is None


def test_refusals_name_the_reason() -> None:
    cfg = load_config({"remote_url": "redis://localhost:6379"}, environ={})
    assert "not a directory" in one_step_refusal(cfg, recompute=True, groups=1, reads_local=True)
    cfg = load_config({"remote_url": "file:///kv"}, environ={})
    assert "local filesystem" in one_step_refusal(cfg, recompute=True, groups=1, reads_local=False)
    assert "several KV cache groups" in one_step_refusal(
        cfg, recompute=True, groups=2, reads_local=True
    )
    assert "kv_load_failure_policy" in one_step_refusal(
        cfg, recompute=False, groups=1, reads_local=True
    )
    assert one_step_refusal(cfg, recompute=True, groups=1, reads_local=True) is None
    cfg = load_config({"remote_url": "file:///kv", "inline_read_ms": 0}, environ={})
    assert "inline_read_ms" in one_step_refusal(cfg, recompute=True, groups=1, reads_local=True)


def test_worker_copies_a_slot_only_after_its_fetch_in_the_same_step(tmp_path: Path) -> None:
    """A restarted worker gets a one-step lookup's metadata: fetches to read now, loads
    held to them, a store after the loads. Chunk 0 loads its own bytes; chunk 1's object
    is corrupt: its load copies nothing and reports its blocks to vLLM; the store computed
    over it is reported failed, the one over good loads kept."""
    root = tmp_path / "kv"
    w0, caches0, results0 = _pp_worker(root, 0, seed=10, layer_offset=0)
    sb = w0.layout.slot_bytes
    h0, h1 = b"\x01" * 32, b"\x02" * 32
    store = step_meta(
        1,
        sb,
        stores=[
            StoreOp(1, 0, [5, 6, 7, 8], h0, upload_op_id=2),
            StoreOp(3, 1, [9, 10, 11, 12], h1, upload_op_id=4),
        ],
    )
    w0.start_load_kv(store)
    w0.wait_for_save(store)
    assert results0(1, {1, 2, 3, 4}) == {1: [True], 2: [True], 3: [True], 4: [True]}
    w0.shutdown()
    tier = FileTier(str(root), background_sweep=False)
    bad = Path(tier.path(w0._keys.key(h1)))
    data = bytearray(bad.read_bytes())
    data[-100] ^= 0xFF
    bad.write_bytes(bytes(data))

    w, caches, _results = _pp_worker(root, 0, seed=99, layer_offset=0)
    before = {name: blocks_of(kv, [24, 25, 26, 27]).clone() for name, kv in caches.items()}
    meta = step_meta(
        1,
        sb,
        loads=[
            LoadOp(12, 2, 0, [20, 21, 22, 23], fetch_op=10),
            LoadOp(13, 3, 0, [24, 25, 26, 27], fetch_op=11),
        ],
        stores=[
            StoreOp(14, 0, [30, 31, 32, 33], b"\x03" * 32, after_loads=(12, 13)),
            StoreOp(15, 1, [34, 35, 36, 37], b"\x04" * 32, after_loads=(12,)),
        ],
    )
    meta.fetches_now = [[FetchOp(10, 2, h0), FetchOp(11, 3, h1)]]
    w.start_load_kv(meta)
    w.wait_for_save(meta)
    got = w.build_worker_meta().results
    assert got[10] == [True] and got[11] == [False]
    assert got[12] == [True] and got[13] == [False]
    assert got[14] == [False] and got[15] == [True]
    assert w.take_failed_blocks() == {24, 25, 26, 27}
    for name in caches:
        assert torch.equal(
            blocks_of(caches[name], [20, 21, 22, 23]), blocks_of(caches0[name], [5, 6, 7, 8])
        ), name
        assert torch.equal(blocks_of(caches[name], [24, 25, 26, 27]), before[name]), name
    w.shutdown()


def test_the_worker_sends_its_keys_in_vllms_handshake() -> None:
    """The facade's get_handshake_metadata carries the worker's namespace, rank, stage,
    weight epoch and whether the tier held its generation at startup (kvtier.canary); None
    without an object tier (vLLM then sends nothing)."""
    from kvtier.connectors.metadata import WarmReport
    from kvtier.connectors.vllm import KVTierConnector

    conn = object.__new__(KVTierConnector)
    conn.cfg = load_config({"remote_url": "file:///kv"}, environ={})
    conn._worker = SimpleNamespace(
        namespace=NS, rank=1, stage=0, weights_epoch=2, fresh_generation=True, warm=None
    )
    assert conn.get_handshake_metadata() == WorkerKeys(NS, 1, 0, 2, fresh_generation=True)
    # and what its warm-up read (warmup: true, connectors/worker/warmup.py)
    conn._worker.warm = warm = WarmReport(chunks=((b"k" * 32, 0),), host_bytes=1)
    assert conn.get_handshake_metadata() == WorkerKeys(NS, 1, 0, 2, True, warm)
    conn.cfg = load_config({}, environ={})
    assert conn.get_handshake_metadata() is None


def test_a_directory_not_on_a_local_filesystem_keeps_lookups_reads(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """NFS, CIFS, a FUSE mount: a ``stat`` there could hold the scheduler for the network's
    time, so the scheduler never asks."""
    from kvtier.objects.tiers import file as file_tier

    monkeypatch.setattr(file_tier, "is_local", lambda path: False)
    side = side_on(tmp_path)
    with caplog.at_level("INFO", logger="kvtier.scheduler"):
        side.set_worker_keys([keys_of()])
    assert side.lookups.probe is None and "not on a local filesystem" in caplog.text


def test_a_directory_the_scheduler_cannot_open_keeps_lookups_reads(tmp_path: Path, caplog) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    side = side_on(blocker / "kv")
    with caplog.at_level("INFO", logger="kvtier.scheduler"):
        side.set_worker_keys([keys_of()])  # never raises: the engine starts
    assert side.lookups.probe is None and "cannot be opened" in caplog.text


def test_only_the_fetches_the_step_loads_are_read_before_it(tmp_path: Path) -> None:
    """A run whose first chunks the step loads is split: those are read before the loads,
    the rest (and runs no load needs) as any lookup's run."""
    side = side_on(tmp_path)
    lookups = side.lookups
    lookups._runs_now = [
        [FetchOp(1, 0, b"a"), FetchOp(2, 1, b"b"), FetchOp(3, 2, b"c")],
        [FetchOp(4, 3, b"d")],
    ]
    now, later = lookups.take_runs_now({1, 2})
    assert [[op.op_id for op in run] for run in now] == [[1, 2]]
    assert [[op.op_id for op in run] for run in later] == [[3], [4]]
    assert lookups.take_runs_now(set()) == ([], [])
