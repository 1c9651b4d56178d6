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
    .venv/bin/python bench/scheduler_cost.py --pricing  # what load_policy: cost adds to a lookup

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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TQDM_MININTERVAL", "1")
# vLLM CPU's own KV cache is planned beside kvtier's host tier when the config is built
# (kvtier.connectors.startup); unset, vLLM would take 92 % of the memory for it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from plots import scheduler_plot
from sched_probes import (
    index_memory,
    run_lookups,
    run_may_load_async,
    run_priced_lookups,
    worker_steps,
)
from sched_setup import (
    ANSWER_TOKENS,
    BLOCK,
    BUDGET,
    CHUNK,
    DECODE_PROMPT,
    HERE,
    VOCAB,
    Plan,
    completes_chunk,
    index_len,
    make_request,
    make_scheduler,
    model_output,
    plan_for,
    prefill_kvtier,
    prefill_offloading,
)
from tables import scheduler_may_load_async_table, scheduler_pricing_table, scheduler_table


# ---- one engine step ----------------------------------------------------------------------
@dataclass
class StepLog:
    us: list[float] = field(default_factory=list)
    meta_bytes: list[int] = field(default_factory=list)
    stores: int = 0
    loads: int = 0


def step(
    variant: str, sched: Any, log: StepLog | None, prof: Any = None, forward_s: float = 0.0
) -> tuple[Any, bool]:
    """One engine step: schedule, model output, update. Times the two scheduler calls;
    ``forward_s`` stands for the model's forward pass between them (a sleep: the GIL is
    free, as while vLLM's engine waits for its workers)."""
    if prof is not None:
        prof.enable()
    t0 = time.perf_counter()
    so = sched.schedule()
    t1 = time.perf_counter()
    if prof is not None:
        prof.disable()
    if forward_s:
        time.sleep(forward_s)
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
            if variant.startswith("kvtier"):
                log.stores += len(meta.stores)
                log.loads += len(meta.loads)
            else:
                log.stores += len(meta.store_jobs)
                log.loads += len(meta.load_jobs)
    return so, crossed


# ---- the step benchmark -------------------------------------------------------------------
def run_case(
    plan: Plan, running: int, n_index: int, bar: Any, profile_variant: str | None = None
) -> tuple[list[dict[str, Any]], Any]:
    """Both phases for one (running, index) pair; returns one record per phase."""
    rng = random.Random(f"{plan.seed}-{running}-{n_index}")
    arrivals = [rng.randint(8192, 32768) for _ in range(plan.prefill_steps)]
    num_blocks = running * 48 + sum(arrivals) // BLOCK + 8192  # nothing is ever preempted
    scheds = {v: make_scheduler(v, n_index, running + 8, num_blocks) for v in plan.variants}
    fill_rng = random.Random(f"fill-{plan.seed}-{n_index}")
    for v, s in scheds.items():
        if v.startswith("kvtier"):
            prefill_kvtier(s, n_index, random.Random(fill_rng.random()))
        elif v == "offloading":
            prefill_offloading(s, n_index, random.Random(fill_rng.random()))
    decode_prompts = [
        [rng.randrange(2, VOCAB) for _ in range(DECODE_PROMPT)] for _ in range(running)
    ]
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
                so, crossed = step(v, scheds[v], logs[v], p, plan.forward_s)
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
        if "kvtier-whatif-off" in logs:
            # the ghosts' cost, step by step: both ran the same step, side by side
            paired = [
                on - off
                for on, off in zip(logs["kvtier"].us, logs["kvtier-whatif-off"].us, strict=True)
            ]
            rec["whatif_added_us_paired_median"] = round(statistics.median(paired), 1)
        records.append(rec)
    for s in scheds.values():
        s.shutdown()
    del scheds
    gc.collect()
    return records, prof


def whatif_cost_table(steps: list[dict[str, Any]]) -> str:
    """The what-if ghosts' cost per step: kvtier's step with them over without (same
    lockstep, same requests), median step times in µs."""
    lines = [
        "",
        "what-if ghosts (whatif: true vs false, same lockstep; paired: the median of "
        "the per-step differences, each step run by both side by side):",
        f"{'running':>8} {'chunks':>10} {'phase':>8} {'off µs':>9} {'on µs':>9} "
        f"{'on/off':>7} {'paired µs':>10} {'paired %':>9}",
    ]
    for r in steps:
        on, off = r["kvtier_step_us"], r["kvtier-whatif-off_step_us"]
        paired = r["whatif_added_us_paired_median"]
        lines.append(
            f"{r['running_requests']:>8} {r['index_chunks']:>10,} {r['phase']:>8} "
            f"{off:>9.1f} {on:>9.1f} {on / off:>7.3f} {paired:>10.1f} "
            f"{100 * paired / off:>8.2f}%"
        )
    return "\n".join(lines)


