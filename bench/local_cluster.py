"""A real Redis Cluster on loopback: ``redis-server --cluster-enabled yes`` processes
joined by ``redis-cli --cluster create`` (3 primaries + 3 replicas by default).

``make bench-tiers`` (tier_cases.local_cluster) and the tests (tests/conftest.py puts
bench/ on sys.path) start and stop it; it lives here, in bench/, so a benchmark run as
``python bench/x.py`` imports it from its own folder without editing sys.path. A missing
``redis-server`` or ``redis-cli`` raises MissingBinary, which fails the test with a clear
message (never a skip): ``.ci/run`` installs both.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable


class MissingBinary(RuntimeError):
    """redis-server or redis-cli is not on PATH (a failure, not a skip)."""


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise MissingBinary(
            f"{name} is not on PATH: a real Redis Cluster needs it. Install it with "
            "`apt-get install -y redis-server redis-tools` (.ci/run does this)."
        )
    return path


class _NodeExited(Exception):
    """A node's redis-server exited while it was being started."""


def _free_pair() -> int:
    """A loopback port p with p + 10000 (its cluster bus) also free a moment ago."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free loopback port pair for a cluster node")


def _wait(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} not within {timeout:.0f} s")


def node_command(port: int, *args: str, timeout: float = 2.0) -> str:
    """One command to a node through redis-cli (text reply)."""
    out = subprocess.run(
        [_binary("redis-cli"), "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return out.stdout


class RedisCluster:
    """``primaries`` primaries with ``replicas`` replicas each; ``node_timeout_ms`` is
    ``cluster-node-timeout`` (how long a dead primary goes unnoticed before a failover)."""

    def __init__(
        self,
        primaries: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 1000,
        password: str | None = None,
        full_coverage: bool = False,
        tls: bool = False,
    ) -> None:
        self.server = _binary("redis-server")
        self.cli = _binary("redis-cli")
        self.primaries, self.replicas = primaries, replicas
        self.node_timeout_ms = node_timeout_ms
        self.password = password
        self.full_coverage = full_coverage
        self.tls = tls
        self.workdir = tempfile.mkdtemp(prefix="kvtier-redis-cluster-")
        self.cert_path = os.path.join(self.workdir, "cert.pem")
        self.key_path = os.path.join(self.workdir, "key.pem")
        if tls:  # a self-signed certificate for 127.0.0.1, also the CA clients trust
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
                    self.key_path,
                    "-out",
                    self.cert_path,
                ],
                check=True,
                capture_output=True,
            )
        self.ports = [_free_pair() for _ in range(primaries * (1 + replicas))]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def seeds(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports[: self.primaries])

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss+cluster://{auth}{self.seeds}/?ssl_ca_certs={self.cert_path}"
        return f"redis+cluster://{auth}{self.seeds}/"

    def _start_node(self, port: int) -> None:
        node_dir = os.path.join(self.workdir, str(port))
        os.makedirs(node_dir, exist_ok=True)
        argv = [
            self.server,
            "--bind",
            "127.0.0.1",
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            os.path.join(node_dir, "nodes.conf"),
            "--cluster-node-timeout",
            str(self.node_timeout_ms),
            # the surviving primaries serve their slots while one is being failed over, and
            # a replica takes over however long ago it last heard from its primary
            "--cluster-require-full-coverage",
            "yes" if self.full_coverage else "no",
            "--cluster-replica-validity-factor",
            "0",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
            "--dir",
            node_dir,
            "--loglevel",
            "warning",
        ]
        if self.tls:
            argv += [
                "--port",
                "0",
                "--tls-port",
                str(port),
                "--tls-cluster",
                "yes",
                "--tls-replication",
                "yes",
                "--tls-auth-clients",
                "no",
                "--tls-cert-file",
                self.cert_path,
                "--tls-key-file",
                self.key_path,
                "--tls-ca-cert-file",
                self.cert_path,
            ]
        else:
            argv += ["--port", str(port)]
        if self.password:
            argv += ["--requirepass", self.password, "--masterauth", self.password]
        with open(os.path.join(node_dir, "server.log"), "ab") as log:
            self.procs[port] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def _auth(self) -> list[str]:
        """redis-cli's arguments for this cluster: AUTH, TLS trusting the test certificate."""
        tls = ["--tls", "--cacert", self.cert_path] if self.tls else []
        return tls + (["-a", self.password, "--no-auth-warning"] if self.password else [])

    def start(self, timeout: float = 90.0) -> None:
        """Start the nodes, create the cluster, wait for its state ok (``timeout`` for each
        step: 30 s ran out on a 2-core machine at load 10)."""
        for port in self.ports:
            self._start_node(port)
        for i in range(len(self.ports)):
            self._wait_node(i)
        subprocess.run(
            [
                self.cli,
                *self._auth(),
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in self.ports),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=timeout,
        )
        _wait(self._ready, timeout, "cluster state ok on every node")

    def _wait_node(self, i: int, tries: int = 3) -> None:
        """Wait for node ``i`` to answer PING (30 s: a TLS node on a loaded machine is
        slow); one that exited at start (its port pair was taken since it was picked)
        is started again on another pair."""
        for attempt in range(tries):
            port = self.ports[i]
            try:
                _wait(lambda p=port: self._pong(p), 30, f"node {port}")
                return
            except _NodeExited:
                if attempt == tries - 1:
                    log = os.path.join(self.workdir, str(port), "server.log")
                    with open(log, "rb") as f:
                        tail = f.read()[-2000:].decode(errors="replace")
                    raise RuntimeError(f"node {port} exited at start: {tail}") from None
                del self.procs[port]
                self.ports[i] = _free_pair()
                self._start_node(self.ports[i])

    def _pong(self, port: int) -> bool:
        if self.procs[port].poll() is not None:
            raise _NodeExited(port)
        return "PONG" in node_command(port, *self._auth(), "PING")

    def _ready(self) -> bool:
        if not all(
            "cluster_state:ok" in node_command(p, *self._auth(), "CLUSTER", "INFO")
            for p in self.live_ports()
        ):
            return False
        if len(self.primary_ports()) != self.primaries:
            return False
        # every replica has its primary's data (a failover right after create promotes one)
        return all(
            "master_link_status:up" in node_command(p, *self._auth(), "INFO", "replication")
            for p in self.live_ports()
            if "role:slave" in node_command(p, *self._auth(), "INFO", "replication")
        )

    def live_ports(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def primary_ports(self) -> list[int]:
        """Ports of live primaries that own slots, as a live node sees the cluster."""
        for port in self.live_ports():
            text = node_command(port, *self._auth(), "CLUSTER", "NODES")
            if not text:
                continue
            out = []
            for line in text.splitlines():
                f = line.split()
                if len(f) > 8 and "master" in f[2] and "fail" not in f[2]:
                    out.append(int(f[1].split("@")[0].rsplit(":", 1)[1]))
            return sorted(out)
        return []

    def port_of_slot(self, slot: int) -> int:
        """The primary serving ``slot`` now (as the first live node sees it)."""
        for port in self.live_ports():
            text = node_command(port, *self._auth(), "CLUSTER", "NODES")
            for line in text.splitlines():
                f = line.split()
                if len(f) < 9 or "master" not in f[2] or "fail" in f[2]:
                    continue
                for r in f[8:]:
                    lo, _, hi = r.partition("-")
                    if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                        return int(f[1].split("@")[0].rsplit(":", 1)[1])
        raise LookupError(f"no primary serves slot {slot}")

    def keys_on(self, port: int) -> int:
        return int(node_command(port, *self._auth(), "DBSIZE").strip() or 0)

    def wait_replicated(self, port: int, timeout: float = 10.0) -> None:
        """Until every replica of primary ``port`` has acknowledged all its writes:
        replication is asynchronous, so a replica promoted before that lacks the last
        writes (Redis Cluster's own semantics: they are lost, misses for kvtier)."""

        def caught_up() -> bool:
            text = node_command(port, *self._auth(), "INFO", "replication")
            info = dict(ln.strip().split(":", 1) for ln in text.splitlines() if ":" in ln)
            offsets = [
                int(dict(kv.split("=", 1) for kv in v.split(","))["offset"])
                for k, v in info.items()
                if k.startswith("slave") and k[5:].isdigit()
            ]
            top = int(info.get("master_repl_offset", "-1"))
            return bool(offsets) and min(offsets) >= top >= 0

        _wait(caught_up, timeout, f"the replicas of {port} caught up")

    def kill(self, port: int) -> None:
        """kill -9 one node: connections die without a goodbye."""
        proc = self.procs[port]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)

    def wait_failover(self, dead: int, timeout: float = 20.0) -> None:
        """Until every slot is served again and ``dead`` is no primary any more."""
        _wait(
            lambda: self._ready() and dead not in self.primary_ports(),
            timeout,
            f"failover of {dead}",
        )

    def cleanup(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        shutil.rmtree(self.workdir, ignore_errors=True)
