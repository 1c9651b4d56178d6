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
import math
import queue
import random
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

#: Everyday words that are one token each in common BPE vocabularies (and in the
#: tiny test tokenizer), so that word counts track token counts.
WORDS: tuple[str, ...] = (
    "across", "agent", "an", "and", "are", "brown", "cache", "cached", "cheap",
    "documents", "dog", "fox", "histories", "host", "in", "is", "jumps", "keeps",
    "keys", "lazy", "link", "loading", "long", "memory", "next", "object", "of",
    "over", "plans", "prompts", "quick", "retrieved", "reused", "scheduler",
    "shared", "the", "values", "when", "while",
)

KVTIER_HIT = "kvtier:hit_tokens_total"
KVTIER_LOOKUP = "kvtier:lookup_tokens_total"
KVTIER_TTFT = "kvtier:ttft_seconds"
VLLM_HIT = "vllm:prefix_cache_hits_total"
VLLM_QUERY = "vllm:prefix_cache_queries_total"
VLLM_EXT_HIT = "vllm:external_prefix_cache_hits_total"
VLLM_EXT_QUERY = "vllm:external_prefix_cache_queries_total"
#: every prompt token by where it came from (vLLM >= 0.32): computed, GPU cache, connector
VLLM_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
OUTCOMES = ("hit", "partial", "miss")


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the bench's flags."""
    p = parser
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="server base URL (a trailing /v1 is accepted)")
    p.add_argument("--model", default=None,
                   help="model name to request (default: the first of /v1/models)")
    p.add_argument("--sessions", type=int, default=8,
                   help="independent sessions (each has its own user text)")
    p.add_argument("--turns", type=int, default=1,
                   help="turns per session; a turn's prompt = last prompt + answer + new text")
    p.add_argument("--shared-prefix-tokens", type=int, default=1024,
                   help="tokens of text every session's first prompt starts with")
    p.add_argument("--turn-tokens", type=int, default=128,
                   help="tokens of new user text per turn (0: the prompt is the shared prefix)")
    p.add_argument("--output-tokens", type=int, default=16, help="max_tokens per request")
    p.add_argument("--concurrency", type=int, default=4, help="sessions in flight at once")
    p.add_argument("--request-rate", type=float, default=0.0,
                   help="Poisson arrival rate, requests/s (0: as fast as concurrency allows)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (same seed, same prompts)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--api-key", default=None, help="bearer token, if the server wants one")
    p.add_argument("--metrics-url", default=None,
                   help="Prometheus endpoint (default: URL/metrics; 'none' to skip)")
    p.add_argument("--metrics-interval", type=float, default=1.0,
                   help="seconds between /metrics scrapes for the hit-rate-over-time plot")
    p.add_argument("--no-calibrate", action="store_true",
                   help="do not ask the server's /tokenize how many tokens a word is")
    p.add_argument("--reset-prefix-cache", action="store_true",
                   help="POST /reset_prefix_cache before each request (vLLM with "
                        "VLLM_SERVER_DEV_MODE=1), so hits must come from the connector")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="write TTFT per outcome and hit rate over time to this PNG")
    p.add_argument("--trace-out", metavar="FILE.jsonl", default=None,
                   help="write the requests sent as a trace for `kvtier size --trace`")


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


class BenchError(Exception):
    """The bench cannot start (bad flags, server unreachable)."""


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


@dataclass(frozen=True, slots=True)
class TokenScale:
    """Tokens of a prompt = ``lead`` (BOS + :data:`LEAD_WORD`) + ``per_word`` x other words."""

    per_word: float = 1.0
    lead: float = 1.0


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
        shared = _lead_text(random.Random(f"kvtier-bench:{seed}:shared"), shared_prefix_tokens,
                            scale)
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


# ----------------------------------------------------------------------- metrics

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')

MetricSample = tuple[str, dict[str, str], float]


