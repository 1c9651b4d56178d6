"""kvtier's metrics on a real vLLM OpenAI server, scraped by a real Prometheus.

Why: the unit tests check the dashboard and rules against series written by
hand; only a real server shows that the connector's figures reach vLLM's
``/metrics`` under the names, labels and label values those queries expect,
and that the three meters show data for a real shared-prefix workload.

Starts the CPU build's API server on a tiny random-weight Llama (built locally,
no downloads) with kvtier loaded, and Prometheus scraping it every second.
Both are stopped by the fixtures. Takes one to three minutes on two cores.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.metrics import ALL, exported_names
from kvtier.sizing.emit import connector_config

# one worker runs the module: its server, Prometheus and workload start once
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200), pytest.mark.xdist_group("metrics_server")]

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny-llama"
KV_TRANSFER_CONFIG = connector_config({"cpu_bytes": "256MiB", "chunk_size": 256})
#: a shared prefix several 256-token chunks long (the tiny tokenizer makes ~1 token per word)
SHARED_PREFIX = " ".join(
    [
        "You are a careful assistant. Answer from the documents below.",
        "kvtier keeps the KV cache of long shared prompts in host memory and an object store.",
        "The quick brown fox jumps over the lazy dog while the scheduler plans the next step.",
        "System prompts, agent histories and retrieved documents are reused across requests.",
        "Prefill is expensive; loading cached keys and values is cheap when the link is fast.",
    ]
    * 12
)
ROUNDS = 4


def _load_deploy_checks() -> ModuleType:
    """The dashboard/rule helpers of tests/deploy (a test module, so loaded by path)."""
    path = ROOT / "tests" / "deploy" / "test_dashboard_rules.py"
    spec = importlib.util.spec_from_file_location("kvtier_deploy_checks", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


checks = _load_deploy_checks()


@dataclass
class VLLMServer:
    proc: subprocess.Popen[bytes]
    url: str
    port: int
    log_path: Path

    def tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's own process group (API server + engine core), then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:  # the engine core may outlive the API server
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        proc.wait(10)


@contextlib.contextmanager
def serve(
    model: str,
    extra_config: dict[str, object],
    log_dir: Path,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[VLLMServer]:
    """vLLM's OpenAI server with kvtier on a free loopback port (``args``: more flags,
    ``env``: more environment); stopped on exit."""
    port = checks.free_port()
    log_path = log_dir / f"vllm-{port}.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    ktc = {**KV_TRANSFER_CONFIG, "kv_connector_extra_config": extra_config}
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--block-size",
        "32",
        "--max-model-len",
        "4096",
        "--kv-transfer-config",
        json.dumps(ktc),
        *(args or []),
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    server = VLLMServer(proc, f"http://127.0.0.1:{port}", port, log_path)
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode}:\n{server.tail()}")
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM did not become healthy in 600 s:\n{server.tail()}")
            time.sleep(1)
        yield server
    finally:
        _stop_group(proc)


@contextlib.contextmanager
def scraping(server: VLLMServer) -> Iterator[Any]:
    """A real Prometheus with the kvtier rules, scraping ``server`` every second."""
    prom = checks.Prometheus(f"127.0.0.1:{server.port}")
    try:
        prom.wait(
            lambda: checks.scraped_twice(prom, "vllm:prefix_cache_queries_total"),
            30,
            "two scrapes of vLLM's /metrics",
        )
        yield prom
    finally:
        prom.stop()


@pytest.fixture(scope="module")
def vllm_server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """The server exactly as issue 5 starts it: host tier only, 256 MiB, 256-token chunks.

    ``tiny_model`` (tests/e2e/conftest.py) is ``build_tiny_llama``'s 4-layer, 256-wide model.
    """
    extra = KV_TRANSFER_CONFIG["kv_connector_extra_config"]
    with serve(tiny_model, extra, tmp_path_factory.mktemp("vllm-log")) as server:
        yield server


@pytest.fixture(scope="module")
def prometheus(vllm_server: VLLMServer) -> Iterator[Any]:
    """Prometheus scraping the module's server from before the workload starts."""
    with scraping(vllm_server) as prom:
        yield prom


