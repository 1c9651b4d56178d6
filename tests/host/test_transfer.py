"""The copy path on the CPU: slab sizing, batched index math, stream/event bookkeeping.

``CudaCopier`` runs here on CPU tensors with a fake :class:`StreamOps` that
logs every stream/event call; the torch copies themselves are real, so the
round trips are bit-exact checks of the same code that runs on CUDA.
"""

from __future__ import annotations

import gc
import mmap
from functools import partial

import copyfakes
import pytest
import torch
from copyfakes import FakeOps, load_every_layer, make_caches, times

from kvtier.host import cuda as kcuda
from kvtier.host.copiers import make_copier
from kvtier.host.cuda_copier import CudaCopier
from kvtier.host.layout import HostSlab, SlotLayout, find_block_dim
from kvtier.host.transfer import (
    CpuCopier,
    check_job,
    contiguous_pieces,
    group_jobs,
    round_plan,
    staging_shape,
)
from kvtier.ops import LoadOp, StoreOp

NUM_BLOCKS, BS, BPC, LAYERS = 40, 32, 4, 3

LAYOUTS = {
    "blocks_first": (NUM_BLOCKS, 4, BS, 2 * 16),  # standardized, FlashInfer NHD
    "flashinfer": (NUM_BLOCKS, 2, BS, 4, 16),  # [num_blocks, 2, block_size, H, D]
    "kv_first": (2, NUM_BLOCKS, BS, 4, 16),  # FlashAttention: [2, num_blocks, ...]
    "mla": (NUM_BLOCKS, BS, 72),  # MLA: one latent per token
}


blocks_of = partial(copyfakes.blocks_of, num_blocks=NUM_BLOCKS)


# ---- fakes ------------------------------------------------------------------------------------
class FakeCudart:
    def __init__(self, result: int = 0) -> None:
        self.result = result
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.registered.append((ptr, size, flags))
        return self.result

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def setup(shape, dtype=torch.bfloat16, slots=6, staging_bytes=None, copier="cuda"):
    src = make_caches(shape, dtype)
    layout = SlotLayout.from_kv_caches(src, NUM_BLOCKS, BPC)
    slab = HostSlab(layout.slot_bytes * slots, layout)
    ops = FakeOps()
    kv = list(src.values())
    if copier == "cuda":
        kw = {} if staging_bytes is None else {"staging_bytes": staging_bytes}
        c = CudaCopier(kv, layout, slab, ops=ops, **kw)
    else:
        c = CpuCopier(kv, layout, slab)
    return src, kv, layout, slab, ops, c


# ---- slab sizing / registration ---------------------------------------------------------------
def test_alloc_host_is_exact_and_page_aligned() -> None:
    n = 3 * mmap.PAGESIZE + 123
    t = kcuda.alloc_host(n)
    assert t.numel() == n and t.dtype == torch.uint8
    assert t.data_ptr() % mmap.PAGESIZE == 0
    assert not t.any()  # anonymous pages are zero


def test_register_host_passes_exact_bytes_and_unregisters_once() -> None:
    rt = FakeCudart()
    n = 10_000_001
    buf = kcuda.PinnedBuffer(n, cudart=rt)
    assert buf.pinned
    assert rt.registered == [(buf.tensor.data_ptr(), n, kcuda.HOST_REGISTER_PORTABLE)]
    buf.close()
    buf.close()
    assert rt.unregistered == [buf.tensor.data_ptr()]


def test_pinned_buffer_unregisters_when_collected() -> None:
    rt = FakeCudart()
    buf = kcuda.PinnedBuffer(1 << 20, cudart=rt)
    ptr = buf.tensor.data_ptr()
    del buf
    gc.collect()
    assert rt.unregistered == [ptr]


def test_refused_registration_leaves_a_working_pageable_buffer() -> None:
    rt = FakeCudart(result=2)  # cudaErrorMemoryAllocation
    buf = kcuda.PinnedBuffer(4096, cudart=rt)
    assert not buf.pinned
    buf.tensor.fill_(7)
    buf.close()
    assert rt.unregistered == []


