"""The restart hit, kvtier's file tier against vLLM's ExampleConnector, in alternating rounds.

``make bench`` times each configuration once, minutes apart, on a shared machine whose
speed drifts by more than the two differ. Here both run ``make bench``'s servers and
settings (``run_all.Setup``): each stores the same distinct prompts once, then, round
after round and in alternating order, is restarted and serves them again (every request
a hit from what outlived vLLM). Printed per configuration: each round's TTFTs, the median
of all and without each round's first request (the restarted server's first request),
and the time the connectors' worker calls took per hit (kvtier: reading and checking
the chunks as the step is bound, then the copies into the KV cache; ExampleConnector:
reading its files and writing them into the KV cache), which both make on the engine's
critical path. The connectors are wrapped, not changed, by this module, which the
servers load as their connector module.

    python bench/restart_ab.py --rounds 6            # about 6 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_LOG_VAR = "KVTIER_BENCH_AB_LOG"
NAMES = ("kvtier-file", "example")


def _timed(cls: type, calls: tuple[str, ...]) -> type:
    """``cls`` with each of ``calls`` appending "call ms" to the file $KVTIER_BENCH_AB_LOG."""

    def wrap(name: str) -> Any:
        orig = getattr(cls, name)

        def timed(self: Any, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(self, *a, **k)
            finally:
                with open(os.environ[_LOG_VAR], "a") as f:
                    f.write(f"{name} {(time.perf_counter() - t0) * 1e3:.3f}\n")

        return timed

    return type(cls.__name__, (cls,), {name: wrap(name) for name in calls})


def __getattr__(name: str) -> type:
    """The connector classes the servers load from this module (their worker calls timed)."""
    if name == "KVTierConnector":
        from kvtier.connectors.vllm import KVTierConnector

        return _timed(KVTierConnector, ("bind_connector_metadata", "start_load_kv"))
    if name == "ExampleConnector":
        from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
            ExampleConnector,
        )

        return _timed(ExampleConnector, ("start_load_kv",))
    raise AttributeError(name)


def prompts(n: int, tokens: int) -> list[list[int]]:
    """``n`` distinct token-id prompts of ``tokens`` tokens (no shared prefix)."""
    return [[(s * 7919 + i * 31 + s * s) % 400 + 10 for i in range(tokens)] for s in range(n)]


def serve(server: Any, batch: list[list[int]]) -> list[tuple[float, int]]:
    """Each prompt once, one at a time: (TTFT ms, tokens vLLM reported as cached)."""
    import httpx

    from kvtier.cli.bench_client import stream_completion
    from kvtier.cli.bench_records import RequestResult

    out = []
    with httpx.Client(timeout=120) as client:
        for i, p in enumerate(batch):
            res = RequestResult(0, i, 0.0)
            stream_completion(client, server.url, "bench", p, 1, res)
            if res.error or res.ttft_s is None:
                raise RuntimeError(f"request {i} failed: {res.error}")
            out.append((res.ttft_s * 1e3, res.cached_tokens or 0))
    return out


def worker_ms(log: Path) -> list[float]:
    """The connector's worker time per hit: its timed calls summed per engine step, steps
    that did nothing (under 0.2 ms) left out."""
    per_hit, cur = [], 0.0
    for line in log.read_text().splitlines():
        name, ms = line.split()
        cur += float(ms)
        if name == "start_load_kv":  # the step's last timed call
            if cur >= 0.2:
                per_hit.append(cur)
            cur = 0.0
    return per_hit


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="restarts of each server")
    ap.add_argument("--prompts", type=int, default=8, help="distinct prompts, stored once")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    import run_all

    from kvtier.cli.tinymodel import build_tiny_llama

    shape = run_all.SHAPES["bench"]
    work = Path(tempfile.mkdtemp(prefix="kvtier-restart-ab-"))
    model = build_tiny_llama(Path(tempfile.gettempdir()) / "kvtier-bench" / "models" / "bench",
                             **shape)  # fmt: skip
    setup_args = argparse.Namespace(model_shape="bench", no_install=True,
                                    kv_load_failure_policy="recompute")
    batch = prompts(args.prompts, args.tokens)
    servers, logs = {}, {}
    ttfts: dict[str, list[list[float]]] = {n: [] for n in NAMES}
    worker: dict[str, list[float]] = {n: [] for n in NAMES}
    with contextlib.ExitStack() as stack:  # a failed round leaves no server or store behind
        for name in NAMES:
            cfg = next(c for c in run_all.CONFIGS if c.name == name)
            st = stack.enter_context(run_all.Setup(cfg, work, setup_args, run_all.PLANS["full"]))
            assert st.kv_transfer is not None
            st.kv_transfer["kv_connector_module_path"] = "restart_ab"  # this module, wrapped
            logs[name] = work / f"{name}.calls"
            st.env |= {_LOG_VAR: str(logs[name]),
                       "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])}
            servers[name] = run_all.VLLMServer(
                python=st.python, model=model, kv_transfer=st.kv_transfer,
                kv_cache_bytes=run_all.DEVICE_CACHE_TOKENS * run_all.kv_bytes_per_token(shape),
                max_model_len=run_all.MAX_MODEL_LEN, env=st.env, log=st.workdir / "vllm.log",
                args=st.vllm_args)
            stack.callback(servers[name].stop)
        for name in NAMES:  # store every prompt once
            servers[name].start()
            serve(servers[name], batch)
            servers[name].stop()
        for r in range(args.rounds):
            for name in NAMES if r % 2 == 0 else NAMES[::-1]:
                logs[name].write_text("")
                servers[name].start()
                got = serve(servers[name], batch)
                servers[name].stop()
                short = [c for _, c in got if c < args.tokens - 64]
                if short:
                    raise RuntimeError(f"{name}: a restart request was not a hit ({short})")
                ttfts[name].append([t for t, _ in got])
                worker[name] += worker_ms(logs[name])
                print(f"round {r + 1} {name:<12} " + " ".join(f"{t:6.1f}" for t, _ in got),
                      file=sys.stderr, flush=True)
    return report(ttfts, worker, args)


def report(ttfts: dict[str, list[list[float]]], worker: dict[str, list[float]],
           args: argparse.Namespace) -> int:
    rows = {}
    for name in NAMES:
        every = [t for rnd in ttfts[name] for t in rnd]
        later = [t for rnd in ttfts[name] for t in rnd[1:]]
        rows[name] = {"p50": statistics.median(every), "p50_after_first": statistics.median(later),
                      "max": max(every), "worker_ms_p50": statistics.median(worker[name])}
    print(f"\nrestart hits, {args.rounds} alternating rounds of {args.prompts} prompts of "
          f"{args.tokens} tokens (ms)")
    print(f"{'':<14}{'TTFT p50':>10}{'w/o first':>11}{'max':>8}{'worker calls p50':>18}")
    for name, row in rows.items():
        print(f"{name:<14}{row['p50']:>10.1f}{row['p50_after_first']:>11.1f}{row['max']:>8.1f}"
              f"{row['worker_ms_p50']:>18.1f}")
    k, e = rows["kvtier-file"], rows["example"]
    later = e["p50_after_first"] / k["p50_after_first"]
    print(f"ExampleConnector ÷ kvtier, TTFT p50: {e['p50'] / k['p50']:.2f}x "
          f"(without each round's first request: {later:.2f}x; goal >= 1)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ttfts": ttfts}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
