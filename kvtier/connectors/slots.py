"""The host tier's slots for one engine: the bytes of one slot (every KV layer's part of
a chunk, each KV cache group's blocks of it) and the host tier's bytes per worker."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kvtier.config import KVTierConfig, format_size
from kvtier.host.layout import KVGroup, align_slot, slot_bytes_for

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


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


def slot_size(
    kv_cache_config: KVCacheConfig, groups: tuple[KVGroup, ...], blocks_per_chunk: int
) -> int:
    """Bytes of one host slot: a chunk's blocks of every layer (of a hybrid model, each
    group's layers for the blocks of a chunk that group stores)."""
    if groups:
        return align_slot(sum(
            sum(layer_page_bytes(kv_cache_config, g)) * group.blocks
            for g, group in enumerate(groups)
        ))  # fmt: skip
    return slot_bytes_for(layer_page_bytes(kv_cache_config), blocks_per_chunk)


def layer_page_bytes(kv_cache_config: KVCacheConfig, group_index: int = 0) -> list[int]:
    """Bytes per block of each KV layer the workers store, as vLLM placed them.

    vLLM gives the scheduler one layer's spec per group (of a ``UniformTypeKVCacheSpecs``,
    attention layers of different sizes, the first layer's), so each layer's page is read
    from its ``kv_cache_tensors`` entry: the smaller of its layer and block strides (a
    layer-outermost tensor steps blocks by the page, a block-outermost one steps layers by
    it). The group spec's page for every layer where vLLM says nothing usable. A hybrid
    model's groups overlay one allocation: ``group_index`` picks the group."""
    group = kv_cache_config.kv_cache_groups[group_index]
    every = {n for g in kv_cache_config.kv_cache_groups for n in g.layer_names}
    fallback = [group.kv_cache_spec.page_size_bytes] * len(group.layer_names)
    pages: dict[str, int] = {}
    for tensor in getattr(kv_cache_config, "kv_cache_tensors", None) or ():
        layers = getattr(tensor, "layers", None)
        strides = getattr(tensor, "layer_stride", 0), getattr(tensor, "block_stride", 0)
        if not layers or min(strides) <= 0:
            return fallback
        pages.update(dict.fromkeys(layers, min(strides)))
    if set(pages) != every:
        return fallback
    return [pages[name] for name in group.layer_names]


def resolve_host_bytes(cfg: KVTierConfig, vllm_config: VllmConfig, world_size: int) -> int:
    """Host tier bytes per worker: ``cpu_bytes`` is per worker (TP rank), like vLLM's
    per-rank KV; "auto" splits what the planner finds free between the workers."""
    from kvtier.sizing.autosize import resolve_cpu_bytes

    offload = getattr(vllm_config, "offload_config", None)
    cpu_offload_gb = float(getattr(getattr(offload, "uva", None), "cpu_offload_gb", 0.0) or 0.0)
    if not cpu_offload_gb:
        cpu_offload_gb = float(getattr(vllm_config.cache_config, "cpu_offload_gb", 0.0) or 0.0)
    model_dir = str(vllm_config.model_config.model)
    requested = cfg.cpu_bytes if cfg.cpu_bytes == "auto" else cfg.cpu_bytes * world_size
    total = resolve_cpu_bytes(
        requested,
        headroom_bytes=cfg.cpu_headroom_bytes,
        cpu_offload_gb=cpu_offload_gb * world_size,
        model_dir=model_dir if os.path.isdir(model_dir) else None,
    )
    return int(total) // world_size
