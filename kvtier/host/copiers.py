"""Which copier moves a worker's KV: :func:`make_copier`.

The choice needs both copiers, so it lives above them: :mod:`kvtier.host.transfer`
(the :class:`~kvtier.host.transfer.Copier` interface, :class:`~kvtier.host.transfer.CpuCopier`
and the index math) and :mod:`kvtier.host.cuda_copier` (built on that module) never
import this one. A hybrid model's KV cache groups each get a copier of their own,
behind one :class:`GroupsCopier`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from kvtier.ops import CopyOp, LoadOp, OpKind, OpResult, StoreOp, group_parts

from .cuda_copier import CudaCopier, StreamOps
from .layout import HostSlab, SlotLayout
from .transfer import Copier, CpuCopier

__all__ = ["GroupsCopier", "make_copier"]

#: builds one group's copier from its tensors, its layout and the slab seen through it
CopierFactory = Callable[[Sequence[torch.Tensor], SlotLayout, HostSlab], Copier]


def make_copier(
    kv: Sequence[torch.Tensor],
    layout: SlotLayout,
    slab: HostSlab,
    ops_factory: Callable[[torch.device], StreamOps] | None = None,
) -> Copier:
    """A :class:`~kvtier.host.cuda_copier.CudaCopier` for KV on CUDA, else a
    :class:`~kvtier.host.transfer.CpuCopier`; one per KV cache group of a hybrid model."""

    def single(kv: Sequence[torch.Tensor], layout: SlotLayout, slab: HostSlab) -> Copier:
        if kv[0].device.type == "cuda":
            ops = ops_factory(kv[0].device) if ops_factory is not None else None
            return CudaCopier(kv, layout, slab, ops=ops)
        return CpuCopier(kv, layout, slab)

    if len(layout.groups) > 1:
        return GroupsCopier(kv, layout, slab, single)
    return single(kv, layout, slab)


class _Tally:
    """One direction's ops across the groups: an op's result is in once every group that
    had blocks of it answered (ok only if all did; its time is theirs added)."""

    def __init__(self, kind: OpKind) -> None:
        self.kind = kind
        self.left: dict[int, int] = {}
        self.ok: dict[int, bool] = {}
        self.seconds: dict[int, float] = {}

    def expect(self, op_id: int, parts: int) -> list[OpResult]:
        if parts == 0:  # nothing of any group to copy (e.g. a window's null blocks)
            return [OpResult(op_id, self.kind, True)]
        self.left[op_id], self.ok[op_id], self.seconds[op_id] = parts, True, 0.0
        return []

    def add(self, results: Sequence[OpResult]) -> list[OpResult]:
        out: list[OpResult] = []
        for res in results:
            if res.op_id not in self.left:
                continue
            self.ok[res.op_id] = self.ok[res.op_id] and res.ok
            self.seconds[res.op_id] += res.seconds
            self.left[res.op_id] -= 1
            if self.left[res.op_id] == 0:
                del self.left[res.op_id]
                ok = self.ok.pop(res.op_id)
                out.append(OpResult(res.op_id, self.kind, ok, seconds=self.seconds.pop(res.op_id)))
        return out


class GroupsCopier(Copier):
    """A hybrid model's copies: each KV cache group's part of an op (its own block ids,
    into its own regions of the slot) goes to that group's copier, over the group's
    layers only (:meth:`SlotLayout.group_layout`), so one group's bytes never reach
    another group's blocks. Layer indices here are the whole layout's."""

    def __init__(
        self,
        kv: Sequence[torch.Tensor],
        layout: SlotLayout,
        slab: HostSlab,
        factory: CopierFactory,
    ) -> None:
        super().__init__(kv, layout, slab)
        self.copiers: list[Copier] = []
        #: layout layer -> (group, that group's layer index)
        self._where: dict[int, tuple[int, int]] = {}
        for g in range(len(layout.groups)):
            idx = [i for i, ll in enumerate(layout.layers) if ll.group == g]
            sub = layout.group_layout(g)
            self.copiers.append(factory([self.kv[i] for i in idx], sub, slab.with_layout(sub)))
            self._where.update({li: (g, j) for j, li in enumerate(idx)})
        self.layerwise = any(c.layerwise for c in self.copiers)
        self._loads = _Tally(OpKind.LOAD)
        self._saves = _Tally(OpKind.STORE)
        self._saves_done: list[OpResult] = []

    def _split(
        self, jobs: Sequence[CopyOp], tally: _Tally
    ) -> tuple[list[list[CopyOp]], list[OpResult]]:
        per_group: list[list[CopyOp]] = [[] for _ in self.copiers]
        done: list[OpResult] = []
        for job in jobs:
            parts = group_parts(job)
            if len(parts) != len(self.copiers):  # a plan for another grouping: refuse it
                done.append(OpResult(job.op_id, tally.kind, False))
                continue
            n = 0
            for g, (first, blocks) in enumerate(parts):
                if not blocks:
                    continue
                n += 1
                # every other field kept as it is (the fetch a load waits for, the loads a
                # store waits for, its upload): a group's part is checked as the whole op
                part: CopyOp = (
                    replace(job, first=first, gpu_blocks=blocks, more=())
                    if isinstance(job, LoadOp)
                    else replace(job, gpu_blocks=blocks, more=())
                )
                per_group[g].append(part)
            done += tally.expect(job.op_id, n)
        return per_group, done

    def begin_loads(self, jobs: Sequence[LoadOp]) -> list[OpResult]:
        per_group, out = self._split(jobs, self._loads)
        for copier, part in zip(self.copiers, per_group, strict=True):
            out += self._loads.add(copier.begin_loads([j for j in part if isinstance(j, LoadOp)]))
        return out

    def finish_loads(self) -> list[OpResult]:
        out: list[OpResult] = []
        for copier in self.copiers:
            out += self._loads.add(copier.finish_loads())
        return out

    def wait_layer(self, layer: int) -> None:
        g, j = self._where[layer]
        self.copiers[g].wait_layer(j)

    def begin_saves(self, jobs: Sequence[StoreOp]) -> None:
        per_group, self._saves_done = self._split(jobs, self._saves)
        for copier, part in zip(self.copiers, per_group, strict=True):
            copier.begin_saves([j for j in part if isinstance(j, StoreOp)])

    def save_layer(self, layer: int) -> None:
        g, j = self._where[layer]
        self.copiers[g].save_layer(j)

    def finish_saves(self) -> list[OpResult]:
        out, self._saves_done = self._saves_done, []
        for copier in self.copiers:
            out += self._saves.add(copier.finish_saves())
        return out

    def close(self) -> None:
        for copier in self.copiers:
            copier.close()
