"""The trace planner against the real engine: predicted and measured host-tier hit rates.

``kvtier size --trace`` predicts, from one pass over a request trace, the share of prompt
tokens kvtier's host tier serves beyond vLLM's own prefix cache at every tier size. This
bench checks the prediction against a real vLLM engine (CPU build, a locally built tiny
random-weight Llama):

1. it writes a trace of multi-turn chat sessions (a few shared system prompts, documents
   drawn with Zipf popularity, some sessions under a ``cache_salt``) as JSONL in the
   format ``kvtier size --trace`` reads (``prompt_token_ids``, ``timestamp``,
   ``cache_salt``);
2. it runs the planner on it (``kvtier size --model M --trace FILE --gpu-kv-tokens 0
   --json`` for the curve, and the planner's own :class:`kvtier.sizing.trace.Simulation`
   for the exact hit rate at a size), with the engine's chunk and block size;
3. it picks three host-tier sizes at about 20 %, 50 % and 90 % of the curve's range (and
   never fewer slots than the longest prompt's full chunks: below that the model is not
   exact, see docs/sizing.md), and replays the trace through one engine per size
   (``cpu_bytes`` = that many slots of the engine's own slot size), one request at a time
   in trace order, with ``LLM.reset_prefix_cache()`` before each request (it leaves
   kvtier's tier alone), so vLLM's own prefix cache serves nothing and every hit is
   kvtier's;
4. it measures kvtier's hit rate from its own counters (the scheduler side's
   ``totals["hit_tokens_host"]``, cross-checked with vLLM's ``num_cached_tokens``)
   divided by the trace's prompt tokens, the planner's ``hit_rate``, and compares, size
   by size and request by request.

Without ``--quick`` two more replays show where the model stops being exact: one at half
the longest prompt's chunks, and one at the largest size with ``--batched`` (4) requests
at a time.

Why a reset and not a small GPU KV: with the reset vLLM's hit is exactly zero, so the
comparison checks the tier model (chunking, the last-token rule, LRU order, slot sizes)
alone; a small GPU KV would add the planner's approximation of vLLM's block pool (an LRU
of blocks) to it, and vLLM's pool never gets smaller than one request's blocks.

    python bench/trace_replay.py --parallel 2 --plot bench/results/trace_replay.png \\
        --json bench/results/trace_replay.json      # make bench-trace

``--quick`` replays a smaller trace (what ``tests/e2e/test_trace_replay.py`` runs).
Every engine's OpenMP threads are bound to all CPUs this process may use
(``VLLM_CPU_OMP_THREADS_BIND``), as the other benches do.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from harness import int_list, omp_cpus
from plots import trace_replay_plot
from tables import print_trace_replay
from traces import (
    HASH_QUICK,
    HASH_REPLAY,
    QUICK,
    TOKEN_HI,
    TOKEN_LO,
    HashTraceShape,
    TraceShape,
    corpus,
    expand_trace,
    generate_hash_trace,
    generate_trace,
)

#: what tests and the e2e replay read from here
__all__ = [
    "HASH_QUICK",
    "QUICK",
    "TOKEN_HI",
    "TOKEN_LO",
    "HashTraceShape",
    "corpus",
    "expand_trace",
    "generate_hash_trace",
    "generate_trace",
    "lru_hits_per_request",
    "max_request_chunks",
    "pick_slots",
    "planner_served",
    "rate_at",
]

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 32
FRACTIONS = (0.2, 0.5, 0.9)


# ----------------------------------------------------------------------- prediction


def planner_curve(
    model: str, trace: Path, chunk_size: int, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``kvtier size --trace --json`` as a user runs it, vLLM's cache taken as empty."""
    argv = [
        sys.executable,
        "-m",
        "kvtier.cli.main",
        "size",
        "--model",
        model,
        "--trace",
        str(trace),
        "--gpu-kv-tokens",
        "0",
        "--chunk-size",
        str(chunk_size),
        "--block-size",
        str(BLOCK_SIZE),
        "--json",
        *extra,
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"kvtier size failed ({proc.returncode}): {proc.stderr[-3000:]}")
    rep: dict[str, Any] = json.loads(proc.stdout)
    return rep


