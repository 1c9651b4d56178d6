"""bench/tier_throughput.py's setup: the servers it starts (redis-server, moto, a
3-primary Redis Cluster) unless given their URLs, one :class:`Case` per backend (kvtier's
tier and the raw client on the same objects), and the timing helpers."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from harness import Proc, Unavailable, start_moto, start_redis

from kvtier.objects.remote import RemoteIO
from kvtier.objects.tiers.base import ObjectTier
from kvtier.ops import OpResult

MiB = 2**20


def wait_for_results(rio: RemoteIO, n: int) -> None:
    """Poll ``rio`` until ``n`` results came; any failed op is an error of the bench."""
    got = 0
    while got < n:
        results = rio.poll()
        bad = [r for r in results if not r.ok]
        if bad:
            raise RuntimeError(f"RemoteIO op failed: {bad[0]}")
        got += len(results)
        if got < n:
            time.sleep(0.002)  # an engine polls once per step; spinning would steal the GIL


def poll_results(rio: RemoteIO, n: int) -> list[OpResult]:
    """Poll ``rio`` until ``n`` results came, every half millisecond (an engine asks again
    every step): how the timed restart-hit reads wait, close to their real latency."""
    got: list[OpResult] = []
    while len(got) < n:
        got += rio.poll()
        if len(got) < n:
            time.sleep(0.0005)
    return got


def time_restart_runs(
    rios: dict[str, RemoteIO],
    key_prefix: str,
    slots: list[memoryview],
    shape: list[int],
    reps: int,
    check: Callable[[], None],
) -> dict[str, list[float]]:
    """Time one run of fetches of every slot, as a restart hit's lookup asks for it, per
    side of ``rios``, ``reps`` times after two warm-up runs each; the sides alternate
    which goes first. ``check`` runs after each run, outside the time."""
    sides = list(rios)
    times: dict[str, list[float]] = {side: [] for side in sides}
    n = len(slots)
    for r in range(reps + 2):
        for side in sides if r % 2 == 0 else sides[::-1]:
            rio = rios[side]
            t0 = time.perf_counter()
            rio.submit_get_run(
                [(i, f"{key_prefix}-{side}-{i}", slots[i]) for i in range(n)],
                dtype="bfloat16",
                shape=shape,
            )
            got = poll_results(rio, n)
            elapsed = time.perf_counter() - t0
            if any(not x.ok for x in got):
                raise RuntimeError(f"restart-hit fetch failed: {got}")
            if r >= 2:
                times[side].append(elapsed)
            check()
    return times


@contextmanager
def local_services(args: argparse.Namespace) -> Iterator[None]:
    """Start redis-server and moto's S3 server on loopback (harness.py's) unless URLs were
    given."""
    procs: list[Proc] = []
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-")
    args.file_root = os.path.join(workdir, "tier")
    try:
        if not args.redis_url and not args.skip_redis:
            try:
                proc, args.redis_url = start_redis(Path(workdir))
            except Unavailable as exc:
                sys.exit(f"{exc}; or pass --redis-url")
            procs.append(proc)
        if not args.s3_endpoint and not args.skip_s3:
            try:
                proc, args.s3_endpoint, aws = start_moto(Path(workdir))
            except Unavailable as exc:
                sys.exit(f"{exc}; or pass --s3-endpoint")
            procs.append(proc)
            for k, v in aws.items():
                os.environ.setdefault(k, v)
        yield
    finally:
        for p in procs:
            p.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def mbps(nbytes: int, seconds: float) -> float:
    return nbytes / MiB / seconds


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Case:
    """One backend: how to open its kvtier tier, raw put/get of ``raw/`` copies (the
    put/get table) and a raw read of a stored kvtier object (the read-into table)."""

    def __init__(
        self,
        name: str,
        open_tier: Callable[[int], ObjectTier],
        raw_put: Callable[[str, bytes], None],
        raw_get: Callable[[str], bytes],
        raw_read_object: Callable[[ObjectTier, str, memoryview], None],
        raw_reader: str,
    ) -> None:
        self.name, self.open_tier = name, open_tier
        self.raw_put, self.raw_get = raw_put, raw_get
        self.raw_read_object, self.raw_reader = raw_read_object, raw_reader


def readinto_all(f, buf: memoryview) -> None:
    """Fill ``buf`` from the open file ``f`` (``readinto`` until full)."""
    got = 0
    while got < buf.nbytes:
        n = f.readinto(buf[got:])
        if not n:
            raise RuntimeError("short read")
        got += n


def file_case(args: argparse.Namespace) -> Case:
    from kvtier.objects.tiers.file import FileTier

    root = args.file_root
    raw_dir = os.path.join(root + "-raw")
    os.makedirs(raw_dir, exist_ok=True)

    def raw_put(key: str, data: bytes) -> None:
        with open(os.path.join(raw_dir, key), "wb") as f:
            f.write(data)

    def raw_get(key: str) -> bytes:
        with open(os.path.join(raw_dir, key), "rb") as f:
            return f.read()

    def raw_read_object(tier: ObjectTier, key: str, buf: memoryview) -> None:
        with open(tier.path(key), "rb", buffering=0) as f:  # type: ignore[attr-defined]
            readinto_all(f, buf)

    return Case(
        "file",
        lambda _threads: FileTier(root),
        raw_put,
        raw_get,
        raw_read_object,
        "readinto (page cache)",
    )


def s3_case(args: argparse.Namespace) -> Case:
    import boto3

    from kvtier.objects.tiers.s3 import S3Tier, client_config

    bucket = args.bucket
    clients: dict[int, object] = {}

    def client_for(threads: int):
        if threads not in clients:  # the same botocore Config as the tier's
            cfg = client_config(threads, 2000)
            clients[threads] = boto3.session.Session().client(
                "s3", endpoint_url=args.s3_endpoint, config=cfg
            )
        return clients[threads]

    client = client_for(max(args.threads))
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass

    def open_tier(threads: int) -> ObjectTier:
        client_for(threads)
        return S3Tier(f"s3://{bucket}/kvtier", endpoint_url=args.s3_endpoint, io_threads=threads)

    def raw_put(key: str, data: bytes) -> None:
        client.put_object(Bucket=bucket, Key="raw/" + key, Body=data)

    def raw_get(key: str) -> bytes:
        return client.get_object(Bucket=bucket, Key="raw/" + key)["Body"].read()

    def raw_read_object(tier: ObjectTier, key: str, buf: memoryview) -> None:
        c = client_for(tier._bench_threads)  # type: ignore[attr-defined]
        data = c.get_object(Bucket=bucket, Key=tier.object_key(key))["Body"].read()  # type: ignore[attr-defined]
        assert len(data) == buf.nbytes

    return Case(
        "s3 (moto)", open_tier, raw_put, raw_get, raw_read_object, "boto3 get_object().read()"
    )


def redis_case(args: argparse.Namespace) -> Case:
    import redis

    from kvtier.objects.tiers.redis import RedisTier

    clients: dict[int, redis.Redis] = {}

    def client_for(threads: int) -> redis.Redis:
        if threads not in clients:
            clients[threads] = redis.Redis.from_url(args.redis_url, max_connections=threads + 2)
        return clients[threads]

    client = client_for(max(args.threads))

    def raw_put(key: str, data: bytes) -> None:
        client.set("raw/" + key, data)

    def raw_get(key: str) -> bytes:
        return client.get("raw/" + key)

    def raw_read_object(tier: ObjectTier, key: str, buf: memoryview) -> None:
        data = client_for(tier._bench_threads).get(key)  # type: ignore[attr-defined]
        assert data is not None and len(data) == buf.nbytes

    def open_tier(threads: int) -> ObjectTier:
        return RedisTier(args.redis_url, io_threads=threads)

    return Case("redis", open_tier, raw_put, raw_get, raw_read_object, "redis-py GET")


def open_case(case: Case, threads: int) -> ObjectTier:
    tier = case.open_tier(threads)
    tier._bench_threads = threads  # type: ignore[attr-defined]  # raw side: same pool size
    return tier


@contextmanager
def local_cluster(primaries: int = 3) -> Iterator[list[int]]:
    """A Redis Cluster of ``primaries`` primaries (no replicas) on loopback, the launcher
    the tests use too (local_cluster.py); yields the primaries' ports."""
    from local_cluster import RedisCluster as LocalCluster

    cluster = LocalCluster(primaries=primaries, replicas=0)
    try:
        cluster.start()
        yield cluster.primary_ports()
    finally:
        cluster.cleanup()


