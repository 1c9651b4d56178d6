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


def test_a_steps_runs_are_copied_in_one_call_and_a_bad_job_fails_alone(monkeypatch) -> None:
    """A step's slice copies go to torch in one call (every layer of every op whose blocks
    are one run); an op whose slot cannot be viewed fails alone, and when the one call
    fails every op is copied again by itself: the same bytes land either way."""
    import kvtier.host.transfer as transfer

    src = make_caches(LAYOUTS["kv_first"])
    layout = SlotLayout.from_kv_caches(src, NUM_BLOCKS, BPC)
    slab = HostSlab(layout.slot_bytes * 4, layout)
    saver = CpuCopier(list(src.values()), layout, slab)
    saver.submit([StoreOp(1, 0, [4, 5, 6, 7], b"a"), StoreOp(2, 1, [20, 21, 22, 23], b"b")])
    assert [r.ok for r in saver.poll()] == [True, True]
    calls: list[int] = []
    real = transfer._foreach_copy

    def counted(dsts, srcs):  # type: ignore[no-untyped-def]
        calls.append(len(dsts))
        real(dsts, srcs)

    monkeypatch.setattr(transfer, "_foreach_copy", counted)
    loads = [LoadOp(3, 0, 0, [30, 31, 32, 33]), LoadOp(4, 1, 0, [8, 9, 10, 11]),
             LoadOp(5, 9, 0, [0, 1, 2, 3])]  # slot 9: there is no such slot  # fmt: skip
    dim = layout.layers[0].block_dim

    def landed(dst: dict) -> bool:
        return all(torch.equal(dst[n].index_select(dim, torch.tensor([30, 31, 32, 33])),
                               kv.index_select(dim, torch.tensor([4, 5, 6, 7])))
                   and torch.equal(dst[n].index_select(dim, torch.tensor([8, 9, 10, 11])),
                                   kv.index_select(dim, torch.tensor([20, 21, 22, 23])))
                   for n, kv in src.items())  # fmt: skip

    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    res = CpuCopier(list(dst.values()), layout, slab).submit(loads)
    assert {r.op_id: r.ok for r in res} == {3: True, 4: True, 5: False}
    assert calls == [2 * len(src)] and landed(dst)

    def broken(dsts, srcs):  # type: ignore[no-untyped-def]
        raise RuntimeError("refused")

    monkeypatch.setattr(transfer, "_foreach_copy", broken)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    res = CpuCopier(list(dst.values()), layout, slab).submit(loads[:2])
    assert {r.op_id: r.ok for r in res} == {3: True, 4: True} and landed(dst)
