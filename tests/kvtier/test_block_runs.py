"""The CPU copier copies a run of consecutive blocks (what vLLM's allocator mostly hands
out) as one slice instead of an index copy; every other block list as before. Both must
move exactly the same bytes, in every KV layout, both ways."""

from __future__ import annotations

import pytest
import torch
from copyfakes import make_caches

from kvtier.host.layout import HostSlab, SlotLayout, first_of_run
from kvtier.host.transfer import CpuCopier
from kvtier.ops import LoadOp, StoreOp

NUM_BLOCKS, BPC = 40, 4
LAYOUTS = {
    "blocks_first": (NUM_BLOCKS, 4, 32, 2 * 16),
    "kv_first": (2, NUM_BLOCKS, 32, 4, 16),
    "mla": (NUM_BLOCKS, 32, 72),
}


@pytest.mark.parametrize(("blocks", "first"), [
    ([7], 7), ([3, 4, 5, 6], 3), ([0, 1], 0), ([], None), ([3, 5, 6, 7], None),
    ([4, 3], None), ([2, 3, 3, 5], None), ([9, 8, 11, 12], None),
])  # fmt: skip
def test_first_of_run(blocks: list[int], first: int | None) -> None:
    assert first_of_run(blocks) == first


@pytest.mark.parametrize("shape", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.parametrize("blocks", [[20, 21, 22, 23], [31, 5, 17, 2], [10, 11, 13, 12]])
def test_a_run_and_scattered_blocks_move_the_same_bytes(shape, blocks: list[int]) -> None:
    src = make_caches(shape)
    layout = SlotLayout.from_kv_caches(src, NUM_BLOCKS, BPC)
    slab = HostSlab(layout.slot_bytes * 4, layout)
    copier = CpuCopier(list(src.values()), layout, slab)
    copier.submit([StoreOp(1, 2, blocks, b"h")])
    assert [r.ok for r in copier.poll()] == [True]
    for targets in ([36, 37, 38], [30, 3, 12]):  # slot blocks 1..3: a run, scattered
        dst = {k: torch.zeros_like(v) for k, v in src.items()}
        loader = CpuCopier(list(dst.values()), layout, slab)
        assert [r.ok for r in loader.submit([LoadOp(2, 2, 1, targets)])] == [True]
        dim = layout.layers[0].block_dim
        others = torch.tensor([b for b in range(NUM_BLOCKS) if b not in targets])
        for name, kv in src.items():
            got = dst[name].index_select(dim, torch.tensor(targets))
            assert torch.equal(got, kv.index_select(dim, torch.tensor(blocks[1:]))), name
            assert not dst[name].index_select(dim, others).any()
