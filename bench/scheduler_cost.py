"""What kvtier costs vLLM's scheduler per step, at fleet load.

Drives vLLM's real v1 ``Scheduler`` (no workers, no model: the way vLLM's own
scheduler tests build it) three times side by side, in lockstep and with the
same requests: without a KV connector, with kvtier's ``KVTierConnector`` in the
scheduler role, and with vLLM's own ``OffloadingConnector`` (CPU spec). Each step
is ``schedule()``, then a ``ModelRunnerOutput`` built the way the model runner
builds it (one sampled token per request that finished its prompt, nothing for
a partial prefill; the connector's worker metadata reporting every op of the
step's metadata as done, which is what kvtier's and vLLM's workers report when
every copy succeeds), then ``update_from_output()``. Only ``schedule()`` and
``update_from_output()`` are timed, so the only difference between the columns is
the connector. The three schedulers step in a shuffled order each step, so
machine noise hits them alike.

Workload per (running requests R, index size N):

- the host-tier index is pre-filled with N ready chunks *directly* (kvtier's
  ``ChunkIndex.begin/commit``, the OffloadingConnector's manager
  ``prepare_store/complete_store``): storing a million chunks through the
  scheduler would take hours on two cores. The tier holds exactly N chunks, so
  every store of the run evicts one (a full tier, the steady state of a busy
  server);
- R requests with 1,030-token prompts are admitted and prefilled (warm-up, not
  measured), then decode;
- ``decode`` phase: steps where no scheduled request completes a 256-token chunk
  (only decode tokens; the prompt length keeps every request inside its chunk);
- ``prefill`` phase: a stream of new 8k-32k-token prompts (always one waiting),
  so every step also prefills up to the 8,192-token budget and completes chunks.

Also measured: ``get_num_new_matched_tokens`` latency (first call for a fresh
32k-token request, as vLLM makes it) for a hit, a partial hit (first half) and a
miss against each index size; kvtier's per-step metadata in bytes as vLLM's
multiprocess executor ships it to workers (``pickle``, highest protocol, in
``MessageQueue.enqueue``); index memory per chunk (RSS growth / chunks), and what the
index leaves to Python's garbage collector: objects it tracks per chunk and the time of
one full collection, after vLLM's own start-up ``gc.freeze``; and kvtier's worker side
in a step where no chunk moves (32 and 80 attention layers), through the connector's
per-step hooks as vLLM's model runner calls them; and ``may_load_async`` (vLLM >= 0.34
asks it as each request enters the waiting queues) per call, with an object tier
configured, against each index size.

    .venv/bin/python bench/scheduler_cost.py            # full run, ~5 min on 2 cores
    .venv/bin/python bench/scheduler_cost.py --quick    # small run, < 1 min
    .venv/bin/python bench/scheduler_cost.py --plot bench/results/scheduler.png
    .venv/bin/python bench/scheduler_cost.py --profile  # cProfile kvtier in the worst case
    .venv/bin/python bench/scheduler_cost.py --may-load-async  # that hook alone, 10k-1M chunks

Writes ``bench/results/scheduler.json``: ``{"steps": [...], "lookups": [...], "memory":
[...], "worker": [...], "may_load_async": [...], ...}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TQDM_MININTERVAL", "1")

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
    plan.seed = args.seed
    return plan


def _model_dir() -> str:
    """A model directory vLLM's ModelConfig accepts: a config.json, no weights, no
    tokenizer (the scheduler never runs the model)."""
    path = Path(tempfile.gettempdir()) / "kvtier-sched-bench-model"
    path.mkdir(exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 1,
        "num_key_value_heads": 1, "vocab_size": VOCAB, "max_position_embeddings": 65536,
        "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def make_scheduler(variant: str, index_chunks: int, max_seqs: int, num_blocks: int,
                   remote_url: str | None = None) -> Any:
    """vLLM's v1 Scheduler as vLLM's tests build it (tests/v1/core/utils.py
    ``create_scheduler``), with ``variant``'s connector in the scheduler role (kvtier's
    with an object tier at ``remote_url``: the scheduler plans for it, never opens it)."""
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
    if variant == "kvtier":
        ktc = KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.connectors.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes": index_chunks * chunk_bytes, "cpu_headroom_bytes": 0,
                "chunk_size": CHUNK,
                # no weights to fingerprint in the bench's model directory: name them
                **({"remote_url": remote_url, "model_fingerprint": "bench"}
                   if remote_url else {}),
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
        model=_model_dir(), dtype="bfloat16", seed=0, skip_tokenizer_init=True,
        max_model_len=MAX_LEN,
    )
    sched_cfg = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=BUDGET, max_model_len=MAX_LEN,
        enable_chunked_prefill=True, is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=True)
    vllm_config = VllmConfig(
        model_config=model, scheduler_config=sched_cfg, cache_config=cache,
        kv_transfer_config=ktc,
    )
    # the same cache manager in every variant (a connector turns the hybrid one off)
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = True
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )
    cache.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vllm_config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK, log_stats=True,
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
        request_id=rid, prompt_token_ids=list(tokens), sampling_params=params,
        pooling_params=None, block_hasher=block_hasher(),
    )


# ---- index pre-fill -------------------------------------------------------------------------
def kvtier_side(sched: Any) -> Any:
    return sched.connector._scheduler


def prefill_kvtier(sched: Any, n: int, rng: random.Random, hashes: Iterable[bytes] = ()) -> None:
    """Put ``n`` ready chunks into kvtier's host-tier index, keyed as a store keys them."""
    from kvtier.index import State

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