def _complete(client: httpx.Client, prompt: str) -> dict:
    resp = client.post(
        "/v1/completions",
        json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0},
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def _reset_gpu_prefix_cache(client: httpx.Client) -> None:
    """Empty vLLM's own prefix cache (not kvtier's) so the next hit must come from kvtier."""
    deadline = time.monotonic() + 30
    while True:
        resp = client.post("/reset_prefix_cache")
        assert resp.status_code == 200, resp.text
        if resp.json().get("success"):
            return
        assert time.monotonic() < deadline, "vLLM refused to reset its prefix cache for 30 s"
        time.sleep(0.2)


@dataclass
class Scrape:
    text: str
    samples: dict[str, list[tuple[dict[str, str], float]]]

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        return sum(v for lab, v in self.samples.get(name, []) if labels.items() <= lab.items())


def _scrape(client: httpx.Client) -> Scrape:
    text = client.get("/metrics").text
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return Scrape(text, samples)


def _settled(scrape: Scrape) -> bool:
    """The workload's figures have reached /metrics (stats flow with engine steps)."""
    return (
        scrape.value("kvtier:hit_tokens_total") > 0
        and scrape.value("kvtier:ttft_seconds_count", outcome="miss") > 0
        and scrape.value("vllm:prompt_tokens_cached_by_source_total", source="host") > 0
        # the ghosts' counts move when their thread applies its queue (every 50 ms)
        and scrape.value("kvtier:whatif_hit_tokens_total", tier="host", scale="1")
        == scrape.value("kvtier:hit_tokens_total", tier="host")
    )


@pytest.fixture(scope="module")
def workload(vllm_server: VLLMServer, prometheus: Any) -> Iterator[Scrape]:
    """Shared-prefix requests with vLLM's prefix cache emptied between them; then /metrics."""
    with httpx.Client(base_url=vllm_server.url, timeout=120) as client:
        first = _complete(client, SHARED_PREFIX + " Question 0: what is kept?")
        assert first["usage"]["prompt_tokens"] >= 3 * 256, first["usage"]
        for i in range(1, ROUNDS + 1):
            _reset_gpu_prefix_cache(client)
            _complete(client, SHARED_PREFIX + f" Question {i}: what is reused?")
            _reset_gpu_prefix_cache(client)
            # a miss: a unique first token changes every chunk's key
            _complete(client, f"{uuid.uuid4().hex} {SHARED_PREFIX}")
        deadline = time.monotonic() + 60
        while True:
            scrape = _scrape(client)
            if _settled(scrape) or time.monotonic() > deadline:
                break
            _complete(client, "ping")  # one more engine step carries pending stats
            time.sleep(1)
        yield scrape


