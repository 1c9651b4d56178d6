"""The cost of the canary's sample (``canary_rate``) on TTFT and throughput, in one run.

A sampled request (kvtier.canary: a fraction ``canary_rate`` of the requests whose hit
the object tier would serve) gets no kvtier hit: vLLM computes its prefix, and its first
chunk the object tier holds is read and compared with the computed one. Its cost is a
prefill instead of a hit, plus one object read. This measures it on object-tier hits
(the only hits a sample can check: a request the host tier serves in full is never
drawn), on one engine:

1. one engine (the bench's tiny Llama, a ``file://`` object tier written through,
   ``canary_first_hit`` on: the engine claims the empty generation and is its first
   writer) stores ``--prompts`` prompts of ``--tokens`` tokens;
2. then, ``--rounds`` times, for every rate of ``--canary-rates`` (the order rotated each
   round, so the machine's drift and neighbours hit every rate alike): the rate is set on
   the running engine's canary (``GenerationTrust.rate``, what ``canary_rate`` sets at
   start), then
   - TTFT: each prompt alone, vLLM's prefix cache and kvtier's host tier emptied before
     it (``reset_prefix_cache(reset_connector=True)``): an object-tier hit, or a sample;
   - throughput: every prompt at once (one ``generate`` of ``--prompts`` requests,
     ``--max-tokens`` each), both caches emptied first: requests and tokens per second.

Printed per rate: TTFT median and mean, throughput, each divided by rate 0's; the
requests drawn as canaries (a request with no cached token) against the number expected
(rate x requests), and the canary's checks by outcome. At 0.01 a run of a few hundred
requests per rate draws only a few: the table also gives the cost one sample adds
(sampled TTFT over hit TTFT) and the TTFT ratio it projects at each rate
(1 + rate x (sampled / hit - 1)), which needs no large sample.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the canary's
counters can be read; its OpenMP threads are bound to every CPU this process may use
(``VLLM_CPU_OMP_THREADS_BIND``), as the other benches do. Run from bench/ttft.py:
``python bench/ttft.py --canary-rates 0,0.001,0.01`` (``make bench-canary``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from llm_engine import kvtier_llm, prompt, seeds, timed_request, tiny_model


def rates(text: str) -> list[float]:
    """``0,0.001,0.01`` -> the rates, 0 first (the baseline every ratio divides by)."""
    out = sorted({float(x) for x in text.split(",") if x.strip()})
    if not out or any(not 0.0 <= r <= 1.0 for r in out):
        raise argparse.ArgumentTypeError("canary rates between 0 and 1, e.g. 0,0.001,0.01")
    return out if out[0] == 0.0 else [0.0, *out]


def _side(llm: Any) -> Any:
    """kvtier's scheduler side (the engine core in this process)."""
    from kvtier.connectors.vllm import scheduler_side

    return scheduler_side(llm.llm_engine.engine_core.engine_core.scheduler.connector)


