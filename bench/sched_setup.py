"""bench/scheduler_cost.py's setup: vLLM's real v1 Scheduler with no connector, kvtier's
or vLLM's OffloadingConnector (no model, no workers), requests with vLLM's block hasher,
an index pre-filled directly, and what a model runner and the connector's workers would
report for a step. vLLM is imported inside the functions."""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK = 32  # vLLM block size (tokens)
CHUNK = 256  # kvtier chunk_size and OffloadingConnector block_size (tokens)
BUDGET = 8192  # max_num_batched_tokens
MAX_LEN = 40_000
DECODE_PROMPT = 4 * CHUNK + 6  # decode requests stay inside their 5th chunk while measured
VOCAB = 32_000
ANSWER_TOKENS = 8  # tokens generated for each arriving long prompt before it finishes
HEAD_SIZE = 4  # one KV head of 4: a 512-byte block, a 4 KiB chunk (kvtier's smallest slot)
VARIANTS = ("vllm", "kvtier", "offloading")
HERE = Path(__file__).resolve().parent


# ---- configuration ------------------------------------------------------------------------
@dataclass
class Plan:
    """What one run measures."""

    running: list[int]
    index_sizes: list[int]
    decode_steps: int
    prefill_steps: int
    lookup_samples: int
    variants: tuple[str, ...]
    seed: int = 0
    #: the model's forward pass, between schedule() and update_from_output() (not timed)
    forward_s: float = 0.0


def plan_for(args: argparse.Namespace) -> Plan:
    if args.quick:
        plan = Plan([16, 64], [1_000, 4_000], 10, 10, 20, VARIANTS)
    else:
        plan = Plan([64, 256, 1024], [10_000, 100_000, 1_000_000], 60, 60, 200, VARIANTS)
    if args.running:
        plan.running = [int(x) for x in args.running.split(",")]
    if args.index:
        plan.index_sizes = [int(float(x)) for x in args.index.split(",")]
    if args.steps:
        plan.decode_steps = plan.prefill_steps = args.steps
    if args.no_offloading:
        plan.variants = ("vllm", "kvtier")
    if args.whatif_off:
        plan.variants += ("kvtier-whatif-off",)
    plan.forward_s = args.forward_ms / 1000
    plan.seed = args.seed
    return plan


def _model_dir() -> str:
    """A model directory vLLM's ModelConfig accepts: a config.json, no weights, no
    tokenizer (the scheduler never runs the model)."""
    path = Path(tempfile.gettempdir()) / "kvtier-sched-bench-model"
    path.mkdir(exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "vocab_size": VOCAB,
        "max_position_embeddings": 65536,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def make_scheduler(
    variant: str,
    index_chunks: int,
    max_seqs: int,
    num_blocks: int,
    remote_url: str | None = None,
    extra: dict[str, Any] | None = None,
) -> Any:
    """vLLM's v1 Scheduler as vLLM's tests build it (tests/v1/core/utils.py
    ``create_scheduler``), with ``variant``'s connector in the scheduler role (kvtier's
    with an object tier at ``remote_url``: the scheduler plans for it, never opens it;
    ``extra``: more of kvtier's settings)."""
    import torch
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.bfloat16
    )
    align = 4096
    chunk_bytes = -(-spec.page_size_bytes * (CHUNK // BLOCK) // align) * align
    ktc = None
    if variant.startswith("kvtier"):
        ktc = KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.connectors.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes": index_chunks * chunk_bytes,
                "cpu_headroom_bytes": 0,
                "chunk_size": CHUNK,
                # the what-if ghosts off: their cost is this variant's difference to "kvtier"
                **({"whatif": False} if variant == "kvtier-whatif-off" else {}),
                # no weights to fingerprint in the bench's model directory: name them
                **({"remote_url": remote_url, "model_fingerprint": "bench"} if remote_url else {}),
                **(extra or {}),
            },
        )
    elif variant == "offloading":
        ktc = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes_to_use": index_chunks * chunk_bytes,
                "block_size": CHUNK,
            },
        )
    model = ModelConfig(
        model=_model_dir(),
        dtype="bfloat16",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=MAX_LEN,
    )
    sched_cfg = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=BUDGET,
        max_model_len=MAX_LEN,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=True)
    vllm_config = VllmConfig(
        model_config=model,
        scheduler_config=sched_cfg,
        cache_config=cache,
        kv_transfer_config=ktc,
    )
    # the same cache manager in every variant (a connector turns the hybrid one off)
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = True
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )
    cache.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
        log_stats=True,
    )


