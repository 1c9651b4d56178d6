"""Pipeline-parallel engines, driven the way vLLM drives them (its CPU build cannot run one).

vLLM 0.32's CPU build fails a pipeline-parallel engine's first forward on its own
(tests/e2e/test_parallel.py says where), so this drives kvtier's parts as vLLM's
multiprocess executor does for ``--pipeline-parallel-size 2``: one scheduler side,
built from stage 0's ``KVCacheConfig`` (vLLM's ``generate_scheduler_kv_cache_config``
takes worker 0's), and one real worker side per stage registered with that stage's
layers only; every step's metadata goes to both, their worker metadata is merged
with ``aggregate`` (vLLM's ``KVOutputAggregator``) and settles the scheduler's ops
once both stages reported. The KV is real tensors moved by the real CPU copier.
Tensor parallelism runs for real in tests/e2e/test_parallel.py.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from copyfakes import blocks_of
from kit import chunk_files
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from kvtier.config import load_config
from kvtier.connectors.engine_shape import EngineShape
from kvtier.connectors.metadata import KVTierMetadata, KVTierWorkerMeta
from kvtier.connectors.scheduler.side import SchedulerSide
from kvtier.connectors.worker.side import WorkerSide
from kvtier.keys import KeySpace, Namespace
from kvtier.objects.remote import RemoteIO

NUM_BLOCKS, BS, BPC = 40, 32, 4
CHUNK = BS * BPC
HEADS, HEAD = 2, 16
#: FlashAttention style: [2, num_blocks, block_size, H, D], bf16
SHAPE = (2, NUM_BLOCKS, BS, HEADS, HEAD)
PAGE = 2 * BS * HEADS * HEAD * 2
init_none_hash(sha256)
_ids = itertools.count()


def layer(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def make_request(n_tokens: int, seed: int = 0) -> Request:
    tokens = [(i * 7919 + seed * 104729) % 480 + 5 for i in range(n_tokens)]
    return Request(
        f"r{next(_ids)}",
        tokens,
        SamplingParams(max_tokens=4),
        None,
        block_hasher=get_request_block_hasher(BS, sha256),
    )


class FakeManager:
    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return (self.blocks[req_id],)


class PipelineEngine:
    """One scheduler side and one worker side per (stage, TP rank), wired as vLLM wires
    them. ``replicated_kv``: every rank holds the same KV (MLA), as vLLM computes it."""

    def __init__(
        self,
        stage_layers: list[list[int]],
        cpu_bytes: int,
        *,
        tp: int = 1,
        extra: dict[str, Any] | None = None,
        replicated_kv: bool = False,
        seed: int = 0,
    ) -> None:
        pp = len(stage_layers)
        cfg = load_config(
            {"cpu_bytes": cpu_bytes, "cpu_headroom_bytes": 0, "chunk_size": CHUNK, **(extra or {})},
            environ={},
        )
        self.ns = Namespace(
            "m", None, "bfloat16", "auto", BS, CHUNK, tp, replicated_kv=replicated_kv
        )
        vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=BS, cpu_offload_gb=0),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
            model_config=SimpleNamespace(model="/nonexistent/model"),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=8192),
            offload_config=None,
        )
        # the scheduler's KV cache config is stage 0's (vLLM takes worker 0's)
        kv_cache_config = SimpleNamespace(
            kv_cache_groups=[
                SimpleNamespace(
                    kv_cache_spec=SimpleNamespace(page_size_bytes=PAGE),
                    layer_names=[layer(i) for i in stage_layers[0]],
                )
            ]
        )
        shape = EngineShape.from_vllm(vllm_config, kv_cache_config)  # type: ignore[arg-type]
        self.side = SchedulerSide(cfg, shape, self.ns)
        self.manager = FakeManager()
        self.side.bind_kv_cache_manager(self.manager)  # type: ignore[arg-type]
        g = torch.Generator().manual_seed(seed)
        self.caches: list[dict[str, torch.Tensor]] = []
        self.workers: list[WorkerSide] = []
        factory = RemoteIO.from_config if cfg.remote_url else None
        for stage, layers in enumerate(stage_layers):
            stage_caches = {
                layer(i): torch.randn(SHAPE, generator=g).to(torch.bfloat16) for i in layers
            }
            for rank in range(tp):
                caches = (
                    {n: kv.clone() for n, kv in stage_caches.items()}
                    if replicated_kv
                    else {
                        n: torch.randn(SHAPE, generator=g).to(torch.bfloat16) for n in stage_caches
                    }
                )
                w = WorkerSide(cfg, self.ns, NUM_BLOCKS, factory)
                w.register_kv_caches(caches, rank=rank, stage=stage)
                self.caches.append(caches)
                self.workers.append(w)

    def idle_step(self) -> None:
        """A step that schedules none of kvtier's requests (fetches and uploads go on)."""
        self._run(
            SimpleNamespace(
                scheduled_new_reqs=[],
                scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                num_scheduled_tokens={},
                scheduled_spec_decode_tokens={},
            )
        )

    def settle(self) -> None:
        """Idle steps until every op the scheduler sent has been reported."""
        for _ in range(500):
            if not len(self.side.ledger):
                return
            self.idle_step()
            time.sleep(0.01)
        raise AssertionError("ops still in flight")

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()

    def step(
        self, req: Request, computed: int, n: int, blocks: list[int], fail_stage: int | None = None
    ) -> KVTierMetadata:
        """One engine step scheduling ``n`` tokens of ``req`` after ``computed``."""
        self.manager.blocks[req.request_id] = blocks
        so = SimpleNamespace(
            scheduled_new_reqs=[
                SimpleNamespace(req_id=req.request_id, num_computed_tokens=computed)
            ],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={req.request_id: n},
            scheduled_spec_decode_tokens={},
        )
        return self._run(so, fail_stage)

    def _run(self, so: Any, fail_stage: int | None = None) -> KVTierMetadata:
        meta = self.side.build_connector_meta(so)
        reports: list[KVTierWorkerMeta] = []
        for w, caches in zip(self.workers, self.caches, strict=True):
            w.begin_step(meta)  # bind_connector_metadata
            w.start_load_kv(meta)
            for name in caches:  # the stage's forward: its own layers only
                w.wait_for_layer_load(name)
                w.save_kv_layer(name)
            w.wait_for_save(meta)
            out = w.build_worker_meta()
            if w.stage == fail_stage:
                out.results = {op: [False] * len(oks) for op, oks in out.results.items()}
            reports.append(out)
        merged: Any = reports[0]
        for r in reports[1:]:
            merged = merged.aggregate(r)
        self.side.update_connector_output(  # type: ignore[arg-type]
            SimpleNamespace(kv_connector_worker_meta=merged)
        )
        return meta

    def prefill(self, req: Request, blocks: list[int], fail_stage: int | None = None) -> int:
        """Ask, allocate, run the prompt's prefill; returns the tokens kvtier loaded."""
        for _ in range(500):  # vLLM asks again each step while object-tier fetches run
            n, is_async = self.side.get_num_new_matched_tokens(req, 0)
            if n is not None:
                break
            self.idle_step()
            time.sleep(0.01)
        assert n is not None and not is_async
        self.manager.blocks[req.request_id] = blocks
        self.side.update_state_after_alloc(req, None, n)  # type: ignore[arg-type]
        self.step(req, n, req.num_tokens - n, blocks, fail_stage)
        self.side.request_finished(req, [])
        return n


