"""Hybrid models: what kvtier serves and what it refuses at startup, with vLLM's own objects.

kvtier subclasses ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager with kvtier:
the KV cache groups kvtier is handed come from vLLM's own ``get_kv_cache_groups`` over a
model's per-layer ``KVCacheSpec``s (as the engine core builds them), and the connector is
built by vLLM's real ``Scheduler`` (scheduler role) or directly (worker role), as vLLM
builds it. No model runs here; tests/connectors/test_hma.py moves real KV of a hybrid
model through vLLM's scheduler and kvtier's sides.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.structured_output import StructuredOutputManager

from kvtier.connectors.vllm import KVTierConnector
from kvtier.errors import ConfigError
from kvtier.host.layout import SlotLayout, slot_bytes_for
from tests.connectors.hybrid_engine import BS, CHUNK, engine_config

NUM_BLOCKS = 32
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
SWA = SlidingWindowSpec(
    block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16, sliding_window=32
)
MAMBA = MambaSpec(
    block_size=BS,
    shapes=((4, 8), (2, 8)),
    dtypes=(torch.bfloat16, torch.bfloat16),
    page_size_padded=FULL.page_size_bytes,
)


def vllm_groups(vc: VllmConfig, specs: dict[str, KVCacheSpec]) -> KVCacheConfig:
    """The KV cache config vLLM's engine core builds from these layers' specs."""
    groups = get_kv_cache_groups(vc, dict(specs))
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def scheduler(vc: VllmConfig, kv_cache_config: KVCacheConfig) -> Any:
    """vLLM's real scheduler, which builds kvtier's connector in the scheduler role."""
    vc.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return Scheduler(
        vllm_config=vc,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BS,
        log_stats=True,
    )


def attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def test_vllm_keeps_its_hybrid_manager_for_kvtier(model_dir: str) -> None:
    assert issubclass(KVTierConnector, SupportsHMA)
    assert engine_config(model_dir).scheduler_config.disable_hybrid_kv_cache_manager is False


def test_full_and_sliding_window_layers_are_two_groups_each_stored(model_dir: str) -> None:
    """Gemma 2/3, gpt-oss style (alternating full and sliding-window layers): vLLM gives
    kvtier a full-attention group and a sliding-window group; a chunk's slot holds every
    block of the full layers and the last ceil(32 / 16) = 2 of the sliding ones, as the
    workers lay it out over the tensors."""
    vc = engine_config(model_dir)
    vc.cache_config.kv_cache_layout = "LBNHC"  # what the engine core resolves first
    kcc = vllm_groups(vc, {attn(0): FULL, attn(1): SWA, attn(2): FULL, attn(3): SWA})
    assert [type(g.kv_cache_spec) for g in kcc.kv_cache_groups] == [
        FullAttentionSpec,
        SlidingWindowSpec,
    ]
    sched = scheduler(vc, kcc)
    side = sched.connector._scheduler
    bpc = CHUNK // BS
    assert side.slot_bytes == slot_bytes_for([FULL.page_size_bytes] * 2, bpc) + 2 * (
        2 * SWA.page_size_bytes
    )
    kv = {attn(i): torch.zeros(2, NUM_BLOCKS, BS, 2, 8, dtype=torch.bfloat16) for i in range(4)}
    layout = SlotLayout.from_kv_caches(kv, NUM_BLOCKS, bpc, side.groups)
    assert layout.slot_bytes == side.slot_bytes
    sched.shutdown()


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_a_mamba_model_is_refused_at_startup_naming_the_model_and_why(
    model_dir: str,
    role: KVConnectorRole,
) -> None:
    """A pure SSM model (Mamba, Mamba2, FalconMamba) runs in vLLM without the hybrid
    manager: one group of Mamba state, one state per request. kvtier's chunks are tokens;
    it would load a "prefix" into state blocks. Refused as vLLM builds the connector."""
    vc = engine_config(model_dir)
    kcc = vllm_groups(vc, {"model.layers.0.mixer": MAMBA, "model.layers.1.mixer": MAMBA})
    assert [type(g.kv_cache_spec) for g in kcc.kv_cache_groups] == [MambaSpec]
    with pytest.raises(ConfigError) as err:
        if role is KVConnectorRole.SCHEDULER:
            scheduler(vc, kcc)
        else:
            KVTierConnector(vc, role, kcc)
    msg = str(err.value)
    assert model_dir in msg and "MambaSpec x 2 layers" in msg and "Mamba/SSM" in msg, msg
    assert "without kvtier" in msg


def test_groups_kvtier_cannot_store_are_refused_not_half_loaded(model_dir: str) -> None:
    """A group that is neither full nor sliding-window attention (chunked-local here) is
    refused at startup, naming it; as are sliding-window groups of another block size."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    vc = engine_config(model_dir)
    local = ChunkedLocalAttentionSpec(
        block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16, attention_chunk_size=64
    )
    kcc = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([attn(0), attn(2)], FULL),
            KVCacheGroupSpec([attn(1), attn(3)], local),
        ],
    )
    with pytest.raises(ConfigError) as err:
        scheduler(vc, kcc)
    msg = str(err.value)
    assert "group 1 (ChunkedLocalAttentionSpec x 2 layers)" in msg, msg
    assert model_dir in msg and "neither full nor sliding-window" in msg
    wide = SlidingWindowSpec(
        block_size=2 * BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16, sliding_window=32
    )
    kcc = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([attn(0)], FULL), KVCacheGroupSpec([attn(1)], wide)],
    )
    with pytest.raises(ConfigError, match="one block size across groups"):
        KVTierConnector(vc, KVConnectorRole.WORKER, kcc)


