"""The restart hit in ``LLM``'s multiprocess engine (the one ``vllm serve`` runs), step by
step: when kvtier's lookup answered, how many engine steps ran while its chunks were
fetched, how long each step's hand-off to the worker took, the load copies, and the rest
beside vLLM's own in-engine hit of the same prompt.

``bench/ttft.py --profile`` times an in-process engine; this one leaves the engine as
``vllm serve`` runs it. kvtier's connector class is wrapped at import, in every process
that imports this script (vLLM spawns the engine core and the worker, which re-import the
main script), never changed; each process appends its events to a file of its own.
With ``--serve`` the same requests go through ``vllm serve`` itself (its OpenAI API,
streamed): the server loads kvtier's connector from this module (``KVTierConnector``
below), so the engine core and the worker wrap it as they import it, and "request in"
is when the client sent the request (the API server's part included).

    python bench/mp_steps.py --tokens 2048 --samples 8 [--serve] [--gap-s 0]
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

_DIR_VAR = "KVTIER_BENCH_STEPS_DIR"
_files: dict[int, TextIO] = {}  # this process's events file, opened once (not in each step)


def _log(event: str, detail: str = "") -> None:
    f = _files.get(os.getpid())
    if f is None:
        path = os.path.join(os.environ[_DIR_VAR], f"{os.getpid()}.log")
        f = _files[os.getpid()] = open(path, "a", buffering=1)  # noqa: SIM115 (one per process)
    f.write(f"{time.time():.6f} {event} {detail}\n")


def _wrap_connector() -> None:
    """Log the connector calls the timeline needs, with how long each took (ms)."""
    from kvtier.connectors.vllm import KVTierConnector as C

    def lookup(a: tuple, r: tuple) -> str:
        return "ask-again" if r[0] is None else str(r[0])

    def nothing(a: tuple, r: object) -> str:
        return ""

    formats = {"get_num_new_matched_tokens": lookup, "build_connector_meta": nothing,
               "bind_connector_metadata": nothing, "start_load_kv": nothing}
    for name, fmt in formats.items():
        orig = getattr(C, name)

        def wrapped(self, *a, _orig=orig, _name=name, _fmt=fmt, **k):  # type: ignore[no-untyped-def]
            t = time.time()
            r = _orig(self, *a, **k)
            _log(_name, f"{(time.time() - t) * 1e3:.3f} {_fmt(a, r)}")
            return r

        setattr(C, name, wrapped)


def read_events(out_dir: str) -> list[tuple[float, str, list[str]]]:
    """Every process's events, in time order: (seconds, event, fields)."""
    events = []
    for path in glob.glob(os.path.join(out_dir, "*.log")):
        with open(path) as f:
            for line in f:
                t, ev, *rest = line.split()
                events.append((float(t), ev, rest))
    return sorted(events, key=lambda e: e[0])


def split_requests(events: Iterable[tuple[float, str, list[str]]]) -> list[dict[str, float]]:
    """Per timed request (between ``begin`` and ``end``, which the bench process logs; a
    request whose lookup never answered is left out): ms from the request's submission to
    kvtier's first lookup of it and to the lookup's answer, the engine steps and the
    slowest hand-off (scheduler built the step -> the worker bound it) before it, the load
    copies, and the TTFT."""
    out: list[dict[str, float]] = []
    cur: dict[str, float] | None = None
    built = t0 = 0.0
    for t, ev, f in events:
        if ev == "begin":
            cur, t0 = {"kind": float(f[0] == "restart"), "steps before answer": 0.0,
                       "slowest hand-off before answer": 0.0, "answer": float("nan"),
                       "first lookup": float("nan"), "copies": 0.0}, t  # fmt: skip
        elif cur is None:
            continue
        if ev == "get_num_new_matched_tokens" and math.isnan(cur["first lookup"]):
            cur["first lookup"] = (t - t0) * 1e3
        if not math.isnan(cur["answer"]):
            if ev == "start_load_kv":
                cur["copies"] += float(f[0])
            elif ev == "end":
                cur["ttft"] = (t - t0) * 1e3
                out.append(cur)
                cur = None
        elif ev == "get_num_new_matched_tokens" and f[1] != "ask-again":
            cur["answer"] = (t - t0) * 1e3
        elif ev == "build_connector_meta":
            built = t
            cur["steps before answer"] += 1
        elif ev == "bind_connector_metadata" and built:
            hand_off = (t - float(f[0]) / 1e3 - built) * 1e3
            key = "slowest hand-off before answer"
            cur[key] = max(cur[key], hand_off)
    return out