def test_pipeline_stages_are_driven_as_vllm_drives_them() -> None:
    eng = PipelineEngine([[0, 1], [2, 3]], cpu_bytes=8 * PAGE * 2 * BPC)
    # per stage: its two layers of a chunk; the scheduler plans with stage 0's, the same
    slot = 2 * PAGE * BPC
    assert eng.side.world_size == 2 and eng.side.slot_bytes == slot
    assert eng.side.index.num_slots == 8
    assert [w.layout.slot_bytes for w in eng.workers if w.layout] == [slot, slot]
    assert [w.stage for w in eng.workers] == [0, 1]

    a = make_request(3 * CHUNK + 1)
    assert eng.prefill(a, list(range(13))) == 0
    assert eng.side.totals["store_ok"] == 3 and eng.side.index.used_slots == 3
    # each stage's slab is cpu_bytes (per worker), holding its own layers' share
    assert all(w.slab is not None and w.slab.nbytes == 8 * slot for w in eng.workers)

    # the same prompt after vLLM dropped its blocks: both stages load their own layers
    b = make_request(3 * CHUNK + 1)
    dst = list(range(20, 33))
    assert eng.prefill(b, dst) == 3 * CHUNK
    assert eng.side.totals["load_ok"] == 3 and eng.side.index.total_refs() == 0
    for caches in eng.caches:
        for kv in caches.values():
            assert torch.equal(
                blocks_of(kv, dst[:12], NUM_BLOCKS), blocks_of(kv, list(range(12)), NUM_BLOCKS)
            )
    eng.side.index.check()

    # each stage reads and writes the object tier under its own keys
    h = a.block_hashes[BPC - 1]
    keys = {KeySpace.worker(eng.ns, 0, s).key(h) for s in (0, 1)}
    assert len(keys) == 2


def test_a_stage_that_fails_its_part_fails_the_chunk() -> None:
    eng = PipelineEngine([[0, 1], [2, 3]], cpu_bytes=8 * PAGE * 2 * BPC)
    a = make_request(2 * CHUNK + 1, seed=1)
    eng.prefill(a, list(range(9)), fail_stage=1)
    assert eng.side.totals["store_failed"] == 2 and eng.side.index.used_slots == 0
    assert eng.prefill(make_request(2 * CHUNK + 1, seed=1), list(range(20, 29))) == 0