def test_missing_cuda_runtime_leaves_a_working_pageable_buffer() -> None:
    class NoRuntime:
        def cudaHostRegister(self, *a):  # noqa: N802
            raise AttributeError("no cudaHostRegister in this build")

    buf = kcuda.PinnedBuffer(8192, cudart=NoRuntime())
    assert not buf.pinned and buf.tensor.numel() == 8192
    buf.close()


def test_host_slab_pinned_is_exact_size_and_round_trips(monkeypatch) -> None:
    rt = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    src = make_caches(LAYOUTS["kv_first"])
    layout = SlotLayout.from_kv_caches(src, NUM_BLOCKS, BPC)
    nbytes = layout.slot_bytes * 3 + 1000  # not a multiple of anything
    slab = HostSlab(nbytes, layout, pin=True)
    assert slab.pinned and slab.nbytes == nbytes and slab.num_slots == 3
    assert rt.registered[0][1] == nbytes
    kv = list(src.values())
    c = CudaCopier(kv, layout, slab, ops=FakeOps())
    c.begin_saves([StoreOp(1, 2, (9, 8, 7, 6))])
    # the one op succeeded, and its time is the copies' (FakeOps: 1 ms per layer)
    assert times(c.finish_saves()) == {1: pytest.approx(0.001 * len(kv))}
    dst = [torch.zeros_like(t) for t in kv]
    c = CudaCopier(dst, layout, slab, ops=FakeOps())
    assert times(c.begin_loads([LoadOp(2, 2, 0, (1, 2, 3, 4))])) == {}  # nothing failed early
    assert times(c.finish_loads()) == {2: pytest.approx(0.001 * len(kv))}
    for s_, d in zip(kv, dst, strict=True):
        assert torch.equal(blocks_of(d, [1, 2, 3, 4]), blocks_of(s_, [9, 8, 7, 6]))
    cpu = HostSlab(nbytes, layout)  # the CPU slab is unchanged: plain, unregistered
    assert not cpu.pinned and cpu.nbytes == nbytes and len(rt.registered) == 1
    slab.close()
    assert rt.unregistered == [slab.buffer.data_ptr()]


def test_exact_size_slab_rss_ratio() -> None:
    """RSS growth of a touched exact-size mapping ÷ requested ≤ 1.02."""
    n = 64 << 20

    def touch(nbytes: int) -> torch.Tensor:
        t = kcuda.alloc_host(nbytes)
        t.fill_(1)
        return t

    ratio, keep = kcuda.rss_ratio(touch, n)
    assert keep.numel() == n
    assert 0.9 <= ratio <= 1.02, ratio


# ---- index math -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("start,count", [(0, 4), (1, 3), (2, 1)])
def test_contiguous_pieces_cover_the_narrowed_region(name, start, count) -> None:
    shape = list(LAYOUTS[name])
    dim = find_block_dim(shape, NUM_BLOCKS)
    shape[dim] = BPC
    t = torch.arange(torch.Size(shape).numel()).view(shape)
    pieces = contiguous_pieces(t, dim, start, count)
    assert all(p.is_contiguous() for p in pieces)
    assert len(pieces) == (1 if dim == 0 else shape[0])
    want = t.narrow(dim, start, count)
    got = torch.stack(pieces) if dim else pieces[0]
    assert torch.equal(got.reshape(want.shape), want)
    # each piece is a view of t (no copy), so a copy into it lands in t
    for p in pieces:
        p.fill_(-1)
    assert (t.narrow(dim, start, count) == -1).all()
    assert (t == -1).sum() == want.numel()


def test_group_jobs_caps_blocks_per_round_and_keeps_order() -> None:
    jobs = [StoreOp(i, i, tuple(range(n))) for i, n in enumerate([4, 4, 3, 4, 1, 9])]
    rounds = group_jobs(jobs, max_blocks=8)
    assert [[j.op_id for j in r] for r in rounds] == [[0, 1], [2, 3, 4], [5]]
    assert group_jobs([], 8) == []
    assert len(group_jobs(jobs, 10_000)) == 1