def planner_served(
    trace: Path, chunk_size: int, trace_block_size: int | None = None
) -> tuple[list[int], int]:
    """served[s] (tokens a tier of s chunks serves) and the prompt tokens, from the
    planner's own simulation (the CLI prints 40 points of it)."""
    from kvtier.sizing.trace import TraceFormat, plan_trace

    sim, _ = plan_trace(
        str(trace),
        tokenizer=None,
        block_size=BLOCK_SIZE,
        chunk_size=chunk_size,
        gpu_kv_tokens=0,
        form=TraceFormat(block_size=trace_block_size),
    )
    return sim.served(), sim.prompt_tokens


def max_request_chunks(trace: Path, chunk_size: int) -> int:
    """Full chunks of the trace's longest prompt."""
    return max(
        len(json.loads(ln)["prompt_token_ids"]) // chunk_size
        for ln in trace.read_text().splitlines()
        if ln.strip()
    )


def pick_slots(
    served: list[int], floor: int, fractions: tuple[float, ...] = FRACTIONS
) -> list[int]:
    """The smallest tier (in slots) reaching each fraction of the curve's range, at least
    ``floor`` slots (below the longest prompt's chunks the model is not exact: see
    docs/sizing.md, Sizing from a request trace)."""
    top = served[-1]
    out = []
    for f in fractions:
        s = next(i for i, v in enumerate(served) if v >= f * top)
        out.append(max(1, floor, s))
    return out


