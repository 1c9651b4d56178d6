"""Real services on loopback for every test: redis-server and moto's S3 server.

Fixtures (see each one's docstring):

    redis_server   session  a running redis-server: .url .port .kill() .start() .restart()
    redis_url      function redis_server's URL, server (re)started if needed and flushed
    s3_server      session  a running moto S3 server: .endpoint_url .env .create_bucket()
                            .client() .kill() .start() .restart()
    s3_env         function s3_server, running, with its AWS_* env set (monkeypatch)
    s3_bucket      function a fresh bucket on it (s3_env applied): .name .url .endpoint_url
    services       function factory of private servers/proxies torn down after the test:
                            services.redis(start=True, password=None, port=None, tls=False)
                            services.s3(start=True, port=None)
                            services.proxy(("127.0.0.1", port)) -> tests.faultproxy.FaultProxy

Servers run as subprocesses (``redis-server``, ``python -m moto.server``) so
that killing one is a real kill -9 and the tests drive them over TCP exactly
as they would drive a production Redis or S3 endpoint. A missing
``redis-server`` fails the tests with a clear message; it is never a skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/faultproxy.py for subdirectories
# bench/local_cluster.py: the Redis Cluster launcher the tests share with make bench-tiers
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

# kvtier refuses an explicit host tier that leaves less than cpu_headroom_bytes (4 GiB by
# default, sized for GPU servers) free. The suite runs up to two engines and a server at
# once on a small CI machine; every engine it starts inherits this smaller headroom.
os.environ.setdefault("KVTIER_CPU_HEADROOM_BYTES", "512MiB")

from faultproxy import FaultProxy  # noqa: E402
from kit import free_port

#: the credentials moto accepts; nothing else in the environment is trusted
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_REGION": "us-east-1",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}


def _wait(check: Callable[[], bool], timeout: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting")
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not become ready within {timeout:.0f} s")


class _Process:
    """A server subprocess on a fixed port that can be killed and started again."""

    what = "server"

    def __init__(self, port: int | None = None) -> None:
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.workdir = tempfile.mkdtemp(prefix=f"kvtier-{self.what}-")
        self.log_path = os.path.join(self.workdir, "server.log")

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 15.0) -> None:
        """Start on the same port (a no-op when running); waits until it answers."""
        if self.alive:
            return
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self._argv(), stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir
            )
        try:
            _wait(self._ready, timeout, f"{self.what} on port {self.port}", self.proc)
        except RuntimeError as exc:
            self.kill()
            with open(self.log_path, errors="replace") as f:
                tail = f.read()[-2000:]
            raise RuntimeError(f"{exc}; its log ends with:\n{tail}") from None

    def kill(self) -> None:
        """kill -9: connections die without a goodbye, state in memory is lost."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """A clean shutdown (SIGTERM)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> None:
        self.kill()
        self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


class RedisServer(_Process):
    """``redis-server`` on loopback, no persistence; ``password`` turns on AUTH."""

    what = "redis-server"

    def __init__(
        self, port: int | None = None, password: str | None = None, tls: bool = False
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                "redis-server is not on PATH: the integration tests need a real Redis. "
                "Install it with `apt-get install -y redis-server` (.ci/run does this).",
                pytrace=False,
            )
        self.binary = binary
        self.password = password
        self.tls = tls
        super().__init__(port)
        self.cert_path = os.path.join(self.workdir, "cert.pem")
        if tls:  # a self-signed certificate for 127.0.0.1, which is also the CA clients trust
            key_path = os.path.join(self.workdir, "key.pem")
            subprocess.run(
                [
                    "openssl",
                    "req",
                    "-x509",
                    "-newkey",
                    "ec",
                    "-pkeyopt",
                    "ec_paramgen_curve:prime256v1",
                    "-nodes",
                    "-days",
                    "2",
                    "-subj",
                    "/CN=127.0.0.1",
                    "-addext",
                    "subjectAltName=IP:127.0.0.1",
                    "-keyout",
                    key_path,
                    "-out",
                    self.cert_path,
                ],
                check=True,
                capture_output=True,
            )

    @property
    def url(self) -> str:
        """``redis://`` (or ``rediss://`` trusting the test certificate), with AUTH if set."""
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}{self.host}:{self.port}/0?ssl_ca_certs={self.cert_path}"
        return f"redis://{auth}{self.host}:{self.port}/0"

    def _argv(self) -> list[str]:
        argv = [
            self.binary,
            "--bind",
            self.host,
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
            "--dir",
            self.workdir,
            "--loglevel",
            "warning",
        ]
        if self.tls:
            argv += [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-auth-clients",
                "no",
                "--tls-cert-file",
                self.cert_path,
                "--tls-ca-cert-file",
                self.cert_path,
                "--tls-key-file",
                os.path.join(self.workdir, "key.pem"),
            ]
        else:
            argv += ["--port", str(self.port)]
        if self.password:
            argv += ["--requirepass", self.password]
        return argv

    def _ready(self) -> bool:
        with socket.create_connection((self.host, self.port), timeout=1) as raw:
            s = raw
            if self.tls:
                ctx = ssl.create_default_context(cafile=self.cert_path)
                s = ctx.wrap_socket(raw, server_hostname=self.host)
            cmd = b"PING\r\n" if not self.password else f"AUTH {self.password}\r\nPING\r\n".encode()
            s.sendall(cmd)
            return b"PONG" in s.recv(100) or b"PONG" in s.recv(100)

    def client(self) -> Any:
        """A redis-py client for arranging and checking test data directly."""
        import redis

        return redis.Redis.from_url(self.url)

    def flush(self) -> None:
        with self.client() as r:
            r.flushall()


