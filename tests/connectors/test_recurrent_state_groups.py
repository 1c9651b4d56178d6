"""Hybrid models with recurrent state (Mamba2, gated delta-net, short conv) as kvtier
stores them: the state group beside the attention groups, from vLLM's own spec classes
and grouping; what is refused and why; the layout digest naming the state's layout; the
slot's size; the worker's view of a state layer handed as a list of tensors.

The real engine runs in tests/e2e/test_recurrent_state.py."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
)

import kvtier.connectors.vllm  # noqa: F401  (as the other tests of real configs)
from kvtier.connectors.engine_shape import EngineShape, KVCacheShape
from kvtier.connectors.groups import Refused, flatten_states, kv_groups
from kvtier.connectors.slots import slot_size
from kvtier.host.layout import FULL, STATE, KVGroup, SlotLayout
from tests.connectors.hybrid_engine import BS, CHUNK, engine_config

NUM_BLOCKS = 16
ATTN = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)


def mamba(mode: str = "align", ssm: tuple[int, ...] = (2, 4, 8)) -> MambaSpec:
    """A Mamba2 layer's spec: conv state (3, 16) bf16 and SSM state float32."""
    return MambaSpec(
        block_size=BS,
        shapes=((3, 16), ssm),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=ATTN.page_size_bytes,
        mamba_cache_mode=mode,
    )


def shape_of(model_dir: str, specs: dict[str, KVCacheSpec]) -> KVCacheShape:
    """The KV cache vLLM's engine core groups from these layers' specs, as kvtier reads it."""
    vc = engine_config(model_dir)
    groups = get_kv_cache_groups(vc, dict(specs))
    kcc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
    return EngineShape.from_vllm(vc, kcc).allocated_kv_cache()


def hybrid(model_dir: str, **kw: object) -> KVCacheShape:
    m = mamba(**kw)  # type: ignore[arg-type]
    return shape_of(model_dir, {"l0.mixer": m, "l1.attn": ATTN, "l2.mixer": m, "l3.attn": ATTN})