def prefill_offloading(sched: Any, n: int, rng: random.Random,
                       hashes: Iterable[bytes] = ()) -> None:
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
    if variant == "kvtier":
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
    if variant == "kvtier":
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
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled, kv_connector_output=worker_output(variant, so),
    )


def completes_chunk(so: Any, sched: Any) -> bool:
    """True when a scheduled request crosses a chunk boundary this step (connector-free)."""
    for rid, n in so.num_scheduled_tokens.items():
        after = sched.requests[rid].num_computed_tokens  # advanced by schedule()
        if after // CHUNK > (after - n) // CHUNK:
            return True
    return False


@dataclass
class StepLog:
    us: list[float] = field(default_factory=list)
    meta_bytes: list[int] = field(default_factory=list)
    stores: int = 0
    loads: int = 0


def step(variant: str, sched: Any, log: StepLog | None, prof: Any = None) -> tuple[Any, bool]:
    """One engine step: schedule, model output, update. Times the two scheduler calls."""
    if prof is not None:
        prof.enable()
    t0 = time.perf_counter()
    so = sched.schedule()
    t1 = time.perf_counter()
    if prof is not None:
        prof.disable()
    mro = model_output(sched, so, variant)
    crossed = completes_chunk(so, sched)
    if prof is not None:
        prof.enable()
    t2 = time.perf_counter()
    sched.update_from_output(so, mro)
    t3 = time.perf_counter()
    if prof is not None:
        prof.disable()
    if log is not None:
        log.us.append(((t1 - t0) + (t3 - t2)) * 1e6)
        meta = so.kv_connector_metadata
        if meta is not None:
            log.meta_bytes.append(len(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)))
            if variant == "kvtier":
                log.stores += len(meta.stores)
                log.loads += len(meta.loads)
            else:
                log.stores += len(meta.store_jobs)
                log.loads += len(meta.load_jobs)
    return so, crossed