def test_round_plan_concatenates_indices_with_offsets() -> None:
    jobs = [LoadOp(1, 0, 1, (7, 8, 9)), LoadOp(2, 3, 0, (2,)), LoadOp(3, 5, 0, (30, 31))]
    index, places = round_plan(jobs)
    assert index == [7, 8, 9, 2, 30, 31]
    assert [(j.op_id, at) for j, at in places] == [(1, 0), (2, 3), (3, 4)]
    assert staging_shape((2, BPC, BS, 4, 16), 1, 6) == (2, 6, BS, 4, 16)


def test_check_job_refuses_what_would_be_a_device_assert() -> None:
    def check(job):
        return check_job(job, NUM_BLOCKS, num_slots=6, blocks_per_chunk=BPC)

    assert check(StoreOp(1, 5, (0, 1, 2, 39))) is None
    assert check(LoadOp(1, 0, 3, (5,))) is None
    assert "slot" in check(StoreOp(1, 6, (0,)))
    assert "outside 0..39" in check(StoreOp(1, 0, (0, 40)))
    assert "outside 0..39" in check(LoadOp(1, 0, 0, (-1,)))
    assert "chunk" in check(LoadOp(1, 0, 2, (1, 2, 3)))
    assert "chunk" in check(StoreOp(1, 0, (0, 1, 2, 3, 4)))
    assert check(StoreOp(1, 0, ())) == "no blocks"


# ---- round trips through both copiers ---------------------------------------------------------
COPIER_CASES = [
    ("cuda", torch.bfloat16, None),
    ("cuda", torch.float32, None),
    ("cuda", torch.float8_e4m3fn, None),  # fp8 KV moves as bytes
    ("cuda", torch.bfloat16, 1),  # 1-byte staging cap: every job is a round of its own
    ("cpu", torch.bfloat16, None),
    ("cpu", torch.float32, None),
]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("copier,dtype,staging", COPIER_CASES)
def test_store_then_load_is_bit_exact(name, copier, dtype, staging) -> None:
    src, kv, layout, slab, _, c = setup(LAYOUTS[name], dtype, staging_bytes=staging, copier=copier)
    stores = [StoreOp(10, 1, (7, 3, 30, 12)), StoreOp(11, 4, (0, 39, 5, 6))]
    c.begin_saves(stores)
    for li in range(LAYERS):
        c.save_layer(li)
    out = times(c.finish_saves())
    assert set(out) == {10, 11} and all(v is not None for v in out.values())

    dst = [torch.zeros_like(t) for t in kv]
    kw = {"staging_bytes": staging} if staging else {}
    c2 = (
        CudaCopier(dst, layout, slab, ops=FakeOps(), **kw)
        if copier == "cuda"
        else CpuCopier(dst, layout, slab)
    )
    loads = [LoadOp(20, 1, 1, (20, 21, 22)), LoadOp(21, 4, 0, (33, 34, 35, 36))]
    out = times(c2.begin_loads(loads))
    for li in range(LAYERS):
        c2.wait_layer(li)
    out.update(times(c2.finish_loads()))
    assert set(out) == {20, 21} and all(v is not None for v in out.values())
    for s, d in zip(kv, dst, strict=True):
        assert torch.equal(blocks_of(d, [20, 21, 22]), blocks_of(s, [3, 30, 12]))
        assert torch.equal(blocks_of(d, [33, 34, 35, 36]), blocks_of(s, [0, 39, 5, 6]))
        rest = [b for b in range(NUM_BLOCKS) if b not in (20, 21, 22, 33, 34, 35, 36)]
        assert not blocks_of(d, rest).any()


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_slot_views_are_cached_for_a_bounded_number_of_chunks(name) -> None:
    """The copier keeps each used slot's views for reuse, but only the most recently
    used chunks' (a host tier of a million slots must not cost a million cached
    views): through more slots than that bound, copies stay bit-exact."""
    src, kv, layout, slab, _, c = setup(LAYOUTS[name], slots=6)
    assert isinstance(c, CudaCopier)
    c._pieces_cap = 2 * LAYERS  # two chunks' worth
    for slot in range(6):
        blocks = tuple((slot * 7 + j) % NUM_BLOCKS for j in range(BPC))
        c.begin_saves([StoreOp(slot, slot, blocks)])
        for li in range(LAYERS):
            c.save_layer(li)
        assert all(v is not None for v in times(c.finish_saves()).values())
        assert len(c._slot_pieces) <= 2 * LAYERS
    dst = [torch.zeros_like(t) for t in kv]
    c2 = CudaCopier(dst, layout, slab, ops=FakeOps())
    c2._pieces_cap = 2 * LAYERS
    for slot in (5, 0, 3, 0, 1):  # evicted and re-made views, and a cached one again
        first = slot * BPC % NUM_BLOCKS
        out = times(c2.begin_loads([LoadOp(100 + slot, slot, 0, tuple(range(first, first + BPC)))]))
        for li in range(LAYERS):
            c2.wait_layer(li)
        out.update(times(c2.finish_loads()))
        assert all(v is not None for v in out.values()) and len(c2._slot_pieces) <= 2 * LAYERS
        for s, d in zip(kv, dst, strict=True):
            want = [(slot * 7 + j) % NUM_BLOCKS for j in range(BPC)]
            assert torch.equal(blocks_of(d, list(range(first, first + BPC))), blocks_of(s, want))


