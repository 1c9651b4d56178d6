"""``kvtier bench --trace``: replay a trace file against the server, open loop at its
timestamps, and predict the host tier's hit rate as ``kvtier size --trace`` would
(:class:`Prediction`). The generated workload is bench.py's; both share the client
(bench_client.py) and the report (bench_report.py).

What a line can make the replay do is bounded, and every bound that acts is counted in
the report (``trace_replay.bounds``): the reader's (:mod:`kvtier.sizing.trace.read`:
prompts, outputs, line bytes); one prompt's tokens (``--max-input-tokens`` cuts, or else
a prompt longer than the server's ``max_model_len``, or :data:`DEFAULT_INPUT_BOUND`
tokens when the server does not say, is not expanded nor sent: the server would refuse
it); the wait between two requests (``--max-gap``: one far-off timestamp must not stall
the replay for months); and the hash-id tokens kept for reuse (:class:`BlockCache`)."""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvtier.sizing.trace.read import MAX_INPUT_LENGTH as MAX_INPUT_TOKENS

from .bench_client import (
    BenchError,
    MetricsPoller,
    first_model,
    http_client,
    reset_prefix_cache,
    scraper,
    stream_completion,
)
from .bench_records import RequestResult, TokenScale
from .bench_report import base_url, summarize
from .promtext import Snapshot

#: the longest prompt sent when neither --max-input-tokens nor the server's /v1/models
#: (vLLM's ``max_model_len``) gives one
DEFAULT_INPUT_BOUND = 2**20
#: --max-gap's default and largest value, in seconds of the replay
DEFAULT_MAX_GAP_S = 60.0
MAX_GAP_LIMIT_S = 86_400.0
#: hash-id block tokens kept for reuse, in tokens (about 40 bytes each)
BLOCK_CACHE_TOKENS = 1 << 21

#: the replay's sleep: a test puts a recorder here to check the waits without waiting
sleep: Callable[[float], None] = time.sleep


@dataclass(slots=True)
class Bounds:
    """The bounds a replay applies and how often each acted (``trace_replay.bounds``)."""

    #: longest prompt sent, in tokens, and where that number comes from
    input_tokens: int
    input_source: str
    #: prompts cut to ``input_tokens`` (--max-input-tokens), or not sent (longer than
    #: the server's max_model_len or the default bound: the server would refuse them)
    inputs_cut: int = 0
    inputs_not_sent: int = 0
    #: output_length over --max-output-tokens, sent as that
    outputs_capped: int = 0
    #: longest wait between two requests (--max-gap), and the gaps cut to it
    max_gap_s: float = DEFAULT_MAX_GAP_S
    gaps_cut: int = 0
    #: lines timestamped before an earlier line: due at once (Schedule)
    timestamps_backwards: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Schedule:
    """When each request is due, in seconds of the replay: the trace's timestamps divided
    by ``speedup``, but no gap longer than ``max_gap`` (one timestamp of 1e15 ms must not
    stall the replay for years). A line a little earlier than the latest (lines out of
    order) is due at once; one more than ``max_gap`` earlier starts the clock again from
    its own time, so after a stray timestamp, far ahead or far behind, the rest keeps its
    pace, shifted by at most ``max_gap``."""

    def __init__(self, speedup: float, bounds: Bounds) -> None:
        self.speedup = speedup
        self.bounds = bounds
        self.due = 0.0
        self._latest: float | None = None

    def next(self, timestamp: float | None) -> float:
        """The due time of the next line (a line without a timestamp: with the one before)."""
        if timestamp is None:
            return self.due
        if self._latest is None:
            self._latest = timestamp
            return self.due
        gap = (timestamp - self._latest) / self.speedup  # finite / >= 1e-3: may be inf
        if gap < 0:
            self.bounds.timestamps_backwards += 1
            if gap < -self.bounds.max_gap_s:  # after a stray line: its time is the clock
                self._latest = timestamp
            return self.due
        if gap > self.bounds.max_gap_s:
            self.bounds.gaps_cut += 1
            gap = self.bounds.max_gap_s
        self.due += gap
        self._latest = timestamp
        return self.due