def test_a_later_stage_with_more_layers_loses_slots_but_never_serves_a_partial_chunk() -> None:
    """vLLM may give a later stage more layers than stage 0 (``get_pp_indices`` for
    7 layers on 3 stages, or ``VLLM_PP_LAYER_PARTITION``). The scheduler sizes its
    slots by stage 0's layers; a bigger stage's slab of the same ``cpu_bytes`` holds
    fewer of them, and its stores to the slots it lacks fail: those chunks roll back
    on every stage (fewer hits, never a chunk with a stage missing)."""
    eng = PipelineEngine([[0], [1, 2, 3]], cpu_bytes=6 * PAGE * BPC)
    assert eng.side.index.num_slots == 6
    assert eng.workers[1].layout is not None and eng.workers[1].layout.slot_bytes == 3 * PAGE * BPC
    a = make_request(6 * CHUNK + 1, seed=2)
    eng.prefill(a, list(range(25)))
    # stage 1's slab has 2 slots: of the 6 chunks only those in slots 0-1 are stored
    assert eng.side.totals["store_ok"] == 2 and eng.side.totals["store_failed"] == 4
    b = make_request(6 * CHUNK + 1, seed=2)
    loaded = eng.prefill(b, list(range(25)))
    assert loaded % CHUNK == 0 and loaded <= 2 * CHUNK
    eng.side.index.check()


def test_mla_kv_is_stored_once_and_loaded_on_every_rank(tmp_path: Path) -> None:
    """MLA: every TP rank holds the same latent KV. Rank 0 alone writes each chunk to
    the object tier; after a restart every rank fetches that one copy and loads it.
    Without replication each rank writes and reads its own (the test's control)."""
    extra = {"remote_url": f"file://{tmp_path / 'kv'}"}
    cpu = 8 * PAGE * 2 * BPC
    eng = PipelineEngine([[0, 1]], cpu, tp=2, extra=extra, replicated_kv=True)
    assert [(w.rank, w.uploads) for w in eng.workers] == [(0, True), (1, False)]
    a = make_request(3 * CHUNK + 1, seed=5)
    assert eng.prefill(a, list(range(13))) == 0
    eng.settle()
    assert eng.side.totals["upload_ok"] == 3 and eng.side.totals["upload_failed"] == 0
    assert len(chunk_files(tmp_path / "kv")) == 3, "one object per chunk, not one per rank"
    puts = [w.remote.counters()["ops_upload"] for w in eng.workers if w.remote]
    assert puts == [3, 0], "rank 1 writes nothing"
    source = eng.caches[0]
    eng.shutdown()

    # a restarted engine (other KV in its blocks, empty host tier): both ranks load
    # rank 0's copy, and every rank's blocks then hold the writer's latent
    eng2 = PipelineEngine([[0, 1]], cpu, tp=2, extra=extra, replicated_kv=True, seed=9)
    b = make_request(3 * CHUNK + 1, seed=5)
    dst = list(range(20, 33))
    assert eng2.prefill(b, dst) == 3 * CHUNK
    assert eng2.side.totals["fetch_ok"] == 3 and eng2.side.totals["hit_tokens_remote"] == 3 * CHUNK
    assert [w.remote.counters()["ops_fetch"] for w in eng2.workers if w.remote] == [3, 3]
    for caches in eng2.caches:
        for name, kv in caches.items():
            assert torch.equal(
                blocks_of(kv, dst[:12], NUM_BLOCKS),
                blocks_of(source[name], list(range(12)), NUM_BLOCKS),
            )
    eng2.shutdown()

    # the control: per-rank KV (not replicated) writes one object per rank and chunk
    other = tmp_path / "kv-per-rank"
    eng3 = PipelineEngine([[0, 1]], cpu, tp=2, extra={"remote_url": f"file://{other}"})
    assert eng3.prefill(make_request(3 * CHUNK + 1, seed=5), list(range(13))) == 0
    eng3.settle()
    assert len(chunk_files(other)) == 6
    eng3.shutdown()


def test_mla_chunk_counts_as_uploaded_only_when_rank_0_wrote_it(tmp_path: Path) -> None:
    """Rank 1 writes nothing and says so with an ok flag; the op's outcome is rank 0's."""
    extra = {"remote_url": f"file://{tmp_path / 'kv'}"}
    eng = PipelineEngine([[0, 1]], 8 * PAGE * 2 * BPC, tp=2, extra=extra, replicated_kv=True)
    rank0 = eng.workers[0]
    assert rank0.remote is not None
    rank0.remote.close()
    rank0.remote = None  # rank 0 lost its tier: its uploads fail
    eng.prefill(make_request(2 * CHUNK + 1, seed=6), list(range(9)))
    eng.settle()
    assert eng.side.totals["upload_ok"] == 0 and eng.side.totals["upload_failed"] == 2
    assert not chunk_files(tmp_path / "kv")
    eng.shutdown()
