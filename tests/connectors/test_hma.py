"""Hybrid models with vLLM's hybrid KV cache manager (``SupportsHMA``), driven for real.

vLLM's CPU build cannot run a hybrid model through the engine here, so this drives the
parts vLLM drives, for real: vLLM's ``Scheduler`` (its ``HybridKVCacheCoordinator``,
block pool, null block and prefix cache) over a ``KVCacheConfig`` of a full-attention
and a sliding-window group (as ``get_kv_cache_groups`` makes it with the hybrid manager
on), the KV tensors as vLLM's ``allocate_kv_cache`` lays them out (the groups overlay one
allocation: a tensor serves one layer of each group), kvtier's scheduler side built by
vLLM's scheduler, and a real worker side whose copies move those tensors. The "forward"
writes each computed token's KV, a pattern unique to its layer, position and token, into
the block vLLM's table gives for that layer's group.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvtier.config import load_config
from kvtier.connectors.engine_shape import KVCacheShape
from kvtier.connectors.groups import kv_groups
from kvtier.connectors.vllm import KVTierConnector
from kvtier.connectors.worker.side import WorkerSide
from kvtier.errors import ConfigError
from kvtier.host.layout import FULL, SLIDING, KVGroup, SlotLayout
from kvtier.keys import Namespace
from kvtier.objects.remote import RemoteIO
from tests.connectors.hybrid_engine import BS, CHUNK, engine_config, kvtier_extra

BPC = CHUNK // BS
WINDOW = 32
HEADS, HEAD = 2, 8
FULL_SPEC = FullAttentionSpec(
    block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16
)
SWA_SPEC = SlidingWindowSpec(
    block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16, sliding_window=WINDOW
)
PAGE = FULL_SPEC.page_size_bytes
init_none_hash(sha256)
_ids = itertools.count()


def attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


#: Gemma 2/3 style: full and sliding-window layers alternate
SPECS: dict[str, KVCacheSpec] = {
    attn(0): FULL_SPEC,
    attn(1): SWA_SPEC,
    attn(2): FULL_SPEC,
    attn(3): SWA_SPEC,
}


def truth(layer: int, pos: int, token: int, like: torch.Tensor) -> torch.Tensor:
    """The KV the "forward" writes for one token of one layer: int16 bit patterns unique
    to (layer, position, token), so a byte from anywhere else shows."""
    n = like.numel()
    base = (layer * 7919 + pos * 131 + token * 17) % 20000
    return (
        (torch.arange(n, dtype=torch.int32) + base)
        .remainder(30000)
        .to(torch.int16)
        .view(like.shape)
    )


class HybridEngine:
    """vLLM's scheduler and one worker side over real tensors, stepped as vLLM steps them."""

    def __init__(
        self,
        model_dir: str,
        specs: dict[str, KVCacheSpec] = SPECS,
        num_blocks: int = 80,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.vc = engine_config(model_dir, extra)
        groups = get_kv_cache_groups(self.vc, dict(specs))
        # the worker's KV cache config, with room for num_blocks blocks
        per_block = sum(s.page_size_bytes for s in specs.values()) // len(groups)
        self.wc = get_kv_cache_config_from_groups(self.vc, groups, num_blocks * per_block)
        self.vc.cache_config.num_gpu_blocks = self.wc.num_blocks
        self.sched = Scheduler(
            vllm_config=self.vc,
            kv_cache_config=generate_scheduler_kv_cache_config([self.wc]),
            structured_output_manager=StructuredOutputManager(self.vc),
            block_size=BS,
            log_stats=True,
        )
        self.side = self.sched.connector._scheduler
        self.null = self.sched.kv_cache_manager.block_pool.null_block.block_id
        self.kv = allocate_kv_cache(
            self.wc, torch.device("cpu"), self.vc.cache_config.get_resolved_kv_cache_layout()
        )
        cfg = load_config(kvtier_extra(extra), environ={})
        self.worker = WorkerSide(
            cfg,
            Namespace("m", None, "bfloat16", "auto", BS, CHUNK, 1),
            self.wc.num_blocks,
            RemoteIO.from_config,
            groups=kv_groups(KVCacheShape.from_vllm(self.wc), BS, CHUNK),
        )
        self.worker.register_kv_caches(self.kv, rank=0)
        self.group_of = {
            name: g for g, grp in enumerate(self.wc.kv_cache_groups) for name in grp.layer_names
        }
        self.layer_no = {name: i for i, name in enumerate(specs)}
        self.loads: list[Any] = []

    def request(self, tokens: list[int], max_tokens: int = 1) -> Request:
        req = Request(
            f"r{next(_ids)}",
            tokens,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            None,
            block_hasher=get_request_block_hasher(BS, sha256),
        )
        self.sched.add_request(req)
        return req

    def block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return tuple(self.sched.kv_cache_manager.get_block_ids(req_id))

    def write(self, req: Request, start: int, end: int) -> None:
        """The forward of tokens ``start..end`` of ``req``: each layer's KV into its group's
        block for the token."""
        ids = self.block_ids(req.request_id)
        tokens = req.all_token_ids
        for name, kv in self.kv.items():
            table = ids[self.group_of[name]]
            bits = kv.view(torch.int16)
            for pos in range(start, end):
                block = table[pos // BS]
                assert block != self.null, (name, pos)
                bits[block, :, pos % BS] = truth(
                    self.layer_no[name], pos, tokens[pos], bits[block, :, pos % BS]
                )

    def step(self, after_loads: Callable[[SchedulerOutput], None] | None = None) -> SchedulerOutput:
        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        w = self.worker
        w.begin_step(meta)
        w.start_load_kv(meta)
        self.loads.extend(meta.loads)
        if after_loads is not None:
            after_loads(so)
        reqs = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        reqs.update(
            zip(
                so.scheduled_cached_reqs.req_ids,
                so.scheduled_cached_reqs.num_computed_tokens,
                strict=True,
            )
        )
        sampled: list[list[int]] = []
        for rid, computed in reqs.items():
            req = self.sched.requests[rid]
            n = so.num_scheduled_tokens[rid]
            self.write(req, computed, computed + n)
            w.wait_for_layer_load(attn(0))
            done = computed + n >= req.num_tokens
            sampled.append([7 + (computed + n) % 50] if done else [])
        w.wait_for_save(meta)
        out = KVConnectorOutput(
            kv_connector_worker_meta=w.build_worker_meta(), invalid_block_ids=w.take_failed_blocks()
        )
        mro = ModelRunnerOutput(
            req_ids=list(reqs),
            req_id_to_index={r: i for i, r in enumerate(reqs)},
            sampled_token_ids=sampled,
            kv_connector_output=out,
        )
        self.sched.update_from_output(so, mro)
        return so

    def run(self, req: Request, **kw: Any) -> None:
        for _ in range(200):
            if req.is_finished():
                return
            self.step(**kw)
        raise AssertionError("request did not finish")

    def group_bits(self, group: int, blocks: list[int]) -> dict[str, torch.Tensor]:
        return {
            name: kv.view(torch.int16)[blocks].clone()
            for name, kv in self.kv.items()
            if self.group_of[name] == group
        }

    def expect(self, req: Request, group: int, positions: range) -> None:
        """Every layer of ``group`` holds the truth for ``positions`` of ``req``."""
        ids = self.block_ids(req.request_id)[group]
        tokens = req.all_token_ids
        for name, kv in self.kv.items():
            if self.group_of[name] != group:
                continue
            bits = kv.view(torch.int16)
            for pos in positions:
                got = bits[ids[pos // BS], :, pos % BS]
                assert torch.equal(got, truth(self.layer_no[name], pos, tokens[pos], got)), (
                    name,
                    pos,
                )


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(i * 7919 + seed * 104729) % 480 + 5 for i in range(n)]


def test_kvtier_keeps_vllms_hybrid_manager(model_dir: str) -> None:
    assert issubclass(KVTierConnector, SupportsHMA)
    vc = engine_config(model_dir)
    assert vc.scheduler_config.disable_hybrid_kv_cache_manager is False
    eng = HybridEngine(model_dir)
    assert type(eng.sched.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    assert [type(g.kv_cache_spec) for g in eng.wc.kv_cache_groups] == [
        FullAttentionSpec,
        SlidingWindowSpec,
    ]
    # full group: every block of a chunk; sliding group: the last ceil(32 / 16) = 2
    assert eng.side.groups == (
        KVGroup(FULL, (attn(0), attn(2)), BPC),
        KVGroup(SLIDING, (attn(1), attn(3)), 2, WINDOW),
    )
    assert eng.side.slot_bytes == 2 * PAGE * BPC + 2 * PAGE * 2
    assert eng.worker.layout is not None and eng.worker.layout.slot_bytes == eng.side.slot_bytes
    # vLLM overlays the groups: layer 0 (full) and layer 1 (sliding) are one tensor
    assert eng.kv[attn(0)].data_ptr() == eng.kv[attn(1)].data_ptr()


def test_a_stored_prompt_loads_back_bit_for_bit_into_every_group_and_nowhere_else(
    model_dir: str,
) -> None:
    eng = HybridEngine(model_dir)
    tokens = prompt(4 * CHUNK + 10)
    a = eng.request(tokens)
    eng.run(a)
    assert eng.side.totals["store_ok"] == 4 and eng.side.totals["stores_window_gone"] == 0
    assert eng.sched.reset_prefix_cache()  # vLLM's own cache forgets it; kvtier's does not

    # every block poisoned: a load may change only the blocks its request's table backs
    g = torch.Generator().manual_seed(3)
    for kv in eng.kv.values():
        kv.view(torch.int16).copy_(
            torch.randint(-30000, 30000, kv.shape, generator=g, dtype=torch.int16)
        )
    before = {name: kv.view(torch.int16).clone() for name, kv in eng.kv.items()}
    b = eng.request(tokens)
    seen: dict[str, Any] = {}

    def check(so: SchedulerOutput) -> None:
        (new,) = so.scheduled_new_reqs
        assert new.num_computed_tokens == 4 * CHUNK  # every chunk from kvtier
        ids = eng.block_ids(b.request_id)
        full, sliding = ids[0][: 4 * BPC], ids[1][: 4 * BPC]
        # vLLM backs only the window before token 256 in the sliding group: 2 blocks
        live = [i for i, blk in enumerate(sliding) if blk != eng.null]
        assert live == [14, 15]
        eng.expect(b, 0, range(4 * CHUNK))
        eng.expect(b, 1, range(14 * BS, 4 * CHUNK))
        # nothing else changed. Each tensor serves a layer of each group (layers 0 and 1
        # are one tensor): its full-group blocks hold the full layer's KV, its sliding
        # blocks the sliding layer's (checked above), every other block is untouched
        window = {sliding[i] for i in live}
        assert not window & set(full)
        for name, kv in eng.kv.items():
            others = [i for i in range(eng.wc.num_blocks) if i not in window | set(full)]
            assert torch.equal(kv.view(torch.int16)[others], before[name][others]), name
        seen["loads"] = list(so.kv_connector_metadata.loads)

    eng.step(after_loads=check)
    loads = seen["loads"]
    assert len(loads) == 4
    # the sliding-window group's part: 2 blocks of the last chunk, none of the others
    assert [len(op.more[0][1]) for op in loads] == [0, 0, 0, 2]
    assert [len(op.gpu_blocks) for op in loads] == [BPC] * 4
    assert eng.side.totals["load_ok"] == 4
    eng.run(b)
    eng.sched.shutdown()


def test_a_chunk_completed_while_decoding_stores_its_window(model_dir: str) -> None:
    """A chunk completed by decode steps: vLLM has freed its sliding-window blocks behind
    the window step after step; the last two it still holds are what the slot needs."""
    eng = HybridEngine(model_dir)
    a = eng.request(prompt(3 * CHUNK + 40, seed=1), max_tokens=30)
    eng.run(a)
    assert eng.side.totals["store_ok"] == 4 and eng.side.totals["stores_window_gone"] == 0
    full_text = list(a.all_token_ids)
    assert eng.sched.reset_prefix_cache()
    b = eng.request(full_text[: 4 * CHUNK + 3])

    def check(so: SchedulerOutput) -> None:
        assert so.scheduled_new_reqs[0].num_computed_tokens == 4 * CHUNK
        eng.expect(b, 0, range(4 * CHUNK))
        eng.expect(b, 1, range(4 * CHUNK - WINDOW, 4 * CHUNK))

    eng.step(after_loads=check)
    eng.run(b)


def test_a_chunk_whose_window_vllm_already_dropped_is_not_stored(model_dir: str) -> None:
    """vLLM's own prefix cache serves a prompt kvtier lost: vLLM hands the request null
    blocks for the sliding-window blocks before the hit's window, so those chunks cannot
    be stored whole; they are skipped (counted), never stored with a hole."""
    eng = HybridEngine(model_dir)
    tokens = prompt(4 * CHUNK + 10, seed=2)
    eng.run(eng.request(tokens))
    assert eng.side.totals["store_ok"] == 4
    eng.side.reset_cache()  # kvtier forgets; vLLM's own prefix cache still holds it
    b = eng.request(tokens)
    so = eng.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4 * CHUNK  # vLLM's own hit
    assert eng.side.totals["stores_window_gone"] == 3  # chunks 0-2: window blocks gone
    assert eng.side.totals["store_ok"] == 5  # chunk 3: its window is the hit's
    eng.run(b)


def test_a_hit_ending_inside_a_chunk_is_not_offered(model_dir: str) -> None:
    """The slot holds a sliding-window group's last blocks of a chunk only, so a hit ends
    on a chunk boundary: a prompt of exactly 4 chunks is served 3 chunks, not the first
    48 tokens of the 4th that a one-group model loads (vLLM computes the last token)."""
    eng = HybridEngine(model_dir)
    tokens = prompt(5 * CHUNK, seed=4)
    eng.run(eng.request(tokens))
    assert eng.sched.reset_prefix_cache()
    b = eng.request(tokens[: 4 * CHUNK])
    so = eng.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 3 * CHUNK
    eng.run(b)


def test_a_hybrid_mamba_model_is_refused_at_startup(model_dir: str) -> None:
    """Jamba/Bamba style: attention and Mamba layers, a Mamba group with the hybrid
    manager on. kvtier cannot store per-request state by chunks of tokens."""
    mamba = MambaSpec(
        block_size=BS,
        shapes=((4, 8), (2, 8)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        page_size_padded=PAGE,
    )
    with pytest.raises(ConfigError) as err:
        HybridEngine(model_dir, {attn(0): FULL_SPEC, "model.layers.1.mixer": mamba})
    msg = str(err.value)
    assert model_dir in msg and "Mamba/SSM" in msg and "MambaSpec" in msg, msg
    assert "without kvtier" in msg


def test_slot_layout_keeps_each_groups_regions_apart_and_names_them(model_dir: str) -> None:
    eng = HybridEngine(model_dir)
    layout = eng.worker.layout
    assert layout is not None
    assert [(ll.name, ll.group, ll.slot_shape[0]) for ll in layout.layers] == [
        (attn(0), 0, BPC),
        (attn(2), 0, BPC),
        (attn(1), 1, 2),
        (attn(3), 1, 2),
    ]
    ends = [(ll.offset, ll.offset + ll.nbytes) for ll in layout.layers]
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ends))
    sub = layout.group_layout(1)
    assert sub.blocks_per_chunk == 2 and sub.slot_bytes == layout.slot_bytes
    # another grouping (or none) is another namespace: never each other's chunks
    one = SlotLayout.from_kv_caches(eng.kv, eng.wc.num_blocks, BPC)
    other = SlotLayout.from_kv_caches(
        eng.kv,
        eng.wc.num_blocks,
        BPC,
        (KVGroup(FULL, (attn(0), attn(2)), BPC), KVGroup(SLIDING, (attn(1), attn(3)), 3, 48)),
    )
    assert len({layout.identity(), one.identity(), other.identity()}) == 3


def test_a_restarted_engine_fetches_every_group_from_the_object_tier(
    model_dir: str,
    tmp_path: Path,
) -> None:
    """The object tier holds a chunk as its slot: every group's regions, under keys whose
    layout digest names the groups. A fresh engine (empty host tier, other KV in its
    blocks) fetches the prompt's chunks and loads each group's part bit for bit."""
    extra = {"remote_url": f"file://{tmp_path / 'kv'}", "model_fingerprint": "hybrid-test"}
    eng = HybridEngine(model_dir, extra=extra)
    tokens = prompt(4 * CHUNK + 10, seed=6)
    eng.run(eng.request(tokens))
    for _ in range(300):  # idle steps until the uploads are reported
        if not eng.side.pending_ops():
            break
        eng.step()
        time.sleep(0.01)
    assert eng.side.totals["upload_ok"] == 4
    eng.worker.shutdown()

    eng2 = HybridEngine(model_dir, extra=extra)
    g = torch.Generator().manual_seed(8)
    for kv in eng2.kv.values():
        kv.view(torch.int16).copy_(
            torch.randint(-30000, 30000, kv.shape, generator=g, dtype=torch.int16)
        )
    b = eng2.request(tokens)
    seen: list[int] = []

    def check(so: SchedulerOutput) -> None:
        if so.scheduled_new_reqs:  # the step vLLM admits it: the fetched chunks load
            seen.append(so.scheduled_new_reqs[0].num_computed_tokens)
            eng2.expect(b, 0, range(4 * CHUNK))
            eng2.expect(b, 1, range(4 * CHUNK - WINDOW, 4 * CHUNK))

    for _ in range(300):  # vLLM asks again while the lookup's fetches run
        if b.is_finished():
            break
        eng2.step(after_loads=check)
        time.sleep(0.01)
    assert seen == [4 * CHUNK]
    assert eng2.side.totals["fetch_ok"] == 4 and eng2.side.totals["hit_tokens_remote"] == 4 * CHUNK
    eng2.worker.shutdown()
