"""The worker side drives the copier in the order vLLM calls it.

A :class:`CudaCopier` on CPU tensors with a fake stream interface stands in for
the GPU (``fake_cuda``), beside the real :class:`CpuCopier`: per-layer saves and
waits, the shared-KV layer, load errors reported as vLLM block ids, stores
declared when vLLM binds a step, micro-batching.
"""

from __future__ import annotations

from functools import partial

import copyfakes
import pytest
import torch
from copyfakes import FakeOps, make_caches
from kit import chunk_files

from kvtier.config import load_config
from kvtier.connectors.metadata import FetchOp, KVTierMetadata, LoadOp, StoreOp
from kvtier.connectors.vllm import KVTierConnector
from kvtier.connectors.worker import side as worker_mod
from kvtier.host.cuda_copier import CudaCopier
from kvtier.host.transfer import CpuCopier
from kvtier.keys import Namespace

NUM_BLOCKS, BS, BPC, LAYERS = 40, 32, 4, 3
#: FlashAttention style: [2, num_blocks, block_size, H, D]
KV_FIRST = (2, NUM_BLOCKS, BS, 4, 16)


blocks_of = partial(copyfakes.blocks_of, num_blocks=NUM_BLOCKS)


def make_worker(monkeypatch, fake_cuda: bool):
    ops = FakeOps()
    if fake_cuda:  # CPU tensors through CudaCopier: the CUDA bookkeeping, run on the CPU
        monkeypatch.setattr(
            worker_mod, "make_copier", lambda kv, layout, slab: CudaCopier(kv, layout, slab, ops)
        )
    # sized by the scheduler (each step's host_bytes): the slab comes with the first step
    cfg = load_config({"cpu_bytes": "auto", "chunk_size": BPC * BS}, environ={})
    ns = Namespace("m", None, "bfloat16", "auto", BS, BPC * BS, 1)
    w = worker_mod.WorkerSide(cfg, ns, NUM_BLOCKS)
    caches = make_caches(KV_FIRST)
    names = list(caches)
    caches["model.layers.3.self_attn.attn"] = caches[names[2]]  # a layer sharing KV
    w.register_kv_caches(caches, rank=0)
    return w, caches, ops


def step_meta(step, layout_slot_bytes, loads=(), stores=()):
    return KVTierMetadata(
        step=step, host_bytes=layout_slot_bytes * 4, loads=list(loads), stores=list(stores)
    )


@pytest.mark.parametrize("fake_cuda", [True, False])
def test_worker_saves_per_layer_and_loads_back(monkeypatch, fake_cuda) -> None:
    w, caches, ops = make_worker(monkeypatch, fake_cuda)
    names = list(caches)
    sb = w.layout.slot_bytes
    meta = step_meta(1, sb, stores=[StoreOp(7, 2, [5, 6, 7, 8], b"h"), StoreOp(8, 9, [1], b"x")])
    w.start_load_kv(meta)
    assert isinstance(w.copier, CudaCopier if fake_cuda else CpuCopier)
    for name in names:
        w.wait_for_layer_load(name)
        w.save_kv_layer(name)
    saves = [e for e in ops.log if e[0] == "wait" and e[1] == "save"]
    assert len(saves) == (LAYERS if fake_cuda else 0)  # the shared layer is saved once
    w.wait_for_save(meta)
    res = w.build_worker_meta()
    assert res.results == {7: [True], 8: [False]}  # slot 9 does not exist

    dst = {k: torch.zeros_like(v) for k, v in caches.items()}
    w._kv = [dst[ll.name] for ll in w.layout.layers]
    w.copier.kv = w._kv
    load = step_meta(2, sb, loads=[LoadOp(9, 2, 1, [30, 31, 32]), LoadOp(10, 2, 0, [99])])
    ops.log.clear()
    w.start_load_kv(load)
    for name in names:
        w.wait_for_layer_load(name)
        w.save_kv_layer(name)
    waits = [e for e in ops.log if e[:2] == ("wait", "compute")]
    # one wait per attention layer; the shared layer waits on its owner's event
    assert len(waits) == (len(names) if fake_cuda else 0)
    if fake_cuda:
        assert waits[-1][2] is waits[-2][2]
    w.wait_for_save(load)
    res = w.build_worker_meta()
    assert res.results == {9: [True], 10: [False]}
    assert res.errors == {"load": 1}
    assert w.take_failed_blocks() == {99}
    for name in names[:3]:
        assert torch.equal(blocks_of(dst[name], [30, 31, 32]), blocks_of(caches[name], [6, 7, 8]))