def timeline(events: Iterable[tuple[float, str, list[str]]], nth: int) -> str:
    """The ``nth`` (from 1) timed restart hit's events, ms after it was sent: each
    connector call with how long it took (ms) and, for a lookup, its answer."""
    lines: list[str] = []
    seen, t0 = 0, None
    for t, ev, f in events:
        if ev == "begin":
            if t0 is not None:
                break
            seen += f[0] == "restart"
            if seen == nth and f[0] == "restart":
                t0 = t
                lines.append(f"restart hit {nth}: ms after it was sent, call, ms it took")
        elif t0 is not None:
            lines.append(f"{(t - t0) * 1e3:8.2f}  {ev:<28} {' '.join(f)}")
    return "\n".join(lines)


def summary(requests: list[dict[str, float]]) -> str:
    """Medians of the restart hits beside the in-engine hits, as a table."""
    rows = ["first lookup", "answer", "steps before answer", "slowest hand-off before answer",
            "copies", "ttft"]
    names = {"first lookup": "request in -> kvtier's first lookup of it (ms)",
             "answer": "request in -> kvtier's lookup answers (ms)",
             "steps before answer": "engine steps before the answer",
             "slowest hand-off before answer": "slowest step hand-off to the worker before it (ms)",
             "copies": "load copies, host slot -> vLLM's KV cache (ms)",
             "ttft": "time to first token (ms)"}  # fmt: skip
    restart = [r for r in requests if r["kind"]]
    engine = [r for r in requests if not r["kind"]]
    lines = [f"{'median of ' + str(len(restart)):<52} {'restart hit':>12} {'in-engine hit':>14}"]
    for k in rows:
        a = statistics.median(r[k] for r in restart) if restart else float("nan")
        b = statistics.median(r[k] for r in engine) if engine else float("nan")
        if k == "answer":
            b = float("nan")  # vLLM's own hit asks kvtier once and gets 0 tokens
        cells = [f"{v:.1f}" if not math.isnan(v) else "-" for v in (a, b)]
        lines.append(f"{names[k]:<52} {cells[0]:>12} {cells[1]:>14}")
    return "\n".join(lines)


def __getattr__(name: str) -> object:
    """``vllm serve`` (``--serve``) loads ``KVTierConnector`` from this module: kvtier's,
    wrapped when this module was imported."""
    if name == "KVTierConnector":
        from kvtier.connectors.vllm import KVTierConnector

        return KVTierConnector
    raise AttributeError(name)


def _serve_first_token(url: str, tokens: list[int]) -> None:
    """One greedy one-token request to ``vllm serve``, streamed; ``end`` is logged when its
    token arrives."""
    import httpx

    body = {"model": "bench", "prompt": tokens, "max_tokens": 1, "temperature": 0,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120,
                      trust_env=False) as r:  # fmt: skip
        r.raise_for_status()
        ended = False
        for line in r.iter_lines():
            if line.startswith("data:") and not ended and os.environ.get(_DIR_VAR):
                _log("end", "")
                ended = True
        if not ended and os.environ.get(_DIR_VAR):
            raise RuntimeError("vllm serve streamed no token")