class S3Server(_Process):
    """moto's S3 API server (``python -m moto.server``) on loopback; state lives in memory."""

    what = "moto-server"

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """Environment that makes plain boto3 (or a vLLM subprocess) use this server."""
        return {**S3_ENV, "AWS_ENDPOINT_URL_S3": self.endpoint_url}

    def _argv(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)]

    def _ready(self) -> bool:
        with socket.create_connection((self.host, self.port), timeout=1) as s:
            s.sendall(b"GET /moto-api/ HTTP/1.0\r\nHost: localhost\r\n\r\n")
            return s.recv(20).startswith(b"HTTP/1.")

    def client(self) -> Any:
        import boto3

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh unique name by default) and return its name."""
        name = name or f"kvtier-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


@dataclass
class S3Bucket:
    """A bucket on the moto server, as a kvtier ``remote_url``."""

    name: str
    server: S3Server
    prefix: str = "kv"

    @property
    def url(self) -> str:
        return f"s3://{self.name}/{self.prefix}"

    @property
    def endpoint_url(self) -> str:
        return self.server.endpoint_url


class ServiceFactory:
    """Private servers and fault proxies for one test, all torn down after it."""

    def __init__(self) -> None:
        self._cleanups: list[Callable[[], None]] = []

    def redis(
        self,
        *,
        start: bool = True,
        password: str | None = None,
        port: int | None = None,
        tls: bool = False,
    ) -> RedisServer:
        server = RedisServer(port, password, tls)
        self._cleanups.append(server.cleanup)
        if start:
            server.start()
        return server

    def s3(self, *, start: bool = True, port: int | None = None) -> S3Server:
        server = S3Server(port)
        self._cleanups.append(server.cleanup)
        if start:
            server.start()
        return server

    def proxy(self, upstream: tuple[str, int]) -> FaultProxy:
        proxy = FaultProxy(upstream).start()
        self._cleanups.append(proxy.close)
        return proxy

    def close(self) -> None:
        for cleanup in reversed(self._cleanups):
            cleanup()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the session. Tests may kill/restart it (``redis_url`` revives it)."""
    server = RedisServer()
    server.start()
    yield server
    server.cleanup()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the session redis-server, running and empty."""
    redis_server.start()
    redis_server.flush()
    return redis_server.url


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server for the session; a kill loses its buckets (it keeps them in RAM)."""
    server = S3Server()
    server.start()
    yield server
    server.cleanup()


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The session S3 server, running, with ``s3_server.env`` set in ``os.environ``.

    Plain ``boto3.client("s3")`` (and so kvtier's S3 tier) then reaches it
    with moto's test credentials and never any real AWS account.
    """
    s3_server.start()
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return s3_server


@pytest.fixture
def s3_bucket(s3_env: S3Server) -> S3Bucket:
    """A new, empty bucket on the session server (``s3_env`` applied); ``.url`` is s3://name/kv."""
    return S3Bucket(s3_env.create_bucket(), s3_env)


@pytest.fixture
def services() -> Iterator[ServiceFactory]:
    """Factory of private servers (redis, s3) and fault proxies, cleaned up after the test."""
    factory = ServiceFactory()
    yield factory
    factory.close()
