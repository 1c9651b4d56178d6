"""``kvtier bench``'s client side, shared by the generated workload (bench.py) and the
trace replay (bench_trace.py): the HTTP client, one streamed completion, Poisson
arrivals, /metrics scrapes, the server's model and prefix-cache reset. httpx is
imported only when a run starts, so the ``kvtier`` CLI stays fast."""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from .bench_records import RequestResult
from .promtext import Snapshot, parse_metrics


class BenchError(Exception):
    """The bench cannot start (bad flags, server unreachable)."""


def stream_completion(
    client: Any,
    base: str,
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    result: RequestResult,
    *,
    messages: list[dict[str, Any]] | None = None,
    cache_salt: str | None = None,
) -> None:
    """POST one streamed completion (a chat completion with ``messages``), filling
    ``result``; never raises for server errors. ``prompt`` may be token ids."""
    import httpx

    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if messages is not None:
        body["messages"], path = messages, "/v1/chat/completions"
    else:
        body["prompt"], path = prompt, "/v1/completions"
    if cache_salt:
        body["cache_salt"] = cache_salt
    t0 = time.perf_counter()
    chunks = 0
    parts: list[str] = []
    try:
        with client.stream("POST", base + path, json=body) as resp:
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
                    choice = obj["choices"][0]
                    parts.append(
                        choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    )
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


def scraper(client: Any, metrics_url: str) -> Callable[[], Snapshot | None]:
    """One /metrics snapshot per call through ``client`` (an ``httpx.Client``); None
    without metrics or when the scrape fails."""
    import httpx

    def scrape() -> Snapshot | None:
        if metrics_url == "none":
            return None
        try:
            r = client.get(metrics_url, timeout=10.0)
            r.raise_for_status()
        except httpx.HTTPError:
            return None
        return Snapshot(time.perf_counter(), parse_metrics(r.text))

    return scrape


def first_model(client: Any, base: str) -> str:
    import httpx

    try:
        r = client.get(base + "/v1/models", timeout=30.0)
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise BenchError(f"cannot list models at {base}/v1/models ({exc}); pass --model") from exc


def reset_prefix_cache(client: Any, base: str) -> None:
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


def http_client(args: argparse.Namespace, in_flight: int) -> Any:
    """The ``httpx.Client`` a run sends through: ``--api-key``, ``--timeout``, a connection
    per request in flight (and a few for /metrics)."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=in_flight + 4)
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    # trust_env=False: never route loopback benchmarks through an environment proxy
    return httpx.Client(timeout=timeout, limits=limits, headers=headers, trust_env=False)
