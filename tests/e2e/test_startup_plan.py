"""A config kvtier refuses stops ``vllm serve`` once, before any worker loads the model
or allocates memory (issue 48, items 2 and 6).

Before, the connector's checks ran where vLLM builds it, in the workers after the model
loaded and in the scheduler after the workers allocated: a bad value was reported four
times, 44 s into startup, and a host tier larger than the host was a raw ``OSError:
[Errno 12]`` from the worker's mmap (or an OOM kill). Each test starts vLLM's real
OpenAI server (engine core and worker processes) and reads its log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.e2e.test_metrics_server import KV_TRANSFER_CONFIG, checks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

#: log lines of a startup that reached the worker processes (vLLM 0.32's CPU worker)
WORKER_STARTED = ("Starting to load model", "host slab", "Initializing a V1 LLM engine")


def serve_until_exit(
    model: str,
    extra: dict[str, object],
    tmp_path: Path,
    unset: tuple[str, ...] = (),
    args: list[str] | None = None,
    timeout: float = 180,
) -> tuple[int, str]:
    """Run vLLM's OpenAI server with kvtier until it exits (it must not start), with the
    variables ``unset`` removed from its environment; its exit status and log."""
    ktc = {**KV_TRANSFER_CONFIG, "kv_connector_extra_config": extra}
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(checks.free_port()),
        "--enforce-eager",
        "--block-size",
        "32",
        "--max-model-len",
        "2048",
        "--kv-transfer-config",
        json.dumps(ktc),
        *(args or []),
    ]
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    for key in unset:
        full_env.pop(key, None)
    log = tmp_path / "vllm.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:  # it started: stop the server and its engine
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        pytest.fail(f"vLLM started with a config kvtier refuses:\n{log.read_text()[-4000:]}")
    finally:
        try:  # an engine process the server left behind
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, log.read_text(errors="replace")


def assert_refused_before_workers(rc: int, log: str, key: str) -> str:
    """One report naming ``key``, kvtier's ERROR line from the process that parsed the
    command line (vLLM then repeats its text once in pydantic's "Value error"), and no
    engine or worker process started. Returns the report's line."""
    assert rc != 0, log[-4000:]
    named = [line for line in log.splitlines() if f"kvtier config '{key}'" in line]
    reports = [line for line in named if "Value error" not in line]
    assert len(reports) == 1 and " ERROR " in reports[0], "\n".join(named) or log[-4000:]
    assert len(named) <= 2, "\n".join(named)
    for started in WORKER_STARTED:
        assert started not in log, f"{started!r}: startup went past the config\n{log[-4000:]}"
    assert "Errno 12" not in log and "Cannot allocate memory" not in log
    return reports[0]


def test_a_host_tier_larger_than_the_host_stops_startup_with_the_plan(
    tiny_model: str, tmp_path: Path
) -> None:
    """cpu_bytes four times the machine's memory: refused with the plan, vLLM's own KV
    space (VLLM_CPU_KVCACHE_SPACE) counted in it, and the largest cpu_bytes that fits."""
    too_big = f"{4 * psutil.virtual_memory().total // 2**30 + 1}GiB"
    rc, log = serve_until_exit(tiny_model, {"cpu_bytes": too_big}, tmp_path)
    report = assert_refused_before_workers(rc, log, "cpu_bytes")
    assert too_big in report and "does not fit" in report
    assert "available host memory" in report and "headroom" in report
    assert "KV cache 1.00 GiB (VLLM_CPU_KVCACHE_SPACE)" in report
    assert "the largest cpu_bytes that fits is" in report


def test_vllm_sizing_its_own_kv_cache_is_in_the_plan(tiny_model: str, tmp_path: Path) -> None:
    """Without VLLM_CPU_KVCACHE_SPACE vLLM's CPU worker grows to --gpu-memory-utilization
    of the host's memory: a host tier of 64 MiB beside 0.99 of it cannot fit, and the
    plan says to set VLLM_CPU_KVCACHE_SPACE (before, the engine started its workers)."""
    rc, log = serve_until_exit(
        tiny_model,
        {"cpu_bytes": "64MiB"},
        tmp_path,
        unset=("VLLM_CPU_KVCACHE_SPACE",),
        args=["--gpu-memory-utilization", "0.99"],
    )
    report = assert_refused_before_workers(rc, log, "cpu_bytes")
    assert "VLLM_CPU_KVCACHE_SPACE unset" in report and "0.99" in report


@pytest.mark.parametrize(
    ("key", "value"),
    [("chunk_size", "abc"), ("remote_url", "ftp://x"), ("chunk_size", 48), ("hmac_key_env", None)],
)
def test_a_bad_value_is_reported_once_before_the_model_loads(
    tiny_model: str, tmp_path: Path, key: str, value: object
) -> None:
    """A value kvtier refuses (chunk_size 48 is no multiple of the 32-token blocks; a
    null key setting, issue 47 item 9) is one line of the log, and no model is loaded."""
    extra = {"cpu_bytes": "64MiB", key: value}
    if key == "hmac_key_env":
        extra["remote_url"] = f"file://{tmp_path}/kv"
    rc, log = serve_until_exit(tiny_model, extra, tmp_path)
    assert_refused_before_workers(rc, log, key)