_HASHER: list[Callable[[Any], list[Any]]] = []


def block_hasher() -> Callable[[Any], list[Any]]:
    """vLLM's request block hasher with the engine's default hash (as EngineCore sets up)."""
    if not _HASHER:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        fn = get_hash_fn_by_name("sha256")
        init_none_hash(fn)
        _HASHER.append(get_request_block_hasher(BLOCK, fn))
    return _HASHER[0]


def make_request(rid: str, tokens: list[int], max_tokens: int = 100_000) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=params,
        pooling_params=None,
        block_hasher=block_hasher(),
    )


# ---- index pre-fill -------------------------------------------------------------------------
def kvtier_side(sched: Any) -> Any:
    from kvtier.connectors.vllm import scheduler_side

    return scheduler_side(sched.connector)


def prefill_kvtier(sched: Any, n: int, rng: random.Random, hashes: Iterable[bytes] = ()) -> None:
    """Put ``n`` ready chunks into kvtier's host-tier index, keyed as a store keys them."""
    from kvtier.host.index import State

    index = kvtier_side(sched).index
    fixed = list(hashes)
    for i in range(n):
        h = fixed[i] if i < len(fixed) else rng.randbytes(32)
        key = h  # the index is keyed by vLLM's block hash, as a store keys it
        entry = index.begin(key, State.STORING)
        if entry is None:  # already there (a fixed hash repeated)
            continue
        index.commit(key, True)
    if len(index) != n:
        raise RuntimeError(f"kvtier's index holds {len(index)} chunks, not {n}")


def prefill_offloading(
    sched: Any, n: int, rng: random.Random, hashes: Iterable[bytes] = ()
) -> None:
    """Put ``n`` stored chunks into the OffloadingConnector's CPU manager."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    manager = sched.connector.connector_scheduler.manager
    fixed = list(hashes)
    batch = 4096
    for start in range(0, n, batch):
        keys = []
        for i in range(start, min(n, start + batch)):
            h = fixed[i] if i < len(fixed) else rng.randbytes(32)
            keys.append(make_offload_key(h, 0))
        ctx = ReqContext(req_id=f"prefill-{start}")
        out = manager.prepare_store(keys, ctx)
        if out is None:
            raise RuntimeError("OffloadingConnector refused the pre-fill")
        manager.complete_store(keys, ctx)
        manager.on_request_finished(ctx)


def index_len(variant: str, sched: Any) -> int | None:
    if variant.startswith("kvtier"):
        return len(kvtier_side(sched).index)
    if variant == "offloading":
        chunks = getattr(sched.connector.connector_scheduler.manager._policy, "chunks", None)
        return len(chunks) if chunks is not None else None
    return None


def chunk_last_hashes(req: Any) -> list[bytes]:
    bpc = CHUNK // BLOCK
    return [bytes(req.block_hashes[(i + 1) * bpc - 1]) for i in range(len(req.block_hashes) // bpc)]


# ---- one engine step ----------------------------------------------------------------------
def worker_output(variant: str, so: Any) -> Any:
    """What the connector's workers report for this step: every op done, once (one worker)."""
    from vllm.v1.outputs import KVConnectorOutput

    meta = so.kv_connector_metadata
    if variant.startswith("kvtier"):
        from kvtier.connectors.metadata import KVTierWorkerMeta

        fetches = [op for run in meta.fetches for op in run]
        ops = meta.loads + meta.stores + fetches + meta.uploads
        wm: Any = KVTierWorkerMeta(steps=[meta.step], results={op.op_id: [True] for op in ops})
    elif variant == "offloading":
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )

        wm = OffloadingWorkerMetadata(
            completed_jobs={j: 1 for j in (*meta.store_jobs, *meta.load_jobs)}
        )
    else:
        return None
    return KVConnectorOutput(kv_connector_worker_meta=wm)


def model_output(sched: Any, so: Any, variant: str) -> Any:
    """The ModelRunnerOutput a model runner returns for ``so``."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = sched.requests[rid]
        sampled.append([] if req.is_prefill_chunk else [2 + req.num_tokens % (VOCAB - 2)])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=worker_output(variant, so),
    )


def completes_chunk(so: Any, sched: Any) -> bool:
    """True when a scheduled request crosses a chunk boundary this step (connector-free)."""
    for rid, n in so.num_scheduled_tokens.items():
        after = sched.requests[rid].num_computed_tokens  # advanced by schedule()
        if after // CHUNK > (after - n) // CHUNK:
            return True
    return False
