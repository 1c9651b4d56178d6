"""A fake OpenAI-compatible server for ``kvtier bench`` tests: a real HTTP server on
loopback (threaded ``http.server``) that streams SSE chunks after a controlled delay,
answers 500 to every Nth completion, and serves a ``/metrics`` page whose counters move
by known amounts per request."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvtier.cli import bench

FIRST_TOKEN_DELAY = 0.2
TOKEN_DELAY = 0.01
HIT_PER_REQUEST = 30
LOOKUP_PER_REQUEST = 40
TTFT_LE = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5)


class FakeServer:
    """State and counters of the fake OpenAI-compatible server."""

    def __init__(
        self, *, fail_every: int = 0, kvtier_metrics: bool = True, by_source: bool = False
    ) -> None:
        self.fail_every = fail_every
        self.kvtier_metrics = kvtier_metrics
        #: vLLM's prompt_tokens_by_source: 100 per request, 10 from the GPU prefix cache,
        #: kvtier's 30 through the connector, 60 computed
        self.by_source = by_source
        self.sources = {
            "local_cache_hit": 700.0,
            "external_kv_transfer": 300.0,
            "local_compute": 5000.0,
        }
        self.lock = threading.Lock()
        self.completions = 0
        self.prompts: list[str] = []
        #: every completion or chat request body, with its arrival (time.monotonic())
        self.bodies: list[tuple[float, dict[str, Any]]] = []
        self.in_flight = self.max_in_flight = 0
        #: lines appended to /metrics as they are (gauges a test sets)
        self.extra_metrics = ""
        self.resets = 0
        # counters start far from zero: a rate computed from totals instead of deltas is wrong
        self.kv_hit, self.kv_lookup = 1000.0, 9000.0
        self.vllm_hit, self.vllm_query = 500.0, 600.0
        self.ttft_obs: dict[str, list[float]] = {"hit": [0.05] * 7, "miss": [0.3] * 3}
        #: the model card's max_model_len in /v1/models, as vLLM lists it (None: left out)
        self.max_model_len: int | None = None

    def observe(self, n: int) -> None:
        """Counters for the n-th (1-based) successful completion."""
        self.kv_hit += HIT_PER_REQUEST
        self.kv_lookup += LOOKUP_PER_REQUEST
        self.vllm_hit += 10
        self.vllm_query += 100
        for source, n_tokens in (
            ("local_cache_hit", 10),
            ("external_kv_transfer", 30),
            ("local_compute", 60),
        ):
            self.sources[source] += n_tokens
        outcome = "hit" if n % 2 == 0 else "miss"
        self.ttft_obs[outcome].append(0.05 if outcome == "hit" else 0.3)

    def metrics_text(self) -> str:
        lab = 'model_name="fake",engine="0"'
        lines = [
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits.",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{lab}}} {self.vllm_hit}",
            f"vllm:prefix_cache_queries_total{{{lab}}} {self.vllm_query}",
            f"vllm:prefix_cache_queries_created{{{lab}}} 1.7e9",
        ]
        if self.by_source:
            lines += ["# TYPE vllm:prompt_tokens_by_source counter"] + [
                f'vllm:prompt_tokens_by_source_total{{{lab},source="{k}"}} {v}'
                for k, v in self.sources.items()
            ]
        if self.kvtier_metrics:
            lines += [
                "# TYPE kvtier:lookup_tokens_total counter",
                f"kvtier:lookup_tokens_total{{{lab}}} {self.kv_lookup}",
                # split across two tiers: the bench must sum them
                f'kvtier:hit_tokens_total{{{lab},tier="host"}} {self.kv_hit - 100}',
                f'kvtier:hit_tokens_total{{{lab},tier="remote"}} 100.0',
                "# TYPE kvtier:ttft_seconds histogram",
            ]
            for outcome, obs in self.ttft_obs.items():
                for le in TTFT_LE:
                    c = sum(o <= le for o in obs)
                    lines.append(
                        f'kvtier:ttft_seconds_bucket{{{lab},outcome="{outcome}",le="{le}"}} {c}.0'
                    )
                lines.append(
                    f'kvtier:ttft_seconds_bucket{{{lab},outcome="{outcome}",le="+Inf"}} '
                    f"{len(obs)}.0"
                )
                lines.append(f'kvtier:ttft_seconds_count{{{lab},outcome="{outcome}"}} {len(obs)}')
                lines.append(f'kvtier:ttft_seconds_sum{{{lab},outcome="{outcome}"}} {sum(obs)}')
        return "\n".join(lines) + "\n" + self.extra_metrics


def _tokens(prompt: str | list[int]) -> int:
    """The fake tokenizer: a BOS, then one token per whitespace-separated word; token ids
    are taken as they are."""
    return len(prompt) if isinstance(prompt, list) else 1 + len(prompt.split())


def _chat_tokens(messages: list[dict[str, Any]]) -> int:
    return _tokens(" ".join(f"{m['role']}: {m.get('content', '')}" for m in messages))


def _handler(state: FakeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/v1/models":
                card: dict[str, Any] = {"id": "fake-model"}
                if state.max_model_len is not None:
                    card["max_model_len"] = state.max_model_len
                self._send(200, json.dumps({"data": [card]}).encode())
            elif self.path == "/metrics":
                with state.lock:
                    text = state.metrics_text()
                self._send(200, text.encode(), "text/plain; version=0.0.4")
            else:
                self._send(404, b"{}")

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"] or 0)) or b"{}")
            if self.path == "/tokenize":
                self._send(200, json.dumps({"count": _tokens(body["prompt"])}).encode())
                return
            if self.path == "/reset_prefix_cache":
                with state.lock:
                    state.resets += 1
                self._send(200, b'{"success": true}')
                return
            chat = self.path == "/v1/chat/completions"
            if self.path != "/v1/completions" and not chat:
                self._send(404, b"{}")
                return
            assert body["stream"] is True and body["temperature"] == 0
            with state.lock:
                state.completions += 1
                n = state.completions
                state.prompts.append(body.get("prompt"))
                state.bodies.append((time.monotonic(), body))
            if state.fail_every and n % state.fail_every == 0:
                self._send(500, b'{"error": "injected failure"}')
                return
            with state.lock:
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                self._stream(n, body, chat)
            finally:
                with state.lock:
                    state.in_flight -= 1

        def _stream(self, n: int, body: dict[str, Any], chat: bool) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            time.sleep(FIRST_TOKEN_DELAY)
            for i in range(body["max_tokens"]):
                chunk = {
                    "choices": [
                        {"index": 0, "delta": {"content": f" tok{n}_{i}"}}
                        if chat
                        else {"index": 0, "text": f" tok{n}_{i}"}
                    ]
                }
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                time.sleep(TOKEN_DELAY)
            usage = {
                "prompt_tokens": (
                    _chat_tokens(body["messages"]) if chat else _tokens(body["prompt"])
                ),
                "completion_tokens": body["max_tokens"],
                "prompt_tokens_details": {"cached_tokens": 3},
            }
            # the counters move before the last chunk goes out, as in vLLM, whose output
            # handler records a step's stats before the API server streams that step's
            # outputs; after it, a scrape right after [DONE] could miss this request
            with state.lock:
                state.observe(n - (n // state.fail_every if state.fail_every else 0))
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    return Handler


@contextmanager
def serving(state: FakeServer) -> Iterator[str]:
    """``state``'s server, started; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def bench_args(url: str, *extra: str) -> Any:
    return bench.build_parser().parse_args(
        [
            "--url",
            url,
            "--sessions",
            "4",
            "--turns",
            "2",
            "--shared-prefix-tokens",
            "50",
            "--turn-tokens",
            "10",
            "--output-tokens",
            "5",
            "--concurrency",
            "2",
            *extra,
        ]
    )
