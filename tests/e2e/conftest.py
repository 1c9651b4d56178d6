"""Fixtures for end-to-end tests: a locally built model and an engine runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import forkserver

ENGINE = Path(__file__).with_name("engine.py")
REPO = Path(__file__).resolve().parents[2]
#: ``kvtier doctor``'s warnings for vLLM's own defaults, which the test engines run with:
#: kv_load_failure_policy "fail", and a stop that kills the engine before kvtier flushes
VLLM_DEFAULTS_NAMED = {"kv-load-failure-fails-requests", "shutdown-loses-queued-writes"}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """4 layers, 256 wide: starts fastest. Built locally, nothing downloaded."""
    from kvtier.cli.tinymodel import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny4"))


def run_engine(
    scenario: str,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    **args: Any,
) -> dict[str, Any]:
    """Run one scenario of tests/e2e/engine.py in a fresh process; return its RESULT.

    The process is forked from a server that has imported vLLM already
    (tests/e2e/forkserver.py) unless ``env`` changes what is read at import."""
    full_env = dict(os.environ)
    full_env.update(
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        PYTHONPATH=str(REPO) + os.pathsep + full_env.get("PYTHONPATH", ""),
        TOKENIZERS_PARALLELISM="false",
        # the 4 GiB default headroom is sized for GPU servers; on a 2-core CI box that
        # runs two engines at once it would refuse the small explicit tiers tests use
        KVTIER_CPU_HEADROOM_BYTES="512MiB",
    )
    base_env = dict(full_env)
    full_env.update(env or {})
    argv = [scenario, json.dumps(args)]
    server = forkserver.shared(base_env, str(REPO))
    if server is not None and not forkserver.import_time_keys(server.env, full_env):
        rc, stdout, stderr = server.run(argv, full_env, timeout)
    else:
        proc = subprocess.run(
            [sys.executable, str(ENGINE), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
            cwd=str(REPO),
        )
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            result["_log"] = stdout[-20000:] + stderr[-20000:]
            return result
    raise AssertionError(
        f"scenario {scenario} ended without a result (exit {rc}):\n"
        f"{stdout[-6000:]}\n{stderr[-12000:]}"
    )


def object_tier(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[dict, dict]:
    """(extra config, env) for one object tier: ``file`` (a directory in ``tmp_path``),
    ``s3`` (moto's server, its env for the engine), ``redis`` (the session's redis-server,
    emptied)."""
    if kind == "file":
        return {"remote_url": f"file://{tmp_path / 'kv'}"}, {}
    if kind == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        env = dict(bucket.server.env)
        return {"remote_url": bucket.url, "s3_endpoint_url": bucket.endpoint_url}, env
    redis_url = request.getfixturevalue("redis_url")
    return {"remote_url": redis_url}, {}


def start_outage(server: Any, sig: Path, deadline_s: float, poll_s: float) -> threading.Thread:
    """A thread that kills ``server`` when the scenario asks, then restarts it.

    The scenario (``outage`` or ``outage_concurrent`` in engine.py) and this thread
    talk through files in ``sig``: killme -> killed, restartme -> restarted.
    ``poll_s`` is how often the kill request is looked for.
    """

    def chaos() -> None:
        deadline = time.time() + deadline_s
        while not (sig / "killme").exists() and time.time() < deadline:
            time.sleep(poll_s)
        server.kill()
        (sig / "killed").write_text("")
        while not (sig / "restartme").exists() and time.time() < deadline:
            time.sleep(0.05)
        server.start()  # without persistence the restarted server is empty
        (sig / "restarted").write_text("")

    t = threading.Thread(target=chaos, daemon=True)
    t.start()
    return t
