"""Which copier moves a worker's KV: :func:`make_copier`.

The choice needs both copiers, so it lives above them: :mod:`kvtier.transfer`
(the :class:`~kvtier.transfer.Copier` interface, :class:`~kvtier.transfer.CpuCopier`
and the index math) and :mod:`kvtier.cuda_copier` (built on that module) never
import this one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .cuda_copier import CudaCopier, StreamOps
from .layout import HostSlab, SlotLayout
from .transfer import Copier, CpuCopier

__all__ = ["make_copier"]


def make_copier(
    kv: Sequence[torch.Tensor],
    layout: SlotLayout,
    slab: HostSlab,
    ops_factory: Callable[[torch.device], StreamOps] | None = None,
) -> Copier:
    """A :class:`~kvtier.cuda_copier.CudaCopier` for KV on CUDA, else a
    :class:`~kvtier.transfer.CpuCopier`."""
    if kv[0].device.type == "cuda":
        ops = ops_factory(kv[0].device) if ops_factory is not None else None
        return CudaCopier(kv, layout, slab, ops=ops)
    return CpuCopier(kv, layout, slab)
