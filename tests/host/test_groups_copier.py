"""A hybrid model's copies (``GroupsCopier``): each KV cache group's blocks move between
its own layers and its own regions of a slot, with either copier underneath (the CUDA
one's stream bookkeeping on a fake, over CPU tensors)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from copyfakes import FakeOps, blocks_of

from kvtier.host.copiers import GroupsCopier, make_copier
from kvtier.host.cuda_copier import CudaCopier
from kvtier.host.layout import FULL, SLIDING, HostSlab, KVGroup, SlotLayout
from kvtier.host.transfer import Copier, CpuCopier
from kvtier.ops import LoadOp, StoreOp

NB, BS, BPC = 24, 4, 4
GROUPS = (KVGroup(FULL, ("a", "c"), BPC), KVGroup(SLIDING, ("b", "d"), 2, 8))


def overlaid_caches(seed: int = 0) -> dict[str, torch.Tensor]:
    """As vLLM's hybrid manager allocates them: one tensor per pair of layers, each
    serving a layer of each group (a and b, c and d)."""
    g = torch.Generator().manual_seed(seed)
    t0 = torch.randn(NB, 2, BS, 8, generator=g).to(torch.bfloat16)
    t1 = torch.randn(NB, 2, BS, 8, generator=g).to(torch.bfloat16)
    return {"a": t0, "c": t1, "b": t0, "d": t1}


def cuda_like(kv: Sequence[torch.Tensor], layout: SlotLayout, slab: HostSlab) -> Copier:
    return CudaCopier(kv, layout, slab, ops=FakeOps())


@pytest.mark.parametrize("factory", [CpuCopier, cuda_like], ids=["cpu", "cuda-fake"])
def test_each_group_stores_and_loads_its_own_blocks(factory) -> None:
    src = overlaid_caches(0)
    layout = SlotLayout.from_kv_caches(src, NB, BPC, GROUPS)
    slab = HostSlab(2 * layout.slot_bytes, layout)
    kv = [src[ll.name] for ll in layout.layers]
    c = GroupsCopier(kv, layout, slab, factory)
    # chunk: full blocks 0-3, the sliding group's last two of its chunk: blocks 10, 11
    c.begin_saves([StoreOp(1, 0, [0, 1, 2, 3], more=([10, 11],))])
    for li in range(len(layout.layers)):
        c.save_layer(li)
    (res,) = c.finish_saves()
    assert res.op_id == 1 and res.ok

    dst = overlaid_caches(5)
    before = {n: t.clone() for n, t in dst.items()}
    kv2 = [dst[ll.name] for ll in layout.layers]
    c2 = GroupsCopier(kv2, layout, slab, factory)
    # load the full group's 4 blocks into 4-7 and the sliding group's last one into 20
    out = c2.begin_loads([LoadOp(2, 0, 0, [4, 5, 6, 7], more=((1, [20]),))])
    for li in range(len(layout.layers)):
        c2.wait_layer(li)
    out += c2.finish_loads()
    assert [(r.op_id, r.ok) for r in out] == [(2, True)]
    for name in ("a", "c"):  # the full layers' KV of blocks 0-3, nothing of b's or d's
        assert torch.equal(
            blocks_of(dst[name], [4, 5, 6, 7], NB), blocks_of(src[name], [0, 1, 2, 3], NB)
        )
    for name in ("b", "d"):  # block 11 (the sliding chunk's last) -> 20
        assert torch.equal(blocks_of(dst[name], [20], NB), blocks_of(src[name], [11], NB))
    untouched = [b for b in range(NB) if b not in (4, 5, 6, 7, 20)]
    for name, t in dst.items():
        assert torch.equal(blocks_of(t, untouched, NB), blocks_of(before[name], untouched, NB))


def test_a_load_with_nothing_of_a_group_and_a_refused_part() -> None:
    src = overlaid_caches(1)
    layout = SlotLayout.from_kv_caches(src, NB, BPC, GROUPS)
    slab = HostSlab(layout.slot_bytes, layout)
    c = make_copier([src[ll.name] for ll in layout.layers], layout, slab)
    assert isinstance(c, GroupsCopier)
    out = c.begin_loads(
        [
            LoadOp(1, 0, 0, [4], more=((0, []),)),  # the sliding group's blocks all null
            LoadOp(2, 0, 0, [], more=((0, []),)),  # nothing at all: done without a copy
            LoadOp(3, 0, 0, [5], more=((1, [6, 7]),)),  # past the group's 2 blocks: refused
            LoadOp(4, 0, 0, [5]),  # a plan for one group: refused, never half-copied
        ]
    )
    assert sorted((r.op_id, r.ok) for r in out) == [(1, True), (2, True), (3, False), (4, False)]


def test_each_groups_part_keeps_every_field_of_its_op() -> None:
    """A hybrid op split into its groups' parts keeps what the copier underneath checks
    (a load's ``fetch_op``, a store's ``after_loads``, its upload and block hash): a part
    rebuilt from slot and blocks alone would be copied as if its fetch had succeeded, the
    same mistake as the trimmed load of a sliding-window model (issue 47, item 1)."""
    src = overlaid_caches(2)
    layout = SlotLayout.from_kv_caches(src, NB, BPC, GROUPS)
    slab = HostSlab(layout.slot_bytes, layout)
    seen: list[object] = []

    class Recording(CpuCopier):
        def begin_loads(self, jobs):  # type: ignore[no-untyped-def]
            seen.extend(jobs)
            return super().begin_loads(jobs)

        def begin_saves(self, jobs):  # type: ignore[no-untyped-def]
            seen.extend(jobs)
            super().begin_saves(jobs)

    c = GroupsCopier([src[ll.name] for ll in layout.layers], layout, slab, Recording)
    c.begin_saves([StoreOp(1, 0, [0, 1, 2, 3], b"h" * 8, 9, more=([10, 11],), after_loads=(5,))])
    c.begin_loads([LoadOp(2, 0, 0, [4, 5, 6, 7], more=((1, [20]),), fetch_op=7)])
    stores = [j for j in seen if isinstance(j, StoreOp)]
    loads = [j for j in seen if isinstance(j, LoadOp)]
    assert len(stores) == 2 and len(loads) == 2
    assert all(
        (s.block_hash, s.upload_op_id, s.after_loads, s.more) == (b"h" * 8, 9, (5,), ())
        for s in stores
    )
    assert all(ld.fetch_op == 7 and ld.more == () for ld in loads)
    assert sorted(ld.first for ld in loads) == [0, 1]