@pytest.mark.parametrize("copier", ["cuda", "cpu"])
def test_flashinfer_hnd_strided_kv_round_trips(copier) -> None:
    """FlashInfer's HND layout hands connectors a permuted view of [num_blocks, 2, H,
    block_size, D]: logically [num_blocks, 2, block_size, H, D], not contiguous."""
    g = torch.Generator().manual_seed(3)

    def hnd() -> torch.Tensor:
        phys = torch.randn((NUM_BLOCKS, 2, 4, BS, 16), generator=g).to(torch.bfloat16)
        return phys.permute(0, 1, 3, 2, 4)

    kv = [hnd() for _ in range(LAYERS)]
    assert not kv[0].is_contiguous()
    layout = SlotLayout.from_kv_caches({f"l{i}": t for i, t in enumerate(kv)}, NUM_BLOCKS, BPC)
    assert layout.layers[0].block_dim == 0
    slab = HostSlab(layout.slot_bytes * 2, layout)
    dst = [torch.zeros_like(t) for t in kv]  # zeros_like keeps the strides
    assert dst[0].stride() == kv[0].stride()
    if copier == "cuda":
        c, c2 = (CudaCopier(t, layout, slab, ops=FakeOps()) for t in (kv, dst))
    else:
        c, c2 = CpuCopier(kv, layout, slab), CpuCopier(dst, layout, slab)
    c.begin_saves([StoreOp(1, 1, (9, 2, 31, 17))])
    for li in range(LAYERS):
        c.save_layer(li)
    assert None not in times(c.finish_saves()).values()
    out = times(c2.begin_loads([LoadOp(2, 1, 0, (4, 5, 6, 7))]))
    out.update(times(c2.finish_loads()))
    assert out and None not in out.values()
    for s, d in zip(kv, dst, strict=True):
        assert torch.equal(blocks_of(d, [4, 5, 6, 7]), blocks_of(s, [9, 2, 31, 17]))


def test_make_copier_picks_cpu_for_cpu_tensors() -> None:
    src, kv, layout, slab, _, _ = setup(LAYOUTS["mla"])
    c = make_copier(kv, layout, slab)
    assert isinstance(c, CpuCopier) and not c.layerwise