@pytest.mark.parametrize("fake_cuda", [True, False])
def test_a_store_after_a_failed_load_of_its_request_is_not_kept(monkeypatch, fake_cuda) -> None:
    """A host-tier load that fails (block 99 does not exist) leaves blocks vLLM recomputes:
    a chunk the same request completed in that step attended to them, so its store is
    reported failed (never ready, never uploaded); a store after loads that succeeded is
    kept (StoreOp.after_loads)."""
    w, caches, _ops = make_worker(monkeypatch, fake_cuda)
    sb = w.layout.slot_bytes
    first = step_meta(1, sb, stores=[StoreOp(1, 0, [1, 2, 3, 4], b"a")])
    w.start_load_kv(first)
    w.wait_for_save(first)
    assert w.build_worker_meta().results == {1: [True]}
    meta = step_meta(
        2,
        sb,
        loads=[LoadOp(2, 0, 0, [5, 6]), LoadOp(3, 0, 0, [99])],
        stores=[
            StoreOp(4, 1, [10, 11, 12, 13], b"b", after_loads=(2, 3)),
            StoreOp(5, 2, [14, 15, 16, 17], b"c", after_loads=(2,)),
            StoreOp(6, 3, [18, 19, 20, 21], b"d"),
        ],
    )
    w.start_load_kv(meta)
    for name in caches:
        w.wait_for_layer_load(name)
        w.save_kv_layer(name)
    w.wait_for_save(meta)
    got = w.build_worker_meta().results
    assert got == {2: [True], 3: [False], 4: [False], 5: [True], 6: [True]}
    assert w.take_failed_blocks() == {99}


def test_saves_run_per_layer_when_vllm_starts_loads_after_the_forward(monkeypatch) -> None:
    """vLLM calls start_load_kv after the forward when a step has no synchronous loads;
    binding the metadata must already have declared the stores for save_kv_layer."""
    w, caches, ops = make_worker(monkeypatch, fake_cuda=True)
    facade = KVTierConnector.__new__(KVTierConnector)  # only the worker-side plumbing
    facade._worker, facade._scheduler, facade._connector_metadata = w, None, None
    facade._asleep = False  # (set by __init__, which this test skips)
    meta = step_meta(1, w.layout.slot_bytes, stores=[StoreOp(7, 1, [5, 6, 7, 8], b"h")])
    facade.bind_connector_metadata(meta)
    for name in caches:  # the forward: each attention layer, then its save
        w.save_kv_layer(name)
    saves = [e for e in ops.log if e[:2] == ("wait", "save")]
    assert len(saves) == LAYERS  # every layer started during the forward
    facade.start_load_kv(None)  # after the forward: must not declare (and copy) again
    facade.wait_for_save()
    assert [e for e in ops.log if e[:2] == ("wait", "save")] == saves
    res = w.build_worker_meta()
    assert res.results == {7: [True]} and res.steps == [1]
    for li, name in enumerate(list(caches)[:3]):
        assert torch.equal(
            w.slab.layer_view(1, li).contiguous().view(torch.uint8),
            blocks_of(caches[name], [5, 6, 7, 8]),
        )


def test_worker_with_micro_batches_saves_only_after_the_forward(monkeypatch) -> None:
    w, caches, ops = make_worker(monkeypatch, fake_cuda=True)
    w.layerwise_saves = False  # the facade sets this when vLLM runs ubatches
    meta = step_meta(1, w.layout.slot_bytes, stores=[StoreOp(7, 1, [5, 6, 7, 8], b"h")])
    w.start_load_kv(meta)
    for name in caches:
        w.save_kv_layer(name)
    assert ops.log == []
    for t in caches.values():
        t.fill_(3)  # the second ubatch writes after the first one's attention
    w.wait_for_save(meta)
    assert w.build_worker_meta().results == {7: [True]}
    for li, name in enumerate(list(caches)[:3]):
        assert torch.equal(
            w.slab.layer_view(1, li).contiguous().view(torch.uint8),
            blocks_of(caches[name], [5, 6, 7, 8]),
        )


