#!/usr/bin/env python3
"""Object-tier throughput: kvtier (codec + tier, and RemoteIO) against raw boto3 / redis-py.

Why: every chunk kvtier moves pays for framing, an xxh3-128 checksum, an
optional HMAC and a copy into the host slot. This measures what that costs
next to the client library alone, on the same server, bytes and concurrency:

- ``sync``: one thread, codec.encode + tier.put / tier.get + codec.decode +
  copy into a slot, against ``put_object``/``get_object`` or ``SET``/``GET``
  of the same payload bytes.
- ``RemoteIO``: ``--threads`` I/O threads through RemoteIO (queues, result
  polling) against a thread pool of the same size calling the raw client.

Raw boto3 uses the same botocore Config as kvtier's S3 tier (pool size,
timeouts, no extra CRC), so the ratio isolates kvtier's own overhead. Each
figure is the best of ``--rounds`` interleaved rounds (the machine is shared);
the ratios are kvtier / raw of the best and of the median round.

    python bench/tier_throughput.py                      # starts redis-server and moto
    python bench/tier_throughput.py --redis-url redis://host:6379/0 --s3-endpoint http://host:9000
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from kvtier import codec
from kvtier.backoff import ConstantBackoff
from kvtier.remote import RemoteIO
from kvtier.tiers.base import ObjectTier

MiB = 2**20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited with code {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            time.sleep(0.2)
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"{what} did not start on port {port}")


@contextmanager
def local_services(args: argparse.Namespace) -> Iterator[None]:
    """Start redis-server and moto's S3 server on loopback unless URLs were given."""
    procs: list[subprocess.Popen] = []
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-")
    try:
        if not args.redis_url and not args.skip_redis:
            binary = shutil.which("redis-server")
            if binary is None:
                sys.exit("redis-server not found; install it or pass --redis-url")
            port = _free_port()
            procs.append(
                subprocess.Popen(
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
                        workdir,
                        "--loglevel",
                        "warning",
                    ],
                    stdout=subprocess.DEVNULL,
                )  # fmt: skip
            )
            _wait_port(port, procs[-1], "redis-server")
            args.redis_url = f"redis://127.0.0.1:{port}/0"
        if not args.s3_endpoint and not args.skip_s3:
            port = _free_port()
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            _wait_port(port, procs[-1], "moto server")
            args.s3_endpoint = f"http://127.0.0.1:{port}"
            for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                         "AWS_DEFAULT_REGION": "us-east-1"}.items():  # fmt: skip
                os.environ.setdefault(k, v)
        yield
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def _mbps(nbytes: int, seconds: float) -> float:
    return nbytes / MiB / seconds


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Case:
    """One backend: a kvtier tier plus raw put/get functions over the same server."""

    def __init__(
        self,
        name: str,
        tier: ObjectTier,
        raw_put: Callable[[str, bytes], None],
        raw_get: Callable[[str], bytes],
    ) -> None:
        self.name, self.tier, self.raw_put, self.raw_get = name, tier, raw_put, raw_get


def s3_case(args: argparse.Namespace) -> Case:
    import boto3

    from kvtier.tiers.s3 import S3Tier, client_config

    cfg = client_config(args.threads, 2000)
    client = boto3.session.Session().client("s3", endpoint_url=args.s3_endpoint, config=cfg)
    bucket = args.bucket
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    tier = S3Tier(f"s3://{bucket}/kvtier", endpoint_url=args.s3_endpoint, io_threads=args.threads)

    def raw_put(key: str, data: bytes) -> None:
        client.put_object(Bucket=bucket, Key="raw/" + key, Body=data)

    def raw_get(key: str) -> bytes:
        return client.get_object(Bucket=bucket, Key="raw/" + key)["Body"].read()

    return Case("s3 (moto)", tier, raw_put, raw_get)


def redis_case(args: argparse.Namespace) -> Case:
    import redis

    from kvtier.tiers.redis import RedisTier

    client = redis.Redis.from_url(args.redis_url, max_connections=args.threads + 2)
    tier = RedisTier(args.redis_url, io_threads=args.threads)

    def raw_put(key: str, data: bytes) -> None:
        client.set("raw/" + key, data)

    def raw_get(key: str) -> bytes:
        return client.get("raw/" + key)

    return Case("redis", tier, raw_put, raw_get)