def test_a_state_group_stores_one_block_per_chunk_beside_the_attention(model_dir: str) -> None:
    kv = hybrid(model_dir)
    groups = kv_groups(kv, BS, CHUNK)
    by_kind = {g.kind: g for g in groups}
    assert set(by_kind) == {STATE, FULL}
    state = by_kind[STATE]
    assert state.layers == ("l0.mixer", "l2.mixer") and state.blocks == 1
    assert state.states == (((3, 16), "bfloat16"), ((2, 4, 8), "float32"))
    # the slot: the attention group's chunk of KV and one state per state layer, without
    # vLLM's padding of the state page to the attention page
    state_bytes = 3 * 16 * 2 + 2 * 4 * 8 * 4
    assert mamba().page_size_bytes > state_bytes
    attn = 2 * ATTN.page_size_bytes * (CHUNK // BS)
    assert slot_size(kv, groups, CHUNK // BS) == -(-(attn + 2 * state_bytes) // 4096) * 4096


@pytest.mark.parametrize("mode", ["none", "all"])
def test_state_held_in_another_mode_is_refused_naming_the_setting(
    model_dir: str, mode: str
) -> None:
    """Only ``align`` keeps a state at every block boundary; the error says what to run."""
    with pytest.raises(Refused, match="--mamba-cache-mode align") as err:
        kv_groups(hybrid(model_dir, mode=mode), BS, CHUNK)
    assert mode in str(err.value)


def test_a_model_of_state_only_is_refused(model_dir: str) -> None:
    kv = shape_of(model_dir, {"l0.mixer": mamba(), "l1.mixer": mamba()})
    with pytest.raises(Refused, match="Mamba/SSM") as err:
        kv_groups(kv, BS, CHUNK)
    assert "without attention layers" in str(err.value)


def test_the_layout_digest_names_the_state_layout(model_dir: str) -> None:
    """Two state layouts of the same bytes (vLLM's CPU runner hands a state layer as raw
    bytes per block, whose shape says nothing of conv or SSM) never share a chunk: their
    layouts' digests, part of every object key, differ."""
    a = kv_groups(hybrid(model_dir, ssm=(2, 4, 8)), BS, CHUNK)
    b = kv_groups(hybrid(model_dir, ssm=(4, 2, 8)), BS, CHUNK)  # same bytes, other heads
    nbytes = 3 * 16 * 2 + 2 * 4 * 8 * 4
    kv = {
        "l0.mixer": torch.zeros(NUM_BLOCKS, 1, 1, nbytes, dtype=torch.uint8),
        "l2.mixer": torch.zeros(NUM_BLOCKS, 1, 1, nbytes, dtype=torch.uint8),
        "l1.attn": torch.zeros(NUM_BLOCKS, 2, BS, 2, 8, dtype=torch.bfloat16),
        "l3.attn": torch.zeros(NUM_BLOCKS, 2, BS, 2, 8, dtype=torch.bfloat16),
    }
    la = SlotLayout.from_kv_caches(kv, NUM_BLOCKS, CHUNK // BS, a)
    lb = SlotLayout.from_kv_caches(kv, NUM_BLOCKS, CHUNK // BS, b)
    assert la.slot_bytes == lb.slot_bytes
    assert la.identity() != lb.identity()


def test_a_state_layer_handed_as_a_list_is_one_region_per_tensor() -> None:
    """vLLM's GPU runner hands a Mamba layer as [conv, ssm]: each is a region of its own,
    ``name#i``, and the groups name those regions; a layer handed as one tensor stays."""
    conv, ssm = torch.zeros(NUM_BLOCKS, 3, 16), torch.zeros(NUM_BLOCKS, 2, 4, 8)
    attn = torch.zeros(NUM_BLOCKS, 2, BS, 2, 8)
    groups = (KVGroup(STATE, ("m",), 1), KVGroup(FULL, ("a",), CHUNK // BS))
    flat, named = flatten_states({"m": [conv, ssm], "a": attn}, groups)
    assert list(flat) == ["m#0", "m#1", "a"] and flat["m#1"] is ssm
    assert named[0].layers == ("m#0", "m#1") and named[1] == groups[1]
    layout = SlotLayout.from_kv_caches(flat, NUM_BLOCKS, CHUNK // BS, named)
    assert [ll.name for ll in layout.layers] == ["m#0", "m#1", "a"]
    assert flatten_states({"a": attn}, groups) == ({"a": attn}, groups)


def test_on_cuda_the_forward_waits_for_the_state_layers_loads(monkeypatch) -> None:
    """vLLM waits for a layer's load (``wait_for_layer_load``) in its attention layers
    only: a state layer's load is waited for by the compute stream as the step's loads
    start, before any layer runs (the CUDA copier on fake streams)."""
    from copyfakes import FakeOps

    from kvtier.config import load_config
    from kvtier.connectors.metadata import KVTierMetadata
    from kvtier.connectors.worker import side as worker_mod
    from kvtier.host.copiers import GroupsCopier
    from kvtier.host.cuda_copier import CudaCopier
    from kvtier.keys import Namespace
    from kvtier.ops import LoadOp

    ops = FakeOps()
    monkeypatch.setattr(
        worker_mod,
        "make_copier",
        lambda kv, layout, slab: GroupsCopier(
            kv, layout, slab, lambda k, lay, s: CudaCopier(k, lay, s, ops=ops)
        ),
    )
    cfg = load_config({"cpu_bytes": "16MiB", "chunk_size": CHUNK}, environ={})
    groups = (
        KVGroup(STATE, ("m0",), 1, states=(((4, 8), "float32"),)),
        KVGroup(FULL, ("a0",), CHUNK // BS),
    )
    w = worker_mod.WorkerSide(
        cfg, Namespace("m", None, "bfloat16", "auto", BS, CHUNK, 1), NUM_BLOCKS, None, groups=groups
    )
    w.register_kv_caches(
        {
            "m0": torch.zeros(NUM_BLOCKS, 1, 1, 128, dtype=torch.uint8),
            "a0": torch.zeros(NUM_BLOCKS, 2, BS, 2, 8, dtype=torch.bfloat16),
        },
        rank=0,
    )
    meta = KVTierMetadata(
        step=1,
        host_bytes=w.layout.slot_bytes * 4,
        loads=[LoadOp(1, 0, 0, [5], more=((0, [7, 8]),))],
    )
    w.begin_step(meta)
    w.start_load_kv(meta)
    waited = [e for e in ops.log if e[0] == "wait" and e[1] == "compute"]
    assert len(waited) == 1, ops.log  # the state layer's, not yet the attention layer's
    w.wait_for_layer_load("a0")
    assert len([e for e in ops.log if e[0] == "wait" and e[1] == "compute"]) == 2
    w.shutdown()


# ---- the planner: the state's two rules ---------------------------------------------------
def _planner(groups: tuple[KVGroup, ...]):  # type: ignore[no-untyped-def]
    from kvtier.connectors.metadata import StepPlan
    from kvtier.connectors.scheduler.ledger import OpLedger
    from kvtier.connectors.scheduler.plans import Planner
    from kvtier.connectors.scheduler.requests import ChunkKeys
    from kvtier.connectors.scheduler.side import SCHEDULER_TOTALS
    from kvtier.host.index import ChunkIndex
    from kvtier.stats import StatsRecorder, Totals

    totals = Totals(SCHEDULER_TOTALS)
    stats = StatsRecorder(totals)
    ledger = OpLedger(ChunkIndex(8), 1, stats, totals)
    planner = Planner(
        ledger,
        ChunkKeys(CHUNK // BS),
        stats,
        totals,
        StepPlan(),
        block_size=BS,
        chunk_size=CHUNK,
        slot_bytes=4096,
        write_through=False,
        groups=groups,
    )
    planner.null_block = 0
    return planner


def _request_state(n_chunks: int):  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from kvtier.connectors.scheduler.requests import RequestState

    hashes = [bytes([c + 1]) * 32 for c in range(n_chunks)]
    req = SimpleNamespace(request_id="r", block_hashes=[], num_publishable_block_hashes=None)
    return RequestState(req, chunk_hashes=hashes)  # type: ignore[arg-type]


STATE_FIRST = (
    KVGroup(STATE, ("m0",), 1, states=(((4,), "float32"),)),
    KVGroup(FULL, ("a0",), CHUNK // BS),
)


@pytest.mark.parametrize("lookahead", [0, 2])
def test_a_hits_state_also_goes_to_every_block_the_request_runs_on(lookahead: int) -> None:
    """The hit's last chunk (chunk 1, state block 2*BPC-1) loads its state into the hit's
    block, and once more into each state block past it (the running block, and the
    lookahead blocks of speculative decoding); the earlier chunk's state blocks are vLLM's
    null block (align mode keeps none there): nothing of them is loaded."""
    bpc = CHUNK // BS
    from kvtier.host.index import State

    p = _planner(STATE_FIRST)
    st = _request_state(2)
    for key in st.chunk_hashes:  # both chunks ready in the host tier
        p.index.begin(key, State.STORING)
        p.index.commit(key, True)
    state = [0] * (2 * bpc - 1) + [77] + [78 + i for i in range(1 + lookahead)]
    attn = list(range(100, 100 + 2 * bpc + 1 + lookahead))
    p.plan_loads(st, (state, attn), 0, 2 * CHUNK)
    loads = p.plan.loads
    state_parts = [ld.gpu_blocks for ld in loads]
    assert state_parts == [[], [77], *[[78 + i] for i in range(1 + lookahead)]], state_parts
    assert all(ld.more[0][1] == [] for ld in loads[2:]), "the extra loads copy only state"
    assert loads[1].more[0][1] == attn[bpc : 2 * bpc]


def test_a_chunk_with_state_is_stored_only_by_the_step_that_ends_on_it(caplog) -> None:
    """A step that ends on chunk 0's end stores it (its state block holds the state there);
    one that completes chunk 1 and runs on does not (the state has moved on): counted,
    and logged once with what to run."""
    import logging

    p = _planner(STATE_FIRST)
    st = _request_state(3)
    bpc = CHUNK // BS
    state = [0] * (bpc - 1) + [77] + [0] * (bpc - 1) + [78] + [79] * (bpc + 1)
    attn = list(range(100, 100 + 3 * bpc + 1))
    stores = p.plan_stores(st, lambda rid: (state, attn), CHUNK)
    assert [op.block_hash for op in stores] == st.chunk_hashes[:1]
    assert stores[0].gpu_blocks == [77] and stores[0].more == (attn[:bpc],)
    with caplog.at_level(logging.WARNING, logger="kvtier.scheduler"):
        assert p.plan_stores(st, lambda rid: (state, attn), 2 * CHUNK + BS) == []
        assert p.plan_stores(st, lambda rid: (state, attn), 3 * CHUNK + BS) == []
    assert p.totals["stores_state_gone"] == 2
    assert len([r for r in caplog.records if "recurrent state" in r.getMessage()]) == 1
