"""KV layout: random paged KV -> slot -> paged KV is bit-exact, for each layout vLLM uses."""

from __future__ import annotations

import pytest
import torch

from kvtier.host.layout import (
    HostSlab,
    SlotLayout,
    find_block_dim,
    gather_blocks,
    scatter_blocks,
    slot_bytes_for,
)

NUM_BLOCKS, BS, BPC = 40, 32, 4

LAYOUTS = {
    # standardized [num_blocks, H, block_size, C] with K and V packed in C
    "blocks_first": (NUM_BLOCKS, 4, BS, 2 * 64),
    # K/V outermost, FlashAttention style: [2, num_blocks, block_size, H, D]
    "kv_first": (2, NUM_BLOCKS, BS, 4, 64),
    # MLA: one latent per token, H == 1
    "mla": (NUM_BLOCKS, 1, BS, 576),
}


def make_caches(shape: tuple[int, ...], dtype: torch.dtype, layers: int = 3):
    g = torch.Generator().manual_seed(0)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=g).to(dtype)
        for i in range(layers)
    }


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_is_bit_exact(name: str, dtype: torch.dtype) -> None:
    src = make_caches(LAYOUTS[name], dtype)
    layout = SlotLayout.from_kv_caches(src, NUM_BLOCKS, BPC)
    slab = HostSlab(layout.slot_bytes * 3, layout)
    assert slab.num_slots == 3
    gpu_blocks = torch.tensor([7, 3, 30, 12])
    for li, kv in enumerate(src.values()):
        gather_blocks(kv, layout.layers[li].block_dim, gpu_blocks, slab.layer_view(1, li))

    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    # load a partial range too: slot blocks 1..3 into different target blocks
    targets = torch.tensor([20, 21, 22])
    for li, kv in enumerate(dst.values()):
        dim = layout.layers[li].block_dim
        scatter_blocks(kv, dim, targets, slab.layer_view(1, li).narrow(dim, 1, 3))
    for (name_, s), d in zip(src.items(), dst.values(), strict=True):
        dim = find_block_dim(s.shape, NUM_BLOCKS)
        got = d.index_select(dim, targets)
        want = s.index_select(dim, gpu_blocks[1:])
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name_
        untouched = [b for b in range(NUM_BLOCKS) if b not in (20, 21, 22)]
        assert not d.index_select(dim, torch.tensor(untouched)).any()


def test_slots_do_not_overlap() -> None:
    src = make_caches(LAYOUTS["blocks_first"], torch.bfloat16)
    layout = SlotLayout.from_kv_caches(src, NUM_BLOCKS, BPC)
    slab = HostSlab(layout.slot_bytes * 2, layout)
    for li in range(len(src)):
        slab.layer_view(0, li).fill_(1)
        slab.layer_view(1, li).fill_(2)
    assert bool((slab.slot_bytes(0) != slab.slot_bytes(1)).any())
    assert all(bool(slab.layer_view(0, li).eq(1).all()) for li in range(len(src)))


def test_slab_is_exactly_the_requested_size() -> None:
    src = make_caches(LAYOUTS["blocks_first"], torch.bfloat16)
    layout = SlotLayout.from_kv_caches(src, NUM_BLOCKS, BPC)
    slab = HostSlab(layout.slot_bytes * 5 + 123, layout)
    assert slab.nbytes == layout.slot_bytes * 5 + 123
    assert slab.num_slots == 5


def test_scheduler_and_worker_agree_on_slot_size() -> None:
    src = make_caches(LAYOUTS["blocks_first"], torch.bfloat16)
    layout = SlotLayout.from_kv_caches(src, NUM_BLOCKS, BPC)
    per_block = [v[0].numel() * v.element_size() for v in src.values()]
    assert slot_bytes_for(per_block, BPC) == layout.slot_bytes


def test_too_small_slab_is_refused() -> None:
    src = make_caches(LAYOUTS["mla"], torch.bfloat16)
    layout = SlotLayout.from_kv_caches(src, NUM_BLOCKS, BPC)
    with pytest.raises(ValueError, match="holds no chunk"):
        HostSlab(layout.slot_bytes - 1, layout)


def test_block_dim_not_found_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="block dimension"):
        find_block_dim((3, 5, 7), NUM_BLOCKS)


def test_backends_with_equal_slot_bytes_describe_different_layouts() -> None:
    """FlashAttention keeps K/V outermost, FlashInfer blocks outermost: same bytes per
    slot, different order. A chunk stored by one is rejected by the other, not loaded."""
    from kvtier.errors import CodecError
    from kvtier.objects import codec

    flash_attn = SlotLayout.from_kv_caches(
        make_caches((2, NUM_BLOCKS, BS, 4, 64), torch.bfloat16), NUM_BLOCKS, BPC
    )
    flashinfer = SlotLayout.from_kv_caches(
        make_caches((NUM_BLOCKS, 2, BS, 4, 64), torch.bfloat16), NUM_BLOCKS, BPC
    )
    assert flash_attn.slot_bytes == flashinfer.slot_bytes
    assert flash_attn.describe() != flashinfer.describe()
    dtype, shape = flash_attn.describe()
    blob = b"".join(
        bytes(p) for p in codec.encode("k", bytes(flash_attn.slot_bytes), dtype=dtype, shape=shape)
    )
    assert codec.decode(blob, key="k", dtype=dtype, shape=shape).nbytes == flash_attn.slot_bytes
    other_dtype, other_shape = flashinfer.describe()
    with pytest.raises(CodecError, match="shape"):
        codec.decode(blob, key="k", dtype=other_dtype, shape=other_shape)


def _resident_bytes(addr: int, nbytes: int) -> int:
    """Bytes of [addr, addr + nbytes) backed by memory, page by page from
    /proc/self/pagemap (bit 63: present), whatever mapping the kernel merged it into."""
    import mmap
    import struct

    page = mmap.PAGESIZE
    first, n = addr // page, -(-nbytes // page)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        data = f.read(n * 8)
    entries = struct.unpack(f"<{n}Q", data)
    return sum(page for e in entries if e >> 63 & 1)


def test_a_cpu_slab_commits_its_pages_in_the_background_and_keeps_what_is_written() -> None:
    """Pages are committed ahead of use (no hit pays first-touch faults), without
    writing them: a slot filled while that runs keeps its bytes."""
    src = make_caches(LAYOUTS["blocks_first"], torch.bfloat16)
    layout = SlotLayout.from_kv_caches(src, NUM_BLOCKS, BPC)
    n_slots = (192 << 20) // layout.slot_bytes
    slab = HostSlab(layout.slot_bytes * n_slots, layout)
    last = n_slots - 1
    slab.slot_bytes(last).fill_(7)  # while the pages before it are being committed
    slab._populating.join(timeout=60)
    assert not slab._populating.is_alive()
    resident = _resident_bytes(slab.buffer.data_ptr(), slab.nbytes)
    assert resident >= 0.95 * slab.nbytes, (resident, slab.nbytes)
    assert bool(slab.slot_bytes(last).eq(7).all())
    assert int(slab.buffer[: layout.slot_bytes * last].count_nonzero()) == 0