def _serve(model: str, max_len: int, extra: dict, work: str, run: Callable[[Any], None],
           timed: bool, kv_mib: int, policy: str = "recompute") -> None:
    """Start ``vllm serve`` with kvtier (``timed``: loaded from this module, so its calls
    are logged), call ``run(request)`` with a function that sends one prompt, stop it."""
    from harness import VLLMServer

    from kvtier.sizing.emit import shutdown_flags

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    env = {"PYTHONPATH": os.pathsep.join([here, root, os.environ.get("PYTHONPATH", "")])}
    if timed:
        env[_DIR_VAR] = os.environ[_DIR_VAR]
    ktc = {"kv_connector": "KVTierConnector", "kv_role": "kv_both",
           "kv_connector_module_path": "mp_steps" if timed else "kvtier.connectors.vllm",
           "kv_connector_extra_config": {"cpu_bytes": "1GiB", "cpu_headroom_bytes": "1GiB",
                                         "chunk_size": 256, **extra},
           "kv_load_failure_policy": policy}  # fmt: skip
    stop_env, stop_args = shutdown_flags(ktc["kv_connector_extra_config"])  # the writes flush
    env |= stop_env
    server = VLLMServer(python=sys.executable, model=Path(model), kv_transfer=ktc,
                        kv_cache_bytes=kv_mib << 20, max_model_len=max_len, env=env,
                        log=Path(work) / f"vllm-{'timed' if timed else 'writer'}.log",
                        args=stop_args)  # fmt: skip
    server.start()
    try:
        run(lambda tokens: _serve_first_token(server.url, tokens))
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length")
    ap.add_argument("--samples", type=int, default=8, help="restart hits timed")
    ap.add_argument("--json", action="store_true", help="also print the requests as JSON")
    ap.add_argument("--serve", action="store_true",
                    help="through `vllm serve` (its OpenAI API, streamed) instead of LLM's "
                    "multiprocess engine")  # fmt: skip
    ap.add_argument("--kv-cache-mib", type=int, default=4096,
                    help="vLLM's KV cache with --serve (68: make bench's 4,096 tokens; the "
                    "timed prompts then evict each other)")  # fmt: skip
    ap.add_argument("--timeline", type=int, default=0, metavar="N",
                    help="also print the N-th timed restart hit's connector calls")
    ap.add_argument("--gap-s", type=float, default=0.3,
                    help="seconds between timed requests (0: back to back, as `make bench` "
                    "sends them)")  # fmt: skip
    ap.add_argument("--file-cache", choices=("warm", "cold"), default="warm",
                    help="the tier's files in the page cache before each restart hit (warm: "
                         "a restart on the node that wrote them) or dropped from it (cold)")
    ap.add_argument("--policy", choices=("recompute", "fail"), default="recompute",
                    help="vLLM's kv_load_failure_policy (recompute: a local directory tier's "
                         "lookups answer in their own step; fail: they take a step of their "
                         "own)")  # fmt: skip
    args = ap.parse_args()
    from harness import omp_cpus

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_cpus())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from llm_engine import kvtier_llm, prompt, seeds, timed_request, tiny_model
    from restart_tiers import set_file_cache

    model, max_len = tiny_model([args.tokens], 8, 1024)
    ss = seeds(10, args.samples + 2)
    def store(request: Callable[[list[int]], Any]) -> None:
        for s in ss:
            request(prompt(s, args.tokens))

    def restart_hits(request: Callable[[list[int]], Any]) -> None:
        request(prompt(ss[0], args.tokens))  # the first request after the restart
        request(prompt(ss[1], 300))
        for kind in ("restart", "engine"):  # the same prompts: a restart hit, then vLLM's
            for s in ss[2:]:
                set_file_cache(extra, args.file_cache if kind == "restart" else "warm")
                time.sleep(args.gap_s)
                _log("begin", kind)
                request(prompt(s, args.tokens))
                if not args.serve:  # (the streamed request logs it at its token)
                    _log("end", kind)

    with tempfile.TemporaryDirectory() as work:
        extra = {"remote_url": f"file://{os.path.join(work, 'tier')}"}
        steps_dir = os.path.join(work, "steps")
        os.makedirs(steps_dir)
        if args.serve:
            _serve(str(model), max_len, extra, work, store, timed=False, kv_mib=args.kv_cache_mib,
                   policy=args.policy)
            os.environ[_DIR_VAR] = steps_dir
            _serve(str(model), max_len, extra, work, restart_hits, timed=True,
                   kv_mib=args.kv_cache_mib, policy=args.policy)
        else:
            writer = kvtier_llm(model, max_len, extra, failure_policy=args.policy)
            store(lambda tokens: timed_request(writer, tokens))
            writer.llm_engine.engine_core.shutdown()  # flushes queued uploads
            os.environ[_DIR_VAR] = steps_dir
            llm = kvtier_llm(model, max_len, extra, failure_policy=args.policy)
            restart_hits(lambda tokens: timed_request(llm, tokens))
            llm.llm_engine.engine_core.shutdown()  # stops the engine's processes
        events = read_events(steps_dir)
        requests = split_requests(events)
    print(summary(requests))
    if args.timeline:
        print(timeline(events, args.timeline))
    if args.json:
        print(json.dumps(requests))


if os.environ.get(_DIR_VAR):
    _wrap_connector()  # in the engine core and the worker, which vLLM spawns

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
