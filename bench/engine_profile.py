"""A profile of restart hits in an in-process engine (``bench/ttft.py --profile``):
cProfile of the engine thread and of kvtier's I/O threads, a timeline of every
object-tier op, the lookup's answer and the loads' copies, and its text summary.

kvtier's classes are wrapped here, in the benchmark's process, never changed; the
engine must run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import json
import os
import statistics
import time


def profile_summary(out_dir: str, top: int = 25) -> str:
    """Text summary of a --profile directory: the timeline of the restart hits (medians
    per prompt length) and the functions with the most own time on each side."""
    import io
    import pstats

    lines = []
    with open(os.path.join(out_dir, "timeline.json")) as f:
        reqs = json.load(f)
    phases: dict[int, dict[str, list[float]]] = {}
    for r in reqs:
        ops = r["ops"]
        gets = sorted((o for o in ops if o["kind"] == "fetch"), key=lambda o: o["queued"])
        if not gets:
            continue
        last = max(g["end"] for g in gets)
        answers = [o for o in ops if o["kind"] == "answer" and o["end"] >= last]
        loads = [o for o in ops if o["kind"] == "load"]
        g0, rest = gets[0], gets[1:] or gets[:1]
        ph = {
            "until first get submitted": g0["queued"],
            "first get: queue wait": g0["start"] - g0["queued"],
            "first get: backend call (read_into + verify)": g0["end"] - g0["start"],
            "first get done -> rest submitted": min(g["queued"] for g in rest) - g0["end"],
            "gets: first submitted -> last done": max(g["end"] for g in gets) - g0["queued"],
            "gets: sum of backend calls (read_into + verify)": sum(
                g["end"] - g["start"] for g in gets
            ),
            "gets: mean queue wait": statistics.mean(g["start"] - g["queued"] for g in gets),
            "last get done -> first token": r["ttft_s"] - last,
            # a one-step lookup answered before its reads, in the step that asked
            "  last get done -> lookup answered (scheduler; 0: one step)": (
                answers[0]["end"] - last if answers else 0.0
            ),
            "  then -> load copies begin": (
                loads[0]["start"] - (answers[0]["end"] if answers else last)
                if loads
                else float("nan")
            ),
            "  load copies (slot -> vLLM's KV cache)": sum(o["end"] - o["start"] for o in loads),
            "  load copies done -> first token": (
                r["ttft_s"] - loads[-1]["end"] if loads else float("nan")
            ),
            "TTFT": r["ttft_s"],
            "gets": len(gets),
        }
        for k, v in ph.items():
            phases.setdefault(r["tokens"], {}).setdefault(k, []).append(v)
    for n, ph in sorted(phases.items()):
        lines.append(f"restart hit, {n}-token prompt, median of {len(ph['TTFT'])}:")
        for k, v in ph.items():
            med = statistics.median(v)
            lines.append(
                f"  {k:<60} {med:.0f}" if k == "gets" else f"  {k:<60} {med * 1000:8.1f} ms"
            )
    for name in ("engine_thread", "io_threads"):
        path = os.path.join(out_dir, name + ".prof")
        if not os.path.exists(path):
            continue
        buf = io.StringIO()
        st = pstats.Stats(path, stream=buf)
        st.sort_stats("tottime").print_stats(top)
        lines.append(f"\n== {name}: own time (tottime), top {top} ==")
        lines += [ln for ln in buf.getvalue().splitlines() if ln.strip()][-top - 2 :]
        buf = io.StringIO()
        st = pstats.Stats(path, stream=buf)
        st.sort_stats("cumulative").print_stats(top)
        lines.append(f"\n== {name}: cumulative time, top {top} ==")
        lines += [ln for ln in buf.getvalue().splitlines() if ln.strip()][-top - 2 :]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
        f.write(text)
    return text


def copies_on_threads(n: int) -> None:
    """--load-copy-threads: the host-tier loads' copies into vLLM's KV cache on ``n``
    OpenMP threads (the engine's other work keeps all of them). An experiment on the
    copier from the benchmark's process: in-process engines only (--profile)."""
    import torch

    from kvtier.host.transfer import CpuCopier

    orig = CpuCopier.begin_loads

    def begin_loads(copier, jobs):
        if not jobs:
            return orig(copier, jobs)
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            return orig(copier, jobs)
        finally:
            torch.set_num_threads(before)

    CpuCopier.begin_loads = begin_loads


class Profiler:
    """--profile-out: cProfile of the engine thread and of RemoteIO's worker threads
    during the restart hits, and a timeline of every object-tier op (engine in-process).

    RemoteIO is wrapped here, in the benchmark's process, not changed."""

    def __init__(self, cprofile: bool = True) -> None:
        import cProfile
        import threading

        from kvtier.connectors.scheduler.side import SchedulerSide
        from kvtier.host.transfer import CpuCopier
        from kvtier.objects.remote import RemoteIO

        self.cprofile = cprofile
        self.main = cProfile.Profile()
        self.io: list = []
        self.events: list[dict] = []
        self.requests: list[dict] = []
        self.active = False
        self._lock = threading.Lock()
        orig_worker, orig_execute = RemoteIO._worker, RemoteIO._execute
        prof = self

        def worker(rio, q):  # each I/O thread profiles itself
            p = cProfile.Profile()
            with prof._lock:
                prof.io.append(p)
            if not prof.cprofile:
                return orig_worker(rio, q)
            p.enable()
            try:
                return orig_worker(rio, q)
            finally:
                p.disable()

        def execute(rio, op):
            t1, mono1 = time.perf_counter(), time.monotonic()
            try:
                return orig_execute(rio, op)
            finally:
                if prof.active:
                    t2 = time.perf_counter()
                    queued = t1 - (mono1 - op.t0)  # when it was submitted
                    prof.events.append(
                        {
                            "kind": str(op.kind),
                            "thread": threading.current_thread().name,
                            "queued": queued,
                            "start": t1,
                            "end": t2,
                        }
                    )

        RemoteIO._worker, RemoteIO._execute = worker, execute
        orig_loads, orig_ask = CpuCopier.begin_loads, SchedulerSide.get_num_new_matched_tokens

        def begin_loads(copier, jobs):  # the loads' copies into vLLM's KV cache
            t1 = time.perf_counter()
            try:
                return orig_loads(copier, jobs)
            finally:
                if prof.active and jobs:
                    prof.events.append(
                        {"kind": "load", "queued": t1, "start": t1, "end": time.perf_counter()}
                    )

        def ask(side, request, computed):  # the scheduler's lookup: "ask again" or a number
            t1 = time.perf_counter()
            out = orig_ask(side, request, computed)
            if prof.active and out[0] is not None:
                prof.events.append(
                    {
                        "kind": "answer",
                        "queued": t1,
                        "start": t1,
                        "end": time.perf_counter(),
                        "tokens": out[0],
                    }
                )
            return out

        CpuCopier.begin_loads, SchedulerSide.get_num_new_matched_tokens = begin_loads, ask
        self._t0 = 0.0

    def start(self, tokens: int) -> None:
        self.events_start = len(self.events)
        self._tokens = tokens
        self.active = True
        self._t0 = time.perf_counter()
        if self.cprofile:
            self.main.enable()

    def stop(self, ttft: float) -> None:
        if self.cprofile:
            self.main.disable()
        self.active = False
        t0 = self._t0
        ev = [
            {**e, "queued": e["queued"] - t0, "start": e["start"] - t0, "end": e["end"] - t0}
            for e in self.events[self.events_start :]
        ]
        self.requests.append({"tokens": self._tokens, "ttft_s": ttft, "ops": ev})

    def write(self, out_dir: str) -> None:
        import pstats

        os.makedirs(out_dir, exist_ok=True)
        if self.cprofile:
            self.main.dump_stats(os.path.join(out_dir, "engine_thread.prof"))
        io_stats = None
        for p in self.io if self.cprofile else ():
            p.create_stats()
            if not p.stats:
                continue
            if io_stats is None:
                io_stats = pstats.Stats(p)
            else:
                io_stats.add(p)
        if io_stats is not None:
            io_stats.dump_stats(os.path.join(out_dir, "io_threads.prof"))
        with open(os.path.join(out_dir, "timeline.json"), "w") as f:
            json.dump(self.requests, f, indent=1)