def test_metrics_endpoint_shows_kvtier(workload: Scrape) -> None:
    """/metrics carries every kvtier series with vLLM's labels and the workload's figures."""
    scrape = workload
    missing = [n for spec in ALL for n in exported_names(spec) if n not in scrape.samples]
    assert missing == [], f"kvtier metrics missing from vLLM's /metrics: {missing}"
    for spec in ALL:
        for name in exported_names(spec):
            for labels, _ in scrape.samples[name]:
                assert labels.get("model_name") == MODEL_NAME and "engine" in labels, (
                    name,
                    labels,
                )
                assert set(spec.labels) <= labels.keys(), (name, labels)
    problems = []
    if not scrape.value("kvtier:lookup_tokens_total") > 0:
        problems.append("kvtier:lookup_tokens_total is 0")
    if not scrape.value("kvtier:hit_tokens_total", tier="host") > 0:
        problems.append('kvtier:hit_tokens_total{tier="host"} is 0')
    for outcome in ("miss",):
        if not scrape.value("kvtier:ttft_seconds_count", outcome=outcome) > 0:
            problems.append(f'kvtier:ttft_seconds_count{{outcome="{outcome}"}} is 0')
    reused = scrape.value("kvtier:ttft_seconds_count", outcome="hit") + scrape.value(
        "kvtier:ttft_seconds_count", outcome="partial"
    )
    if not reused > 0:
        problems.append('kvtier:ttft_seconds_count{outcome=~"hit|partial"} is 0')
    for mode in ("sync", "async"):
        if not any(
            lab.get("mode") == mode
            for lab, _ in scrape.samples.get("kvtier:lookup_delay_seconds_count", [])
        ):
            problems.append(f'no kvtier:lookup_delay_seconds series with mode="{mode}"')
    if not scrape.value("kvtier:lookup_delay_seconds_count", mode="sync") > 0:
        problems.append('kvtier:lookup_delay_seconds_count{mode="sync"} is 0')
    if not scrape.value("kvtier:host_bytes_used") > 0:
        problems.append("kvtier:host_bytes_used is 0")
    if not scrape.value("kvtier:host_bytes_capacity") >= 256 * 2**20 * 0.9:
        problems.append("kvtier:host_bytes_capacity is not about cpu_bytes (256 MiB)")
    cached_host = scrape.value("vllm:prompt_tokens_cached_by_source_total", source="host")
    if not cached_host > 0:
        problems.append('vllm:prompt_tokens_cached_by_source_total{source="host"} is 0')
    # both are counted at admission and published in the same scheduler stats
    hit_host = scrape.value("kvtier:hit_tokens_total", tier="host")
    if cached_host != hit_host:
        problems.append(
            f'vLLM counts {cached_host:g} cached tokens from source="host" but kvtier '
            f'counts {hit_host:g} kvtier:hit_tokens_total{{tier="host"}}'
        )
    assert problems == [], "\n".join(problems)


def test_whatif_counters_on_metrics(workload: Scrape) -> None:
    """The ghost tiers' counters on the real server's /metrics: today's size (scale 1)
    counts exactly the host hits, a larger tier never fewer, none more than was looked up."""
    scrape = workload
    host = scrape.value("kvtier:hit_tokens_total", tier="host")
    whatif = [
        scrape.value("kvtier:whatif_hit_tokens_total", tier="host", scale=s)
        for s in ("0.5", "1", "2", "4", "8")
    ]
    assert whatif[1] == host > 0, (whatif, host)
    assert whatif == sorted(whatif), whatif
    assert whatif[-1] <= scrape.value("kvtier:lookup_tokens_total")


def test_prometheus_evaluates_dashboard_and_rules(
    workload: Scrape, prometheus: checks.Prometheus
) -> None:
    """Every dashboard and rule expression works on the real server's series; meters show data."""
    prom = prometheus
    time.sleep(3)  # a few more scrapes after the workload's last figures
    answers = checks.check_expressions(prom)

    def values(where: str) -> list[float]:
        return [float(r["value"][1]) for r in answers[where]["data"]["result"]]

    meter1 = "panel '① Prefix-cache hit rate'"
    meter2 = "panel '② Time to first token, p50 and p99'"
    meter3 = "panel '③ Miss tail: TTFT p99 of misses and lookup delay p99'"
    hit_rate = values(f"{meter1} B")
    assert len(hit_rate) == 1 and 0 < hit_rate[0] <= 1, hit_rate
    assert any(v > 0 for v in values(f"{meter1} A")), answers[f"{meter1} A"]
    assert values(f"{meter1} C"), answers[f"{meter1} C"]  # vLLM's own: may be NaN or 0
    for ref in ("A", "B"):  # vLLM's TTFT p50 and p99
        assert all(math.isfinite(v) for v in values(f"{meter2} {ref}")), answers[f"{meter2} {ref}"]
    for ref in ("C", "D"):  # kvtier's by outcome: at least the miss line is a number
        assert any(math.isfinite(v) for v in values(f"{meter2} {ref}")), answers[f"{meter2} {ref}"]
    assert all(math.isfinite(v) for v in values(f"{meter3} A")), answers[f"{meter3} A"]
    assert all(math.isfinite(v) for v in values(f"{meter3} C")), answers[f"{meter3} C"]
    assert values(f"{meter3} B"), answers[f"{meter3} B"]  # async: NaN without an object tier


