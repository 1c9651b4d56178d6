"""bench/scheduler_cost.py's measurements beside the step benchmark: lookup latency
(``get_num_new_matched_tokens``), ``may_load_async``, the worker side in a step where
nothing moves, and the index's memory per chunk."""

from __future__ import annotations

import gc
import pickle
import random
import statistics
import tempfile
import time
from collections.abc import Iterable
from typing import Any

from sched_setup import (
    BLOCK,
    CHUNK,
    HEAD_SIZE,
    VOCAB,
    Plan,
    chunk_last_hashes,
    index_len,
    kvtier_side,
    make_request,
    make_scheduler,
    prefill_kvtier,
    prefill_offloading,
)


# ---- lookups ------------------------------------------------------------------------------
def outcome_tokens(outcome: str, hit_toks: list[int], half: int, rng: random.Random) -> list[int]:
    """A prompt the host tier holds ("hit"), holds the first ``half`` chunks of
    ("partial"), or lacks ("miss"), as long as ``hit_toks``."""
    if outcome == "hit":
        return hit_toks
    if outcome == "partial":
        return hit_toks[: half * CHUNK] + [
            rng.randrange(2, VOCAB) for _ in range(len(hit_toks) - half * CHUNK)
        ]
    return [rng.randrange(2, VOCAB) for _ in range(len(hit_toks))]


def run_lookups(plan: Plan, n_index: int, bar: Any, prof: Any = None) -> list[dict[str, Any]]:
    """get_num_new_matched_tokens for a fresh 32k-token request: hit, partial, miss."""
    rng = random.Random(f"lookup-{plan.seed}-{n_index}")
    prompt_len = 32 * 1024
    hit_toks = [rng.randrange(2, VOCAB) for _ in range(prompt_len)]
    probe = make_request("probe", hit_toks)
    hashes = chunk_last_hashes(probe)
    half = len(hashes) // 2
    out = []
    for variant in [v for v in plan.variants if v in ("kvtier", "offloading")]:
        sched = make_scheduler(variant, n_index, 16, 4096)
        conn = sched.connector
        fill = prefill_kvtier if variant == "kvtier" else prefill_offloading
        # the hit prompt's chunks first (the oldest: a lookup must not depend on recency)
        fill(sched, n_index, random.Random(rng.random()), hashes=hashes)
        for outcome in ("hit", "partial", "miss"):
            lat: list[float] = []
            matched = []
            for i in range(plan.lookup_samples):
                toks = outcome_tokens(outcome, hit_toks, half, rng)
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
            out.append(
                {
                    "connector": variant,
                    "index_chunks": n_index,
                    "prompt_tokens": prompt_len,
                    "outcome": outcome,
                    "samples": len(lat),
                    "p50_us": round(statistics.median(lat), 1),
                    "p99_us": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 1),
                    "matched_tokens": int(statistics.median([m or 0 for m in matched])),
                    "index_chunks_actual": index_len(variant, sched),
                }
            )
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
                toks = outcome_tokens(outcome, hit_toks, half, rng)
                reqs.append(make_request(f"m-{outcome}-{i}", toks))
            lat: list[float] = []
            answers = set()
            for req in reqs:
                t0 = time.perf_counter()
                answers.add(conn.may_load_async(req))
                lat.append((time.perf_counter() - t0) * 1e6)
            lat.sort()
            out.append(
                {
                    "index_chunks": n_index,
                    "prompt_tokens": prompt_len,
                    "outcome": outcome,
                    "answer": sorted(answers),
                    "samples": len(lat),
                    "p50_us": round(statistics.median(lat), 2),
                    "p99_us": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 2),
                }
            )
        sched.shutdown()
        del sched, conn
    gc.collect()
    return out