def parse_metrics(text: str) -> list[MetricSample]:
    """Parse Prometheus text exposition into (name, labels, value) samples."""
    samples: list[MetricSample] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        name, raw_labels, raw_value = m.groups()
        try:
            value = float(raw_value)
        except ValueError:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\")
                  for k, v in _LABEL.findall(raw_labels or "")}
        samples.append((name, labels, value))
    return samples


@dataclass(slots=True)
class Snapshot:
    """One scrape of ``/metrics``: when, and what it said."""

    t: float
    samples: list[MetricSample] = field(default_factory=list)

    def total(self, name: str, **where: str) -> float | None:
        """Sum over every series of ``name`` (vLLM labels by model and engine) whose labels
        include ``where``; None if absent."""
        vals = [v for n, labels, v in self.samples
                if n == name and all(labels.get(k) == x for k, x in where.items())]
        return sum(vals) if vals else None

    def has(self, name: str) -> bool:
        """Whether any series of ``name`` (or its histogram parts) is exported."""
        return any(n == name or n.startswith(name + "_") for n, _, _ in self.samples)

    def buckets(self, name: str, label: str) -> dict[str, dict[float, float]]:
        """Histogram ``name`` as {label value: {le: cumulative count}}, summed over other labels."""
        out: dict[str, dict[float, float]] = {}
        for n, labels, v in self.samples:
            if n != name + "_bucket" or "le" not in labels:
                continue
            le = float(labels["le"])  # "+Inf" parses as inf
            per = out.setdefault(labels.get(label, ""), {})
            per[le] = per.get(le, 0.0) + v
        return out


def counter_delta(
    before: Snapshot | None, after: Snapshot | None, name: str, **where: str
) -> float | None:
    """Increase of a counter over the run; a series that appeared mid-run started at 0."""
    if after is None:
        return None
    end = after.total(name, **where)
    if end is None:
        return None
    start = before.total(name, **where) if before is not None else None
    return end - (start or 0.0)


#: where a prompt token came from, as the headline's split shows it
TOKEN_SOURCES = ("gpu_prefix_cache", "kvtier_host", "kvtier_object_tier", "other_connector",
                 "computed")  # fmt: skip


def token_sources(before: Snapshot | None, after: Snapshot | None) -> dict[str, float] | None:
    """Prompt tokens of the run by source, from vLLM's ``prompt_tokens_by_source`` and
    kvtier's hit counters; None when the server does not export the former."""
    def delta(name: str, **where: str) -> float:
        return counter_delta(before, after, name, **where) or 0.0

    if counter_delta(before, after, VLLM_BY_SOURCE) is None:
        return None
    external = delta(VLLM_BY_SOURCE, source="external_kv_transfer")
    host, remote = delta(KVTIER_HIT, tier="host"), delta(KVTIER_HIT, tier="remote")
    return {
        "gpu_prefix_cache": delta(VLLM_BY_SOURCE, source="local_cache_hit"),
        "kvtier_host": host,
        "kvtier_object_tier": remote,
        "other_connector": max(0.0, external - host - remote),
        "computed": delta(VLLM_BY_SOURCE, source="local_compute"),
    }


def token_shares(sources: dict[str, float] | None) -> dict[str, float] | None:
    """Each source's share of the run's prompt tokens."""
    total = sum(sources.values()) if sources else 0.0
    if not sources or total <= 0:
        return None
    return {k: v / total for k, v in sources.items()}


def hit_rates(before: Snapshot | None, after: Snapshot | None) -> dict[str, float | None]:
    """Every hit rate the server lets us compute, by source."""
    def ratio(hit: str, query: str) -> float | None:
        h, q = counter_delta(before, after, hit), counter_delta(before, after, query)
        if h is None or q is None or q <= 0:
            return None
        return h / q

    shares = token_shares(token_sources(before, after))
    return {
        "any_cache": None if shares is None else 1.0 - shares["computed"],
        "kvtier": ratio(KVTIER_HIT, KVTIER_LOOKUP),
        "vllm_prefix_cache": ratio(VLLM_HIT, VLLM_QUERY),
        "vllm_external": ratio(VLLM_EXT_HIT, VLLM_EXT_QUERY),
    }


