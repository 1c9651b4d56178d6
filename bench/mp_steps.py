"""The restart hit in ``LLM``'s multiprocess engine (the one ``vllm serve`` runs), step by
step: when kvtier's lookup answered, how many engine steps ran while its chunks were
fetched, how long each step's hand-off to the worker took, the load copies, and the rest
beside vLLM's own in-engine hit of the same prompt.

``bench/ttft.py --profile`` times an in-process engine; this one leaves the engine as
``vllm serve`` runs it. kvtier's connector class is wrapped at import, in every process
that imports this script (vLLM spawns the engine core and the worker, which re-import the
main script), never changed; each process appends its events to a file of its own.

    python bench/mp_steps.py --tokens 2048 --samples 8
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
from collections.abc import Iterable
from typing import TextIO

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
    request whose lookup never answered is left out): ms
    from the request's submission to the lookup's answer, the engine steps and the slowest
    hand-off (scheduler built the step -> the worker bound it) before it, the load copies,
    and the TTFT."""
    out: list[dict[str, float]] = []
    cur: dict[str, float] | None = None
    built = t0 = 0.0
    for t, ev, f in events:
        if ev == "begin":
            cur, t0 = {"kind": float(f[0] == "restart"), "steps before answer": 0.0,
                       "slowest hand-off before answer": 0.0, "answer": float("nan"),
                       "copies": 0.0}, t  # fmt: skip
        elif cur is None:
            continue
        elif not math.isnan(cur["answer"]):
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


def summary(requests: list[dict[str, float]]) -> str:
    """Medians of the restart hits beside the in-engine hits, as a table."""
    rows = ["answer", "steps before answer", "slowest hand-off before answer", "copies", "ttft"]
    names = {"answer": "request in -> kvtier's lookup answers (ms)",
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length")
    ap.add_argument("--samples", type=int, default=8, help="restart hits timed")
    ap.add_argument("--json", action="store_true", help="also print the requests as JSON")
    ap.add_argument("--file-cache", choices=("warm", "cold"), default="warm",
                    help="the tier's files in the page cache before each restart hit (warm: "
                         "a restart on the node that wrote them) or dropped from it (cold)")
    args = ap.parse_args()
    from harness import omp_cpus

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_cpus())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from llm_engine import kvtier_llm, prompt, seeds, timed_request, tiny_model
    from restart_tiers import set_file_cache

    model, max_len = tiny_model([args.tokens], 8, 1024)
    ss = seeds(10, args.samples + 2)
    with tempfile.TemporaryDirectory() as work:
        extra = {"remote_url": f"file://{os.path.join(work, 'tier')}"}
        writer = kvtier_llm(model, max_len, extra)
        for s in ss:
            timed_request(writer, prompt(s, args.tokens))
        writer.llm_engine.engine_core.shutdown()  # flushes queued uploads
        os.environ[_DIR_VAR] = os.path.join(work, "steps")
        os.makedirs(os.environ[_DIR_VAR])
        llm = kvtier_llm(model, max_len, extra)
        timed_request(llm, prompt(ss[0], args.tokens))  # the first request after the restart
        timed_request(llm, prompt(ss[1], 300))
        for kind in ("restart", "engine"):  # the same prompts: a restart hit, then vLLM's
            for s in ss[2:]:
                set_file_cache(extra, args.file_cache if kind == "restart" else "warm")
                time.sleep(0.3)
                _log("begin", kind)
                timed_request(llm, prompt(s, args.tokens))
                _log("end", kind)
        llm.llm_engine.engine_core.shutdown()  # stops the engine's processes
        requests = split_requests(read_events(os.environ[_DIR_VAR]))
    print(summary(requests))
    if args.json:
        print(json.dumps(requests))


if os.environ.get(_DIR_VAR):
    _wrap_connector()  # in the engine core and the worker, which vLLM spawns

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