# ---- the step benchmark -------------------------------------------------------------------
def run_case(plan: Plan, running: int, n_index: int, bar: Any,
             profile_variant: str | None = None) -> tuple[list[dict[str, Any]], Any]:
    """Both phases for one (running, index) pair; returns one record per phase."""
    rng = random.Random(f"{plan.seed}-{running}-{n_index}")
    arrivals = [rng.randint(8192, 32768) for _ in range(plan.prefill_steps)]
    num_blocks = running * 48 + sum(arrivals) // BLOCK + 8192  # nothing is ever preempted
    scheds = {v: make_scheduler(v, n_index, running + 8, num_blocks) for v in plan.variants}
    fill_rng = random.Random(f"fill-{plan.seed}-{n_index}")
    for v, s in scheds.items():
        if v == "kvtier":
            prefill_kvtier(s, n_index, random.Random(fill_rng.random()))
        elif v == "offloading":
            prefill_offloading(s, n_index, random.Random(fill_rng.random()))
    decode_prompts = [[rng.randrange(2, VOCAB) for _ in range(DECODE_PROMPT)]
                      for _ in range(running)]
    for s in scheds.values():
        for i, toks in enumerate(decode_prompts):
            s.add_request(make_request(f"d{i}", toks))
    order = list(scheds)
    # warm-up: prefill every decode request, then a few pure decode steps
    warm = 0
    while any(s.waiting or any(r.is_prefill_chunk for r in s.running) for s in scheds.values()):
        for v in order:
            step(v, scheds[v], None)
        warm += 1
        if warm > running * DECODE_PROMPT // 1000 + 200:
            raise RuntimeError("warm-up did not converge")
    for _ in range(3):
        for v in order:
            step(v, scheds[v], None)
    gc.collect()
    prof = None
    if profile_variant:
        import cProfile

        prof = cProfile.Profile()
    records = []
    for phase, n_steps in (("decode", plan.decode_steps), ("prefill", plan.prefill_steps)):
        logs = {v: StepLog() for v in scheds}
        measured, chunk_steps = 0, 0
        pending = list(arrivals) if phase == "prefill" else []
        a = 0
        for _ in range(n_steps):
            if phase == "prefill" and not scheds["vllm"].waiting and pending:
                toks = [rng.randrange(2, VOCAB) for _ in range(pending.pop(0))]
                for s in scheds.values():
                    # answers are short, so the stream never fills max_num_seqs
                    s.add_request(make_request(f"p{a}", toks, max_tokens=ANSWER_TOKENS))
                a += 1
            rng.shuffle(order)
            crossed_any, shapes = [], set()
            for v in order:
                p = prof if v == profile_variant else None
                so, crossed = step(v, scheds[v], logs[v], p)
                crossed_any.append(crossed)
                shapes.add((so.total_num_scheduled_tokens, len(so.num_scheduled_tokens)))
            if len(shapes) != 1:
                raise RuntimeError("the schedulers diverged: the connector changed the schedule")
            measured += 1
            chunk_steps += crossed_any[0]
            bar.update(1)
        if phase == "decode" and chunk_steps:
            raise RuntimeError("a decode step completed a chunk: lower --steps")
        base = statistics.median(logs["vllm"].us)
        rec: dict[str, Any] = {
            "running_requests": running,
            "index_chunks": n_index,
            "phase": phase,
            "steps": measured,
            "steps_completing_chunks": chunk_steps,
            "scheduled_requests": len(scheds["vllm"].running),
            "vllm_step_us": round(base, 1),
        }
        for v in scheds:
            if v == "vllm":
                continue
            lg = logs[v]
            med = statistics.median(lg.us)
            rec[f"{v}_step_us"] = round(med, 1)
            rec[f"{v}_ratio"] = round(med / base, 3)
            rec[f"{v}_added_us"] = round(med - base, 1)
            rec[f"{v}_p90_us"] = round(statistics.quantiles(lg.us, n=10)[-1], 1)
            rec[f"{v}_stores"] = lg.stores
            rec[f"{v}_loads"] = lg.loads
            rec[f"{v}_meta_bytes_median"] = int(statistics.median(lg.meta_bytes or [0]))
            rec[f"{v}_meta_bytes_max"] = max(lg.meta_bytes or [0])
            rec[f"{v}_index_chunks_after"] = index_len(v, scheds[v])
        rec["vllm_p90_us"] = round(statistics.quantiles(logs["vllm"].us, n=10)[-1], 1)
        records.append(rec)
    for s in scheds.values():
        s.shutdown()
    del scheds
    gc.collect()
    return records, prof