# ---- stream / event bookkeeping ---------------------------------------------------------------
def test_loads_one_event_per_layer_recorded_after_that_layer_only() -> None:
    src, kv, layout, slab, _, _ = setup(LAYOUTS["kv_first"])
    slab.buffer.copy_(torch.randint(1, 255, (slab.nbytes,), dtype=torch.uint8))
    dst = [torch.zeros_like(t) for t in kv]
    ops = FakeOps()
    c = CudaCopier(dst, layout, slab, ops=ops)
    seen: dict[str, list[list[bool]]] = {"load": [], "scatter": []}
    ops.on_record = lambda ev, stream: (
        seen[stream.name].append([bool(blocks_of(d, [9]).any()) for d in dst])
        if stream.name in seen
        else None
    )
    out = times(c.begin_loads([LoadOp(1, 2, 0, (9,)), LoadOp(2, 3, 1, (10, 11))]))
    assert out == {}  # nothing known yet: results come from finish_loads
    # the load stream first waits for compute (blocks may still be in use)
    assert ops.log[0] == ("record", ops.log[1][2], "compute")
    assert ops.log[1][:2] == ("wait", "load")
    # per layer on the load stream: a start event, then the copies and their event, all
    # before that layer is scattered; the layer's event follows its scatter, on the
    # scatter stream, which waited for the copies' event
    assert seen["load"][0::2] == [[False, False, False], [True, False, False], [True, True, False]]
    assert seen["load"][1::2] == seen["load"][0::2]
    assert seen["scatter"] == [[True, False, False], [True, True, False], [True, True, True]]
    records = [(e, s) for kind, e, s in ops.log[2:] if kind == "record"]
    copied = [e for e, s in records if s == "load"][1::2]
    layer_events = [e for e, s in records if s == "scatter"]
    assert len(layer_events) == LAYERS
    waits = [(s, e) for kind, s, e in ops.log[2:] if kind == "wait"]
    assert [("scatter", e) for e in copied] == [w for w in waits if w[0] == "scatter"]
    # a staging buffer is copied into again only after the scatter that read it (a ring
    # of two: layer 2's copy waits for layer 0's scatter)
    assert [w for w in waits if w[0] == "load"] == [("load", layer_events[0])]
    ops.log.clear()
    c.wait_layer(1)  # compute waits for layer 1's event only
    assert ops.log == [("wait", "compute", layer_events[1])]
    ops.log.clear()
    out = times(c.finish_loads())
    assert ops.log == [("sync", layer_events[-1])]  # host waits once, for the last layer
    # the metric: 1 ms per layer, shared by blocks (op 1 moved 1 block, op 2 two)
    assert out == pytest.approx({1: LAYERS * 0.001 / 3, 2: LAYERS * 0.001 * 2 / 3})
    ops.log.clear()
    assert times(c.finish_loads()) == {} and ops.log == []
    c.wait_layer(0)  # no loads this step: no wait
    assert ops.log == []


def test_saves_start_per_layer_after_compute_and_finish_synchronizes() -> None:
    src, kv, layout, slab, ops, c = setup(LAYOUTS["blocks_first"])
    slab.buffer.zero_()
    c.begin_saves([StoreOp(5, 0, (1, 2, 3, 4))])
    assert ops.log == []  # nothing is copied before the layer is computed
    for li in range(LAYERS):
        ops.log.clear()
        c.save_layer(li)
        ev_written, ev_start, ev_done = ops.log[0][1], ops.log[2][1], ops.log[3][1]
        assert ops.log == [
            ("record", ev_written, "compute"),  # this layer's attention is enqueued
            ("wait", "save", ev_written),  # the save stream copies only after it
            ("record", ev_start, "save"),
            ("record", ev_done, "save"),
        ]
        region = [slab.layer_view(0, i).any().item() for i in range(LAYERS)]
        assert region == [i <= li for i in range(LAYERS)]  # this layer saved, later ones not
    c.save_layer(1)  # a repeated call does nothing
    ops.log.clear()
    out = times(c.finish_saves())
    assert ops.log == [("sync", ev_done)]
    assert out == pytest.approx({5: LAYERS * 0.001})


def test_finish_saves_saves_layers_whose_save_kv_layer_never_came() -> None:
    src, kv, layout, slab, ops, c = setup(LAYOUTS["mla"])
    c.begin_saves([StoreOp(5, 2, (8, 9, 10, 11))])
    c.save_layer(0)
    out = times(c.finish_saves())
    assert out[5] is not None
    for li in range(LAYERS):
        assert torch.equal(
            slab.layer_view(2, li).view(torch.uint8), blocks_of(kv[li], [8, 9, 10, 11])
        )


