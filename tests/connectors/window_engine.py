"""vLLM's real ``Scheduler`` and a real kvtier worker over any grouping of attention layers,
with the token budget and load-failure policy a test picks.

:class:`~tests.connectors.test_hma.HybridEngine` drives a full + sliding-window model;
this engine drives the same loop over a model of full-attention layers only, of
sliding-window layers only (one ``SlidingWindowSpec`` group: kvtier's single-group
path), or both, with ``max_num_batched_tokens`` small enough to split a prefill at a
token that is not on a block boundary (63), and with ``kv_load_failure_policy`` so a
local directory tier's lookups are answered in their own step (one-step lookups). It
records every store and load the scheduler planned, and checks the KV a request attends
to: every block vLLM backs holds the "forward"'s own bytes for each computed token.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheSpec
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvtier.config import load_config
from kvtier.connectors.engine_shape import KVCacheShape
from kvtier.connectors.groups import kv_groups
from kvtier.connectors.metadata import WorkerKeys
from kvtier.connectors.scheduler.one_step_lookups import LocalProbe
from kvtier.connectors.worker.side import WorkerSide
from kvtier.keys import Namespace
from kvtier.objects.remote import RemoteIO
from kvtier.objects.tiers import FileTier
from kvtier.ops import LoadOp, StoreOp, all_blocks
from tests.connectors.hybrid_engine import BS, CHUNK, kvtier_extra
from tests.connectors.test_hma import FULL_SPEC, SWA_SPEC, HybridEngine, attn, truth

BPC = CHUNK // BS
WINDOW = SWA_SPEC.sliding_window  # 32 tokens: smaller than a chunk less one block

#: the model's attention layers, by kind of KV cache grouping
KINDS: dict[str, dict[str, KVCacheSpec]] = {
    "full": {attn(i): FULL_SPEC for i in range(4)},
    "sliding": {attn(i): SWA_SPEC for i in range(4)},
    "hybrid": {attn(0): FULL_SPEC, attn(1): SWA_SPEC, attn(2): FULL_SPEC, attn(3): SWA_SPEC},
}


def engine_config(
    model_dir: str, extra: dict[str, Any] | None, *, budget: int, policy: str
) -> VllmConfig:
    """vLLM's config with kvtier as the connector; ``budget``: tokens per step (a prompt
    longer than that is prefilled in chunks of ``budget`` tokens)."""
    ktc = KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier.connectors.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=kvtier_extra(extra),
        kv_load_failure_policy=policy,
    )
    vc = VllmConfig(
        model_config=ModelConfig(
            model=model_dir, dtype="bfloat16", seed=0, skip_tokenizer_init=True, max_model_len=2048
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=budget,
            max_model_len=2048,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BS, cache_dtype="auto", enable_prefix_caching=True),
        kv_transfer_config=ktc,
    )
    vc.cache_config.kv_cache_layout = "LBNHC"  # what the engine core resolves first
    return vc


class WindowEngine(HybridEngine):
    """vLLM's scheduler and one worker side over real tensors, of the grouping ``kind``."""

    def __init__(
        self,
        model_dir: str,
        kind: str,
        *,
        budget: int = 1024,
        policy: str = "fail",
        extra: dict[str, Any] | None = None,
        num_blocks: int = 80,
    ) -> None:
        specs = KINDS[kind]
        self.kind = kind
        self.vc = engine_config(model_dir, extra, budget=budget, policy=policy)
        groups = get_kv_cache_groups(self.vc, dict(specs))
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
        self.cfg = load_config(kvtier_extra(extra), environ={})
        self.worker = WorkerSide(
            self.cfg,
            Namespace("m", None, "bfloat16", "auto", BS, CHUNK, 1),
            self.wc.num_blocks,
            RemoteIO.from_config,
            groups=kv_groups(KVCacheShape.from_vllm(self.wc), BS, CHUNK),
        )
        self.worker.register_kv_caches(self.kv, rank=0)
        if self.cfg.remote_url:  # vLLM's handshake: the worker's keys to the scheduler
            keys = WorkerKeys(self.worker.namespace, 0, 0, self.worker.weights_epoch)
            self.sched.connector.set_xfer_handshake_metadata({0: keys})
        self.group_of = {
            name: g for g, grp in enumerate(self.wc.kv_cache_groups) for name in grp.layer_names
        }
        self.layer_no = {name: i for i, name in enumerate(specs)}
        self.loads: list[LoadOp] = []
        self.stores: list[StoreOp] = []
        #: every op result the worker reported (op id -> ok)
        self.results: dict[int, bool] = {}
        #: the block ids the worker reported to vLLM as load errors
        self.failed_blocks: set[int] = set()

    @property
    def one_step(self) -> bool:
        return self.side.lookups.probe is not None

    def force_one_step(self) -> None:
        """One-step lookups where kvtier refuses them (a sliding-window model): to drive
        the worker's own guard, that a load held to a fetch copies only what it read."""
        assert self.cfg.remote_url is not None
        root = self.cfg.remote_url.removeprefix("file://")
        keys = WorkerKeys(self.worker.namespace, 0, 0, self.worker.weights_epoch)
        self.side.lookups.probe = LocalProbe(FileTier(root, background_sweep=False), [keys])

    def step(self, after_loads: Any = None) -> SchedulerOutput:
        def record(so: SchedulerOutput) -> None:
            self.stores.extend(so.kv_connector_metadata.stores)
            if after_loads is not None:
                after_loads(so)

        build, take = self.worker.build_worker_meta, self.worker.take_failed_blocks

        def built() -> Any:
            meta = build()
            self.results.update({i: all(v) for i, v in meta.results.items()})
            return meta

        def taken() -> set[int]:
            failed = take()
            self.failed_blocks |= failed
            return failed

        self.worker.build_worker_meta, self.worker.take_failed_blocks = built, taken  # type: ignore[method-assign]
        try:
            return super().step(after_loads=record)
        finally:
            del self.worker.build_worker_meta, self.worker.take_failed_blocks

    def settle(self, timeout_s: float = 10.0) -> None:
        """Idle steps until every op the scheduler sent was reported (uploads, fetches)."""
        deadline = time.monotonic() + timeout_s
        while self.side.pending_ops() and time.monotonic() < deadline:
            self.step()
            time.sleep(0.01)
        assert not self.side.pending_ops(), "ops left unreported"

    def poison(self, seed: int) -> None:
        """Random bits in every block: a load may change only what it should."""
        g = torch.Generator().manual_seed(seed)
        for kv in self.kv.values():
            kv.view(torch.int16).copy_(
                torch.randint(-30000, 30000, kv.shape, generator=g, dtype=torch.int16)
            )

    def holes_stored(self) -> list[StoreOp]:
        """The stores planned with vLLM's null block among their blocks (a chunk with a hole)."""
        return [op for op in self.stores if self.null in all_blocks(op)]

    def expect_attended(self, req: Request) -> None:
        """After a step: every block vLLM backs for ``req`` holds the truth of each token it
        counts as computed, all groups (what the request's next tokens attend to)."""
        upto = req.num_computed_tokens
        ids = self.block_ids(req.request_id)
        tokens = req.all_token_ids
        for name, kv in self.kv.items():
            table = ids[self.group_of[name]]
            bits = kv.view(torch.int16)
            for pos in range(upto):
                block = table[pos // BS]
                if block == self.null:
                    continue
                got = bits[block, :, pos % BS]
                assert torch.equal(got, truth(self.layer_no[name], pos, tokens[pos], got)), (
                    f"{name}: token {pos} in block {block} is not its KV"
                )

    def object_path(self, block_hash: bytes) -> Path:
        """The file of this worker's object for the chunk ``block_hash``."""
        root = self.cfg.remote_url.removeprefix("file://")  # type: ignore[union-attr]
        return Path(
            FileTier(root, background_sweep=False).path(self.worker._object_key(block_hash))
        )