def lru_hits_per_request(trace: Path, slots: int, chunk_size: int) -> list[int]:
    """The planner's rules for one tier size, request by request (an LRU of ``slots``
    chunk keys): to find the requests where the engine differs from the model."""
    from collections import OrderedDict

    from kvtier.keys import chunk_block_hashes, token_block_hashes

    lru: OrderedDict[bytes, None] = OrderedDict()
    out = []
    for ln in trace.read_text().splitlines():
        if not ln.strip():
            continue
        r = json.loads(ln)
        ids = r["prompt_token_ids"]
        keys = chunk_block_hashes(
            token_block_hashes(ids, BLOCK_SIZE, r.get("cache_salt")), chunk_size // BLOCK_SIZE
        )
        cap = (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
        hit = 0
        for c, k in enumerate(keys):
            if c * chunk_size >= cap or k not in lru:
                break
            hit = min((c + 1) * chunk_size, cap)
        out.append(hit)
        for k in keys:
            lru[k] = None
            lru.move_to_end(k)
            while len(lru) > slots:
                lru.popitem(last=False)
    return out


def rate_at(served: list[int], prompt_tokens: int, slots: int) -> float:
    return served[min(slots, len(served) - 1)] / prompt_tokens


# ------------------------------------------------------------------------- replay


def replay(
    model: str, trace: Path, cpu_bytes: int, chunk_size: int, batch: int = 1
) -> dict[str, Any]:
    """One engine, this host-tier size: every request of the trace, one at a time (or
    ``batch`` consecutive requests at once; then the hits are per batch)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.connectors.vllm import scheduler_side

    ktc = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.connectors.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes": cpu_bytes,
            "chunk_size": chunk_size,
            "cpu_headroom_bytes": "256MiB",
        },
    }
    llm = LLM(
        model=model,
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=4096,
        seed=0,
        kv_transfer_config=ktc,
    )
    # the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): kvtier's
    # scheduler side and its counters are at hand
    core: Any = llm.llm_engine.engine_core
    side = scheduler_side(core.engine_core.scheduler.connector)
    sp = SamplingParams(max_tokens=1, temperature=0)
    requests = [json.loads(ln) for ln in trace.read_text().splitlines() if ln.strip()]
    hits: list[int] = []
    cached: list[int] = []
    resets_failed = pending_after = 0
    t0 = time.monotonic()
    for i in range(0, len(requests), batch):
        if not llm.reset_prefix_cache():
            resets_failed += 1
        before = side.totals["hit_tokens_host"]
        prompts = []
        for r in requests[i : i + batch]:
            tp = TokensPrompt(prompt_token_ids=r["prompt_token_ids"])
            if r.get("cache_salt"):
                tp["cache_salt"] = r["cache_salt"]
            prompts.append(tp)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        hits.append(side.totals["hit_tokens_host"] - before)
        cached.append(sum(o.num_cached_tokens or 0 for o in outs))
        pending_after = max(pending_after, side.pending_ops())
    # the totals' names as this build of the connector declares them
    totals = dict(side.totals)
    skipped = totals.get("stores_skipped", totals.get("store_skipped", 0))
    result = {
        "cpu_bytes": cpu_bytes,
        "batch": batch,
        "slot_bytes": side.slot_bytes,
        "num_slots": side.index.num_slots,
        "requests": len(requests),
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in requests),
        "hit_tokens_host": sum(hits),
        "cached_tokens_vllm": sum(cached),
        "per_request_hits": hits,
        "resets_failed": resets_failed,
        "max_pending_ops_after_request": pending_after,
        "stores_skipped": skipped,
        "evictions": totals.get("evictions", 0),
        "store_failed": totals.get("store_failed", 0),
        "load_failed": totals.get("load_failed", 0),
        "replay_s": time.monotonic() - t0,
    }
    llm.llm_engine.engine_core.shutdown()
    return result


def run_replay(
    model: str, trace: Path, cpu_bytes: int, chunk_size: int, batch: int = 1, timeout: float = 900
) -> dict[str, Any]:
    """:func:`replay` in a fresh process (one engine per process, engine core inside it)."""
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", omp_cpus()),
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    argv = [
        sys.executable,
        __file__,
        "--phase-replay",
        json.dumps(
            {
                "model": model,
                "trace": str(trace),
                "cpu_bytes": cpu_bytes,
                "chunk_size": chunk_size,
                "batch": batch,
            }
        ),
    ]
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            out: dict[str, Any] = json.loads(line[len("RESULT ") :])
            out["engine_s"] = time.monotonic() - t0
            return out
    raise RuntimeError(
        f"replay at cpu_bytes={cpu_bytes} ended without a result "
        f"(exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )


# ---------------------------------------------------------------------- the check


def run(
    model_dir: Path,
    workdir: Path,
    shape: TraceShape,
    chunk_size: int,
    slots: list[int] | None = None,
    below: bool = False,
    batch: int = 1,
    parallel: int = 1,
    hash_shape: HashTraceShape | None = None,
) -> dict[str, Any]:
    """Generate the trace, predict, replay at three sizes (and with ``below`` at one size
    under the longest prompt's chunks, with ``batch`` > 1 at the largest size with that
    many requests at a time): the whole comparison. With ``hash_shape`` the trace is a
    hash-id (Mooncake-format) one: the planner reads it as it is, the engine gets each id's
    tokens."""
    from kvtier.cli.tinymodel import build_tiny_llama

    model = str(build_tiny_llama(model_dir))
    trace = workdir / "trace.jsonl"
    plan_from, extra, tbs, fmt = trace, (), None, "tokens"
    if hash_shape is None:
        n = generate_trace(trace, shape)
    else:
        plan_from, tbs, fmt = workdir / "trace_hash.jsonl", hash_shape.block_size, "mooncake"
        extra = ("--trace-block-size", str(tbs))
        generate_hash_trace(plan_from, hash_shape)
        n = expand_trace(plan_from, trace, tbs)
    curve = planner_curve(model, plan_from, chunk_size, extra)
    served, prompt_tokens = planner_served(plan_from, chunk_size, tbs)
    # the ids planned without their tokens, and the tokens the engine gets: one curve
    same_as_tokens = planner_served(trace, chunk_size) == (served, prompt_tokens)
    slot_bytes = int(curve["keys"]["host_slot_bytes"])
    k_max = max_request_chunks(trace, chunk_size)
    sizes = [(s, False, 1) for s in (slots or pick_slots(served, k_max))]
    if below and k_max > 1:
        sizes.append((max(1, k_max // 2), True, 1))
    if batch > 1:  # where kvtier has the most to lose to its batch neighbours
        sizes.append((max(s for s, is_below, _ in sizes if not is_below), False, batch))
    # the hit rates do not depend on timing (one request at a time in each engine), so
    # the engines may run side by side: their start-up is mostly one core's work
    with ThreadPoolExecutor(max(1, parallel)) as pool:
        runs = list(
            pool.map(
                lambda sz: run_replay(model, trace, sz[0] * slot_bytes, chunk_size, sz[2]), sizes
            )
        )
    points = []
    for (s, is_below, _), m in zip(sizes, runs, strict=True):
        cpu_bytes = s * slot_bytes
        measured = m["hit_tokens_host"] / m["prompt_tokens"]
        predicted = rate_at(served, prompt_tokens, cpu_bytes // slot_bytes)
        differ: list[int] = []
        if m["batch"] == 1:  # batched, the hits are per batch
            model_hits = lru_hits_per_request(trace, s, chunk_size)
            differ = [
                i
                for i, (a, b) in enumerate(zip(model_hits, m["per_request_hits"], strict=True))
                if a != b
            ]
        points.append(
            {
                "slots": s,
                "cpu_bytes": cpu_bytes,
                "below_longest_prompt": is_below,
                "predicted_hit_rate": predicted,
                "measured_hit_rate": measured,
                "difference_pp": (measured - predicted) * 100,
                "requests_differing": len(differ),
                "first_differing": differ[:10],
                **m,
            }
        )
        print(
            f"[cpu_bytes {cpu_bytes} ({s} slots): predicted {predicted * 100:.1f} %, "
            f"measured {measured * 100:.1f} %, {len(differ)} requests differ, "
            f"engine {m['engine_s']:.0f} s]",
            file=sys.stderr,
            flush=True,
        )
    return {
        "trace": {
            **curve["trace"],
            "path": plan_from.name,
            "generated_requests": n,
            "max_request_chunks": k_max,
            "shape": asdict(hash_shape if hash_shape is not None else shape),
        },
        "format": fmt,
        "planned_from_ids_as_from_tokens": same_as_tokens,
        "chunk_size": chunk_size,
        "block_size": BLOCK_SIZE,
        "planner_slot_bytes": slot_bytes,
        "max_hit_rate": served[-1] / prompt_tokens,
        "curve": curve["host_tier"],
        "points": points,
        "machine": {
            "cpus": len(os.sched_getaffinity(0)),
            "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", omp_cpus()),
        },
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the small trace the e2e test runs")
    p.add_argument("--chunk-size", type=int, default=128)
    p.add_argument(
        "--slots",
        type=int_list,
        help="host-tier sizes in slots (default: the "
        "sizes at 20, 50 and 90 %% of the curve's range)",
    )
    p.add_argument(
        "--no-below",
        action="store_true",
        help="skip the extra replay at half "
        "the longest prompt's chunks (where the model is known not to be exact)",
    )
    p.add_argument(
        "--batched",
        type=int,
        help="also replay the largest size this many "
        "requests at a time (default 4; 1: not; --quick: not)",
    )
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="engines run at once (the hit rates do not depend on it; the start-ups overlap)",
    )
    p.add_argument("--seed", type=int, default=0, help="trace seed")
    p.add_argument(
        "--hash-ids",
        action="store_true",
        help="a hash-id (Mooncake-format) "
        "trace instead: planned from the ids, replayed as each id's tokens",
    )
    p.add_argument("--model-dir", help="where to build the tiny model (default: a temp dir)")
    p.add_argument("--workdir", help="where the trace goes (default: a temp dir)")
    p.add_argument("--plot", help="draw the curve and the measured points into this PNG")
    p.add_argument("--json", dest="json_out", help="write the result to this JSON file")
    p.add_argument("--phase-replay", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.phase_replay:
        a = json.loads(args.phase_replay)
        res = replay(a["model"], Path(a["trace"]), a["cpu_bytes"], a["chunk_size"], a["batch"])
        print("RESULT " + json.dumps(res), flush=True)
        os._exit(0)  # skip vLLM's slow interpreter teardown
    shape = QUICK if args.quick else TraceShape()
    shape = TraceShape(**{**asdict(shape), "seed": args.seed})
    hash_shape = None
    if args.hash_ids:
        hash_shape = HASH_QUICK if args.quick else HASH_REPLAY
        hash_shape = HashTraceShape(**{**asdict(hash_shape), "seed": args.seed})
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvtier-trace-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model_dir or os.path.join(tempfile.gettempdir(), "kvtier-tiny4"))
    res = run(
        model_dir,
        workdir,
        shape,
        args.chunk_size,
        args.slots,
        below=not args.quick and not args.no_below,
        batch=args.batched if args.batched is not None else (1 if args.quick else 4),
        parallel=args.parallel,
        hash_shape=hash_shape,
    )
    print_trace_replay(res)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1) + "\n")
    if args.plot:
        trace_replay_plot(res, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