# ---- lookups ------------------------------------------------------------------------------
def run_lookups(plan: Plan, n_index: int, bar: Any, prof: Any = None) -> list[dict[str, Any]]:
    """get_num_new_matched_tokens for a fresh 32k-token request: hit, partial, miss."""
    rng = random.Random(f"lookup-{plan.seed}-{n_index}")
    prompt_len = 32 * 1024
    hit_toks = [rng.randrange(2, VOCAB) for _ in range(prompt_len)]
    probe = make_request("probe", hit_toks)
    hashes = chunk_last_hashes(probe)
    half = len(hashes) // 2
    out = []
    for variant in [v for v in plan.variants if v != "vllm"]:
        sched = make_scheduler(variant, n_index, 16, 4096)
        conn = sched.connector
        fill = prefill_kvtier if variant == "kvtier" else prefill_offloading
        # the hit prompt's chunks first (the oldest: a lookup must not depend on recency)
        fill(sched, n_index, random.Random(rng.random()), hashes=hashes)
        for outcome in ("hit", "partial", "miss"):
            lat: list[float] = []
            matched = []
            for i in range(plan.lookup_samples):
                if outcome == "hit":
                    toks = hit_toks
                elif outcome == "partial":
                    toks = hit_toks[: half * CHUNK] + [
                        rng.randrange(2, VOCAB) for _ in range(prompt_len - half * CHUNK)
                    ]
                else:
                    toks = [rng.randrange(2, VOCAB) for _ in range(prompt_len)]
                req = make_request(f"l-{outcome}-{i}", toks)
                if hasattr(conn, "on_new_request") and variant == "offloading":
                    conn.on_new_request(req)
                profiled = prof is not None and variant == "kvtier"
                if profiled:
                    prof.enable()
                t0 = time.perf_counter()
                n, _ = conn.get_num_new_matched_tokens(req, 0)
                lat.append((time.perf_counter() - t0) * 1e6)
                if profiled:
                    prof.disable()
                matched.append(n)
                conn.request_finished(req, [])
            lat.sort()
            out.append({
                "connector": variant, "index_chunks": n_index, "prompt_tokens": prompt_len,
                "outcome": outcome, "samples": len(lat),
                "p50_us": round(statistics.median(lat), 1),
                "p99_us": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 1),
                "matched_tokens": int(statistics.median([m or 0 for m in matched])),
                "index_chunks_actual": index_len(variant, sched),
            })
            bar.update(1)
        sched.shutdown()
        del sched, conn
        gc.collect()
    return out


# ---- may_load_async -----------------------------------------------------------------------
def run_may_load_async(plan: Plan, n_index: int) -> list[dict[str, Any]]:
    """kvtier's ``may_load_async`` (vLLM >= 0.34 asks it as each request enters the waiting
    queues), with an object tier configured and ``n_index`` chunks in the host tier, for a
    fresh 32k-token request whose prompt the host tier holds (the answer is no), half
    holds and lacks (yes). Called on the connector as vLLM's scheduler calls it."""
    rng = random.Random(f"may-load-async-{plan.seed}-{n_index}")
    prompt_len = 32 * 1024
    hit_toks = [rng.randrange(2, VOCAB) for _ in range(prompt_len)]
    hashes = chunk_last_hashes(make_request("probe", hit_toks))
    half = len(hashes) // 2
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-tier-") as tier:
        sched = make_scheduler("kvtier", n_index, 16, 4096, remote_url=f"file://{tier}")
        conn = sched.connector
        prefill_kvtier(sched, n_index, random.Random(rng.random()), hashes=hashes)
        out = []
        for outcome in ("hit", "partial", "miss"):
            reqs = []
            for i in range(plan.lookup_samples):
                if outcome == "hit":
                    toks = hit_toks
                elif outcome == "partial":
                    toks = hit_toks[: half * CHUNK] + [
                        rng.randrange(2, VOCAB) for _ in range(prompt_len - half * CHUNK)
                    ]
                else:
                    toks = [rng.randrange(2, VOCAB) for _ in range(prompt_len)]
                reqs.append(make_request(f"m-{outcome}-{i}", toks))
            lat: list[float] = []
            answers = set()
            for req in reqs:
                t0 = time.perf_counter()
                answers.add(conn.may_load_async(req))
                lat.append((time.perf_counter() - t0) * 1e6)
            lat.sort()
            out.append({
                "index_chunks": n_index, "prompt_tokens": prompt_len, "outcome": outcome,
                "answer": sorted(answers), "samples": len(lat),
                "p50_us": round(statistics.median(lat), 2),
                "p99_us": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 2),
            })
        sched.shutdown()
        del sched, conn
    gc.collect()
    return out