#: the headline's meaning, by the key of hit_rates() it was taken from
ANY_CACHE = "share of prompt tokens from any cache (vllm:prompt_tokens_by_source)"


def pick_hit_rate(rates: dict[str, float | None]) -> tuple[float | None, str]:
    """The share of prompt tokens served from any cache (GPU prefix cache, kvtier, another
    connector) when vLLM exports it; else kvtier's own counters (tokens beyond vLLM's
    cache), else vLLM's prefix cache; and which was used."""
    if rates.get("any_cache") is not None:
        return rates["any_cache"], ANY_CACHE
    if rates.get("kvtier") is not None:
        return rates["kvtier"], f"{KVTIER_HIT} / {KVTIER_LOOKUP}"
    if rates.get("vllm_prefix_cache") is not None:
        return rates["vllm_prefix_cache"], f"{VLLM_HIT} / {VLLM_QUERY}"
    return None, "none (no hit counters on /metrics)"


def bucket_delta(before: Snapshot | None, after: Snapshot, name: str,
                 label: str) -> dict[str, list[tuple[float, float]]]:
    """Histogram buckets added during the run: {label value: [(le, cumulative count)]}."""
    end = after.buckets(name, label)
    start = before.buckets(name, label) if before is not None else {}
    out = {}
    for key, per in end.items():
        base = start.get(key, {})
        out[key] = sorted((le, c - base.get(le, 0.0)) for le, c in per.items())
    return out


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus-style quantile: linear interpolation inside the bucket holding rank q."""
    if not buckets:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


def quantile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated quantile of raw samples (numpy's default method)."""
    if not values:
        return None
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


# ---------------------------------------------------------------------- requests


@dataclass(slots=True)
class RequestResult:
    """What one streamed completion did, as the client saw it."""

    session: int
    turn: int
    start_s: float
    ok: bool = False
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    text: str = ""
    prompt: str = ""


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def stream_completion(client: Any, base: str, model: str, prompt: str, max_tokens: int,
                      result: RequestResult) -> None:
    """POST one streamed completion, filling ``result``; never raises for server errors."""
    import httpx

    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    chunks = 0
    parts: list[str] = []
    try:
        with client.stream("POST", base + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                detail = resp.read().decode("utf-8", "replace")[:200]
                result.error = f"HTTP {resp.status_code}: {detail}"
                return
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                obj = json.loads(payload)
                if "error" in obj:
                    result.error = f"stream error: {str(obj['error'])[:200]}"
                    return
                if obj.get("choices"):
                    if result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - t0
                    chunks += 1
                    parts.append(obj["choices"][0].get("text") or "")
                usage = obj.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.output_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens")
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:240]
        return
    result.latency_s = time.perf_counter() - t0
    if result.ttft_s is None:
        result.error = "stream ended without a token"
        return
    if result.output_tokens is None:
        result.output_tokens = chunks
    result.text = "".join(parts)
    result.ok = True


class Pacer:
    """Poisson arrivals at ``rate``/s from a seeded generator, shared by all workers."""

    def __init__(self, rate: float, seed: int) -> None:
        self.rate = rate
        self._rng = random.Random(f"kvtier-bench:{seed}:arrivals")
        self._lock = threading.Lock()
        self._next = time.perf_counter()

    def wait(self) -> None:
        """Sleep until this caller's arrival slot."""
        if self.rate <= 0:
            return
        with self._lock:
            self._next += self._rng.expovariate(self.rate)
            due = self._next
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