def test_facade_asks_vllm_for_piecewise_cuda_graphs() -> None:
    """Layer-wise waits and saves cannot live inside a captured full CUDA graph."""
    assert KVTierConnector.requires_piecewise_for_cudagraph({"cpu_bytes": "1GiB"}) is True


def _pp_worker(root, stage: int, seed: int, layer_offset: int):
    """One pipeline stage's worker as vLLM builds it at PP=2 (same namespace, same
    metadata for every stage) with a file:// object tier; its two layers are named as
    they are on that stage (layers 0-1 on stage 0, 2-3 on stage 1) with their own KV."""
    import time as _time

    from kvtier.objects.remote import RemoteIO
    from kvtier.objects.tiers import FileTier

    cfg = load_config(
        {"cpu_bytes": "64MiB", "chunk_size": BPC * BS, "remote_url": f"file://{root}"},
        environ={},
    )
    ns = Namespace("m", None, "bfloat16", "auto", BS, BPC * BS, 1, pp_size=2)

    def remote(c):
        return RemoteIO(FileTier(str(root)), threads=1, queue_depth=8, timeout_s=5, signer=None)

    w = worker_mod.WorkerSide(cfg, ns, NUM_BLOCKS, remote)
    src = make_caches(KV_FIRST, layers=2, seed=seed)
    caches = {
        f"model.layers.{i + layer_offset}.self_attn.attn": kv for i, kv in enumerate(src.values())
    }
    w.register_kv_caches(caches, rank=0, stage=stage)

    def results(meta_step, want):
        deadline = _time.monotonic() + 10
        got: dict[int, list[bool]] = {}
        while _time.monotonic() < deadline and not want <= got.keys():
            got.update(w.build_worker_meta().results)
            _time.sleep(0.01)
        return got

    return w, caches, results


def test_pipeline_stages_never_load_each_others_chunks(tmp_path) -> None:
    """PP=2: both stages get the same scheduler metadata (same block hash, same slot) but
    hold different layers with the same shapes. Each stage's upload must land under its
    own key, and a fresh engine's stage 1 must get stage 1's bytes back, never stage 0's."""
    root = tmp_path / "kv"
    h = b"\x11" * 32
    stages = [_pp_worker(root, s, seed=10 + s, layer_offset=2 * s) for s in (0, 1)]
    for w, _caches, results in stages:
        sb = w.layout.slot_bytes
        store = step_meta(1, sb, stores=[StoreOp(1, 0, [5, 6, 7, 8], h, upload_op_id=2)])
        w.start_load_kv(store)
        w.wait_for_save(store)
        assert results(1, {1, 2}) == {1: [True], 2: [True]}
        w.shutdown()
    assert len(chunk_files(root)) == 2, "one object per stage"

    for stage in (1, 0):  # a restarted engine; stage 1 first
        w, caches, results = _pp_worker(root, stage, seed=99, layer_offset=2 * stage)
        original = stages[stage][1]
        sb = w.layout.slot_bytes
        fetch = step_meta(1, sb)
        fetch.fetches = [[FetchOp(3, 0, h)]]
        w.begin_step(fetch)
        w.wait_for_save(fetch)
        assert results(1, {3}) == {3: [True]}
        load = step_meta(2, sb, loads=[LoadOp(4, 0, 0, [20, 21, 22, 23])])
        w.start_load_kv(load)
        w.wait_for_save(load)
        assert w.build_worker_meta().results == {4: [True]}
        for name in caches:
            assert torch.equal(
                blocks_of(caches[name], [20, 21, 22, 23]), blocks_of(original[name], [5, 6, 7, 8])
            ), (stage, name)
        w.shutdown()
