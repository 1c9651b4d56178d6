"""Host-tier hit TTFT against vLLM's own prefix hit and a cold prefill, in one run.

On a locally built 8-layer, 1024-wide Llama and a 2,048-token prompt, measures
the median time to first token of

  (a) a cold prefill (nothing cached anywhere),
  (b) vLLM's own in-engine prefix-cache hit,
  (c) a kvtier host-tier hit right after ``LLM.reset_prefix_cache()``,

and prints c/b and c/a. Each sample uses a fresh prompt so (a) is really cold.

With ``--restart file,s3,redis`` it then measures, for each object tier,
(d) a hit after an engine restart: one engine stores the prompts and exits, a
new engine (empty host tier) serves them from the object tier, and d/b is
printed beside c/b. S3 is moto's server and Redis Debian's redis-server, both
started on loopback by this script.

Run it with ``make bench-ttft`` (about 3 minutes on 2 cores, plus ~1 minute a tier).

Each restart hit is split: the in-engine hit, the backend's own client on the same stored
chunks (open + readinto, redis-py GET, boto3 GetObject on kvtier's read threads: the
bytes' share) and the rest, kvtier's own cost, side by side per tier and length.
``--compression lossless`` stores and reads the chunks compressed (both engines); ``auto``
stores them in the form the writing engine's own timed reads favour (raw until it has read
both forms).

``--sweep 512,1024,2048,4096,8192`` measures (a), (b), (c) and (d) for every
tier of ``--restart`` (default: file, s3, redis) at each prompt length instead,
and ``--plot out.png`` draws them (matplotlib): TTFT by prompt length, and TTFT
divided by the cold prefill of the same length. ``--profile DIR`` runs one more
restart engine per tier in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with
cProfile on the engine thread and on kvtier's I/O threads and a timeline of every
object-tier op, and writes them to DIR; ``--timeline-only`` keeps the timeline (lookup
answered, load copies, first token) without cProfile's overhead, and
``--load-copy-threads N`` runs the loads' copies on N OpenMP threads there.

``--canary-rates 0,0.001,0.01`` measures instead what the canary's sample
(``canary_rate``) costs object-tier hits in TTFT and throughput, every rate on one
engine, interleaved, each against rate 0 (bench/canary_cost.py says how; ``make
bench-canary``).

Every engine's OpenMP threads are bound to all CPUs this process may use
(``VLLM_CPU_OMP_THREADS_BIND``), as ``make bench`` does.

This script is the scenario; its engines are llm_engine.py's, its object tiers
restart_tiers.py's, its profile engine_profile.py's, its tables and plot in tables.py
and plots.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import canary_cost
from engine_profile import Profiler, copies_on_threads, profile_summary
from harness import int_list, omp_cpus
from llm_engine import kvtier_llm, prompt, seeds, timed_request, tiny_model
from plots import ttft_sweep_plot
from restart_tiers import copy_objects, object_tier, raw_client, set_file_cache
from tables import print_ttft_one, print_ttft_sweep

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_cpus())


def _phase(
    args: argparse.Namespace,
    phase: str,
    extra: dict,
    env: dict,
    profile: str = "",
    baseline: bool = False,
) -> dict:
    """Run one engine of the restart measurement in its own process."""
    cmd = [
        sys.executable,
        __file__,
        "--phase",
        phase,
        "--extra",
        json.dumps(extra),
        "--lengths",
        ",".join(map(str, args.lengths)),
        "--samples",
        str(args.samples),
        "--layers",
        str(args.layers),
        "--hidden",
        str(args.hidden),
        "--compression",
        args.compression,
        "--io-threads",
        str(args.io_threads),
    ]
    if args.model_dir:
        cmd += ["--model-dir", args.model_dir]
    if baseline:
        cmd += ["--baseline"]
    if profile:
        cmd += ["--profile-out", profile] + (["--timeline-only"] if args.timeline_only else [])
        cmd += ["--load-copy-threads", str(args.load_copy_threads)]
        env = {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    # the engine core's own traceback comes before the client's: keep its error lines too
    cause = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "signal" in ln]
    raise RuntimeError(
        f"{phase} engine failed (exit {proc.returncode}):\n"
        + "\n".join(cause[:20])
        + "\n...\n"
        + proc.stderr[-4000:]
    )


def _restart_engine(args: argparse.Namespace, llm_factory) -> dict:
    """--phase write: store the prompts and exit. --phase read: (d) then (b) per prompt,
    for every length of --lengths; the result is keyed by length."""
    extra = json.loads(args.extra)
    if args.load_copy_threads:
        copies_on_threads(args.load_copy_threads)
    llm = llm_factory(extra)
    # the engine's first request; in --phase read a restart hit (--phase write stored it)
    first_s, first_cached = timed_request(llm, prompt(999, min(args.lengths)))
    plan_seeds = seeds(500, args.samples * len(args.lengths))
    plan = [
        (n, plan_seeds[li * args.samples + i])
        for i in range(args.samples)
        for li, n in enumerate(args.lengths)
    ]
    if args.phase == "write":
        base: dict[int, dict[str, list]] = {
            n: {"cold": [], "engine": [], "host": [], "cached_engine": [], "cached_host": []}
            for n in args.lengths
        }
        for n, seed in plan:
            p = prompt(seed, n)
            t = timed_request(llm, p)[0]
            if args.baseline:  # (a), (b), (c) on the prompts this engine stores
                base[n]["cold"].append(t)
                t, c = timed_request(llm, p)
                base[n]["engine"].append(t)
                base[n]["cached_engine"].append(c)
                llm.reset_prefix_cache()
                t, c = timed_request(llm, p)
                base[n]["host"].append(t)
                base[n]["cached_host"].append(c)
        llm.llm_engine.engine_core.shutdown()  # flushes queued uploads
        if not args.baseline:
            return {}
        return {
            str(n): {
                "cold_ttft_s": statistics.median(b["cold"]),
                "engine_hit_ttft_s": statistics.median(b["engine"]),
                "kvtier_hit_ttft_s": statistics.median(b["host"]),
                "cold_all_s": b["cold"],
                "engine_hit_all_s": b["engine"],
                "kvtier_hit_all_s": b["host"],
                "cached_tokens_engine": b["cached_engine"][0],
                "cached_tokens_kvtier": b["cached_host"][0],
            }
            for n, b in base.items()
        }
    prof = Profiler(cprofile=not args.timeline_only) if args.profile_out else None
    restart_hit: dict[int, list] = {n: [] for n in args.lengths}
    engine_hit: dict[int, list] = {n: [] for n in args.lengths}
    cached: dict[int, list] = {n: [] for n in args.lengths}
    for n, seed in plan:
        p = prompt(seed, n)
        if prof:
            prof.start(n)
        t, c = timed_request(llm, p)  # host tier empty: served by the object tier
        if prof:
            prof.stop(t)
        restart_hit[n].append(t)
        cached[n].append(c)
        engine_hit[n].append(timed_request(llm, p)[0])
    llm.llm_engine.engine_core.shutdown()  # stops the engine's processes
    if prof:
        prof.write(args.profile_out)  # after the I/O threads stopped and saved their profiles
    return {
        str(n): {
            "restart_hit_ttft_s": statistics.median(restart_hit[n]),
            "engine_hit_ttft_s": statistics.median(engine_hit[n]),
            "restart_hit_all_s": restart_hit[n],
            "engine_hit_all_s": engine_hit[n],
            "cached": cached[n],
            "first_request": {
                "tokens": min(args.lengths),
                "ttft_s": first_s,
                "cached": first_cached,
            },
        }
        for n in args.lengths
    }


def _lengths(text: str) -> list[int]:
    return int_list(text, minimum=64)  # a prompt length of at least one chunk's worth


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length")
    parser.add_argument("--samples", type=int, default=7, help="prompts per case")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--model-dir", help="where to build the model (default: a temp dir)")
    parser.add_argument(
        "--compression",
        choices=["none", "lossless", "auto"],
        default="none",
        help="kvtier's compression of object-tier chunks (both engines)",
    )
    parser.add_argument(
        "--io-threads",
        type=int,
        default=4,
        help="kvtier's io_threads (half of them read; the raw client's "
        "baseline reads on as many threads)",
    )
    parser.add_argument(
        "--file-cache",
        choices=["warm", "cold"],
        default="warm",
        help="the file tier's objects in the page cache before its restart "
        "hits and each raw-client read (warm: a vLLM restarted on the node "
        "that wrote them) or out of it (cold: read from the device)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--restart",
        default="",
        help="comma-separated object tiers to measure a hit after an engine restart on "
        "(file, s3, redis)",
    )
    parser.add_argument(
        "--sweep",
        type=_lengths,
        help="comma-separated prompt lengths: every case at each of them "
        "(--restart defaults to file,s3,redis)",
    )
    parser.add_argument("--plot", help="with --sweep: draw the sweep into this PNG")
    parser.add_argument("--out", help="also write the result JSON to this file")
    parser.add_argument(
        "--profile",
        help="profile a restart hit per tier into this directory "
        "(an extra in-process engine per tier)",
    )
    parser.add_argument("--phase", choices=["write", "read"], help=argparse.SUPPRESS)
    parser.add_argument("--extra", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--lengths", type=_lengths, help=argparse.SUPPRESS)
    parser.add_argument("--profile-out", default="", help=argparse.SUPPRESS)
    parser.add_argument(
        "--load-copy-threads",
        type=int,
        default=0,
        help="with --profile: the loads' copies on this many OpenMP threads "
        "(an experiment on the copier; 0: as the engine runs them)",
    )
    parser.add_argument(
        "--timeline-only",
        action="store_true",
        help="with --profile: the timeline alone, without cProfile's overhead",
    )
    parser.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    canary_cost.add_args(parser)
    args = parser.parse_args(argv)
    if args.plot and not args.sweep:
        parser.error("--plot needs --sweep")
    if args.sweep and not args.restart:
        args.restart = "file,s3,redis"
    if args.lengths is None:
        args.lengths = args.sweep or [args.tokens]
    bad = set(filter(None, args.restart.split(","))) - {"file", "s3", "redis"}
    if bad:
        parser.error(f"--restart takes file, s3, redis; not {', '.join(sorted(bad))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.canary_rates:  # its engine in this process: the canary's counters are read
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    import vllm  # noqa: F401  vLLM's import-time setup first, as before every engine

    if args.canary_rates:
        canary_cost.main(args)
        os._exit(0)  # skip the interpreter's slow teardown

    model, max_len = tiny_model(args.lengths, args.layers, args.hidden, args.model_dir)

    def make_llm(extra: dict):
        # profiled: scheduler, worker and kvtier's I/O threads all in this process
        return kvtier_llm(
            model,
            max_len,
            {"compression": args.compression, "io_threads": args.io_threads, **extra},
            in_process=bool(args.profile_out),
        )

    if args.phase:
        print("RESULT " + json.dumps(_restart_engine(args, make_llm)), flush=True)
        os._exit(0)
    restarts: dict[str, dict] = {}
    baseline: dict[str, dict] = {}
    written = ""  # --sweep: the file tier the one writing engine filled
    if args.restart:
        args.model_dir = str(model)
        kinds = list(filter(None, args.restart.split(",")))
        if args.sweep:  # one engine stores every prompt (and measures a, b, c) for all tiers
            written = os.path.join(tempfile.mkdtemp(prefix="kvtier-bench-"), "tier")
            t0 = time.monotonic()
            baseline = _phase(args, "write", {"remote_url": f"file://{written}"}, {}, baseline=True)
            print(f"[write + baseline: {time.monotonic() - t0:.0f} s]", file=sys.stderr, flush=True)
        for kind in kinds:
            t0 = time.monotonic()
            with object_tier(kind, tempfile.mkdtemp(prefix="kvtier-bench-")) as (extra, env):
                if not written:
                    _phase(args, "write", extra, env)
                elif kind == "file":
                    extra = {"remote_url": f"file://{written}"}
                else:
                    copy_objects(written, kind, extra)
                set_file_cache(extra, args.file_cache)  # (a no-op on other tiers)
                restarts[kind] = _phase(args, "read", extra, env)
                # the backend's own client on the same chunks: the bytes' share of a hit
                raw = raw_client(
                    kind,
                    extra,
                    args.lengths,
                    threads=(args.io_threads + 1) // 2,
                    file_cache=args.file_cache,
                )
                for n, v in raw.items():
                    restarts[kind][n]["raw"] = v
                if args.profile:
                    where = os.path.join(args.profile, kind)
                    set_file_cache(extra, args.file_cache)
                    inproc = _phase(args, "read", extra, env, profile=where)
                    for n, v in inproc.items():  # the same hits, engine in this process
                        restarts[kind][n]["inprocess"] = {
                            k: v[k] for k in ("restart_hit_ttft_s", "engine_hit_ttft_s")
                        }
                        print(
                            f"[{kind} {n} tokens, in-process engine: restart hit "
                            f"{v['restart_hit_ttft_s'] * 1000:.1f} ms, in-engine hit "
                            f"{v['engine_hit_ttft_s'] * 1000:.1f} ms]",
                            file=sys.stderr,
                        )
                    print(
                        f"\n[profile of the {kind} tier: {where}]\n" + profile_summary(where),
                        file=sys.stderr,
                        flush=True,
                    )
            print(f"[{kind}: {time.monotonic() - t0:.0f} s]", file=sys.stderr, flush=True)
        if written:  # the one writing engine's file tier (GiB at long prompts)
            shutil.rmtree(os.path.dirname(written), ignore_errors=True)
    if baseline:
        _report(args, {int(n): v for n, v in baseline.items()}, restarts)
        os._exit(0)
    llm = make_llm({})
    timed_request(llm, prompt(999, min(args.lengths)))  # warm-up: first-run kernel setup
    cold: dict[int, list] = {n: [] for n in args.lengths}
    engine_hit: dict[int, list] = {n: [] for n in args.lengths}
    kvtier_hit: dict[int, list] = {n: [] for n in args.lengths}
    cached: dict[int, dict] = {n: {"engine": [], "kvtier": []} for n in args.lengths}
    plan_seeds = seeds(0, args.samples * len(args.lengths))
    for i in range(args.samples):
        for li, n in enumerate(args.lengths):
            p = prompt(plan_seeds[li * args.samples + i], n)
            llm.reset_prefix_cache()
            cold[n].append(timed_request(llm, p)[0])
            t, c = timed_request(llm, p)
            engine_hit[n].append(t)
            cached[n]["engine"].append(c)
            llm.reset_prefix_cache()
            t, c = timed_request(llm, p)
            kvtier_hit[n].append(t)
            cached[n]["kvtier"].append(c)
    base = {
        n: {
            "cold_ttft_s": statistics.median(cold[n]),
            "engine_hit_ttft_s": statistics.median(engine_hit[n]),
            "kvtier_hit_ttft_s": statistics.median(kvtier_hit[n]),
            "cached_tokens_engine": cached[n]["engine"][0],
            "cached_tokens_kvtier": cached[n]["kvtier"][0],
        }
        for n in args.lengths
    }
    _report(args, base, restarts)
    llm.llm_engine.engine_core.shutdown()  # stop the engine core and worker processes
    os._exit(0)  # then skip the interpreter's slow teardown


def _report(args: argparse.Namespace, base: dict[int, dict], restarts: dict[str, dict]) -> None:
    """Print (and write, and plot) the result: ``base`` holds (a), (b), (c) by length."""
    by_len = {}
    for n in args.lengths:
        a, b, c = (base[n][k] for k in ("cold_ttft_s", "engine_hit_ttft_s", "kvtier_hit_ttft_s"))
        by_len[n] = {
            **base[n],
            "prompt_tokens": n,
            "kvtier_over_engine_hit": c / b,
            "kvtier_over_cold": c / a,
            "restart": {k: _breakdown(v[str(n)]) for k, v in restarts.items()},
        }
    machine = {
        "cpus": os.cpu_count(),
        "omp_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
        # other work on the CPUs slows every OpenMP step (the load's copies most)
        "loadavg_1m_at_end": os.getloadavg()[0],
        "file_cache": args.file_cache,
    }
    if args.sweep:
        result = {
            "samples": args.samples,
            "model": f"{args.layers} layers x {args.hidden}",
            "machine": machine,
            "sweep": [by_len[n] for n in args.lengths],
            "note": "(a), (b), (c) measured in the engine that stored the prompts "
            "(file tier configured); S3 and Redis hold copies of its objects",
        }
    else:
        result = {
            **by_len[args.tokens],
            "samples": args.samples,
            "machine": machine,
            "model": f"{args.layers} layers x {args.hidden}",
        }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.json:
        print(json.dumps(result))
    elif args.sweep:
        print_ttft_sweep(result)
    else:
        print_ttft_one(result)
    if args.plot:
        ttft_sweep_plot(result, args.plot)
    sys.stdout.flush()


def _breakdown(r: dict) -> dict:
    """One tier's restart hit at one length, split: the in-engine hit (what vLLM's own
    cache needs), the backend's raw client on the same chunks (the bytes' share) and
    the rest, kvtier's own cost (goal: at most 10 ms or 20 % of the raw time)."""
    out = {**r, "over_engine_hit": r["restart_hit_ttft_s"] / r["engine_hit_ttft_s"]}
    if "raw" in r:
        raw = r["raw"]["parallel_s"]
        out["kvtier_own_s"] = r["restart_hit_ttft_s"] - r["engine_hit_ttft_s"] - raw
        out["kvtier_own_goal_s"] = max(0.010, 0.2 * raw)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