def test_no_saves_means_no_stream_work() -> None:
    src, kv, layout, slab, ops, c = setup(LAYOUTS["mla"])
    c.begin_saves([])
    for li in range(LAYERS):
        c.save_layer(li)
    assert times(c.finish_saves()) == {} and ops.log == []
    assert times(c.begin_loads([])) == {} and times(c.finish_loads()) == {} and ops.log == []


def test_refused_ops_fail_alone_and_touch_nothing() -> None:
    src, kv, layout, slab, ops, c = setup(LAYOUTS["kv_first"])
    before = slab.buffer.clone()
    c.begin_saves([StoreOp(1, 0, (0, 1, 2, 99)), StoreOp(2, 1, (4, 5, 6, 7))])
    for li in range(LAYERS):
        c.save_layer(li)
    out = times(c.finish_saves())
    assert out[1] is None and out[2] is not None
    assert torch.equal(slab.slot_bytes(0), before[: layout.slot_bytes])  # slot 0 untouched

    dst = [torch.zeros_like(t) for t in kv]
    c2 = CudaCopier(dst, layout, slab, ops=FakeOps())
    out = times(c2.begin_loads([LoadOp(3, 9, 0, (1,)), LoadOp(4, 1, 0, (1,))]))
    assert out == {3: None}
    out = times(c2.finish_loads())
    assert out[4] is not None and 3 not in out
    assert torch.equal(blocks_of(dst[0], [1]), blocks_of(kv[0], [4]))


def test_all_refused_enqueues_nothing() -> None:
    src, kv, layout, slab, ops, c = setup(LAYOUTS["kv_first"])
    c.begin_saves([StoreOp(1, 0, (99,))])
    for li in range(LAYERS):
        c.save_layer(li)
    assert times(c.finish_saves()) == {1: None}
    assert ops.log == []


def test_a_failed_enqueue_fails_every_op_of_the_batch(monkeypatch) -> None:
    src, kv, layout, slab, ops, c = setup(LAYOUTS["blocks_first"])
    calls = {"n": 0}
    real = c._copy_layer

    def flaky(batch, li, to_host):
        calls["n"] += 1
        if li == 1:
            raise RuntimeError("CUDA out of memory")
        real(batch, li, to_host)

    monkeypatch.setattr(c, "_copy_layer", flaky)
    assert times(c.begin_loads([LoadOp(1, 0, 0, (1,)), LoadOp(2, 1, 0, (2,))])) == {}
    ops.log.clear()
    for li in range(LAYERS):
        c.wait_layer(li)  # never waits on an event that was not recorded
    out = times(c.finish_loads())
    assert out == {1: None, 2: None}


def test_a_failed_host_sync_fails_the_saves() -> None:
    src, kv, layout, slab, ops, c = setup(LAYOUTS["blocks_first"])
    c.begin_saves([StoreOp(1, 0, (1, 2))])
    for li in range(LAYERS):
        c.save_layer(li)
    ops.fail_sync = True
    assert times(c.finish_saves()) == {1: None}


def test_unfinished_saves_are_finished_and_reported_next_step() -> None:
    src, kv, layout, slab, ops, c = setup(LAYOUTS["blocks_first"])
    c.begin_saves([StoreOp(1, 0, (1, 2))])
    c.save_layer(0)
    c.begin_saves([StoreOp(2, 1, (3, 4))])  # wait_for_save never came for step 1
    out = times(c.finish_saves())
    assert set(out) == {1, 2} and None not in out.values()
    assert torch.equal(
        slab.layer_view(0, 2).narrow(0, 0, 2).view(torch.uint8), blocks_of(kv[2], [1, 2])
    )


