"""EngineShape.from_vllm on vLLM's own config objects: what kvtier reads of a real
``VllmConfig`` and ``KVCacheConfig`` (full and sliding-window groups built from vLLM's
spec classes), and that the value cannot change once read."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)

# the connector's module loaded first, as in the other tests of real configs: building
# one then runs no startup check of the host's memory (tests/connectors/test_startup_check.py)
import kvtier.connectors.vllm  # noqa: F401
from kvtier.connectors.engine_shape import EngineShape
from tests.connectors.hybrid_engine import BS, CHUNK, engine_config

FULL = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
WINDOW = SlidingWindowSpec(
    block_size=BS,
    num_kv_heads=2,
    head_size=8,
    dtype=torch.bfloat16,
    sliding_window=32,
    extra_retained_tokens=16,
)


def test_a_real_engine_config_reads_into_its_shape(model_dir: str) -> None:
    vc = engine_config(model_dir)
    vc.parallel_config.distributed_executor_backend = "mp"
    kcc = KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], FULL), KVCacheGroupSpec(["l2"], WINDOW)],
    )
    shape = EngineShape.from_vllm(vc, kcc)
    assert (shape.model, shape.revision, shape.served_name) == (model_dir, None, model_dir)
    assert (shape.dtype, shape.kv_cache_dtype, shape.block_size) == ("bfloat16", "auto", BS)
    assert (shape.tp_size, shape.pp_size, shape.world_size, shape.nnodes) == (1, 1, 1, 1)
    assert shape.max_num_batched_tokens == 1024 and shape.max_model_len == 2048
    assert shape.executor_backend == "mp" and shape.load_format == "auto"
    assert shape.connector == "KVTierConnector" and shape.connector_extra["chunk_size"] == CHUNK
    assert shape.kv_load_failure_policy == vc.kv_transfer_config.kv_load_failure_policy
    assert shape.draft_model is None and not shape.kv_events and not shape.use_mla
    # the model config as vLLM runs it, less transformers' bookkeeping (the path)
    assert shape.hf_config_dict["num_hidden_layers"] == 4
    assert "_name_or_path" not in shape.hf_config_dict
    kv = shape.allocated_kv_cache()
    assert kv.num_blocks == 32 and kv.layer_pages is None  # no tensors named: spec pages
    full, window = kv.groups
    assert full.layer_names == ("l0", "l1") and full.page_bytes == FULL.page_size_bytes
    assert [(s.full, s.sliding, s.attention, s.block_size) for s in full.specs] == [
        (True, False, True, BS)
    ]
    assert [(s.sliding, s.window) for s in window.specs] == [(True, 48)]
    assert (full.event_kind, window.event_window) == ("full_attention", 32)
    assert full.describe() == "FullAttentionSpec x 2 layers"
    assert EngineShape.from_vllm(vc, kcc) == shape  # reading twice reads the same


def test_the_shape_is_frozen_and_owns_its_values(model_dir: str) -> None:
    """Read once: nothing downstream can change it, nor does a later change of vLLM's
    config objects reach it."""
    vc = engine_config(model_dir)
    shape = EngineShape.from_vllm(vc)
    with pytest.raises(dataclasses.FrozenInstanceError):
        shape.block_size = 32  # type: ignore[misc]
    with pytest.raises(TypeError):
        shape.connector_extra["chunk_size"] = 1  # type: ignore[index]
    vc.kv_transfer_config.kv_connector_extra_config["chunk_size"] = 1
    assert shape.connector_extra["chunk_size"] == CHUNK
    assert shape.kv_cache is None
    with pytest.raises(ValueError, match="not allocated"):
        shape.allocated_kv_cache()


def test_layer_pages_come_from_the_tensors_when_they_cover_every_layer(model_dir: str) -> None:
    """Each layer's page is the smaller of its tensor's strides; a tensor that names no
    layers (or misses one) leaves the groups' spec pages in charge."""
    page = FULL.page_size_bytes
    tensors = [
        KVCacheTensor(
            size=2 * page * 32, layers=["l0", "l1"], layer_stride=page * 32, block_stride=page
        )
    ]
    kcc = KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], FULL)],
    )
    kv = EngineShape.from_vllm(engine_config(model_dir), kcc).allocated_kv_cache()
    assert dict(kv.layer_pages or {}) == {"l0": page, "l1": page}
    kcc.kv_cache_groups = [KVCacheGroupSpec(["l0", "l1", "l2"], FULL)]
    kv = EngineShape.from_vllm(engine_config(model_dir), kcc).allocated_kv_cache()
    assert kv.layer_pages is None


def test_mamba_state_is_named_as_such(model_dir: str) -> None:
    """What the connector refuses by (groups.kv_groups, vllm.check_kv_cache_groups)."""
    mamba = MambaSpec(block_size=BS, shapes=((4,),), dtypes=(torch.float32,))
    kcc = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["m0"], mamba)]
    )
    (group,) = EngineShape.from_vllm(engine_config(model_dir), kcc).allocated_kv_cache().groups
    assert [(s.mamba, s.attention, s.full) for s in group.specs] == [(True, False, False)]
