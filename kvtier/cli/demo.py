"""``kvtier demo``: a real vLLM engine with kvtier on a locally built model.

Builds an 8-layer, 1024-wide Llama with random weights (nothing is downloaded),
then runs two engines, one after the other, each in its own process:

1. Engine 1 answers questions about a few long shared documents. vLLM's own
   prefix cache is flushed before every request, as GPU memory pressure would
   evict it in production; kvtier's host tier brings the document's KV back.
2. Engine 2 starts after engine 1 has exited, with an empty host tier, and gets
   its hits from the local-directory object tier engine 1 wrote.

It prints what each request cost: prompt tokens, tokens served by kvtier and from
which of its tiers, tokens vLLM's own prefix cache served, the prompt tokens kvtier
missed and why (``kvtier:miss_tokens`` reasons, the tail past the last full chunk
left out), and time to first token (TTFT), then TTFT cold vs with a kvtier hit.
vLLM's ``reset_prefix_cache()`` may refuse (while a finished request's blocks are
still held); the demo retries it and says so when it never succeeded, since vLLM's
own cache then serves what kvtier would have.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TextIO

DOC_TOKENS = 1536
QUESTION_TOKENS = 64
#: the engine's first request (kernel set-up), timed: the demo's measure of this machine
WARM_TOKENS = 200
#: seconds between two progress lines when stderr is not a terminal (a terminal gets one
#: line redrawn every PROGRESS_TICK seconds)
PROGRESS_EVERY = 10.0
PROGRESS_TICK = 0.5
#: seconds an engine takes to stop (and flush its uploads), as the estimate counts them
STOP_S = 5.0
#: exit status after Ctrl-C (128 + SIGINT, as a shell reports it)
INTERRUPTED = 130


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the demo's flags."""
    parser.add_argument(
        "--workdir",
        help="where the model, the object tier and the engines' logs go, kept afterwards "
        "(default: a new temporary directory, removed at the end, Ctrl-C or error alike)",
    )
    parser.add_argument("--docs", type=int, default=3, help="shared documents (default 3)")
    parser.add_argument(
        "--questions", type=int, default=3, help="questions per document (default 3)"
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="a 4-layer, 256-wide model: faster, but prefill is too cheap to show savings",
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the process exit code. A temporary directory of its own (the
    model alone is ~250 MB) is removed however the demo ends; Ctrl-C stops the engine
    without its shutdown noise and exits 130."""
    temporary = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvtier-demo-"))
    progress = Progress(sys.stderr)
    try:
        return _run(args, workdir, progress)
    except KeyboardInterrupt:
        progress.close()
        progress.say("stopped (Ctrl-C)" + (f"; {workdir} removed" if temporary else ""))
        return INTERRUPTED
    finally:
        progress.close()
        if temporary:
            shutil.rmtree(workdir, ignore_errors=True)


def _run(args: argparse.Namespace, workdir: Path, progress: Progress) -> int:
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    model_dir = workdir / ("model-small" if args.small else "model")
    tier_dir = workdir / "object-tier"
    shape = dict(layers=4, hidden=256) if args.small else dict(layers=8, hidden=1024)
    progress.say(
        "two vLLM engines start one after the other; how long a start takes "
        "depends on the CPU (30 s to 2 min): the first is timed, and the rest of "
        "the demo estimated from it"
    )
    progress.stage(
        f"building a {shape['layers']}-layer, {shape['hidden']}-wide Llama in {model_dir}"
    )
    from kvtier.cli.tinymodel import build_tiny_llama

    build_tiny_llama(
        model_dir, heads=16 if not args.small else 4, kv_heads=8 if not args.small else 2, **shape
    )
    common = {"model": str(model_dir), "tier": str(tier_dir), "docs": args.docs}
    progress.say("engine 1: host tier 1 GiB + local-directory object tier")
    first = _phase({**common, "phase": 1, "questions": args.questions}, workdir, progress)
    if first is None:
        return 1
    progress.say("engine 1 exited. engine 2: a new process with an empty host tier")
    second = _phase({**common, "phase": 2, "questions": 1}, workdir, progress)
    if second is None:
        return 1
    progress.close()
    _report(first, second)
    now, estimate, at = time.monotonic(), progress.estimate, progress.estimate_at
    progress.say(
        f"done in {duration(now - t0)}"
        + (
            f"; the rest after engine 1's start took {duration(now - at)}, estimated "
            f"{duration(estimate)}"
            if estimate is not None and at is not None
            else ""
        )
    )
    return 0


def duration(seconds: float) -> str:
    """``45 s``, ``2 min``, ``3 min 10 s``: rounded as an estimate deserves."""
    s = max(0, round(seconds))
    if s < 90:
        return f"{s} s"
    m, rest = divmod(round(s / 10) * 10, 60)
    return f"{m} min" + (f" {rest} s" if rest else "")


def estimate_rest(start_s: float, warm_s: float, docs: int, questions: int) -> float:
    """Seconds the demo still takes once engine 1 has started and timed its warm-up:
    engine 2 starts as slowly as engine 1 did; a cold document's prefill costs the
    warm-up's time per token (kernel set-up included: an upper side), a hit one
    warm-up; each engine stops in ``STOP_S``. Rough by design: said as "about"."""
    cold = warm_s * (DOC_TOKENS + QUESTION_TOKENS) / WARM_TOKENS
    engine1 = docs * cold + docs * max(0, questions - 1) * warm_s + cold  # + the check doc
    engine2 = start_s + warm_s + cold + docs * warm_s  # warm-up, canary check doc, hits
    return engine1 + engine2 + 2 * STOP_S


class Progress:
    """What the demo waits for and for how long, so minutes of engine start are not
    silent: on a terminal one status line redrawn with a spinner, otherwise (a log, CI) a
    line every ``every`` seconds. A ticker thread draws it; ``say`` prints over it."""

    SPIN = "|/-\\"

    def __init__(
        self,
        stream: TextIO,
        *,
        tty: bool | None = None,
        every: float = PROGRESS_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self.every = every
        self.clock = clock
        self.label = ""
        self.since = self.last = clock()
        self.spins = 0
        #: seconds engine 1 took to start, and the estimate said after its warm-up (when)
        self.started_s: float | None = None
        self.estimate: float | None = None
        self.estimate_at: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def stage(self, label: str, *, restart: bool = True) -> None:
        """Wait for ``label`` now; elapsed time counts from here unless ``restart`` is
        False (a later stage of the same engine)."""
        with self._lock:
            self.label = label
            now = self.clock()
            if restart:
                self.since = now
            self.last = now
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._tick_forever, daemon=True, name="kvtier-demo-progress"
            )
            self._thread.start()

    def _tick_forever(self) -> None:
        while not self._stop.wait(PROGRESS_TICK):
            self.tick()

    def tick(self) -> None:
        """Draw the status: redrawn on a terminal, a new line each ``every`` elsewhere."""
        with self._lock:
            if not self.label:
                return
            now = self.clock()
            elapsed = duration(now - self.since)
            if self.tty:
                self.spins += 1
                spin = self.SPIN[self.spins % len(self.SPIN)]
                self.stream.write(f"\r\033[K[kvtier demo] {self.label} {spin} {elapsed}")
                self.stream.flush()
            elif now - self.last >= self.every:
                self.last = now
                self.stream.write(f"[kvtier demo] {self.label} ... {elapsed}\n")
                self.stream.flush()

    def say(self, msg: str) -> None:
        """One line of its own (the status line, on a terminal, is redrawn after it)."""
        with self._lock:
            if self.tty and self.label:
                self.stream.write("\r\033[K")
            self.stream.write(f"[kvtier demo] {msg}\n")
            self.stream.flush()

    def idle(self) -> None:
        """Nothing is waited for: no status line until the next stage."""
        with self._lock:
            if self.tty and self.label:
                self.stream.write("\r\033[K")
                self.stream.flush()
            self.label = ""

    def close(self) -> None:
        """Stop the ticker and clear the status line (before the table, or at exit)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self.idle()

    def engine_line(self, spec: dict[str, Any], words: list[str]) -> None:
        """A ``STAGE`` line of the engine process: the status follows it, and engine 1's
        start and warm-up give the estimate of the rest."""
        phase = spec["phase"]
        what = words[0] if words else ""
        if what == "ready" and phase == 1:
            self.started_s = self.clock() - self.since
        if what == "warm" and phase == 1 and self.started_s is not None and len(words) > 1:
            self.estimate = estimate_rest(
                self.started_s, float(words[1]), spec["docs"], spec["questions"]
            )
            self.estimate_at = self.clock()
            self.say(
                f"engine 1 started in {duration(self.started_s)} and ran its first "
                f"{WARM_TOKENS} tokens in {float(words[1]):.1f} s: the rest of the demo "
                f"takes about {duration(self.estimate)} (engine 2 starts the same way)"
            )
        labels = {
            "ready": "warming up",
            "warm": "running requests",
            "request": f"request {' of '.join(words[1:3])}",
            "stopping": "stopping (flushing uploads to the directory tier)",
        }
        if what in labels:
            self.stage(f"engine {phase}: {labels[what]}", restart=False)


def _engine_command(spec: dict[str, Any]) -> list[str]:
    """The engine process's command line (a test puts a fake engine here)."""
    return [sys.executable, "-m", "kvtier.cli.demo", json.dumps(spec)]


def _read_lines(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _phase(spec: dict[str, Any], workdir: Path, progress: Progress) -> list[dict[str, Any]] | None:
    """Run one engine process; its rows, or None when it failed (its log shown)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    log_path = workdir / f"engine-{spec['phase']}.log"
    rows: list[dict[str, Any]] | None = None
    other: collections.deque[str] = collections.deque(maxlen=50)
    progress.stage(f"engine {spec['phase']}: starting vLLM")
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            _engine_command(spec),
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert proc.stdout is not None
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
        try:
            while (line := lines.get()) is not None:
                if line.startswith("STAGE "):
                    progress.engine_line(spec, line.split()[1:])
                elif line.startswith("RESULT "):
                    rows = json.loads(line[7:])
                else:
                    other.append(line)
            proc.wait()
        except KeyboardInterrupt:
            stop_quietly(proc)
            raise
        finally:
            progress.idle()
    if rows is not None:
        return rows
    tail = log_path.read_text(encoding="utf-8", errors="replace")[-8000:]
    sys.stderr.write("\n".join(other) + ("\n" if other else "") + tail)
    progress.say(f"engine {spec['phase']} failed (exit {proc.returncode}); its log is above")
    return None


def stop_quietly(proc: subprocess.Popen[str], grace: float = 10.0) -> None:
    """Stop an engine process after Ctrl-C. A terminal's Ctrl-C reached it too (one
    process group) and it exits on its own; a driver interrupted alone passes SIGINT on;
    then SIGTERM, then SIGKILL. Its shutdown messages stay in its log, unshown; a second
    Ctrl-C skips to the next step instead of leaving a traceback."""
    steps: list[tuple[signal.Signals | None, float]] = [
        (None, 1.0),
        (signal.SIGINT, grace),
        (signal.SIGTERM, 5.0),
        (signal.SIGKILL, 5.0),
    ]
    for sig, wait in steps:
        if proc.poll() is not None:
            return
        try:
            if sig is not None:
                proc.send_signal(sig)
            proc.wait(timeout=wait)
            return
        except (subprocess.TimeoutExpired, KeyboardInterrupt, ProcessLookupError):
            continue


def _source(r: dict[str, Any]) -> str:
    """Which of kvtier's tiers served the row: host, disk, both, or "-"."""
    parts = [
        name for name, key in (("host", "host_tokens"), ("disk", "remote_tokens")) if r.get(key)
    ]
    return "+".join(parts) or "-"


def _missed(r: dict[str, Any]) -> str:
    """The prompt tokens kvtier missed, by reason (the tail left out), or "-"."""
    missed = {k: v for k, v in r.get("missed", {}).items() if v and k != "tail"}
    return ",".join(f"{k}:{v}" for k, v in sorted(missed.items())) or "-"


def _report(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> None:
    print()
    print(
        f"{'engine':>6} {'doc':>4} {'q':>3} {'prompt':>7} {'kvtier':>7} {'source':>9} "
        f"{'vllm':>6} {'missed':>14} {'TTFT ms':>8}"
    )
    for phase, rows in ((1, first), (2, second)):
        for r in rows:
            vllm = f"{r['vllm_tokens']}{'' if r['reset'] else '!'}"
            print(
                f"{phase:>6} {r['doc']:>4} {r['q']:>3} {r['prompt_tokens']:>7} "
                f"{r['kvtier_tokens']:>7} {_source(r):>9} {vllm:>6} {_missed(r):>14} "
                f"{r['ttft_s'] * 1000:>8.1f}"
            )
    rows = first + second
    print()
    print(
        "kvtier: tokens kvtier's host tier or disk tier served; vllm: tokens vLLM's own "
        "prefix cache served; missed: tokens kvtier lacked, by reason"
    )
    unreset = sum(not r["reset"] for r in rows)
    if unreset:
        print(
            f"! vLLM's prefix cache could not be flushed before {unreset} request(s): "
            "its own hits there stand in for kvtier's"
        )
    cold = [r["ttft_s"] for r in rows if r["kvtier_tokens"] == 0 and r["vllm_tokens"] == 0]
    host = [r["ttft_s"] for r in first if r["kvtier_tokens"] > 0]
    remote = [r["ttft_s"] for r in second if r["kvtier_tokens"] > 0]
    prompt = sum(r["prompt_tokens"] for r in rows)
    served = sum(r["kvtier_tokens"] for r in rows)
    print()
    print(f"requests                   {len(rows)}")
    print(f"prompt tokens              {prompt}")
    print(f"tokens served by kvtier    {served} ({served / max(prompt, 1):.0%})")
    if cold:
        print(f"TTFT cold (median)         {statistics.median(cold) * 1000:.1f} ms")
    if host:
        print(f"TTFT host-tier hit         {statistics.median(host) * 1000:.1f} ms")
    if remote:
        print(f"TTFT after restart (disk)  {statistics.median(remote) * 1000:.1f} ms")
    if second and "canary" in second[0]:
        c = second[0]["canary"]
        print(
            f"canary (engine 2)          {c['match']} match, {c['mismatch']} mismatch: the "
            "stored KV checked against vLLM's own before engine 2 loads any"
        )
    if cold and host:
        saved = 1 - statistics.median(host) / statistics.median(cold)
        print(f"TTFT saved by a hit        {saved:.0%}")


# ---- engine process --------------------------------------------------------------------------
def _reset_prefix_cache(llm: Any) -> bool:
    """Flush vLLM's own prefix cache; True once it said it did. vLLM refuses while blocks
    are still held (a finished request's, for a moment): a few tries, then False."""
    for _ in range(20):
        if llm.reset_prefix_cache():
            return True
        time.sleep(0.05)
    return False


def _tokens(seed: int, n: int) -> list[int]:
    return [((i * 7919 + seed * 104729 + seed * seed) % 480) + 5 for i in range(n)]


def _engine(spec: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier import metrics
    from kvtier.connectors.vllm import scheduler_side
    from kvtier.sizing.emit import shutdown_flags
    from kvtier.stats import total_name

    ktc: dict[str, Any] = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.connectors.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes": "1GiB",
            "cpu_headroom_bytes": "1GiB",
            "remote_url": f"file://{spec['tier']}",
        },
        # as kvtier advises: a failed load is recomputed, and the directory tier's
        # lookups answer in their own step (kvtier.connectors.scheduler.one_step_lookups)
        "kv_load_failure_policy": "recompute",
    }
    # as kvtier advises: the engine's stop leaves the queued uploads time to flush
    env, stop = shutdown_flags(ktc["kv_connector_extra_config"])
    os.environ.update(env)
    _stage("loading")
    llm = LLM(
        model=spec["model"],
        enforce_eager=True,
        block_size=32,
        max_model_len=4096,
        seed=0,
        kv_transfer_config=ktc,
        shutdown_timeout=int(stop[1]),
    )
    side = (
        scheduler_side(llm.llm_engine.engine_core.engine_core.scheduler.connector)
        if hasattr(llm.llm_engine.engine_core, "engine_core")
        else None
    )
    sp = SamplingParams(max_tokens=1, temperature=0)
    _stage("ready")
    # warm-up: the first forward pass sets up kernels; keep it out of the figures (its
    # time is the driver's measure of this machine)
    t0 = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=_tokens(7, WARM_TOKENS))], sp, use_tqdm=False)
    _stage(f"warm {time.perf_counter() - t0:.3f}")
    # the check document: engine 1 (the directory's first writer) stores it; engine 2,
    # which finds another engine's chunks there, trusts them only once the KV vLLM computes
    # for this document matches the stored chunk (kvtier's canary), and loads after that
    canary = {"match": 0, "mismatch": 0}

    def checks(outcome: str) -> str:  # the canary's counter in the scheduler's totals
        return total_name(metrics.CANARY, (outcome,))

    check = TokensPrompt(prompt_token_ids=_tokens(99, DOC_TOKENS) + [1] * 8)
    if spec["phase"] == 2:
        before = dict(side.totals) if side else {}
        llm.generate([check], sp, use_tqdm=False)
        for _ in range(50):  # the workers report the comparisons in later steps
            if side is None or (
                side.canary.pending == 0
                and any(side.totals[checks(r)] > before.get(checks(r), 0) for r in canary)
            ):
                break
            llm.generate([TokensPrompt(prompt_token_ids=_tokens(8, 16))], sp, use_tqdm=False)
        if side is not None:
            canary = {r: side.totals[checks(r)] - before.get(checks(r), 0) for r in canary}
    rows: list[dict[str, Any]] = []
    total = spec["questions"] * spec["docs"]
    for q in range(spec["questions"]):
        for d in range(spec["docs"]):
            _stage(f"request {len(rows) + 1} {total}")
            prompt = _tokens(100 + d, DOC_TOKENS) + _tokens(
                1000 * spec["phase"] + 10 * d + q, QUESTION_TOKENS
            )
            reset = _reset_prefix_cache(llm)  # what GPU memory pressure does to a prefix
            before = dict(side.totals) if side else {}
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
            ttft = time.perf_counter() - t0
            after = dict(side.totals) if side else {}
            delta = {k: after[k] - before.get(k, 0) for k in after}
            cached = out.num_cached_tokens or 0
            host, remote = delta.get("hit_tokens_host", 0), delta.get("hit_tokens_remote", 0)
            if side is None:  # (the engine in another process: the split is unknown)
                host = cached
            rows.append(
                {
                    "doc": d,
                    "q": q,
                    "prompt_tokens": len(prompt),
                    "kvtier_tokens": host + remote,
                    "host_tokens": host,
                    "remote_tokens": remote,
                    "vllm_tokens": max(0, cached - host - remote),
                    "reset": reset,
                    "missed": {
                        k.removeprefix("miss_tokens_"): v
                        for k, v in delta.items()
                        if k.startswith("miss_tokens_")
                    },
                    "ttft_s": ttft,
                }
            )
    if spec["phase"] == 1:
        llm.generate([check], sp, use_tqdm=False)
    _stage("stopping")
    llm.llm_engine.engine_core.shutdown()  # flushes queued uploads to the object tier
    if spec["phase"] == 2:
        for row in rows:
            row["canary"] = canary
    return rows


def _stage(what: str) -> None:
    """A line the driver reads for its progress and estimate."""
    print(f"STAGE {what}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        result = _engine(json.loads(sys.argv[1]))
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the driver says it
        os._exit(INTERRUPTED)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)