def test_staging_is_one_buffer_per_stream_reused_across_layers_and_rounds() -> None:
    src, kv, layout, slab, ops, c = setup(LAYOUTS["kv_first"], staging_bytes=1)
    assert c.max_round_blocks == BPC  # the cap never goes below one chunk
    jobs = [StoreOp(i, i, (i, i + 10)) for i in range(4)]  # 8 blocks: two rounds of 4
    c.begin_saves(jobs)
    for li in range(LAYERS):
        c.save_layer(li)
    out = times(c.finish_saves())
    assert None not in out.values()
    assert set(c._staging) == {"save"}
    per_block = layout.layers[0].nbytes // BPC
    assert c._staging["save"].numel() == BPC * per_block  # one round's worth, not the step's
    for job in jobs:
        for li in range(LAYERS):
            got = slab.layer_view(job.slot, li).narrow(1, 0, 2).contiguous().view(torch.uint8)
            assert torch.equal(got, blocks_of(kv[li], list(job.gpu_blocks)))


def test_copy_all_falls_back_to_a_loop_when_foreach_refuses(monkeypatch) -> None:
    from kvtier.host import transfer

    def refuse(*a, **k):
        raise RuntimeError("Tensors must be on the same device")

    monkeypatch.setattr(torch, "_foreach_copy_", refuse)
    monkeypatch.setattr(transfer, "_FOREACH_OK", True)
    dsts, srcs = [torch.zeros(3), torch.zeros(2)], [torch.ones(3), torch.full((2,), 2.0)]
    transfer.copy_all(dsts, srcs)
    assert dsts[0].tolist() == [1, 1, 1] and dsts[1].tolist() == [2, 2]
    assert transfer._FOREACH_OK is False


def test_block_ids_go_to_the_device_before_the_copy_stream_waits(monkeypatch) -> None:
    """The block ids are copied from pageable host memory, a copy CUDA may synchronize
    with its stream; made after the stream waits for compute, it would hold the host until
    the compute stream's queued work (the previous forward, this layer's attention) ends."""
    src, kv, layout, slab, ops, c = setup(LAYOUTS["blocks_first"])
    real = CudaCopier._rounds

    def rounds(self: CudaCopier, jobs):  # type: ignore[no-untyped-def]
        ops.log.append(("rounds",))
        return real(self, jobs)

    monkeypatch.setattr(CudaCopier, "_rounds", rounds)
    c.begin_loads([LoadOp(1, 2, 0, (9,))])
    assert [e[0] for e in ops.log[:3]] == ["rounds", "record", "wait"] and ops.log[2][1] == "load"
    c.finish_loads()
    c.begin_saves([StoreOp(5, 0, (1, 2, 3, 4))])
    ops.log.clear()
    c.save_layer(0)
    assert [e[0] for e in ops.log[:3]] == ["rounds", "record", "wait"] and ops.log[2][1] == "save"
    ops.log.clear()
    c.save_layer(1)  # later layers reuse the rounds
    assert ("rounds",) not in ops.log and ops.log[1][:2] == ("wait", "save")
    c.finish_saves()


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_whole_chunk_loads_copy_once_per_chunk_and_layer_bit_exact(
    name, dtype, monkeypatch
) -> None:
    """Loads of whole chunks copy each chunk's layer region (K and V together) in one
    copy and scatter it as its slot holds it: the blocks get exactly the slot's bytes."""
    from kvtier.host import cuda_copier

    src, kv, layout, slab, ops, c = setup(LAYOUTS[name], dtype)
    slab.buffer.copy_(torch.randint(0, 256, (slab.nbytes,), dtype=torch.uint8))
    copies: list[int] = []
    real = cuda_copier.copy_all
    monkeypatch.setattr(cuda_copier, "copy_all", lambda d, s: (copies.append(len(d)), real(d, s)))
    ids = {1: (13, 2, 27, 8), 3: (0, 39, 14, 15), 5: (30, 31, 32, 33)}
    loads = [LoadOp(40 + slot, slot, 0, blocks) for slot, blocks in ids.items()]
    assert None not in load_every_layer(c, loads).values()
    assert copies == [len(loads)] * LAYERS  # one round per layer, one copy per chunk
    for li, d in enumerate(kv):
        dim = layout.layers[li].block_dim
        for slot, blocks in ids.items():
            want = slab.layer_view(slot, li).contiguous().view(torch.uint8)
            got = d.view(torch.uint8).index_select(dim, torch.tensor(blocks)).contiguous()
            assert torch.equal(got, want), (li, slot)