def _wait_metrics(client: httpx.Client, done: Any, what: str, timeout: float = 90) -> Scrape:
    """Scrape /metrics until ``done(scrape)``; a short request each round carries stats up."""
    deadline = time.monotonic() + timeout
    while True:
        scrape = _scrape(client)
        if done(scrape):
            return scrape
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        _complete(client, "ping")
        time.sleep(1)


def test_object_tier_metrics(tiny_model: str, tmp_path: Path) -> None:
    """Two replicas sharing a file:// object tier: uploads, async lookups and remote hits.

    The host-only server above never looks up the object tier, so the async half of
    meter 3 and the remote rows stay empty there. Replica A stores a prefix (write-through
    uploads it); replica B, with an empty host tier, must find it in the object tier.
    """
    objects = tmp_path / "objects"
    objects.mkdir()
    # replica B's first hit is a load, as before the canary (tests/e2e/test_canary.py and
    # the README's restart test cover the first-hit check)
    extra = {
        "cpu_bytes": "256MiB",
        "chunk_size": 256,
        "remote_url": f"file://{objects}",
        "canary_first_hit": False,
    }
    with serve(tiny_model, extra, tmp_path) as a, httpx.Client(base_url=a.url, timeout=120) as c:
        _complete(c, SHARED_PREFIX + " Question A: what is kept?")
        uploaded = _wait_metrics(
            c,
            lambda s: s.value("kvtier:transfer_seconds_count", op="upload") >= 3,
            "replica A to upload the shared prefix's chunks",
        )
    problems = []
    if not uploaded.value("kvtier:bytes_total", tier="remote", direction="write") > 0:
        problems.append('replica A: kvtier:bytes_total{tier="remote",direction="write"} is 0')

    with (
        serve(tiny_model, extra, tmp_path) as b,
        scraping(b) as prom,
        httpx.Client(base_url=b.url, timeout=120) as c,
    ):
        _complete(c, SHARED_PREFIX + " Question B: what is reused?")
        scrape = _wait_metrics(
            c,
            lambda s: s.value("kvtier:hit_tokens_total", tier="remote") > 0,
            "replica B to serve tokens from the object tier",
        )
        if not scrape.value("kvtier:lookup_delay_seconds_count", mode="async") > 0:
            problems.append('replica B: kvtier:lookup_delay_seconds_count{mode="async"} is 0')
        if not scrape.value("kvtier:transfer_seconds_count", op="fetch") > 0:
            problems.append('replica B: kvtier:transfer_seconds_count{op="fetch"} is 0')
        if not scrape.value("kvtier:bytes_total", tier="remote", direction="read") > 0:
            problems.append('replica B: kvtier:bytes_total{tier="remote",direction="read"} is 0')
        remote_hits = scrape.value("kvtier:hit_tokens_total", tier="remote")
        disk = scrape.value("vllm:prompt_tokens_cached_by_source_total", source="disk")
        if disk != remote_hits:
            problems.append(
                f'replica B: vLLM counts {disk:g} cached tokens from source="disk" (a file:// '
                f'tier) but kvtier counts {remote_hits:g} kvtier:hit_tokens_total{{tier="remote"}}'
            )
        time.sleep(3)  # scrapes after the last figures
        answers = checks.check_expressions(prom)
        meter1 = "panel '① Prefix-cache hit rate' A"
        by_tier = {
            r["metric"]["tier"]: float(r["value"][1]) for r in answers[meter1]["data"]["result"]
        }
        if not by_tier.get("remote", 0) > 0:
            problems.append(f"replica B: meter 1 shows no remote hit rate: {by_tier}")
        meter3 = "panel '③ Miss tail: TTFT p99 of misses and lookup delay p99' B"
        async_p99 = [float(r["value"][1]) for r in answers[meter3]["data"]["result"]]
        if not (len(async_p99) == 1 and math.isfinite(async_p99[0])):
            problems.append(f"replica B: meter 3 async lookup p99 is not a number: {async_p99}")
    assert problems == [], "\n".join(problems)