def test_a_model_without_kv_cache_is_refused(model_dir: str) -> None:
    vc = engine_config(model_dir)
    kcc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[])
    with pytest.raises(ConfigError, match="attention-free"):
        KVTierConnector(vc, KVConnectorRole.WORKER, kcc)


@pytest.mark.parametrize("wide_first", [False, True])
def test_layers_of_different_sizes_in_one_group_size_the_slot_layer_by_layer(
    model_dir: str,
    wide_first: bool,
) -> None:
    """Attention layers of different KV sizes (2 and 4 KV heads: Nemotron-NAS style) are
    one group, ``UniformTypeKVCacheSpecs`` on the workers, of which vLLM hands the
    scheduler only the first layer's spec. The scheduler sizes a chunk's slot from where
    vLLM placed each layer, as the workers lay it out over the real tensors: counting the
    first layer's page once per layer made it smaller than the workers' when that layer was
    the small one, so the scheduler planned slots past the end of the workers' slabs."""
    vc = engine_config(model_dir)
    vc.cache_config.kv_cache_layout = "LBNHC"  # what the engine core resolves first
    wide = FullAttentionSpec(block_size=BS, num_kv_heads=4, head_size=8, dtype=torch.bfloat16)
    specs = {attn(0): wide, attn(1): FULL} if wide_first else {attn(0): FULL, attn(1): wide}
    worker_cfg = get_kv_cache_config_from_groups(vc, get_kv_cache_groups(vc, dict(specs)), 1 << 20)
    sched = scheduler(vc, generate_scheduler_kv_cache_config([worker_cfg]))
    side = sched.connector._scheduler
    kv = {
        name: torch.zeros(2, worker_cfg.num_blocks, BS, spec.num_kv_heads, 8, dtype=torch.bfloat16)
        for name, spec in specs.items()
    }
    layout = SlotLayout.from_kv_caches(kv, worker_cfg.num_blocks, CHUNK // BS)
    assert side.slot_bytes == layout.slot_bytes
    assert side.index.num_slots == side.host_bytes // layout.slot_bytes
    sched.shutdown()


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_layers_of_one_size_keep_the_slot_they_had(model_dir: str, layout: str) -> None:
    """Layer-outermost (blocks step by the page) and block-outermost (layers step by it)
    placements of same-size layers give the slot the group spec gives."""
    from kvtier.connectors.engine_shape import KVCacheShape
    from kvtier.connectors.slots import layer_page_bytes

    vc = engine_config(model_dir)
    vc.cache_config.kv_cache_layout = layout
    specs = {attn(i): FULL for i in range(3)}
    worker_cfg = get_kv_cache_config_from_groups(vc, get_kv_cache_groups(vc, dict(specs)), 1 << 20)
    sched_cfg = generate_scheduler_kv_cache_config([worker_cfg])
    page = FULL.page_size_bytes
    strides = {(t.layer_stride > page, t.block_stride > page) for t in sched_cfg.kv_cache_tensors}
    assert strides == ({(True, False)} if layout == "LBNHC" else {(False, True)})
    assert layer_page_bytes(KVCacheShape.from_vllm(sched_cfg)) == [page] * 3


def test_a_sliding_window_only_model_loads_only_its_window(model_dir: str) -> None:
    """Every layer sliding-window (one group of ``SlidingWindowSpec``, which vLLM keeps with
    the hybrid manager off): vLLM backs a hit's blocks outside the window of its next token
    with its null block. The scheduler plans the whole hit as vLLM's block table says; the
    worker copies only the blocks vLLM backs, the window, bit for bit from their own
    chunk's slot blocks, over real tensors, and nothing lands in the null block."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from kvtier.config import load_config
    from kvtier.connectors.worker.side import WorkerSide
    from kvtier.host.index import State
    from kvtier.keys import Namespace

    vc = engine_config(model_dir)
    kcc = vllm_groups(vc, {attn(0): SWA, attn(1): SWA})
    assert [type(g.kv_cache_spec) for g in kcc.kv_cache_groups] == [SlidingWindowSpec]
    sched = scheduler(vc, kcc)
    side = sched.connector._scheduler
    init_none_hash(sha256)
    req = Request(
        "r",
        list(range(5, 5 + 4 * CHUNK + 10)),
        SamplingParams(max_tokens=2),
        None,
        block_hasher=get_request_block_hasher(BS, sha256),
    )
    bpc = CHUNK // BS
    keys = req.block_hashes[bpc - 1 :: bpc]
    for key in keys:  # the host tier holds all 4 chunks of the prompt
        side.index.begin(key, State.STORING)
        side.index.commit(key, True)
    sched.add_request(req)
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4 * CHUNK
    table = out.scheduled_new_reqs[0].block_ids[0]
    null = sched.kv_cache_manager.block_pool.null_block.block_id
    window = range(4 * bpc - SWA.sliding_window // BS, 4 * bpc)  # the hit's blocks it needs
    assert [b for b in range(4 * bpc) if table[b] != null] == list(window)
    meta = out.kv_connector_metadata
    assert meta.null_block == null
    assert sum(len(op.gpu_blocks) for op in meta.loads) == 4 * bpc  # the plan: the whole hit

    cfg = load_config(
        {"cpu_bytes": 1 << 22, "cpu_headroom_bytes": 0, "chunk_size": CHUNK}, environ={}
    )
    worker = WorkerSide(cfg, Namespace("m", None, "bfloat16", "auto", BS, CHUNK, 1), NUM_BLOCKS)
    g = torch.Generator().manual_seed(1)
    kv = {
        attn(i): torch.randn(2, NUM_BLOCKS, BS, 2, 8, generator=g).to(torch.bfloat16)
        for i in range(2)
    }
    before = {name: t.clone() for name, t in kv.items()}
    worker.register_kv_caches(kv, rank=0)
    worker.begin_step(meta)
    assert worker.slab is not None and worker.copier is not None
    worker.slab.buffer.copy_(
        torch.randint(0, 256, worker.slab.buffer.shape, generator=g, dtype=torch.uint8)
    )
    asked: list[Any] = []
    begin_loads = worker.copier.begin_loads
    worker.copier.begin_loads = lambda ops: asked.extend(ops) or begin_loads(ops)  # type: ignore[method-assign]
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    assert sorted(b for op in asked for b in op.gpu_blocks) == sorted(table[b] for b in window)
    slot_of = {side.index.get(k).slot: c for c, k in enumerate(keys)}
    for li, name in enumerate(kv):
        for b in range(4 * bpc):
            c, j = divmod(b, bpc)
            slot = next(s for s, cc in slot_of.items() if cc == c)
            if b in window:
                want = worker.slab.layer_view(slot, li)[:, j]
                bits = kv[name][:, table[b]].view(torch.int16)  # bit for bit (NaNs too)
                assert torch.equal(bits, want.view(torch.int16)), (name, b)
        untouched = [i for i in range(NUM_BLOCKS) if i not in {table[b] for b in window}]
        assert torch.equal(
            kv[name][:, untouched].view(torch.int16), before[name][:, untouched].view(torch.int16)
        ), name
    reported = worker.build_worker_meta().results
    assert sorted(reported) == sorted(op.op_id for op in meta.loads)
    assert all(oks == [True] for oks in reported.values())
    sched.shutdown()


def test_a_sliding_group_stores_the_tokens_vllm_retains_before_its_window(
    model_dir: str,
) -> None:
    """vLLM keeps ``extra_retained_tokens`` behind a sliding window (multi-module MTP) and
    backs their blocks in a hit: kvtier's slot holds them too (window 32 + 16 retained =
    48 tokens: the chunk's last 3 blocks of 16), and a window longer than a chunk keeps
    whole chunks."""
    from kvtier.connectors.engine_shape import KVCacheShape
    from kvtier.connectors.groups import kv_groups

    retained = SlidingWindowSpec(
        block_size=BS,
        num_kv_heads=2,
        head_size=8,
        dtype=torch.bfloat16,
        sliding_window=32,
        extra_retained_tokens=16,
    )
    long = SlidingWindowSpec(
        block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16, sliding_window=4 * CHUNK
    )
    for spec, blocks, window in ((retained, 3, 48), (long, CHUNK // BS, 4 * CHUNK)):
        kcc = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([attn(0)], FULL), KVCacheGroupSpec([attn(1)], spec)],
        )
        full, sliding = kv_groups(KVCacheShape.from_vllm(kcc), BS, CHUNK)
        assert (full.kind, full.blocks) == ("full", CHUNK // BS)
        assert (sliding.kind, sliding.blocks, sliding.window) == ("sliding", blocks, window)