# ---- worker side --------------------------------------------------------------------------
def worker_steps(layer_counts: Iterable[int], steps: int) -> list[dict[str, Any]]:
    """kvtier's worker side in a step where no chunk moves (every decode step), driven
    through the connector facade in the order vLLM's model runner calls it: the
    metadata unpickled as vLLM's message queue delivers it, ``bind_connector_metadata``,
    ``start_load_kv``, per attention layer ``wait_for_layer_load`` and ``save_kv_layer``,
    ``wait_for_save``, the step's reports (load errors, worker metadata, stats),
    ``clear_connector_metadata``. CPU tensors; on CUDA the same calls run with nothing to
    enqueue."""
    import torch

    from kvtier.config import load_config
    from kvtier.connectors.metadata import KVTierMetadata
    from kvtier.connectors.vllm import KVTierConnector
    from kvtier.connectors.worker import WorkerSide
    from kvtier.keys import Namespace

    out = []
    num_blocks = 64
    for layers in layer_counts:
        cfg = load_config({"cpu_bytes": "64MiB", "chunk_size": CHUNK}, environ={})
        ns = Namespace("m", None, "bfloat16", "auto", BLOCK, CHUNK, 1)
        worker = WorkerSide(cfg, ns, num_blocks)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        caches = {n: torch.zeros((2, num_blocks, BLOCK, 1, HEAD_SIZE), dtype=torch.bfloat16)
                  for n in names}
        worker.register_kv_caches(caches, rank=0)
        assert worker.layout is not None
        facade = KVTierConnector.__new__(KVTierConnector)  # the worker role's plumbing only
        facade._worker, facade._scheduler, facade._connector_metadata = worker, None, None
        facade._asleep = False
        host_bytes = worker.layout.slot_bytes * 16
        times = []
        meta_bytes = 0
        for i in range(steps + 10):
            wire = pickle.dumps(KVTierMetadata(step=i, host_bytes=host_bytes),
                                protocol=pickle.HIGHEST_PROTOCOL)
            meta_bytes = len(wire)
            t0 = time.perf_counter()
            facade.bind_connector_metadata(pickle.loads(wire))
            facade.start_load_kv(None)  # type: ignore[arg-type]
            for n in names:
                facade.wait_for_layer_load(n)
                facade.save_kv_layer(n, None, None)  # type: ignore[arg-type]
            facade.wait_for_save()
            facade.get_block_ids_with_load_errors()
            facade.build_connector_worker_meta()
            facade.get_kv_connector_stats()
            facade.clear_connector_metadata()
            if i >= 10:  # the first steps allocate the host slab
                times.append((time.perf_counter() - t0) * 1e6)
        out.append({"layers": layers, "steps": steps, "meta_bytes": meta_bytes,
                    "worker_step_us": round(statistics.median(times), 1),
                    "worker_step_p99_us": round(sorted(times)[int(len(times) * 0.99)], 1)})
        facade.shutdown()
    return out


# ---- memory -------------------------------------------------------------------------------
def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def index_memory(plan: Plan, n: int) -> list[dict[str, Any]]:
    """Memory per indexed chunk while ``n`` chunks are put into the index: process RSS
    growth, and (a second, fresh fill) the Python heap growth tracemalloc sees, which
    freed memory the allocator reuses cannot hide."""
    import tracemalloc

    from vllm.utils.gc_utils import freeze_gc_heap

    out = []
    for variant in [v for v in plan.variants if v != "vllm"]:
        fill = prefill_kvtier if variant == "kvtier" else prefill_offloading
        sched = make_scheduler(variant, n, 16, 4096)
        # as vLLM's engine core does once its scheduler (and so the connector) is built:
        # what exists then is never walked again; what the index adds later may be
        freeze_gc_heap()
        tracked_before = len(gc.get_objects())
        before = rss()
        fill(sched, n, random.Random(1))
        gc.collect()
        grown = rss() - before
        tracked = len(gc.get_objects()) - tracked_before
        full_gc_ms = []
        for _ in range(3):
            t0 = time.perf_counter()
            gc.collect()
            full_gc_ms.append((time.perf_counter() - t0) * 1e3)
        gc.unfreeze()
        sched.shutdown()
        del sched
        gc.collect()
        sched = make_scheduler(variant, n, 16, 4096)
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        fill(sched, n, random.Random(1))
        gc.collect()
        heap = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        out.append({"connector": variant, "index_chunks": n, "rss_growth_bytes": grown,
                    "bytes_per_chunk": round(grown / n, 1),
                    "heap_bytes_per_chunk": round(heap / n, 1),
                    "gc_tracked_per_chunk": round(tracked / n, 2),
                    "full_gc_ms": round(statistics.median(full_gc_ms), 1)})
        sched.shutdown()
        del sched
        gc.collect()
    return out