def profile_report(prof: Any, top: int) -> list[dict[str, Any]]:
    """kvtier's functions (connector facade, scheduler side, index, keys) by own time."""
    import pstats

    st = pstats.Stats(prof)
    rows = []
    for (filename, line, name), (_cc, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        norm = filename.replace(os.sep, "/")
        if "/connectors/" in norm or "/kvtier/" in norm:
            where = "/".join(norm.split("/")[-2:])
            rows.append(
                {
                    "function": f"{where}:{line}({name})",
                    "calls": nc,
                    "tottime_ms": round(tt * 1000, 2),
                    "cumtime_ms": round(ct * 1000, 2),
                }
            )
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
    p.add_argument(
        "--quick",
        action="store_true",
        help="small run: 16/64 running, 1k/4k chunks, 10+10 steps (< 1 min)",
    )
    p.add_argument("--running", help="comma-separated running-request counts (overrides)")
    p.add_argument("--index", help="comma-separated index sizes in chunks, e.g. 1e4,1e6")
    p.add_argument("--steps", type=int, help="measured steps per phase (default 60, quick 10)")
    p.add_argument(
        "--no-offloading", action="store_true", help="leave vLLM's OffloadingConnector out"
    )
    p.add_argument(
        "--whatif-off",
        action="store_true",
        help="also run kvtier with whatif: false in the same lockstep (the "
        "kvtier-whatif-off columns): the what-if ghosts' cost is the difference",
    )
    p.add_argument(
        "--forward-ms",
        type=float,
        default=0.0,
        help="a model forward pass between schedule() and update_from_output() "
        "(a sleep, not timed; default 0): threads such as the what-if ghosts' "
        "run then, as in a real engine",
    )
    p.add_argument(
        "--out",
        default=str(HERE / "results" / "scheduler.json"),
        help="JSON results file (default: bench/results/scheduler.json)",
    )
    p.add_argument("--plot", metavar="PNG", help="write a plot of the curves to this PNG")
    p.add_argument(
        "--profile",
        action="store_true",
        help="only cProfile kvtier's scheduler in the worst case (largest running "
        "count and index) and print where its time goes, function by function",
    )
    p.add_argument("--top", type=int, default=25, help="functions shown by --profile")
    p.add_argument(
        "--may-load-async",
        action="store_true",
        help="only time may_load_async against each index size and print it "
        "(writes no results file)",
    )
    p.add_argument(
        "--pricing",
        action="store_true",
        help="only time what load_policy: cost adds to an object-tier lookup (a 32k-token "
        "prompt priced chunk by chunk, against load_policy: always in the same run) and "
        "to a step, and print it (writes no results file)",
    )
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
        with tqdm(
            total=plan.decode_steps + plan.prefill_steps, disable=args.no_progress, desc="profile"
        ) as bar:
            recs, prof = run_case(plan, running, n, bar, profile_variant="kvtier")
        for r in recs:
            print(
                f"{r['phase']}: vLLM {r['vllm_step_us']:.0f} µs, kvtier "
                f"{r['kvtier_step_us']:.0f} µs ({r['kvtier_ratio']:.2f}x, profiled)"
            )
        print(
            f"kvtier functions, {running} running, {n:,} chunks, "
            f"{plan.decode_steps}+{plan.prefill_steps} steps:"
        )
        print(f"{'own ms':>9} {'cum ms':>9} {'calls':>8}  function")
        for row in profile_report(prof, args.top):
            print(
                f"{row['tottime_ms']:9.1f} {row['cumtime_ms']:9.1f} {row['calls']:8d}  "
                f"{row['function']}"
            )
        import cProfile

        lprof = cProfile.Profile()
        with tqdm(total=3, disable=args.no_progress, desc="profile lookups") as bar:
            looks = run_lookups(plan, n, bar, lprof)
        print(
            f"\nget_num_new_matched_tokens, 32k-token prompt, {n:,} chunks, "
            f"{plan.lookup_samples} x hit/partial/miss:"
        )
        for r in looks:
            print(
                f"  {r['outcome']}: p50 {r['p50_us']:.0f} µs, p99 {r['p99_us']:.0f} µs (profiled)"
            )
        print(f"{'own ms':>9} {'cum ms':>9} {'calls':>8}  function")
        for row in profile_report(lprof, args.top):
            print(
                f"{row['tottime_ms']:9.1f} {row['cumtime_ms']:9.1f} {row['calls']:8d}  "
                f"{row['function']}"
            )
        return 0

    if args.may_load_async:
        rows = [r for n in plan.index_sizes for r in run_may_load_async(plan, n)]
        print(scheduler_may_load_async_table(rows))
        return 0

    if args.pricing:
        rows = [r for n in plan.index_sizes for r in run_priced_lookups(plan, n)]
        print(scheduler_pricing_table(rows))
        return 0

    cases = [(r, n) for n in plan.index_sizes for r in plan.running]
    probed = [v for v in plan.variants if v in ("kvtier", "offloading")]
    n_lookup = len(plan.index_sizes) * 3 * len(probed)
    total = len(cases) * (plan.decode_steps + plan.prefill_steps) + n_lookup
    result: dict[str, Any] = {
        "benchmark": "scheduler_cost",
        "command": " ".join(["bench/scheduler_cost.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
        },
        "variants": list(plan.variants),
        "settings": {
            "block_size": BLOCK,
            "chunk_size": CHUNK,
            "max_num_batched_tokens": BUDGET,
            "decode_prompt_tokens": DECODE_PROMPT,
            "arriving_prompt_tokens": [8192, 32768],
            "decode_steps": plan.decode_steps,
            "prefill_steps": plan.prefill_steps,
            "lookup_samples": plan.lookup_samples,
            "index_prefill": "direct (ChunkIndex.begin/commit; manager prepare/complete)",
            "metadata_serialization": "pickle.HIGHEST_PROTOCOL (vLLM MessageQueue)",
        },
        "steps": [],
        "lookups": [],
        "memory": [],
        "worker": [],
        "may_load_async": [],
        "pricing": [],
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
            result["pricing"].extend(run_priced_lookups(plan, n))
    result["seconds"] = round(time.monotonic() - t_start, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(scheduler_table(result))
    if "kvtier-whatif-off" in plan.variants:
        print(whatif_cost_table(result["steps"]))
    print(scheduler_pricing_table(result["pricing"]))
    print(f"\nwrote {args.out} in {result['seconds']:.0f} s")
    if args.plot:
        scheduler_plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