def run_case(case: Case, args: argparse.Namespace, chunks: list[bytes]) -> list[tuple]:
    size = len(chunks[0])
    shape = [size // 2]
    keys = [f"bench-{i}" for i in range(len(chunks))]
    total = size * len(chunks)
    signer = codec.Signer(b"bench-key") if args.hmac else None
    slots = [memoryview(bytearray(size)) for _ in chunks]

    def kv_put_sync() -> None:
        for k, c in zip(keys, chunks, strict=True):
            case.tier.put(k, codec.encode(k, c, dtype="bfloat16", shape=shape, signer=signer))

    def kv_get_sync() -> None:
        for k, slot in zip(keys, slots, strict=True):
            blob = case.tier.get(k)
            assert blob is not None
            slot[:] = codec.decode(blob, key=k, dtype="bfloat16", shape=shape, signer=signer)

    def raw_put_sync() -> None:
        for k, c in zip(keys, chunks, strict=True):
            case.raw_put(k, c)

    def raw_get_sync() -> None:
        for k in keys:
            blob = case.raw_get(k)  # held like kvtier holds its blob, so malloc sees the same
            assert len(blob) == size

    rio = RemoteIO(
        case.tier,
        threads=args.threads,
        queue_depth=len(chunks) + 1,
        timeout_s=60.0,
        signer=signer,
        backoff=ConstantBackoff(0.1),
    )

    def wait_results(n: int) -> None:
        got = 0
        while got < n:
            results = rio.poll()
            bad = [r for r in results if not r.ok]
            if bad:
                raise RuntimeError(f"RemoteIO op failed: {bad[0]}")
            got += len(results)
            if got < n:
                time.sleep(0.002)  # an engine polls once per step; spinning would steal the GIL

    def kv_put_async() -> None:
        for i, (k, c) in enumerate(zip(keys, chunks, strict=True)):
            assert rio.submit_put(i, k, memoryview(c), dtype="bfloat16", shape=shape)
        wait_results(len(keys))

    def kv_get_async() -> None:
        for i, (k, slot) in enumerate(zip(keys, slots, strict=True)):
            rio.submit_get_into(i, k, slot, dtype="bfloat16", shape=shape)
        wait_results(len(keys))

    # RemoteIO gives reads and writes their own threads; the raw side gets as many per op
    put_pool = ThreadPoolExecutor(max_workers=rio.write_threads)
    get_pool = ThreadPoolExecutor(max_workers=rio.read_threads)

    def raw_put_pool() -> None:
        list(put_pool.map(case.raw_put, keys, chunks))

    def raw_get_pool() -> None:
        list(get_pool.map(case.raw_get, keys))

    pairs = [
        ("sync, 1 thread", "put", kv_put_sync, raw_put_sync),
        ("sync, 1 thread", "get", kv_get_sync, raw_get_sync),
        (f"RemoteIO, {rio.write_threads} threads", "put", kv_put_async, raw_put_pool),
        (f"RemoteIO, {rio.read_threads} threads", "get", kv_get_async, raw_get_pool),
    ]
    rows = []
    raw_put_sync()  # objects exist for the first get round of both sides
    kv_put_sync()
    for mode, op, kv_fn, raw_fn in pairs:
        kv_t: list[float] = []
        raw_t: list[float] = []
        for r in range(args.rounds):  # interleaved, alternating who goes first
            order = ((raw_fn, raw_t), (kv_fn, kv_t))
            for fn, times in order if r % 2 == 0 else order[::-1]:
                times.append(_timed(fn))
        rows.append(
            (case.name, mode, op, _mbps(total, min(kv_t)), _mbps(total, min(raw_t)),
             statistics.median(raw_t) / statistics.median(kv_t))
        )  # fmt: skip
    for slot, c in zip(slots, chunks, strict=True):
        assert bytes(slot) == c, "a fetched chunk differs from what was written"
    rio.close()  # closes the tier too
    put_pool.shutdown()
    get_pool.shutdown()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Put/get throughput of kvtier's object tiers vs raw boto3 and redis-py.",
    )
    parser.add_argument("--redis-url", help="use this Redis instead of starting redis-server")
    parser.add_argument("--s3-endpoint", help="use this S3 endpoint instead of starting moto")
    parser.add_argument("--bucket", default="kvtier-bench", help="S3 bucket (created if missing)")
    parser.add_argument("--chunk-mib", type=float, default=8.0, help="chunk size in MiB")
    parser.add_argument("--chunks", type=int, default=16, help="chunks per round")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per figure")
    parser.add_argument(
        "--threads", type=int, default=4, help="io_threads (RemoteIO splits it: reads, writes)"
    )
    parser.add_argument("--hmac", action="store_true", help="sign and verify chunks (HMAC)")
    parser.add_argument("--skip-s3", action="store_true")
    parser.add_argument("--skip-redis", action="store_true")
    args = parser.parse_args(argv)

    size = int(args.chunk_mib * MiB) // 2 * 2
    base = os.urandom(size)
    chunks = [i.to_bytes(8, "little") + base[8:] for i in range(args.chunks)]
    rows: list[tuple] = []
    with local_services(args):
        if not args.skip_s3:
            rows += run_case(s3_case(args), args, chunks)
        if not args.skip_redis:
            rows += run_case(redis_case(args), args, chunks)
    print(
        f"\n{args.chunks} chunks of {size / MiB:.1f} MiB, best of {args.rounds} rounds, "
        f"hmac={'on' if args.hmac else 'off'}, {os.cpu_count()} CPUs"
    )
    print(f"{'backend':<11} {'mode':<22} {'op':<4} {'kvtier MB/s':>12} {'raw MB/s':>10} "
          f"{'ratio best':>10} {'ratio median':>12}")  # fmt: skip
    worst = float("inf")
    for backend, mode, op, kv, raw, median_ratio in rows:
        ratio = kv / raw
        worst = min(worst, median_ratio)
        print(
            f"{backend:<11} {mode:<22} {op:<4} {kv:>12.1f} {raw:>10.1f} {ratio:>10.2f} "
            f"{median_ratio:>12.2f}"
        )
    print(f"lowest median ratio kvtier/raw {worst:.2f} (goal >= 0.9)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