class BlockCache:
    """The tokens of recently expanded hash ids, LRU, at most ``budget`` tokens held (a
    count of entries would let 2**20-token blocks fill the memory)."""

    def __init__(self, lo: int, hi: int, budget: int = BLOCK_CACHE_TOKENS) -> None:
        self.lo, self.hi, self.budget = lo, hi, budget
        self.held = 0
        self._blocks: OrderedDict[tuple[int, int], tuple[int, ...]] = OrderedDict()

    def get(self, hash_id: int, size: int) -> tuple[int, ...]:
        from kvtier.sizing import trace as tr

        key = (hash_id, size)
        if (block := self._blocks.get(key)) is not None:
            self._blocks.move_to_end(key)
            return block
        block = tuple(tr.block_tokens(hash_id, size, self.lo, self.hi))
        if size <= self.budget:
            self._blocks[key] = block
            self.held += size
            while self.held > self.budget:
                self.held -= len(self._blocks.popitem(last=False)[1])
        return block


def _token_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise BenchError(f"--token-range {text!r}: want LO:HI, e.g. 100:30000") from None
    if not 0 <= lo < hi <= 2**31:
        raise BenchError(f"--token-range {text}: want 0 <= LO < HI <= 2**31")
    return lo, hi


def _validate_trace(args: argparse.Namespace) -> tuple[int, int]:
    if not (math.isfinite(args.max_gap) and 0 <= args.max_gap <= MAX_GAP_LIMIT_S):
        raise BenchError(f"--max-gap must be a number of seconds from 0 to {MAX_GAP_LIMIT_S:g}")
    if not (math.isfinite(args.speedup) and 1e-3 <= args.speedup <= 1e6):
        raise BenchError("--speedup must be a number from 0.001 to 1000000")
    for name in ("max_requests", "max_input_tokens", "max_output_tokens"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_input_tokens is not None and args.max_input_tokens > MAX_INPUT_TOKENS:
        raise BenchError(
            f"--max-input-tokens must be at most {MAX_INPUT_TOKENS} (the trace "
            "reader's bound on one prompt)"
        )
    for name in ("max_concurrency", "plan_chunk_size", "plan_tp", "output_tokens"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be at least 1")
    if args.trace_block_size is not None and not 1 <= args.trace_block_size <= 2**20:
        raise BenchError("--trace-block-size must be from 1 to 1048576")
    if args.trace_out:
        raise BenchError(
            "--trace-out writes generated sessions; with --trace the trace is already the record"
        )
    if not os.path.isfile(args.trace):
        raise BenchError(f"cannot read the trace {args.trace}")
    return _token_range(args.token_range)


class Prediction:
    """``kvtier size --trace`` on the requests as they are sent (cut, counted), one at a
    time in trace order: the host tier's share of prompt tokens at the server's size."""

    def __init__(self, args: argparse.Namespace, before: Snapshot | None) -> None:
        from kvtier.sizing import trace as tr

        self.tr = tr
        self.reason: str | None = None
        info = _cache_config(before)
        self.block_size = int(info.get("block_size") or 16)
        if args.reset_prefix_cache:
            gpu_tokens, self.gpu_source = 0, "none: --reset-prefix-cache empties it each time"
        elif args.gpu_kv_tokens is not None:
            gpu_tokens, self.gpu_source = max(0, args.gpu_kv_tokens), "--gpu-kv-tokens"
        elif info.get("num_gpu_blocks"):
            gpu_tokens = int(info["num_gpu_blocks"]) * self.block_size
            self.gpu_source = "vllm:cache_config_info"
        else:
            gpu_tokens, self.gpu_source = 0, "unknown, taken as 0"
        self.gpu_tokens = gpu_tokens
        self.chunk_size = args.plan_chunk_size
        self.sim: Any = None
        if self.chunk_size % self.block_size:
            self.reason = (
                f"--plan-chunk-size {self.chunk_size} is not a multiple of the "
                f"server's block size {self.block_size}"
            )
        else:
            self.sim = tr.Simulation(
                self.block_size, self.chunk_size, gpu_tokens // self.block_size
            )
        self.skipped = 0
        self.checked: set[int] = set()

    def add(self, req: Any) -> None:
        if self.sim is None:
            return
        if req.hash_ids is None and not req.token_ids:
            self.skipped += 1  # text and chat lines: their tokens are the server's
            return
        if req.hash_ids is not None and req.block_size not in self.checked:
            if err := self.tr.block_size_error(self.chunk_size, req.block_size):
                self.reason, self.sim = err, None
                return
            self.checked.add(req.block_size)
        self.sim.add(req)

    def result(self, args: argparse.Namespace, after: Snapshot | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "host_hit_rate": None,
            "gpu_hit_rate": None,
            "chunk_size": self.chunk_size,
            "block_size": self.block_size,
            "gpu_kv_tokens": self.gpu_tokens,
            "gpu_kv_source": self.gpu_source,
            "requests_not_modelled": self.skipped,
        }
        sim = self.sim
        if sim is None or not sim.prompt_tokens:
            out["why_none"] = self.reason or "no token-id or hash-id request to model"
            return out
        total = sim.prompt_tokens
        out["gpu_hit_rate"] = sim.gpu_hit_tokens / total
        served = sim.served()
        capacity = after.total("kvtier:host_bytes_capacity") if after is not None else None
        if capacity is None:
            out["why_none"] = "the server's /metrics has no kvtier:host_bytes_capacity"
            return out
        if not args.plan_model:
            out["why_none"] = "pass --plan-model (the served model) for the slot size"
            return out
        from kvtier.sizing.memory_plan import PlanInputs, make_plan
        from kvtier.sizing.model import ModelConfigError

        try:
            plan = make_plan(PlanInputs(model=args.plan_model, tp=args.plan_tp))
        except (ModelConfigError, ValueError, KeyError) as e:
            out["why_none"] = f"--plan-model: {e}"
            return out
        slot = self.tr.slot_bytes(int(plan["kv_bytes_per_token_per_rank"]), self.chunk_size)
        chunks = int(capacity) // (slot * args.plan_tp)
        out.update(
            host_tier_bytes=int(capacity),
            host_tier_chunks=chunks,
            host_hit_rate=served[min(chunks, len(served) - 1)] / total,
            max_hit_rate=(sim.gpu_hit_tokens + served[-1]) / total,
        )
        return out


def _cache_config(snap: Snapshot | None) -> dict[str, str]:
    """The labels of vLLM's ``vllm:cache_config_info`` (block_size, num_gpu_blocks)."""
    for name, labels, _ in snap.samples if snap is not None else []:
        if name == "vllm:cache_config_info":
            return labels
    return {}


def server_max_model_len(client: Any, base: str, model: str) -> int | None:
    """The served model's ``max_model_len`` from /v1/models (vLLM lists it), or None."""
    import httpx

    try:
        r = client.get(base + "/v1/models", timeout=30.0)
        r.raise_for_status()
        cards = r.json()["data"]
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return None
    if not isinstance(cards, list):
        return None
    dicts = [c for c in cards if isinstance(c, dict)]
    card = next((c for c in dicts if c.get("id") == model), dicts[0] if dicts else None)
    n = card.get("max_model_len") if card is not None else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


def input_bounds(args: argparse.Namespace, max_model_len: int | None) -> Bounds:
    """The longest prompt the replay sends: --max-input-tokens (longer ones cut), else the
    server's max_model_len, else :data:`DEFAULT_INPUT_BOUND` (longer ones not sent)."""
    if args.max_input_tokens is not None:
        n, source = args.max_input_tokens, "--max-input-tokens"
    elif max_model_len is not None:
        n, source = min(max_model_len, MAX_INPUT_TOKENS), "the server's max_model_len"
    else:
        n, source = DEFAULT_INPUT_BOUND, "default: the server does not say its max_model_len"
    return Bounds(n, source, max_gap_s=float(args.max_gap))


def execute_trace(args: argparse.Namespace, *, progress: bool | None = None) -> dict[str, Any]:
    """Replay ``args.trace`` against the server, open loop at the trace's timestamps
    (divided by ``--speedup``, gaps at most ``--max-gap``), at most ``--max-concurrency``
    in flight; the summary."""
    from kvtier.sizing import trace as tr

    lo, hi = _validate_trace(args)
    base = base_url(args.url)
    metrics_url = args.metrics_url or base + "/metrics"
    form = tr.TraceFormat(args.trace_format, args.trace_block_size)
    stats = tr.TraceStats()
    with http_client(args, args.max_concurrency) as client:
        scrape = scraper(client, metrics_url)

        model = args.model or first_model(client, base)
        bounds = input_bounds(
            args,
            None
            if args.max_input_tokens is not None
            else server_max_model_len(client, base, model),
        )
        before = scrape()
        prediction = Prediction(args, before)
        poller = MetricsPoller(scrape, args.metrics_interval) if args.plot else None
        if poller:
            poller.start()
        try:
            reqs = tr.read_trace(args.trace, None, stats, False, form)
            run_ = _drive_trace(
                client, base, model, reqs, args, (lo, hi), prediction, progress, bounds
            )
        finally:
            if poller:
                poller.stop()
        after = scrape()
    trace_info = {
        "path": os.path.basename(args.trace),
        "format": stats.format,
        "formats": stats.formats,
        "block_size": (
            min(stats.block_sizes)
            if len(stats.block_sizes) == 1
            else sorted(stats.block_sizes) or None
        ),
        "bad_lines": stats.bad_lines,
        "bad_examples": stats.bad_examples,
        "prediction": prediction.result(args, after),
        "bounds": {
            **bounds.as_dict(),
            "over_cap_lines": stats.over_cap,
            "reader_input_tokens": MAX_INPUT_TOKENS,
        },
    }
    return summarize(
        args,
        model,
        TokenScale(),
        run_,
        before,
        after,
        poller.snapshots if poller else [],
        trace_info,
    )


def _drive_trace(
    client: Any,
    base: str,
    model: str,
    reqs: Any,
    args: argparse.Namespace,
    token_range: tuple[int, int],
    prediction: Prediction,
    progress: bool | None,
    bounds: Bounds,
) -> tuple[list[RequestResult], float]:
    """Open loop: each request starts at its due time (:class:`Schedule`), or as soon as
    fewer than ``--max-concurrency`` are in flight (then it is late: ``start_s - due_s``).
    A prompt is checked against ``bounds`` before its tokens are made."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    from kvtier.sizing import trace as tr

    blocks = BlockCache(*token_range)

    def tokens(req: Any) -> list[int]:
        if req.hash_ids is None:
            return list(req.token_ids)
        out: list[int] = []
        bs, last = req.block_size, len(req.hash_ids) - 1
        for i, h in enumerate(req.hash_ids):  # of the last block only the tokens sent
            out += blocks.get(h, bs if i < last else req.length - last * bs)
        return out

    if progress is None:
        progress = not args.json and sys.stderr.isatty()
    bar = tqdm(
        total=args.max_requests,
        desc="kvtier bench --trace",
        unit="req",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )
    slots = threading.BoundedSemaphore(args.max_concurrency)
    lock = threading.Lock()
    results: list[RequestResult] = []
    schedule = Schedule(args.speedup, bounds)
    t_start = time.perf_counter()

    def send(i: int, req: Any, prompt: str | list[int], max_tokens: int, due: float) -> None:
        try:
            if args.reset_prefix_cache:
                reset_prefix_cache(client, base)
            res = RequestResult(i, 0, time.perf_counter() - t_start, due_s=due)
            try:
                stream_completion(
                    client,
                    base,
                    model,
                    prompt,
                    max_tokens,
                    res,
                    messages=req.messages,
                    cache_salt=req.cache_salt,
                )
            except Exception as exc:  # noqa: BLE001 - a bad response must not stop the replay
                res.ok, res.error = False, f"{type(exc).__name__}: {exc}"[:240]
            with lock:
                results.append(res)
                bar.update(1)
                if not res.ok:
                    bar.set_postfix(failed=sum(not r.ok for r in results))
        finally:
            slots.release()

    with ThreadPoolExecutor(max_workers=args.max_concurrency) as pool:
        try:
            for i, req in enumerate(reqs):
                if args.max_requests is not None and i >= args.max_requests:
                    break
                due = schedule.next(req.timestamp)
                if req.prompt_tokens > bounds.input_tokens:
                    if args.max_input_tokens is None:  # the server would refuse it
                        bounds.inputs_not_sent += 1
                        bar.update(1)
                        continue
                    tr.truncate(req, bounds.input_tokens)
                    bounds.inputs_cut += 1
                prediction.add(req)
                out_tokens = req.output_length or args.output_tokens
                if args.max_output_tokens is not None and out_tokens > args.max_output_tokens:
                    out_tokens = args.max_output_tokens
                    bounds.outputs_capped += 1
                prompt: str | list[int] = req.text if req.text is not None else tokens(req)
                delay = due - (time.perf_counter() - t_start)
                if delay > 0:  # the schedule keeps every gap within --max-gap
                    sleep(min(delay, bounds.max_gap_s))
                slots.acquire()
                pool.submit(send, i, req, prompt, max(1, out_tokens), due)
        except tr.TraceError as e:
            raise BenchError(str(e)) from e
        finally:
            pool.shutdown(wait=True)
            bar.close()
    duration = time.perf_counter() - t_start
    results.sort(key=lambda r: r.start_s)
    return results, duration