# ---- report -------------------------------------------------------------------------------
def table(result: dict[str, Any]) -> str:
    """Markdown tables of the step and lookup figures."""
    variants = [v for v in result["variants"] if v != "vllm"]
    head = "| running | index chunks | phase | vLLM µs |"
    sep = "|---|---|---|---|"
    for v in variants:
        head += f" {v} µs | {v} ÷ vLLM | {v} meta B |"
        sep += "---|---|---|"
    lines = [head, sep]
    for r in result["steps"]:
        row = (f"| {r['running_requests']} | {r['index_chunks']:,} | {r['phase']} | "
               f"{r['vllm_step_us']:.0f} |")
        for v in variants:
            row += (f" {r[f'{v}_step_us']:.0f} | {r[f'{v}_ratio']:.2f} | "
                    f"{r[f'{v}_meta_bytes_median']:,} |")
        lines.append(row)
    lines += ["", "| connector | index chunks | outcome | matched | p50 µs | p99 µs |",
              "|---|---|---|---|---|---|"]
    for r in result["lookups"]:
        lines.append(f"| {r['connector']} | {r['index_chunks']:,} | {r['outcome']} | "
                     f"{r['matched_tokens']:,} | {r['p50_us']:.0f} | {r['p99_us']:.0f} |")
    lines += ["", may_load_async_table(result.get("may_load_async", []))]
    lines += ["", "| worker side, step with no chunk moving: layers | median µs | p99 µs "
              "| metadata B |", "|---|---|---|---|"]
    for r in result.get("worker", []):
        lines.append(f"| {r['layers']} | {r['worker_step_us']:.0f} | {r['worker_step_p99_us']:.0f} "
                     f"| {r['meta_bytes']} |")
    lines += ["", "| connector | chunks | bytes per chunk (RSS) | (tracemalloc) "
              "| GC-tracked objects per chunk | full collection ms |", "|---|---|---|---|---|---|"]
    for r in result["memory"]:
        lines.append(f"| {r['connector']} | {r['index_chunks']:,} | {r['bytes_per_chunk']:.0f} | "
                     f"{r['heap_bytes_per_chunk']:.0f} | {r['gc_tracked_per_chunk']:.2f} | "
                     f"{r['full_gc_ms']:.1f} |")
    return "\n".join(lines)


