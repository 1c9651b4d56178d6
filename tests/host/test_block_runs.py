"""The CPU copier copies runs of consecutive blocks, ascending (a fresh pool of vLLM's
allocator) or descending (once it has cycled: it frees a request's blocks in reverse
order and hands the last freed out first), as slices instead of an index copy; every
other block list as before. Every way must move exactly the same bytes, in every KV
layout, both ways."""

from __future__ import annotations

import pytest
import torch
from copyfakes import make_caches
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.host.layout import MAX_RUNS, HostSlab, Run, SlotLayout, block_runs
from kvtier.host.transfer import CpuCopier
from kvtier.ops import LoadOp, StoreOp

NUM_BLOCKS, BPC = 40, 4
LAYOUTS = {
    "blocks_first": (NUM_BLOCKS, 4, 32, 2 * 16),
    "kv_first": (2, NUM_BLOCKS, 32, 4, 16),
    "mla": (NUM_BLOCKS, 32, 72),
}


A, D = False, True  # ascending, descending


@pytest.mark.parametrize(
    ("blocks", "runs"),
    [
        ([7], [(0, 7, 1, A)]),
        ([3, 4, 5, 6], [(0, 3, 4, A)]),
        ([6, 5, 4, 3], [(0, 3, 4, D)]),
        ([], None),
        ([3, 5, 6, 7], [(0, 3, 1, A), (1, 5, 3, A)]),
        ([4, 3], [(0, 3, 2, D)]),
        ([2, 3, 3, 5], [(0, 2, 2, A), (2, 3, 1, A), (3, 5, 1, A)]),
        ([9, 8, 11, 12], [(0, 8, 2, D), (2, 11, 2, A)]),
        ([40, 39, 38, 1, 2, 3], [(0, 38, 3, D), (3, 1, 3, A)]),
        ([1, 9, 3, 7, 5], None),  # five runs: one index copy
    ],
)
def test_block_runs(blocks: list[int], runs: list[tuple[int, int, int, bool]] | None) -> None:
    assert block_runs(blocks) == (None if runs is None else [Run(*r) for r in runs])


@given(st.lists(st.integers(0, 30), max_size=20))
def test_runs_name_every_block_once_in_order(blocks: list[int]) -> None:
    """Expanded back, the runs are the block list itself."""
    runs = block_runs(blocks)
    if runs is None:
        assert not blocks or len(blocks) > MAX_RUNS
        return
    assert len(runs) <= MAX_RUNS
    out: list[int] = []
    for r in runs:
        assert r.at == len(out) and r.count >= 1
        span = range(r.low, r.low + r.count)
        out.extend(reversed(span) if r.descending else span)
    assert out == blocks


def stored(shape, slot: int, blocks: list[int]):  # type: ignore[no-untyped-def]
    """KV caches of ``shape`` and a slab whose ``slot`` holds their ``blocks`` (a store)."""
    src = make_caches(shape)
    layout = SlotLayout.from_kv_caches(src, NUM_BLOCKS, BPC)
    slab = HostSlab(layout.slot_bytes * (slot + 2), layout)
    copier = CpuCopier(list(src.values()), layout, slab)
    copier.submit([StoreOp(1, slot, blocks, b"h")])
    assert [r.ok for r in copier.poll()] == [True]
    return src, layout, slab


def loaded_into_zeros(src, layout, slab, op: LoadOp):  # type: ignore[no-untyped-def]
    """Zeroed caches shaped like ``src`` after ``op`` loaded a slot into them."""
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    loader = CpuCopier(list(dst.values()), layout, slab)
    assert [r.ok for r in loader.submit([op])] == [True]
    return dst


@pytest.mark.parametrize("shape", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.parametrize(
    "blocks",
    [
        [20, 21, 22, 23],
        [31, 5, 17, 2],
        [10, 11, 13, 12],
        [23, 22, 21, 20],
        [9, 8, 30, 31],
    ],
)
def test_a_run_and_scattered_blocks_move_the_same_bytes(shape, blocks: list[int]) -> None:
    src, layout, slab = stored(shape, 2, blocks)
    for targets in ([36, 37, 38], [38, 37, 36], [30, 3, 12]):  # slot blocks 1..3
        dst = loaded_into_zeros(src, layout, slab, LoadOp(2, 2, 1, targets))
        dim = layout.layers[0].block_dim
        others = torch.tensor([b for b in range(NUM_BLOCKS) if b not in targets])
        for name, kv in src.items():
            got = dst[name].index_select(dim, torch.tensor(targets))
            assert torch.equal(got, kv.index_select(dim, torch.tensor(blocks[1:]))), name
            assert not dst[name].index_select(dim, others).any()


@settings(max_examples=60, deadline=None)
@given(
    shape=st.sampled_from(list(LAYOUTS.values())),
    blocks_stored=st.permutations(range(NUM_BLOCKS)).map(lambda p: p[:BPC]),
    loaded=st.permutations(range(NUM_BLOCKS)).map(lambda p: p[:BPC]),
    runs=st.booleans(),
)
def test_any_block_list_moves_the_bytes_an_index_copy_moves(
    shape, blocks_stored, loaded, runs
) -> None:
    """Against ``index_select`` / ``index_copy_`` themselves, for blocks anywhere (often
    a few runs of one block, copied run by run) or one run either way; the blocks not
    named stay as they were."""
    if runs:  # stored from a descending run, loaded into an ascending one
        b, c = min(blocks_stored[0], NUM_BLOCKS - BPC), min(loaded[0], NUM_BLOCKS - BPC)
        blocks_stored = list(range(b + BPC - 1, b - 1, -1))
        loaded = list(range(c, c + BPC))
    src, layout, slab = stored(shape, 0, blocks_stored)
    dim = layout.layers[0].block_dim
    for li, kv in enumerate(src.values()):
        want = kv.index_select(dim, torch.tensor(blocks_stored))
        assert torch.equal(slab.layer_view(0, li), want)
    dst = loaded_into_zeros(src, layout, slab, LoadOp(2, 0, 0, loaded))
    for li, (name, kv) in enumerate(dst.items()):
        want = torch.zeros_like(kv).index_copy_(dim, torch.tensor(loaded), slab.layer_view(0, li))
        assert torch.equal(kv, want), name