# ---- priced lookups -----------------------------------------------------------------------
def run_priced_lookups(plan: Plan, n_index: int) -> list[dict[str, Any]]:
    """What pricing a lookup against recomputing (``load_policy: cost``) adds to
    ``get_num_new_matched_tokens``: a fresh 32k-token request the host tier lacks, asked of
    a Redis tier (planned, never opened: no workers; trusted, ``canary_first_hit: false``;
    a directory would answer from its own probe instead) by two schedulers side by side,
    one priced and one ``always``, in a shuffled order per request. The priced one's
    estimates are measured (a tier at 1 GB/s and 5 ms, a prefill at 50 µs a token), so
    every lookup takes the measured path: each of its 128 chunks priced, the deadline set.
    Also the cost model's per-step work (a step's start and its report, ``StepTimes``),
    which every engine with an object tier does under either policy."""
    from kvtier.costs import PrefillCosts, StepTimes

    rng = random.Random(f"priced-{plan.seed}-{n_index}")
    prompt_len = 32 * 1024
    settings = {"canary_first_hit": False}
    scheds = {
        policy: make_scheduler(
            "kvtier",
            n_index,
            16,
            4096,
            "redis://127.0.0.1:9/0",
            {**settings, "load_policy": policy},
        )
        for policy in ("always", "cost")
    }
    for s in scheds.values():
        prefill_kvtier(s, n_index, random.Random(rng.random()))
    lookups = kvtier_side(scheds["cost"]).lookups
    now = lookups.clock()
    for _ in range(8):  # measured: the priced path, not the prior
        lookups.tier_costs.observe(latency_s=0.005, nbytes=1 << 24, seconds=0.0168, now=now)
        lookups.prefill.observe_step(0.1, 2048, now)
    lat: dict[str, list[float]] = {p: [] for p in scheds}
    for i in range(plan.lookup_samples):
        toks = [rng.randrange(2, VOCAB) for _ in range(prompt_len)]
        for policy, s in sorted(scheds.items(), key=lambda _: rng.random()):
            req = make_request(f"p-{policy}-{i}", toks)
            t0 = time.perf_counter()
            s.connector.get_num_new_matched_tokens(req, 0)
            lat[policy].append((time.perf_counter() - t0) * 1e6)
            s.connector.request_finished(req, [])
    if not lookups.tier_costs.measured(lookups.clock()):
        raise RuntimeError("the priced scheduler's tier estimate aged out: it priced nothing")
    paired = statistics.median(c - a for c, a in zip(lat["cost"], lat["always"], strict=True))
    out = []
    for policy, s in scheds.items():
        out.append(
            {
                "what": f"a 32k-token lookup, load_policy {policy}",
                "index_chunks": n_index,
                "samples": len(lat[policy]),
                "p50_us": round(statistics.median(lat[policy]), 1),
                "p99_us": round(sorted(lat[policy])[int(len(lat[policy]) * 0.99) - 1], 1),
                **({"added_us_paired_median": round(paired, 1)} if policy == "cost" else {}),
            }
        )
        s.shutdown()
    del scheds, lookups
    steps = StepTimes(PrefillCosts(256))
    times = []
    for i in range(max(1000, plan.lookup_samples * 10)):
        t0 = time.perf_counter()
        steps.began(i, 2048, t0)
        steps.reported(i, t0)
        times.append((time.perf_counter() - t0) * 1e6)
    out.append(
        {
            "what": "a step's prefill sample (StepTimes), either policy",
            "index_chunks": n_index,
            "samples": len(times),
            "p50_us": round(statistics.median(times), 2),
            "p99_us": round(sorted(times)[int(len(times) * 0.99) - 1], 2),
        }
    )
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
    from kvtier.connectors.worker.side import WorkerSide
    from kvtier.keys import Namespace

    out = []
    num_blocks = 64
    for layers in layer_counts:
        cfg = load_config({"cpu_bytes": "64MiB", "chunk_size": CHUNK}, environ={})
        ns = Namespace("m", None, "bfloat16", "auto", BLOCK, CHUNK, 1)
        worker = WorkerSide(cfg, ns, num_blocks)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        caches = {
            n: torch.zeros((2, num_blocks, BLOCK, 1, HEAD_SIZE), dtype=torch.bfloat16)
            for n in names
        }
        worker.register_kv_caches(caches, rank=0)
        assert worker.layout is not None
        facade = KVTierConnector.__new__(KVTierConnector)  # the worker role's plumbing only
        facade._worker, facade._scheduler, facade._connector_metadata = worker, None, None
        facade._asleep = False
        host_bytes = worker.layout.slot_bytes * 16
        times = []
        meta_bytes = 0
        for i in range(steps + 10):
            wire = pickle.dumps(
                KVTierMetadata(step=i, host_bytes=host_bytes), protocol=pickle.HIGHEST_PROTOCOL
            )
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
        out.append(
            {
                "layers": layers,
                "steps": steps,
                "meta_bytes": meta_bytes,
                "worker_step_us": round(statistics.median(times), 1),
                "worker_step_p99_us": round(sorted(times)[int(len(times) * 0.99)], 1),
            }
        )
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
    for variant in [v for v in plan.variants if v in ("kvtier", "offloading")]:
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
        out.append(
            {
                "connector": variant,
                "index_chunks": n,
                "rss_growth_bytes": grown,
                "bytes_per_chunk": round(grown / n, 1),
                "heap_bytes_per_chunk": round(heap / n, 1),
                "gc_tracked_per_chunk": round(tracked / n, 2),
                "full_gc_ms": round(statistics.median(full_gc_ms), 1),
            }
        )
        sched.shutdown()
        del sched
        gc.collect()
    return out
