"""The CUDA copy path on a real GPU: pinned exact-size slab, streams, per-layer events.

Skipped (by ``tests/cuda/conftest.py``) where ``torch.cuda.is_available()`` is
False. Sizes are big enough that a missing stream wait would show up as stale
or torn data, and small enough to run in seconds on one GPU.
"""

from __future__ import annotations

import pytest
import torch
from copyfakes import load_every_layer, save_every_layer, times

from kvtier.host import cuda as kcuda
from kvtier.host.copiers import make_copier
from kvtier.host.cuda_copier import CudaCopier
from kvtier.host.layout import HostSlab, SlotLayout, find_block_dim
from kvtier.ops import LoadOp, StoreOp

pytestmark = pytest.mark.cuda

NUM_BLOCKS, BS, BPC, LAYERS = 256, 16, 16, 4

LAYOUTS = {
    "flash_attn": (2, NUM_BLOCKS, BS, 8, 128),  # [2, num_blocks, block_size, H, D]
    "flashinfer": (NUM_BLOCKS, 2, BS, 8, 128),  # [num_blocks, 2, block_size, H, D]
    "mla": (NUM_BLOCKS, BS, 576),  # [num_blocks, block_size, kv_lora_rank + rope]
}


def caches(shape, dtype, layers=LAYERS, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=g, device="cuda").to(dtype)
        for i in range(layers)
    }


def blocks(kv: torch.Tensor, ids: list[int]) -> torch.Tensor:
    dim = find_block_dim(kv.shape, NUM_BLOCKS)
    idx = torch.tensor(ids, device=kv.device)
    return kv.index_select(dim, idx).view(torch.uint8).cpu()


def setup(shape, dtype, slots=8, layers=LAYERS):
    src = caches(shape, dtype, layers)
    layout = SlotLayout.from_kv_caches(src, NUM_BLOCKS, BPC)
    slab = HostSlab(layout.slot_bytes * slots + 12345, layout, pin=True)
    return src, list(src.values()), layout, slab


def test_slab_is_pinned_at_exact_size_with_rss_within_2_percent() -> None:
    torch.zeros(1, device="cuda")  # the CUDA context's own RSS must not count
    nbytes = (1 << 30) + (1 << 28) + 4096 * 3 + 7  # 1.25 GiB and change: pin_memory -> 2 GiB

    def full_slab(n: int) -> kcuda.PinnedBuffer:
        buf = kcuda.PinnedBuffer(n)
        buf.tensor.fill_(1)  # a host tier written end to end
        return buf

    ratio, buf = kcuda.rss_ratio(full_slab, nbytes)
    assert buf.pinned and buf.tensor.is_pinned() and buf.tensor.numel() == nbytes
    assert 0.98 <= ratio <= 1.02, ratio
    buf.close()