def cluster_case(ports: list[int], threads: int) -> Case:
    """kvtier's RedisClusterTier against redis-py's RedisCluster on the same primaries; the
    raw keys carry kvtier's key as their hash tag, so each raw object's primary is the
    primary of the kvtier object it is compared with."""
    import redis.cluster

    from kvtier.objects.tiers.redis_cluster import RedisClusterTier

    url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports) + "/"
    client = redis.cluster.RedisCluster(
        startup_nodes=[redis.cluster.ClusterNode("127.0.0.1", p) for p in ports],
        max_connections=threads + 2,
    )

    def raw_put(key: str, data: bytes) -> None:
        client.set(f"raw/{{{key}}}", data)

    def raw_get(key: str) -> bytes:
        return client.get(f"raw/{{{key}}}")

    def raw_read_object(tier: ObjectTier, key: str, buf: memoryview) -> None:
        data = client.get(key)
        assert data is not None and len(data) == buf.nbytes

    case = Case(
        f"cluster x{len(ports)}",
        lambda t: RedisClusterTier(url, io_threads=t),
        raw_put,
        raw_get,
        raw_read_object,
        "redis-py RedisCluster GET",
    )
    case.client = client  # type: ignore[attr-defined]
    case.raw_key = lambda key: f"raw/{{{key}}}"  # type: ignore[attr-defined]
    return case


def key_spread(client, n: int) -> dict:
    """Where ``n`` random chunk keys (kvtier's own key function) land: keys per primary,
    through the cluster client's slot map."""
    import collections

    from kvtier.keys import chunk_key

    ns = os.urandom(16)
    counts: collections.Counter[str] = collections.Counter()
    for _ in range(n):
        key = chunk_key(ns, os.urandom(32))
        node = client.nodes_manager.get_node_from_slot(client.keyslot(key))
        counts[node.name] += 1
    per = sorted(counts.values())
    return {
        "keys": n,
        "per_primary": dict(sorted(counts.items())),
        "min_share": per[0] / n,
        "max_share": per[-1] / n,
        "max_over_mean": per[-1] / (n / len(per)),
    }