class MetricsPoller:
    """Scrapes /metrics every few seconds in a thread, for hit rate over time."""

    def __init__(self, scrape: Callable[[], Snapshot | None], interval: float) -> None:
        self.snapshots: list[Snapshot] = []
        self._scrape = scrape
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            snap = self._scrape()
            if snap is not None:
                self.snapshots.append(snap)


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
    import httpx

    _validate(args)
    base = _base_url(args.url)
    metrics_url = args.metrics_url or base + "/metrics"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    # trust_env=False: never route loopback benchmarks through an environment proxy
    with httpx.Client(timeout=timeout, limits=limits, headers=headers, trust_env=False) as client:

        def scrape() -> Snapshot | None:
            if metrics_url == "none":
                return None
            try:
                r = client.get(metrics_url, timeout=10.0)
                r.raise_for_status()
            except httpx.HTTPError:
                return None
            return Snapshot(time.perf_counter(), parse_metrics(r.text))

        model = args.model or _first_model(client, base)
        scale = TokenScale() if args.no_calibrate else _token_scale(client, base, model)
        sessions = make_workload(
            seed=args.seed, sessions=args.sessions, turns=args.turns,
            shared_prefix_tokens=args.shared_prefix_tokens, turn_tokens=args.turn_tokens,
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
    return summarize(args, model, scale, results, before, after,
                     poller.snapshots if poller else [])


def _drive(client: Any, base: str, model: str, sessions: list[Session],
           args: argparse.Namespace, progress: bool | None) -> tuple[list[RequestResult], float]:
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
    bar = tqdm(total=total, desc="kvtier bench", unit="req", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
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
                _reset_prefix_cache(client, base)
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

    threads = [threading.Thread(target=worker, daemon=True)
               for _ in range(min(args.concurrency, total))]
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
            f.write(json.dumps({"timestamp": round(r.start_s, 6), "prompt": r.prompt,
                                "session": r.session, "turn": r.turn}) + "\n")


def _first_model(client: Any, base: str) -> str:
    import httpx

    try:
        r = client.get(base + "/v1/models", timeout=30.0)
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise BenchError(f"cannot list models at {base}/v1/models ({exc}); pass --model") from exc


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
            r = client.post(base + "/tokenize", json={"model": model, "prompt": prompt},
                            timeout=30.0)
            r.raise_for_status()
            counts.append(int(r.json()["count"]))
        except (httpx.HTTPError, KeyError, ValueError, TypeError):
            return TokenScale()
    per_word = (counts[1] - counts[0]) / 200
    if per_word <= 0:
        return TokenScale()
    return TokenScale(per_word=per_word, lead=max(counts[0] - 200 * per_word, 0.0))


def _reset_prefix_cache(client: Any, base: str) -> None:
    """Empty vLLM's own prefix cache; retried because in-flight saves make it refuse."""
    import httpx

    for _ in range(50):
        try:
            r = client.post(base + "/reset_prefix_cache", timeout=30.0)
        except httpx.HTTPError:
            return
        if r.status_code != 200:
            return
        try:
            if r.json().get("success", True):
                return
        except ValueError:
            return
        time.sleep(0.1)


# ------------------------------------------------------------------- summarizing


def summarize(args: argparse.Namespace, model: str, scale: TokenScale,
              run: tuple[list[RequestResult], float], before: Snapshot | None,
              after: Snapshot | None, timeline: list[Snapshot]) -> dict[str, Any]:
    """The numbers the table, --json and --plot show."""
    results, duration = run
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    rates = hit_rates(before, after)
    rate, source = pick_hit_rate(rates)
    sources = token_sources(before, after)
    by_outcome: dict[str, dict[str, Any]] = {}
    ttft_buckets: dict[str, list[tuple[float, float]]] = {}
    if after is not None and after.has(KVTIER_TTFT):
        ttft_buckets = bucket_delta(before, after, KVTIER_TTFT, "outcome")
        for outcome in sorted(ttft_buckets, key=_outcome_order):
            b = ttft_buckets[outcome]
            count = b[-1][1] if b else 0.0
            by_outcome[outcome] = {
                "count": int(round(count)),
                "p50_s": histogram_quantile(0.5, b),
                "p99_s": histogram_quantile(0.99, b),
            }
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return {
        "url": _base_url(args.url),
        "model": model,
        "workload": {
            "sessions": args.sessions, "turns": args.turns,
            "shared_prefix_tokens": args.shared_prefix_tokens, "turn_tokens": args.turn_tokens,
            "output_tokens": args.output_tokens, "concurrency": args.concurrency,
            "request_rate": args.request_rate, "seed": args.seed,
            "reset_prefix_cache": bool(args.reset_prefix_cache),
            "tokens_per_word": round(scale.per_word, 4),
            "lead_tokens": round(scale.lead, 2),
        },
        "requests": len(results),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "throughput_rps": len(ok) / duration if duration > 0 else 0.0,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else 0.0,
        "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None,
        "cached_tokens_total": sum(cached) if cached else None,
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "ttft_p50_s": quantile(ttfts, 0.5),
        "ttft_p99_s": quantile(ttfts, 0.99),
        "ttft_by_outcome": by_outcome,
        "ttft_buckets_by_outcome": {k: [[le, c] for le, c in v] for k, v in ttft_buckets.items()},
        "hit_rate": rate,
        "hit_rate_source": source,
        "hit_rate_by_source": token_shares(sources),
        "prompt_tokens_by_source": sources,
        "hit_rates": rates,
        "metrics_deltas": {
            name: counter_delta(before, after, name)
            for name in (KVTIER_HIT, KVTIER_LOOKUP, VLLM_HIT, VLLM_QUERY, VLLM_EXT_HIT,
                         VLLM_EXT_QUERY)
        },
        "hit_rate_timeline": _timeline(before, timeline, after, source),
        "errors": errors,
        "samples": [
            {k: v for k, v in asdict(r).items() if k not in ("text", "prompt")}
            for r in results
        ],
    }


def _outcome_order(outcome: str) -> tuple[int, str]:
    return (OUTCOMES.index(outcome) if outcome in OUTCOMES else len(OUTCOMES), outcome)


def _timeline(before: Snapshot | None, mids: list[Snapshot], after: Snapshot | None,
              source: str) -> list[dict[str, float | None]]:
    """Hit rate in each scrape interval, by the same source the summary uses."""
    key = ("any_cache" if source == ANY_CACHE
           else "kvtier" if source.startswith("kvtier:") else "vllm_prefix_cache")
    snaps = [s for s in (before, *mids, after) if s is not None]
    snaps.sort(key=lambda s: s.t)
    if len(snaps) < 2:
        return []
    t0 = snaps[0].t
    out = []
    for a, b in zip(snaps, snaps[1:], strict=False):
        out.append({"t_s": b.t - t0, "hit_rate": hit_rates(a, b)[key]})
    return out


def _fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.3f} s"


def format_table(result: dict[str, Any]) -> str:
    """The human-readable summary."""
    w = result["workload"]
    rows: list[tuple[str, str]] = [
        ("server", f"{result['url']}  model={result['model']}"),
        ("workload", f"{w['sessions']} sessions x {w['turns']} turns, shared "
                     f"{w['shared_prefix_tokens']} + {w['turn_tokens']}/turn tokens, "
                     f"{w['output_tokens']} out, concurrency {w['concurrency']}"),
        ("requests", f"{result['requests']} ({result['failed']} failed)"),
        ("duration", f"{result['duration_s']:.2f} s"),
        ("throughput", f"{result['throughput_rps']:.3f} req/s  "
                       f"({result['output_tokens_per_s']:.1f} output tok/s)"),
        ("TTFT p50 / p99", f"{_fmt_s(result['ttft_p50_s'])} / {_fmt_s(result['ttft_p99_s'])}"
                           "  (client, streamed)"),
    ]
    for outcome, d in result["ttft_by_outcome"].items():
        rows.append((f"  TTFT {outcome}", f"{_fmt_s(d['p50_s'])} / {_fmt_s(d['p99_s'])}"
                                         f"  (n={d['count']}, server {KVTIER_TTFT})"))
    hr = result["hit_rate"]
    rows.append(("hit rate", ("-" if hr is None else f"{hr * 100:.1f} %")
                 + f"  ({result['hit_rate_source']})"))
    shares = result.get("hit_rate_by_source")
    if shares:
        rows.append(("  from", ", ".join(f"{k.replace('_', ' ')} {v * 100:.1f} %"
                                         for k, v in shares.items() if k != "computed")))
        rows.append(("  computed", f"{shares['computed'] * 100:.1f} %"))
    for err, n in list(result["errors"].items())[:5]:
        rows.append(("error", f"{n} x {err}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _iter_cdf(values: Iterable[float]) -> tuple[list[float], list[float]]:
    s = sorted(values)
    return s, [(i + 1) / len(s) for i in range(len(s))]


def write_plot(result: dict[str, Any], path: str) -> None:
    """TTFT distribution per outcome (left) and hit rate over time (right), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ttfts = [s["ttft_s"] for s in result["samples"] if s["ok"] and s["ttft_s"] is not None]
    if ttfts:
        xs, ys = _iter_cdf(ttfts)
        ax1.step(xs, ys, where="post", label=f"client, all (n={len(xs)})", color="black")
    for outcome, buckets in result["ttft_buckets_by_outcome"].items():
        total = buckets[-1][1] if buckets else 0
        finite = [(le, c) for le, c in buckets if not math.isinf(le)]
        if total <= 0 or not finite:
            continue
        # only the buckets where this outcome's CDF moves, so the x axis stays readable
        lo = max((i for i, (_, c) in enumerate(finite) if c == 0), default=0)
        hi = min((i for i, (_, c) in enumerate(finite) if c >= total), default=len(finite) - 1)
        finite = finite[lo:hi + 1]
        ax1.step([le for le, _ in finite], [c / total for _, c in finite], where="post",
                 label=f"server, {outcome} (n={int(total)})")
    ax1.set_xscale("log")
    ax1.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax1.set_xlabel("time to first token (s)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("TTFT distribution")
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    tl = [p for p in result["hit_rate_timeline"] if p["hit_rate"] is not None]
    if tl:
        ax2.plot([p["t_s"] for p in tl], [p["hit_rate"] * 100 for p in tl], marker=".")
    else:
        ax2.text(0.5, 0.5, "no hit-rate counters on /metrics", ha="center", va="center",
                 transform=ax2.transAxes)
    ax2.set_ylim(-2, 102)
    ax2.set_xlabel("time since start (s)")
    ax2.set_ylabel("hit rate per scrape interval (%)")
    what = ("prompt tokens from any cache" if result["hit_rate_source"] == ANY_CACHE
            else result["hit_rate_source"].split(" ")[0])
    ax2.set_title(f"hit rate ({what})")
    ax2.grid(True, alpha=0.3)
    shares = result.get("hit_rate_by_source")
    if shares:  # the whole run's split, beside the curve
        ax2.text(0.02, 0.02, "whole run:\n" + "\n".join(
                     f"{k.replace('_', ' ')}: {v * 100:.1f} %" for k, v in shares.items()),
                 transform=ax2.transAxes, fontsize=8, va="bottom",
                 bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "0.8"})
    w = result["workload"]
    fig.suptitle(f"kvtier bench: {result['model']}, {w['sessions']}x{w['turns']} turns, "
                 f"{result['requests']} requests", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    """A standalone parser (``python -m kvtier.sizing.bench``, and the bench runner)."""
    parser = argparse.ArgumentParser(prog="kvtier bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    raise SystemExit(run(build_parser().parse_args()))