def test_host_slab_pins_through_cuda_host_register() -> None:
    src, kv, layout, slab = setup(LAYOUTS["mla"], torch.bfloat16)
    assert slab.pinned and slab.buffer.is_pinned()
    assert slab.nbytes == layout.slot_bytes * 8 + 12345
    assert isinstance(make_copier(kv, layout, slab), CudaCopier)
    slab.close()


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_round_trip_on_gpu_is_bit_exact(name, dtype) -> None:
    src, kv, layout, slab = setup(LAYOUTS[name], dtype)
    c = CudaCopier(kv, layout, slab, staging_bytes=3 * (layout.layers[0].nbytes // BPC) * BPC)
    store_ids = [list(range(i * 20, i * 20 + BPC)) for i in range(5)]
    store_ids[2] = [255 - b for b in store_ids[2]]  # not sorted, not contiguous
    out = save_every_layer(c, [StoreOp(i, i, tuple(ids)) for i, ids in enumerate(store_ids)])
    assert sorted(out) == list(range(5)) and None not in out.values()

    dst = [torch.zeros_like(t) for t in kv]
    c2 = CudaCopier(dst, layout, slab)
    targets = [list(range(100 + 16 * i, 100 + 16 * i + BPC - 3)) for i in range(5)]
    out = load_every_layer(c2, [LoadOp(10 + i, i, 3, tuple(t)) for i, t in enumerate(targets)])
    assert None not in out.values() and len(out) == 5
    torch.cuda.synchronize()
    for s, d in zip(kv, dst, strict=True):
        for ids, t in zip(store_ids, targets, strict=True):
            assert torch.equal(blocks(d, t), blocks(s, ids[3:]))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_whole_chunk_loads_on_gpu_are_bit_exact(name, dtype) -> None:
    """Whole chunks load with one copy per chunk and layer and a scatter of the chunk as
    its slot holds it, on the scatter stream; a ring of two staging buffers (a round of
    two chunks each) is reused across rounds and layers."""
    src, kv, layout, slab = setup(LAYOUTS[name], dtype)
    per_chunk = max(ll.nbytes for ll in layout.layers)
    c = CudaCopier(kv, layout, slab)
    ids = [tuple(range(250 - 11 * i, 250 - 11 * i - 3 * BPC, -3)) for i in range(5)]
    assert None not in save_every_layer(c, [StoreOp(i, i, t) for i, t in enumerate(ids)]).values()
    dst = [torch.zeros_like(t) for t in kv]
    c2 = CudaCopier(dst, layout, slab, staging_bytes=4 * per_chunk)
    targets = [tuple(range(20 * i, 20 * i + BPC)) for i in range(5)]
    out = load_every_layer(c2, [LoadOp(10 + i, i, 0, t) for i, t in enumerate(targets)])
    assert None not in out.values() and len(out) == 5
    torch.cuda.synchronize()
    for s, d in zip(kv, dst, strict=True):
        for t, i in zip(targets, ids, strict=True):
            assert torch.equal(blocks(d, list(t)), blocks(s, list(i)))


def test_flashinfer_hnd_strided_kv_round_trips_on_gpu() -> None:
    """FlashInfer HND: connectors get a permuted, non-contiguous view of the KV."""
    g = torch.Generator(device="cuda").manual_seed(1)
    kv = [
        torch.randn((NUM_BLOCKS, 2, 8, BS, 128), generator=g, device="cuda")
        .to(torch.bfloat16)
        .permute(0, 1, 3, 2, 4)
        for _ in range(LAYERS)
    ]
    layout = SlotLayout.from_kv_caches({f"l{i}": t for i, t in enumerate(kv)}, NUM_BLOCKS, BPC)
    slab = HostSlab(layout.slot_bytes * 2, layout, pin=True)
    ids = tuple(range(200, 200 - 3 * BPC, -3))
    c = CudaCopier(kv, layout, slab)
    assert None not in save_every_layer(c, [StoreOp(1, 1, ids)]).values()
    dst = [torch.zeros_like(t) for t in kv]
    c2 = CudaCopier(dst, layout, slab)
    targets = tuple(range(10, 10 + BPC))
    assert None not in load_every_layer(c2, [LoadOp(2, 1, 0, targets)]).values()
    torch.cuda.synchronize()
    for s, d in zip(kv, dst, strict=True):
        assert torch.equal(blocks(d, list(targets)), blocks(s, list(ids)))


def test_each_layer_waits_for_its_own_load() -> None:
    """Compute reads layer i right after wait_layer(i): it must see the loaded bytes."""
    shape = (2, 2048, BS, 8, 128)  # 8 MiB copied per layer: long enough to race
    src = caches(shape, torch.bfloat16, layers=8)
    layout = SlotLayout.from_kv_caches(src, 2048, 128)
    slab = HostSlab(layout.slot_bytes, layout, pin=True)
    slab.buffer.view(torch.int16)[:] = 3  # 3 as int16 bits is a tiny nonzero bf16
    kv = [torch.zeros_like(t) for t in src.values()]
    c = CudaCopier(kv, layout, slab)
    ids = tuple(range(0, 2048, 16))
    times(c.begin_loads([LoadOp(1, 0, 0, ids)]))
    sums = []
    for li in range(len(kv)):
        c.wait_layer(li)
        sums.append((kv[li].view(torch.int16) == 3).sum())  # on the compute stream
    want = 2 * len(ids) * BS * 8 * 128
    assert [int(s) for s in sums] == [want] * len(kv)
    assert None not in times(c.finish_loads()).values()


def test_saves_wait_for_the_layer_compute() -> None:
    """KV written on the compute stream just before save_layer(i) is what lands in the slab."""
    shape = (2, 2048, BS, 8, 128)
    src = caches(shape, torch.bfloat16, layers=4)
    layout = SlotLayout.from_kv_caches(src, 2048, 128)
    slab = HostSlab(layout.slot_bytes, layout, pin=True)
    kv = list(src.values())
    c = CudaCopier(kv, layout, slab)
    ids = tuple(range(5, 2048, 16))
    c.begin_saves([StoreOp(1, 0, ids)])
    big = torch.randn(4096, 4096, device="cuda")
    for li, t in enumerate(kv):
        for _ in range(4):
            big = big @ big / 64  # keep the compute stream busy before the write
        t.fill_(li + 1)  # this layer's "attention" writes its KV
        c.save_layer(li)
    assert None not in times(c.finish_saves()).values()
    for li in range(len(kv)):
        assert (slab.layer_view(0, li).float() == li + 1).all(), li


def test_loads_do_not_block_the_host() -> None:
    """With a pinned slab, begin_loads returns before the copies finish."""
    shape = (2, 8192, BS, 8, 128)  # 32 MiB copied per layer, 512 MiB in all
    kv = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in range(16)]
    layout = SlotLayout.from_kv_caches({f"l{i}": t for i, t in enumerate(kv)}, 8192, 512)
    slab = HostSlab(layout.slot_bytes, layout, pin=True)
    c = CudaCopier(kv, layout, slab)
    torch.cuda.synchronize()
    times(c.begin_loads([LoadOp(1, 0, 0, tuple(range(0, 8192, 16)))]))
    last = c._loads.last_event if c._loads is not None else None
    assert last is not None and not last.query()
    assert None not in times(c.finish_loads()).values()
    assert last.query()