def may_load_async_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| may_load_async: index chunks | prompt held | answer | p50 µs | p99 µs |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['index_chunks']:,} | {r['outcome']} | {r['answer']} | "
                     f"{r['p50_us']:.2f} | {r['p99_us']:.2f} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = [v for v in result["variants"] if v != "vllm"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    sizes = sorted({r["index_chunks"] for r in result["steps"]})
    # a colour per connector, darker for a larger index; the line style is the phase
    maps = {"kvtier": plt.get_cmap("Blues"), "offloading": plt.get_cmap("Oranges")}
    shade = {n: 0.45 + 0.5 * i / max(1, len(sizes) - 1) for i, n in enumerate(sizes)}
    markers = dict(zip(sizes, ("o", "s", "^", "D"), strict=False))
    ax = axes[0]
    for v in variants:
        for phase, style in (("decode", "-"), ("prefill", "--")):
            for n in sizes:
                rs = [r for r in result["steps"] if r["phase"] == phase and r["index_chunks"] == n]
                ax.plot([r["running_requests"] for r in rs], [r[f"{v}_ratio"] for r in rs],
                        style, marker=markers.get(n, "o"), color=maps[v](shade[n]),
                        label=f"{v} {phase} {n:,}")
    ax.axhline(1.05, color="grey", lw=0.8, ls=":")
    ax.axhline(1.15, color="grey", lw=0.8, ls=":")
    ax.set(xscale="log", xlabel="running requests", ylabel="step time ÷ no connector",
           title="schedule()+update_from_output()")
    ax.legend(fontsize=6)
    ax = axes[1]
    n = sizes[-1]
    for v, color in zip(("vllm", *variants), ("k", "C0", "C1"), strict=False):
        for phase, style in (("decode", "-"), ("prefill", "--")):
            rs = [r for r in result["steps"] if r["phase"] == phase and r["index_chunks"] == n]
            ax.plot([r["running_requests"] for r in rs], [r[f"{v}_step_us"] / 1000 for r in rs],
                    style, color=color, marker="o", label=f"{v} {phase}")
    ax.set(xscale="log", yscale="log", xlabel="running requests", ylabel="ms per step",
           title=f"step time, index {n:,} chunks")
    ax.legend(fontsize=7)
    ax = axes[2]
    for v in variants:
        for outcome, style in (("hit", "-"), ("partial", "--"), ("miss", ":")):
            rs = [r for r in result["lookups"] if r["connector"] == v and r["outcome"] == outcome]
            ax.plot([r["index_chunks"] for r in rs], [r["p99_us"] for r in rs], style,
                    marker="o", color=maps[v](0.8), label=f"{v} {outcome} p99")
    ax.axhline(200, color="grey", lw=0.8, ls=":")
    ax.set(xscale="log", yscale="log", xlabel="index chunks", ylabel="µs",
           title="get_num_new_matched_tokens, 32k-token prompt")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def profile_report(prof: Any, top: int) -> list[dict[str, Any]]:
    """kvtier's functions (connector facade, scheduler side, index, keys) by own time."""
    import pstats

    st = pstats.Stats(prof)
    rows = []
    for (filename, line, name), (_cc, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        norm = filename.replace(os.sep, "/")
        if "/connectors/" in norm or "/kvtier/" in norm:
            where = "/".join(norm.split("/")[-2:])
            rows.append({"function": f"{where}:{line}({name})", "calls": nc,
                         "tottime_ms": round(tt * 1000, 2), "cumtime_ms": round(ct * 1000, 2)})
    rows.sort(key=lambda r: -r["tottime_ms"])
    return rows[:top]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scheduler_cost.py",
        description=(
            "Time vLLM's real v1 Scheduler (schedule() + update_from_output(), no model) "
            "without a KV connector, with kvtier's KVTierConnector and with vLLM's "
            "OffloadingConnector, in lockstep on the same requests; plus kvtier's lookup "
            "latency, per-step metadata bytes and index memory per chunk. Ratios are "
            "against the no-connector scheduler measured in the same run."
        ),
        epilog=(
            "Full run: 64/256/1,024 running requests x 10k/100k/1M indexed chunks, "
            "60 decode + 60 prefill steps each (a few minutes on 2 cores). The index is "
            "pre-filled directly (not through stores). Results: --out JSON; --plot PNG."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true",
                   help="small run: 16/64 running, 1k/4k chunks, 10+10 steps (< 1 min)")
    p.add_argument("--running", help="comma-separated running-request counts (overrides)")
    p.add_argument("--index", help="comma-separated index sizes in chunks, e.g. 1e4,1e6")
    p.add_argument("--steps", type=int, help="measured steps per phase (default 60, quick 10)")
    p.add_argument("--no-offloading", action="store_true",
                   help="leave vLLM's OffloadingConnector out")
    p.add_argument("--out", default=str(HERE / "results" / "scheduler.json"),
                   help="JSON results file (default: bench/results/scheduler.json)")
    p.add_argument("--plot", metavar="PNG", help="write a plot of the curves to this PNG")
    p.add_argument("--profile", action="store_true",
                   help="only cProfile kvtier's scheduler in the worst case (largest running "
                   "count and index) and print where its time goes, function by function")
    p.add_argument("--top", type=int, default=25, help="functions shown by --profile")
    p.add_argument("--may-load-async", action="store_true",
                   help="only time may_load_async against each index size and print it "
                   "(writes no results file)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = plan_for(args)
    from tqdm import tqdm

    t_start = time.monotonic()
    if args.profile:
        running, n = max(plan.running), max(plan.index_sizes)
        plan.variants = ("vllm", "kvtier")
        with tqdm(total=plan.decode_steps + plan.prefill_steps, disable=args.no_progress,
                  desc="profile") as bar:
            recs, prof = run_case(plan, running, n, bar, profile_variant="kvtier")
        for r in recs:
            print(f"{r['phase']}: vLLM {r['vllm_step_us']:.0f} µs, kvtier "
                  f"{r['kvtier_step_us']:.0f} µs ({r['kvtier_ratio']:.2f}x, profiled)")
        print(f"kvtier functions, {running} running, {n:,} chunks, "
              f"{plan.decode_steps}+{plan.prefill_steps} steps:")
        print(f"{'own ms':>9} {'cum ms':>9} {'calls':>8}  function")
        for row in profile_report(prof, args.top):
            print(f"{row['tottime_ms']:9.1f} {row['cumtime_ms']:9.1f} {row['calls']:8d}  "
                  f"{row['function']}")
        import cProfile

        lprof = cProfile.Profile()
        with tqdm(total=3, disable=args.no_progress, desc="profile lookups") as bar:
            looks = run_lookups(plan, n, bar, lprof)
        print(f"\nget_num_new_matched_tokens, 32k-token prompt, {n:,} chunks, "
              f"{plan.lookup_samples} x hit/partial/miss:")
        for r in looks:
            print(f"  {r['outcome']}: p50 {r['p50_us']:.0f} µs, "
                  f"p99 {r['p99_us']:.0f} µs (profiled)")
        print(f"{'own ms':>9} {'cum ms':>9} {'calls':>8}  function")
        for row in profile_report(lprof, args.top):
            print(f"{row['tottime_ms']:9.1f} {row['cumtime_ms']:9.1f} {row['calls']:8d}  "
                  f"{row['function']}")
        return 0

    if args.may_load_async:
        rows = [r for n in plan.index_sizes for r in run_may_load_async(plan, n)]
        print(may_load_async_table(rows))
        return 0

    cases = [(r, n) for n in plan.index_sizes for r in plan.running]
    n_lookup = len(plan.index_sizes) * 3 * (len(plan.variants) - 1)
    total = len(cases) * (plan.decode_steps + plan.prefill_steps) + n_lookup
    result: dict[str, Any] = {
        "benchmark": "scheduler_cost",
        "command": " ".join(["bench/scheduler_cost.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine()},
        "variants": list(plan.variants),
        "settings": {"block_size": BLOCK, "chunk_size": CHUNK, "max_num_batched_tokens": BUDGET,
                     "decode_prompt_tokens": DECODE_PROMPT, "arriving_prompt_tokens": [8192, 32768],
                     "decode_steps": plan.decode_steps, "prefill_steps": plan.prefill_steps,
                     "lookup_samples": plan.lookup_samples,
                     "index_prefill": "direct (ChunkIndex.begin/commit; manager prepare/complete)",
                     "metadata_serialization": "pickle.HIGHEST_PROTOCOL (vLLM MessageQueue)"},
        "steps": [], "lookups": [], "memory": [], "worker": [], "may_load_async": [],
    }
    try:
        import vllm

        result["vllm_version"] = vllm.__version__
    except Exception:
        pass
    with tqdm(total=total, disable=args.no_progress, desc="scheduler cost") as bar:
        result["memory"] = index_memory(plan, max(plan.index_sizes))
        result["worker"] = worker_steps((32, 80), plan.decode_steps * 5)
        for running, n in cases:
            bar.set_postfix_str(f"{running} running, {n:,} chunks")
            recs, _ = run_case(plan, running, n, bar)
            result["steps"].extend(recs)
        for n in plan.index_sizes:
            bar.set_postfix_str(f"lookups, {n:,} chunks")
            result["lookups"].extend(run_lookups(plan, n, bar))
            result["may_load_async"].extend(run_may_load_async(plan, n))
    result["seconds"] = round(time.monotonic() - t_start, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    print(f"\nwrote {args.out} in {result['seconds']:.0f} s")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
