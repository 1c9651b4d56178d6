"""``kvtier bench``: drive an OpenAI-compatible endpoint with a shared-prefix workload.

It answers the three questions an operator asks of a KV offload tier — how fast
is the first token, how many requests per second, how many prompt tokens came
from the cache — against any server that speaks ``/v1/completions``, so the
same numbers can be taken with and without kvtier, or with another connector.

TTFT is measured on the client from a streamed response. The hit rate comes
from the server's own ``/metrics`` (read before and after the run), preferring
kvtier's counters and falling back to vLLM's prefix-cache counters; when the
server exports ``kvtier:ttft_seconds``, TTFT is also broken down by kvtier
outcome from that histogram. torch and vLLM are never imported here;
matplotlib only with ``--plot``, httpx and tqdm only when a run starts, so the
``kvtier`` CLI stays fast.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .bench_client import (
    BenchError,
    MetricsPoller,
    Pacer,
    first_model,
    http_client,
    reset_prefix_cache,
    scraper,
    stream_completion,
)
from .bench_records import RequestResult, TokenScale
from .bench_report import base_url, format_table, summarize, write_plot
from .bench_trace import DEFAULT_MAX_GAP_S, execute_trace

#: Everyday words that are one token each in common BPE vocabularies (and in the
#: tiny test tokenizer), so that word counts track token counts.
WORDS: tuple[str, ...] = (
    "across",
    "agent",
    "an",
    "and",
    "are",
    "brown",
    "cache",
    "cached",
    "cheap",
    "documents",
    "dog",
    "fox",
    "histories",
    "host",
    "in",
    "is",
    "jumps",
    "keeps",
    "keys",
    "lazy",
    "link",
    "loading",
    "long",
    "memory",
    "next",
    "object",
    "of",
    "over",
    "plans",
    "prompts",
    "quick",
    "retrieved",
    "reused",
    "scheduler",
    "shared",
    "the",
    "values",
    "when",
    "while",
)


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the bench's flags."""
    p = parser
    p.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="server base URL (a trailing /v1 is accepted)",
    )
    p.add_argument(
        "--model", default=None, help="model name to request (default: the first of /v1/models)"
    )
    p.add_argument(
        "--sessions", type=int, default=8, help="independent sessions (each has its own user text)"
    )
    p.add_argument(
        "--turns",
        type=int,
        default=1,
        help="turns per session; a turn's prompt = last prompt + answer + new text",
    )
    p.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=1024,
        help="tokens of text every session's first prompt starts with",
    )
    p.add_argument(
        "--turn-tokens",
        type=int,
        default=128,
        help="tokens of new user text per turn (0: the prompt is the shared prefix)",
    )
    p.add_argument("--output-tokens", type=int, default=16, help="max_tokens per request")
    p.add_argument("--concurrency", type=int, default=4, help="sessions in flight at once")
    p.add_argument(
        "--request-rate",
        type=float,
        default=0.0,
        help="Poisson arrival rate, requests/s (0: as fast as concurrency allows)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (same seed, same prompts)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--api-key", default=None, help="bearer token, if the server wants one")
    p.add_argument(
        "--metrics-url",
        default=None,
        help="Prometheus endpoint (default: URL/metrics; 'none' to skip)",
    )
    p.add_argument(
        "--metrics-interval",
        type=float,
        default=1.0,
        help="seconds between /metrics scrapes for the hit-rate-over-time plot",
    )
    p.add_argument(
        "--no-calibrate",
        action="store_true",
        help="do not ask the server's /tokenize how many tokens a word is",
    )
    p.add_argument(
        "--reset-prefix-cache",
        action="store_true",
        help="POST /reset_prefix_cache before each request (vLLM with "
        "VLLM_SERVER_DEV_MODE=1), so hits must come from the connector",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="write TTFT per outcome and hit rate over time to this PNG",
    )
    p.add_argument(
        "--trace-out",
        metavar="FILE.jsonl",
        default=None,
        help="write the requests sent as a trace for `kvtier size --trace`",
    )
    t = p.add_argument_group(
        "trace replay (--trace: send a trace's requests instead of generated sessions)"
    )
    t.add_argument(
        "--trace",
        metavar="FILE.jsonl",
        default=None,
        help="replay this trace: every format `kvtier size --trace` reads; hash-id "
        "lines (Mooncake, Bailian) become tokens, the same id always the same "
        "tokens; token-id, text and chat lines are sent as they are",
    )
    t.add_argument(
        "--trace-format",
        default="auto",
        choices=("auto", "tokens", "text", "messages", "mooncake", "bailian"),
        help="as `kvtier size --trace-format` (default: per line)",
    )
    t.add_argument(
        "--trace-block-size",
        type=int,
        default=None,
        metavar="N",
        help="tokens per hash id (default 512 for Mooncake lines, 16 for Bailian)",
    )
    t.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        metavar="F",
        help="send at F times the trace's rate (its timestamps divided by F)",
    )
    t.add_argument(
        "--max-gap",
        type=float,
        default=DEFAULT_MAX_GAP_S,
        metavar="S",
        help="wait at most S seconds between two requests (after --speedup; "
        "default 60, at most 86400): a longer gap in the trace is cut to S; a "
        "line timestamped before an earlier one is sent at once (more than S "
        "before: the replay keeps time from it); both counted in the report",
    )
    t.add_argument(
        "--max-requests",
        type=int,
        default=None,
        metavar="N",
        help="replay only the first N requests",
    )
    t.add_argument(
        "--max-input-tokens",
        type=int,
        default=None,
        metavar="N",
        help="cut token-id and hash-id prompts to their first N tokens (shared "
        "prefixes stay shared); text and chat prompts are sent whole. Without "
        "it, a prompt longer than the server's max_model_len (from /v1/models; "
        "1048576 tokens when it does not say) is not sent, as the server would "
        "refuse it, and counted; a line over 2**24 prompt tokens is a bad line",
    )
    t.add_argument(
        "--max-output-tokens",
        type=int,
        default=None,
        metavar="N",
        help="cap a line's output_length (lines without one ask --output-tokens)",
    )
    t.add_argument(
        "--max-concurrency",
        type=int,
        default=32,
        metavar="N",
        help="requests in flight at most; a request due while N are in flight "
        "waits and counts as late (default 32)",
    )
    t.add_argument(
        "--token-range",
        default="100:30000",
        metavar="LO:HI",
        help="token ids a hash id expands to, in [LO, HI) (default 100:30000; "
        "inside the model's vocabulary)",
    )
    t.add_argument(
        "--plan-model",
        metavar="PATH",
        default=None,
        help="the served model's directory or config.json: with it the trace's "
        "predicted host-tier hit rate (kvtier size --trace) is shown beside what "
        "the server delivered, at the tier size /metrics reports",
    )
    t.add_argument(
        "--plan-chunk-size",
        type=int,
        default=256,
        metavar="N",
        help="the server's kvtier chunk_size, for the prediction (default 256)",
    )
    t.add_argument(
        "--plan-tp",
        type=int,
        default=1,
        metavar="N",
        help="the server's tensor-parallel size, for the prediction (default 1)",
    )
    t.add_argument(
        "--gpu-kv-tokens",
        type=int,
        default=None,
        metavar="N",
        help="vLLM's GPU KV tokens, for the prediction (default: from /metrics' "
        "vllm:cache_config_info)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the bench; returns 0, or 1 when no request succeeded (failures never raise)."""
    try:
        result = execute(args)
    except BenchError as exc:
        print(f"kvtier bench: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
    if args.plot:
        write_plot(result, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0 if result["requests"] > result["failed"] else 1


# ---------------------------------------------------------------------- workload


@dataclass(frozen=True, slots=True)
class Session:
    """One session's texts: the first prompt and the user text of each later turn."""

    index: int
    first_prompt: str
    follow_ups: tuple[str, ...]


#: every prompt starts with this word, so the tokens a prompt's start costs (a BOS, a
#: first word without a leading space) are the same for every prompt and can be measured
LEAD_WORD = "the"


def words_text(rng: random.Random, tokens: int, per_word: float = 1.0) -> str:
    """About ``tokens`` tokens of text drawn from :data:`WORDS` (to follow a space)."""
    if tokens <= 0:
        return ""
    n = max(1, round(tokens / max(per_word, 1e-6)))
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _lead_text(rng: random.Random, tokens: int, scale: TokenScale) -> str:
    """A prompt's opening: :data:`LEAD_WORD` and enough words for ``tokens`` in all."""
    rest = words_text(rng, max(1, round(tokens - scale.lead)), scale.per_word)
    return f"{LEAD_WORD} {rest}"


def make_workload(
    *,
    seed: int,
    sessions: int,
    turns: int,
    shared_prefix_tokens: int,
    turn_tokens: int,
    scale: TokenScale | None = None,
) -> list[Session]:
    """Deterministic prompts for ``seed``: a shared prefix, then per-session text.

    String seeds make :mod:`random` independent of ``PYTHONHASHSEED``, so two
    processes (or two replicas' benches) build byte-identical prompts.
    """
    scale = scale or TokenScale()
    shared = ""
    if shared_prefix_tokens > 0:
        shared = _lead_text(
            random.Random(f"kvtier-bench:{seed}:shared"), shared_prefix_tokens, scale
        )
    out = []
    for s in range(sessions):
        rng = random.Random(f"kvtier-bench:{seed}:session:{s}")
        texts = [words_text(rng, turn_tokens, scale.per_word) for _ in range(max(turns, 1))]
        if shared:
            first = " ".join(t for t in (shared, texts[0]) if t)
        else:
            first = _lead_text(rng, turn_tokens, scale)
        out.append(Session(s, first, tuple(texts[1:])))
    return out


def next_prompt(prompt: str, answer: str, user_text: str) -> str:
    """Turn N+1's prompt; newlines keep turn N's tokens a prefix of turn N+1's."""
    return "\n".join(part for part in (prompt, answer, user_text) if part)


# ---------------------------------------------------------------------- the run


def _validate(args: argparse.Namespace) -> None:
    for name in ("sessions", "turns", "concurrency"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name} must be at least 1")
    for name in ("shared_prefix_tokens", "turn_tokens", "request_rate"):
        if getattr(args, name) < 0:
            raise BenchError(f"--{name.replace('_', '-')} must not be negative")
    if args.output_tokens < 1:
        raise BenchError("--output-tokens must be at least 1")
    if args.shared_prefix_tokens == 0 and args.turn_tokens == 0:
        raise BenchError("--shared-prefix-tokens and --turn-tokens are both 0: no prompt")


def execute(args: argparse.Namespace, *, progress: bool | None = None) -> dict[str, Any]:
    """Run the workload against the server and return the summary (what --json prints)."""
    if getattr(args, "trace", None):
        return execute_trace(args, progress=progress)
    _validate(args)
    base = base_url(args.url)
    metrics_url = args.metrics_url or base + "/metrics"
    with http_client(args, args.concurrency) as client:
        scrape = scraper(client, metrics_url)

        model = args.model or first_model(client, base)
        scale = TokenScale() if args.no_calibrate else _token_scale(client, base, model)
        sessions = make_workload(
            seed=args.seed,
            sessions=args.sessions,
            turns=args.turns,
            shared_prefix_tokens=args.shared_prefix_tokens,
            turn_tokens=args.turn_tokens,
            scale=scale,
        )
        before = scrape()
        poller = MetricsPoller(scrape, args.metrics_interval) if args.plot else None
        if poller:
            poller.start()
        try:
            results = _drive(client, base, model, sessions, args, progress)
        finally:
            if poller:
                poller.stop()
        after = scrape()
    if getattr(args, "trace_out", None):
        write_trace(results[0], args.trace_out)
    return summarize(args, model, scale, results, before, after, poller.snapshots if poller else [])


def _drive(
    client: Any,
    base: str,
    model: str,
    sessions: list[Session],
    args: argparse.Namespace,
    progress: bool | None,
) -> tuple[list[RequestResult], float]:
    """Send every turn with ``concurrency`` workers; returns the results and the wall time.

    Turns are served from one FIFO queue: a session's next turn joins the back
    of the queue when its previous turn finishes, so sessions interleave the way
    chat users do (everyone else's turn runs before yours comes back), which is
    what pushes a session's history out of a small device cache.
    """
    from tqdm import tqdm

    total = len(sessions) * args.turns
    if progress is None:
        progress = not args.json and sys.stderr.isatty()
    bar = tqdm(
        total=total,
        desc="kvtier bench",
        unit="req",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )
    pacer = Pacer(args.request_rate, args.seed)
    ready: queue.Queue[tuple[Session, int, str] | None] = queue.Queue()
    for sess in sessions:
        ready.put((sess, 0, sess.first_prompt))
    lock = threading.Lock()
    results: list[RequestResult] = []
    t_start = time.perf_counter()

    def worker() -> None:
        while (item := ready.get()) is not None:
            sess, turn, prompt = item
            pacer.wait()
            if args.reset_prefix_cache:
                reset_prefix_cache(client, base)
            res = RequestResult(sess.index, turn, time.perf_counter() - t_start, prompt=prompt)
            try:
                stream_completion(client, base, model, prompt, args.output_tokens, res)
            except Exception as exc:  # noqa: BLE001 - a bad response must not stall the queue
                res.ok, res.error = False, f"{type(exc).__name__}: {exc}"[:240]
            if turn + 1 < args.turns:
                answer = res.text if res.ok else ""
                ready.put((sess, turn + 1, next_prompt(prompt, answer, sess.follow_ups[turn])))
            with lock:
                results.append(res)
                bar.update(1)
                if not res.ok:
                    bar.set_postfix(failed=sum(not r.ok for r in results))
                if len(results) == total:
                    for _ in range(args.concurrency):
                        ready.put(None)

    threads = [
        threading.Thread(target=worker, daemon=True) for _ in range(min(args.concurrency, total))
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        bar.close()
    duration = time.perf_counter() - t_start
    results.sort(key=lambda r: r.start_s)
    return results, duration


def write_trace(results: Sequence[RequestResult], path: str) -> None:
    """The requests as sent, in start order, in the trace format of ``kvtier size --trace``
    (``prompt`` text, tokenized there with the model's tokenizer as the server did), so a
    bench run can be planned and replayed."""
    with open(path, "w", encoding="utf-8") as f:
        for r in sorted(results, key=lambda r: r.start_s):
            f.write(
                json.dumps(
                    {
                        "timestamp": round(r.start_s, 6),
                        "prompt": r.prompt,
                        "session": r.session,
                        "turn": r.turn,
                    }
                )
                + "\n"
            )


def _token_scale(client: Any, base: str, model: str) -> TokenScale:
    """Tokens per word and per prompt start, from vLLM's /tokenize; 1 and 1 when unavailable.

    Two prompts of 200 and 400 words give the slope (tokens per word) and the
    intercept (BOS, first word), so prompt lengths land on the token counts asked
    for — which matters, since a prefix cache works in whole blocks.
    """
    import httpx

    words = words_text(random.Random("kvtier-bench:calibrate"), 400).split()
    counts = []
    for n in (200, 400):
        prompt = " ".join([LEAD_WORD, *words[:n]])
        try:
            r = client.post(
                base + "/tokenize", json={"model": model, "prompt": prompt}, timeout=30.0
            )
            r.raise_for_status()
            counts.append(int(r.json()["count"]))
        except (httpx.HTTPError, KeyError, ValueError, TypeError):
            return TokenScale()
    per_word = (counts[1] - counts[0]) / 200
    if per_word <= 0:
        return TokenScale()
    return TokenScale(per_word=per_word, lead=max(counts[0] - 200 * per_word, 0.0))


def build_parser() -> argparse.ArgumentParser:
    """A standalone parser (``python -m kvtier.cli.bench``, and the bench runner)."""
    parser = argparse.ArgumentParser(prog="kvtier bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    raise SystemExit(run(build_parser().parse_args()))
