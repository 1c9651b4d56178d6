"""A stopped ``vllm serve`` writes the chunks still queued for the object tier, when it
runs with the shutdown window kvtier asks for (connectors/worker/shutdown.py).

vLLM's default stop (``--shutdown-timeout 0``) kills the engine as soon as the API
server gets SIGTERM, which is what Kubernetes sends on every rolling restart: the last
requests' chunks, queued for upload, were lost, and the next replica missed exactly the
prompts it was most likely to see. Here every upload crosses a loopback proxy that delays
each packet, so the chunks are still queued when SIGTERM arrives, and the server is
stopped the way Kubernetes stops a pod (SIGTERM to the API server, then waiting).
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from kvtier.config import load_config
from kvtier.sizing import doctor
from kvtier.sizing.emit import shutdown_flags
from tests.e2e.test_metrics_server import MODEL_NAME, serve

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

#: four full chunks of 256 tokens and a partial one
PROMPT = [(7 * i) % 400 + 10 for i in range(1100)]
CHUNKS = 4
#: one-way delay of every packet to and from Redis: each upload takes over a second
LATENCY_S = 0.3
LOSES = "shutdown-loses-queued-writes"


def stop_like_kubernetes(proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    """SIGTERM to the API server alone (the container's first process), then wait."""
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout)


def serve_one_prompt(
    tiny_model: str, url: str, log_dir: Path, args: list[str], env: dict[str, str]
) -> str:
    """Start vLLM with kvtier writing through to ``url``, compute PROMPT, stop vLLM as soon
    as the answer is in; its log."""
    extra = {"cpu_bytes": "64MiB", "chunk_size": 256, "remote_url": url, "io_threads": 2}
    log_dir.mkdir()
    with serve(tiny_model, extra, log_dir, args=args, env=env) as server:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            r = client.post(
                "/v1/completions",
                json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0},
            )
            r.raise_for_status()
        stop_like_kubernetes(server.proc)
        return server.log_path.read_text(errors="replace")


def test_queued_uploads_are_written_when_vllm_is_stopped(
    tiny_model: str, tmp_path: Path, services
) -> None:
    redis = services.redis()
    proxy = services.proxy((redis.host, redis.port))
    proxy.latency_s = LATENCY_S
    url = f"redis://{proxy.address}/0"
    env, args = shutdown_flags({"remote_url": url})
    assert args == ["--shutdown-timeout", "20"]  # what the chart and `--emit` set

    log = serve_one_prompt(tiny_model, url, tmp_path / "advised", args, env)
    with redis.client() as r:
        assert _chunks(r) == CHUNKS, log[-4000:]
    assert "--shutdown-timeout" not in _kvtier_warnings(log), log[-4000:]
    assert "were not written at shutdown" not in log
    assert LOSES not in doctor_codes(log)

    # vLLM's defaults: startup names the flags, and the stop loses what was queued
    with redis.client() as r:
        r.flushall()
    log = serve_one_prompt(tiny_model, url, tmp_path / "defaults", [], {})
    warned = _kvtier_warnings(log)
    assert "--shutdown-timeout is 0" in warned and "--shutdown-timeout 20" in warned, warned
    assert "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=20" in warned
    assert LOSES in doctor_codes(log)  # `kvtier doctor` on the server's log says it too
    with redis.client() as r:
        assert _chunks(r) < CHUNKS, "vLLM no longer kills its engine at once: revisit the warning"
    assert load_config({"remote_url": url}).vllm_shutdown_timeout_s() == 20


def _chunks(r) -> int:
    """The chunks in the Redis: its keys but the generation's manifest."""
    return sum(1 for k in r.scan_iter() if not k.endswith(b"/manifest"))


def doctor_codes(log: str) -> set[str]:
    return {w["code"] for w in doctor.report(doctor.parse_log(log.splitlines()))["warnings"]}


def _kvtier_warnings(log: str) -> str:
    return "\n".join(line for line in log.splitlines() if "WARNING" in line and "kvtier" in line)