def _settle(llm: Any, timeout_s: float = 60.0) -> None:
    """Run tiny requests until every upload, fetch and check the workers owe is reported."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    deadline = time.monotonic() + timeout_s
    while _side(llm).pending_ops() and time.monotonic() < deadline:
        llm.generate(
            [TokensPrompt(prompt_token_ids=[7, 8, 9])], SamplingParams(max_tokens=1), use_tqdm=False
        )


def _checks(side: Any) -> dict[str, int]:
    return {
        k.removeprefix("canary_checks_"): int(v)
        for k, v in side.totals.items()
        if k.startswith("canary_checks_")
    }


def _batch(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, int]:
    """All ``prompts`` in one generate: (seconds, tokens in and out, requests with no
    cached token: the canaries)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.prompt_token_ids or []) + len(o.outputs[0].token_ids) for o in outs)
    return wall, tokens, sum(1 for o in outs if not o.num_cached_tokens)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The measurement (the module's docstring); returns the result per rate."""
    random.seed(args.seed)  # the canary's draws (random.random): the same run, the same draws
    model, max_len = tiny_model([args.tokens], args.layers, args.hidden, args.model_dir)
    tier = tempfile.mkdtemp(prefix="kvtier-bench-canary-")
    extra = {
        "remote_url": f"file://{tier}",
        "write_policy": "write_through",
        "canary_first_hit": True,
        "canary_rate": 0.0,
        "io_threads": args.io_threads,
    }
    llm = kvtier_llm(model, max_len, extra, in_process=True)
    try:
        side = _side(llm)
        timed_request(llm, prompt(999, args.tokens))  # warm-up: first-run kernel setup
        prompts = [prompt(s, args.tokens) for s in seeds(0, args.prompts)]
        _batch(llm, prompts, 1)  # stored: host tier and object tier
        _settle(llm)
        trust = side.canary.trust.state
        assert side.canary.trusted, f"the engine should be the first writer: {trust}"
        per: dict[float, dict[str, Any]] = {
            r: {
                "ttft": [],
                "cached": [],
                "batch_s": [],
                "batch_tokens": 0,
                "batch_requests": 0,
                "batch_sampled": 0,
                "checks": {},
            }
            for r in args.canary_rates
        }
        order = list(args.canary_rates)
        t_start = time.monotonic()
        for rnd in range(args.rounds):
            for rate in order[rnd % len(order) :] + order[: rnd % len(order)]:
                res = per[rate]
                side.canary.trust.rate = rate
                before = _checks(side)
                for p in prompts:
                    llm.reset_prefix_cache(reset_connector=True)
                    t, cached = timed_request(llm, p)
                    res["ttft"].append(t)
                    res["cached"].append(cached)
                llm.reset_prefix_cache(reset_connector=True)
                wall, tokens, sampled = _batch(llm, prompts, args.max_tokens)
                res["batch_s"].append(wall)
                res["batch_tokens"] += tokens
                res["batch_requests"] += len(prompts)
                res["batch_sampled"] += sampled
                _settle(llm)
                for k, v in _checks(side).items():
                    res["checks"][k] = res["checks"].get(k, 0) + v - before.get(k, 0)
            print(
                f"[round {rnd + 1}/{args.rounds}: {time.monotonic() - t_start:.0f} s]",
                file=sys.stderr,
                flush=True,
            )
        state = side.canary.trust.state.value
    finally:
        llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(tier, ignore_errors=True)
    return _summary(args, per, state)


def _summary(args: argparse.Namespace, per: dict[float, dict[str, Any]], state: str) -> dict:
    rows = []
    for rate, r in per.items():
        hits = [t for t, c in zip(r["ttft"], r["cached"], strict=True) if c]
        drawn = [t for t, c in zip(r["ttft"], r["cached"], strict=True) if not c]
        requests = len(r["ttft"]) + r["batch_requests"]
        rows.append(
            {
                "rate": rate,
                "ttft_median_s": statistics.median(r["ttft"]),
                "ttft_mean_s": statistics.fmean(r["ttft"]),
                "hit_ttft_median_s": statistics.median(hits) if hits else None,
                "sampled_ttft_median_s": statistics.median(drawn) if drawn else None,
                "requests_per_s": r["batch_requests"] / sum(r["batch_s"]),
                "tokens_per_s": r["batch_tokens"] / sum(r["batch_s"]),
                "requests": requests,
                "sampled": len(drawn) + r["batch_sampled"],
                "expected_sampled": rate * requests,
                "checks": r["checks"],
            }
        )
    base = rows[0]
    all_hits = [row["hit_ttft_median_s"] for row in rows if row["hit_ttft_median_s"]]
    all_drawn = [
        t for r in per.values() for t, c in zip(r["ttft"], r["cached"], strict=True) if not c
    ]
    # one sample's cost, from every rate's samples (the sampled TTFT is a prefill)
    per_sample = (
        statistics.median(all_drawn) / statistics.median(all_hits)
        if all_drawn and all_hits
        else None
    )
    for row in rows:
        row["ttft_median_ratio"] = row["ttft_median_s"] / base["ttft_median_s"]
        row["ttft_mean_ratio"] = row["ttft_mean_s"] / base["ttft_mean_s"]
        row["throughput_ratio"] = row["requests_per_s"] / base["requests_per_s"]
        row["projected_ttft_mean_ratio"] = (
            1 + row["rate"] * (per_sample - 1) if per_sample is not None else None
        )
    return {
        "rows": rows,
        "sampled_over_hit_ttft": per_sample,
        "state": state,
        "prompts": args.prompts,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "model": f"{args.layers} layers x {args.hidden}",
        "machine": {
            "cpus": os.cpu_count(),
            "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ""),
            "loadavg_1m_at_end": os.getloadavg()[0],
        },
    }


def print_table(res: dict[str, Any]) -> None:
    print(
        f"canary_rate cost: {res['prompts']} prompts of {res['tokens']} tokens, "
        f"{res['rounds']} rounds, model {res['model']}, object-tier hits (file://), "
        f"engine state at end: {res['state']}"
    )
    print(
        f"{'rate':>7} {'TTFT med':>9} {'ratio':>6} {'TTFT mean':>10} {'ratio':>6} "
        f"{'proj.':>6} {'req/s':>7} {'ratio':>6} {'sampled':>8} {'expected':>8}  checks"
    )
    for r in res["rows"]:
        proj = r["projected_ttft_mean_ratio"]
        print(
            f"{r['rate']:>7g} {r['ttft_median_s'] * 1e3:>7.1f}ms {r['ttft_median_ratio']:>6.3f} "
            f"{r['ttft_mean_s'] * 1e3:>8.1f}ms {r['ttft_mean_ratio']:>6.3f} "
            f"{proj if proj is not None else float('nan'):>6.3f} "
            f"{r['requests_per_s']:>7.2f} {r['throughput_ratio']:>6.3f} "
            f"{r['sampled']:>8d} {r['expected_sampled']:>8.1f}  "
            f"{json.dumps(r['checks'], sort_keys=True)}"
        )
    s = res["sampled_over_hit_ttft"]
    print(
        "one sample's TTFT over an object-tier hit's: "
        + (f"{s:.2f}x" if s is not None else "no sample drawn (raise --rounds)")
    )
    print(
        "ratio: against canary_rate 0 in the same run; proj.: the mean TTFT ratio one "
        "sample's cost projects, 1 + rate x (that - 1)"
    )


def add_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "canary_rate cost (--canary-rates)",
        "TTFT and throughput of object-tier hits at each canary_rate, rate 0 the baseline, "
        "all on one engine, rates interleaved (see bench/canary_cost.py)",
    )
    group.add_argument(
        "--canary-rates",
        type=rates,
        metavar="R,R,...",
        help="measure the canary sample's cost at these rates (0 added if "
        "missing), e.g. 0,0.001,0.01",
    )
    group.add_argument(
        "--prompts",
        type=int,
        default=32,
        help="distinct prompts, each served once per rate per round as a "
        "TTFT request and once in the throughput batch (default 32)",
    )
    group.add_argument(
        "--rounds",
        type=int,
        default=10,
        help="rounds over every rate; requests per rate = 2 x prompts x "
        "rounds (default 10: 640; 0.01 draws about 6 of them)",
    )
    group.add_argument(
        "--max-tokens",
        type=int,
        default=16,
        help="tokens generated per request of the throughput batch",
    )
    group.add_argument("--seed", type=int, default=0, help="the canary's draws")


def main(args: argparse.Namespace) -> int:
    result = measure(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    sys.stdout.flush()
    return 0
