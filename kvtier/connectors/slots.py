"""The host tier's slots for one engine: the bytes of one slot (every KV layer's part of
a chunk, each KV cache group's blocks of it) and the host tier's bytes per worker."""

from __future__ import annotations

import errno
import os

from kvtier.config import KVTierConfig, format_size
from kvtier.host.layout import HostSlab, KVGroup, SlotLayout, align_slot, slot_bytes_for

from .engine_shape import EngineShape, KVCacheShape


def host_slots(cfg: KVTierConfig, host_bytes: int, slot_bytes: int, world_size: int) -> int:
    """How many slots of ``slot_bytes`` the host tier has per worker (at least one)."""
    num_slots = host_bytes // slot_bytes
    if num_slots < 1:
        from kvtier.errors import ConfigError

        raise ConfigError(
            "cpu_bytes",
            cfg.cpu_bytes,
            f"at least one chunk per worker: {format_size(slot_bytes * world_size)}"
            f" for chunk_size={cfg.chunk_size} on this model",
        )
    return num_slots


def slot_size(kv_cache: KVCacheShape, groups: tuple[KVGroup, ...], blocks_per_chunk: int) -> int:
    """Bytes of one host slot: a chunk's blocks of every layer (of a hybrid model, each
    group's layers for the blocks of a chunk that group stores)."""
    if groups:
        return align_slot(
            sum(sum(layer_page_bytes(kv_cache, g)) * group.blocks for g, group in enumerate(groups))
        )
    return slot_bytes_for(layer_page_bytes(kv_cache), blocks_per_chunk)


def layer_page_bytes(kv_cache: KVCacheShape, group_index: int = 0) -> list[int]:
    """Bytes per block of each KV layer the workers store, as vLLM placed them.

    vLLM gives the scheduler one layer's spec per group (of a ``UniformTypeKVCacheSpecs``,
    attention layers of different sizes, the first layer's), so each layer's page is read
    from its ``kv_cache_tensors`` entry (:attr:`KVCacheShape.layer_pages`). The group
    spec's page for every layer where vLLM says nothing usable. A hybrid model's groups
    overlay one allocation: ``group_index`` picks the group."""
    group = kv_cache.groups[group_index]
    if all(spec.mamba for spec in group.specs):
        # a state group: one block of state per layer, its bytes without vLLM's padding
        # (what the workers see: vLLM's CPU runner hands these bytes as the layer's
        # tensor, its GPU runner a list of the state tensors)
        return [group.specs[0].state_bytes] * len(group.layer_names)
    pages = kv_cache.layer_pages
    if pages is None:
        return [group.page_bytes] * len(group.layer_names)
    return [pages[name] for name in group.layer_names]


def resolve_host_bytes(cfg: KVTierConfig, shape: EngineShape, world_size: int) -> int:
    """Host tier bytes per worker: ``cpu_bytes`` is per worker (TP rank), like vLLM's
    per-rank KV; "auto" splits what the planner finds free between the workers.

    An explicit size is not checked against the memory free here: the scheduler is built
    after the workers allocated their slabs, so that memory is gone already. It was
    checked before the workers started (:mod:`.startup`) and by each worker before it
    allocated (:func:`allocate_slab`). "auto" is resolved here, with vLLM's KV cache
    allocated and the slabs not yet (they are allocated on the first step, this size)."""
    from kvtier.sizing.autosize import host_plan

    if cfg.cpu_bytes != "auto":
        return cfg.cpu_bytes
    model_dir = shape.model
    plan = host_plan(
        headroom_bytes=cfg.cpu_headroom_bytes,
        cpu_offload_gb=shape.cpu_offload_gb * world_size,
        model_dir=model_dir if os.path.isdir(model_dir) else None,
        workers=world_size,
    )
    return plan.check("auto")


def allocate_slab(
    cfg: KVTierConfig, nbytes: int, layout: SlotLayout, *, pin: bool, commit: bool, rank: int
) -> HostSlab:
    """A worker's host slab of ``nbytes``, checked first against the memory this host has
    left now (vLLM's KV cache and weights are in place, other workers' slabs may be): one
    ConfigError naming ``cpu_bytes``, the plan and what would fit, never an allocation the
    kernel refuses (a raw ``OSError: [Errno 12]`` from mmap) or an OOM kill while its pages
    are committed. The kernel's refusal itself becomes the same ConfigError."""
    from kvtier.errors import ConfigError
    from kvtier.sizing.autosize import host_plan

    given = cfg.cpu_bytes
    plan = host_plan(headroom_bytes=cfg.cpu_headroom_bytes)
    if nbytes > max(0, plan.largest_total):
        raise ConfigError(
            "cpu_bytes",
            given,
            f"the host slab of worker rank {rank} ({format_size(nbytes)}) "
            f"does not fit the memory left before it is allocated; {plan.text()}; "
            f"{plan.fit_hint()}",
        )
    try:
        return HostSlab(nbytes, layout, pin=pin, commit=commit)
    except (OSError, MemoryError) as exc:
        if isinstance(exc, OSError) and exc.errno not in (errno.ENOMEM, errno.EAGAIN):
            raise
        raise ConfigError(
            "cpu_bytes",
            given,
            f"the host slab of worker rank {rank} ({format_size(nbytes)}) "
            f"could not be allocated ({exc}); {plan.text()}; {plan.fit_hint()}",
        ) from None
