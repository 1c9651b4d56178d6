#!/usr/bin/env python3
"""Object-tier throughput: kvtier (codec + tier, and RemoteIO) against raw readers / writers.

Why: every chunk kvtier moves pays for framing, an xxh3-128 checksum, an
optional HMAC and a copy into the host slot. This measures what that costs
next to the client library alone, on the same server, bytes and concurrency:

- ``sync``: one thread, codec.encode + tier.put / tier.get + codec.decode +
  copy into a slot, against ``put_object``/``get_object`` or ``SET``/``GET``
  of the same payload bytes.
- ``RemoteIO``: ``--threads`` I/O threads through RemoteIO (queues, result
  polling) against a thread pool of the same size calling the raw client.

Then, reads into host slots (the path a hit after a restart takes): for each
``--threads`` value (kvtier's ``io_threads``; RemoteIO reads on ceil(n/2) of
them) and each ``--concurrency`` (chunks in flight), the already stored kvtier
objects are read

- ``async``: through ``RemoteIO.submit_get_into`` (straight into the slot,
  verified there), polled every 0.5 ms,
- ``sync``: ``tier.read_into`` + ``codec.verify`` on a thread pool of the
  same size as RemoteIO's read threads,
- ``raw``: the same objects' bytes (header included) by the raw reader on a
  pool of that size: ``readinto`` a preallocated buffer (file, page cache),
  ``GET`` (redis-py, hiredis parser when installed), ``get_object()['Body'].read()``
  (boto3).

A round is repeated batches of ``concurrency`` chunks until ``--round-mib``
MiB were read; kvtier and raw alternate within each round.

Then, encryption (``encryption_key_*``): put and get through kvtier with every
chunk sealed (AES-256-GCM) against the same ops unsealed, both sync (one
thread: encode + put, read_into + verify) and through RemoteIO (uploads from
host slots, fetches into host slots), interleaved rounds; the ratio is sealed ÷
plain of the median round (goal >= 0.9). Before it, the machine's AES-256-GCM
speed on one core (seal into a buffer, open in place) is printed. And what a
restart hit waits for: one prompt's run of ``--hit-chunks`` chunks fetched as a
lookup does (``RemoteIO.submit_get_run``: the first alone, the rest in
parallel), sealed and plain alternating, latency per run (median): the part of
a restart hit's TTFT that encryption changes.

Then, compression (``compression: lossless``) on KV-like bf16 chunks (normal values,
per-channel scales, as K and V are; or, with ``--kv-dir``, the chunks a real engine
wrote to a ``file://`` tier): stored ÷ raw bytes and single-thread compress and
decompress GB/s of python-blosc2 (kvtier's choice: shuffle + zstd level 1) and, when
installed, zstandard on byte planes (the alternative evaluated); and the restart-hit
fetch of ``--hit-chunks`` chunks, raw and compressed alternating, per backend: the
part of a restart hit's TTFT that compression changes (compressed ÷ raw < 1: faster).

Then, Redis Cluster (with ``redis`` in ``--only``; ``--only-cluster`` runs it alone): the
put/get table on one redis-server and on a 3-primary cluster (``redis-server
--cluster-enabled yes`` on loopback, no replicas), started here, every put round writing
objects deleted before it (untimed: RemoteIO skips a chunk whose key exists, which the
other put/get table's RemoteIO put row times after its first round); the raw side is
``redis.Redis`` on the node and ``redis.cluster.RedisCluster`` on the cluster, its keys
hash-tagged with kvtier's key (``raw/{key}``) so both sides' objects sit on the same
primaries. And how kvtier's chunk keys spread over the primaries: ``--spread-keys``
random chunk keys (``kvtier.keys.chunk_key``) mapped through the cluster's slot map.

Raw boto3 uses the same botocore Config as kvtier's S3 tier (pool size,
timeouts, no extra CRC), so the ratio isolates kvtier's own overhead. Each
figure is the best of ``--rounds`` interleaved rounds (the machine is shared);
the ratios are kvtier / raw of the best and of the median round.

    python bench/tier_throughput.py                      # starts redis-server and moto
    python bench/tier_throughput.py --redis-url redis://host:6379/0 --s3-endpoint http://host:9000
    python bench/tier_throughput.py --only file,redis --threads 2,4 --concurrency 16
    python bench/tier_throughput.py --only-cluster       # 1 node vs 3 primaries alone
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from harness import free_port, int_list

from kvtier import codec, compress
from kvtier.backoff import ConstantBackoff
from kvtier.remote import MAX_FRAME, RemoteIO
from kvtier.seal import Sealer
from kvtier.tiers.base import ObjectTier

MiB = 2**20
BACKENDS = ("file", "s3", "redis")


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
    args.file_root = os.path.join(workdir, "tier")
    try:
        if not args.redis_url and not args.skip_redis:
            binary = shutil.which("redis-server")
            if binary is None:
                sys.exit("redis-server not found; install it or pass --redis-url")
            port = free_port()
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
            port = free_port()
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


def _readinto_all(f, buf: memoryview) -> None:
    got = 0
    while got < buf.nbytes:
        n = f.readinto(buf[got:])
        if not n:
            raise RuntimeError("short read")
        got += n


def file_case(args: argparse.Namespace) -> Case:
    from kvtier.tiers.file import FileTier

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
            _readinto_all(f, buf)

    return Case("file", lambda _threads: FileTier(root), raw_put, raw_get, raw_read_object,
                "readinto (page cache)")  # fmt: skip


def s3_case(args: argparse.Namespace) -> Case:
    import boto3

    from kvtier.tiers.s3 import S3Tier, client_config

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

    return Case("s3 (moto)", open_tier, raw_put, raw_get, raw_read_object,
                "boto3 get_object().read()")  # fmt: skip


def redis_case(args: argparse.Namespace) -> Case:
    import redis

    from kvtier.tiers.redis import RedisTier

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

    return Case("redis", open_tier, raw_put, raw_get, raw_read_object,
                "redis-py GET")  # fmt: skip


def _open(case: Case, threads: int) -> ObjectTier:
    tier = case.open_tier(threads)
    tier._bench_threads = threads  # type: ignore[attr-defined]  # raw side: same pool size
    return tier


def run_case(
    case: Case, args: argparse.Namespace, chunks: list[bytes], fresh_puts: bool = False
) -> list[tuple]:
    """The put/get table: sync (one thread) and RemoteIO at ``--putget-threads``.

    With ``fresh_puts`` both sides' objects are deleted (untimed) before each put round:
    RemoteIO does not write a chunk whose key already exists (its ``exists`` check), so
    without it the RemoteIO put row after the first round times that check, not a write.
    """
    size = len(chunks[0])
    shape = [size // 2]
    keys = [f"bench-{i}" for i in range(len(chunks))]
    total = size * len(chunks)
    signer = codec.Signer(b"bench-key") if args.hmac else None
    slots = [memoryview(bytearray(size)) for _ in chunks]
    tier = _open(case, args.putget_threads)

    def kv_put_sync() -> None:
        for k, c in zip(keys, chunks, strict=True):
            tier.put(k, codec.encode(k, c, dtype="bfloat16", shape=shape, signer=signer))

    def kv_get_sync() -> None:
        for k, slot in zip(keys, slots, strict=True):
            blob = tier.get(k)
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
        tier,
        threads=args.putget_threads,
        queue_depth=len(chunks) + 1,
        timeout_s=60.0,
        signer=signer,
        backoff=ConstantBackoff(0.1),
    )

    def kv_put_async() -> None:
        for i, (k, c) in enumerate(zip(keys, chunks, strict=True)):
            assert rio.submit_put(i, k, memoryview(c), dtype="bfloat16", shape=shape)
        wait_for_results(rio, len(keys))

    def kv_get_async() -> None:
        for i, (k, slot) in enumerate(zip(keys, slots, strict=True)):
            rio.submit_get_into(i, k, slot, dtype="bfloat16", shape=shape)
        wait_for_results(rio, len(keys))

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
    raw_keys = [case.raw_key(k) for k in keys] if fresh_puts else []  # type: ignore[attr-defined]
    for mode, op, kv_fn, raw_fn in pairs:
        kv_t: list[float] = []
        raw_t: list[float] = []
        for r in range(args.rounds):  # interleaved, alternating who goes first
            order = ((raw_fn, raw_t), (kv_fn, kv_t))
            for fn, times in order if r % 2 == 0 else order[::-1]:
                if fresh_puts and op == "put":
                    tier.delete(raw_keys if fn is raw_fn else keys)
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


def _measure_into(
    case: Case,
    args: argparse.Namespace,
    tier: ObjectTier,
    rio: RemoteIO,
    pool: ThreadPoolExecutor,
    chunks: list[bytes],
    conc: int,
    signer: codec.Signer | None,
) -> dict:
    """One row of the read-into table: ``conc`` chunks in flight, async / sync / raw."""
    size = len(chunks[0])
    shape = [size // 2]
    n_obj = len(chunks)
    slots = [memoryview(bytearray(size)) for _ in range(conc)]
    raw_bufs = [memoryview(bytearray(MAX_FRAME + size)) for _ in range(conc)]
    batches = max(1, round(args.round_mib * MiB / (conc * size)))
    nbytes = batches * conc * size
    # the batches of a round take turns over all stored objects
    plan = [[(b * conc + j) % n_obj for j in range(conc)] for b in range(batches)]

    def kv_async() -> None:
        for batch in plan:
            for i, c in enumerate(batch):
                rio.submit_get_into(i, f"into-{c}", slots[i], dtype="bfloat16", shape=shape)
            got = 0
            while got < len(batch):
                res = rio.poll()
                if any(not r.ok for r in res):
                    raise RuntimeError(f"RemoteIO get failed: {res}")
                got += len(res)
                if got < len(batch):
                    time.sleep(0.0005)

    def read_verify(c: int, slot: memoryview) -> None:
        k = f"into-{c}"
        head = tier.read_into(k, slot, MAX_FRAME)
        assert head is not None
        codec.verify(head, slot, key=k, dtype="bfloat16", shape=shape, signer=signer)

    def raw_one(c: int, buf: memoryview) -> None:
        case.raw_read_object(tier, f"into-{c}", buf[: case.obj_sizes[c]])  # type: ignore[attr-defined]

    def kv_sync() -> None:
        for batch in plan:
            list(pool.map(read_verify, batch, slots))

    def raw() -> None:
        for batch in plan:
            list(pool.map(raw_one, batch, raw_bufs))

    times: dict[str, list[float]] = {"raw": [], "async": [], "sync": []}
    fns = [("raw", raw), ("async", kv_async), ("sync", kv_sync)]
    raw()  # warm connections and pools
    kv_async()
    kv_sync()
    for r in range(args.rounds):  # interleaved, rotating who goes first
        for name, fn in fns[r % 3 :] + fns[: r % 3]:
            times[name].append(_timed(fn))
    for i, c in enumerate(plan[-1]):  # the slots hold what was stored
        assert bytes(slots[i]) == chunks[c], "a fetched chunk differs from what was written"
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    return {
        "backend": case.name, "raw_reader": case.raw_reader, "io_threads": rio_threads(rio),
        "read_threads": rio.read_threads, "concurrency": conc, "chunk_mib": size / MiB,
        "bytes_per_round": nbytes, "rounds": args.rounds,
        **{f"{k}_gbps_best": nbytes / best[k] / 1e9 for k in best},
        **{f"{k}_gbps_median": nbytes / med[k] / 1e9 for k in med},
        "async_over_raw": med["raw"] / med["async"],
        "sync_over_raw": med["raw"] / med["sync"],
    }  # fmt: skip


def rio_threads(rio: RemoteIO) -> int:
    return rio.tier._bench_threads  # type: ignore[attr-defined]


def run_into(case: Case, args: argparse.Namespace, chunks: list[bytes]) -> list[dict]:
    """The read-into table: kvtier async / sync and the raw reader, per io_threads and
    concurrency, on objects stored once through the tier."""
    size = len(chunks[0])
    shape = [size // 2]
    keys = [f"into-{i}" for i in range(len(chunks))]
    signer = codec.Signer(b"bench-key") if args.hmac else None
    writer = _open(case, max(args.threads))
    case.obj_sizes = []  # type: ignore[attr-defined]
    for k, c in zip(keys, chunks, strict=True):
        parts = codec.encode(k, c, dtype="bfloat16", shape=shape, signer=signer)
        writer.put(k, parts)
        case.obj_sizes.append(codec.encoded_size(parts))  # type: ignore[attr-defined]
    writer.close()
    rows = []
    for threads in args.threads:
        tier = _open(case, threads)
        depth = max(args.concurrency) + 1
        rio = RemoteIO(tier, threads=threads, queue_depth=depth, timeout_s=60.0, signer=signer,
                       backoff=ConstantBackoff(0.1))  # fmt: skip
        n_read = rio.read_threads
        pool = ThreadPoolExecutor(max_workers=n_read)
        for conc in args.concurrency:
            rows.append(_measure_into(case, args, tier, rio, pool, chunks, conc, signer))
        rio.close()  # closes the tier too
        pool.shutdown()
    return rows


def aes_gcm_speed(size: int, rounds: int) -> dict[str, float]:
    """GB/s of kvtier's sealing on one core: seal into its scratch buffer, open in place."""
    sealer = Sealer(os.urandom(32))
    plain = memoryview(os.urandom(size))
    buf = memoryview(bytearray(size))
    seal_t, open_t = [], []
    for _ in range(max(rounds, 3) * 4):
        t0 = time.perf_counter()
        seal, ct = sealer.seal(b"aad", plain)
        t1 = time.perf_counter()
        buf[:] = ct
        t2 = time.perf_counter()
        sealer.open_into(seal, b"aad", buf)
        open_t.append(time.perf_counter() - t2)
        seal_t.append(t1 - t0)
    assert bytes(buf) == bytes(plain)
    return {"seal_gbps": size / statistics.median(seal_t) / 1e9,
            "open_gbps": size / statistics.median(open_t) / 1e9}  # fmt: skip


def run_encryption(case: Case, args: argparse.Namespace, chunks: list[bytes]) -> list[dict]:
    """The encryption table: sealed ÷ plain put and get, sync and through RemoteIO."""
    size = len(chunks[0])
    shape = [size // 2]
    total = size * len(chunks)
    hmac_key = b"bench-key" if args.hmac else None
    plain_signer = codec.Signer(hmac_key) if hmac_key else None
    sealed_signer = codec.Signer(hmac_key, sealer=Sealer(os.urandom(32)))
    sides = {"plain": plain_signer, "sealed": sealed_signer}
    slots = [memoryview(bytearray(size)) for _ in chunks]
    # the host tier's slots the uploads read from: plaintext, never changed by sealing
    sources = [memoryview(bytearray(c)) for c in chunks]
    tier = _open(case, args.putget_threads)
    rios = {
        side: RemoteIO(_open(case, args.putget_threads), threads=args.putget_threads,
                       queue_depth=len(chunks) + 1, timeout_s=60.0, signer=signer,
                       backoff=ConstantBackoff(0.1))  # fmt: skip
        for side, signer in sides.items()
    }

    def keys(side: str) -> list[str]:
        return [f"enc-{side}-{i}" for i in range(len(chunks))]

    def put_sync(side: str) -> Callable[[], None]:
        def run() -> None:
            for k, src in zip(keys(side), sources, strict=True):
                tier.put(k, codec.encode(k, src, dtype="bfloat16", shape=shape,
                                         signer=sides[side]))  # fmt: skip
        return run

    def get_sync(side: str) -> Callable[[], None]:
        def run() -> None:
            for k, slot in zip(keys(side), slots, strict=True):
                head = tier.read_into(k, slot, MAX_FRAME)
                assert head is not None
                codec.verify(head, slot, key=k, dtype="bfloat16", shape=shape,
                             signer=sides[side])  # fmt: skip
        return run

    def put_async(side: str) -> Callable[[], None]:
        def run() -> None:
            rio = rios[side]
            for i, (k, src) in enumerate(zip(keys(side), sources, strict=True)):
                assert rio.submit_put(i, k, src, dtype="bfloat16", shape=shape)
            wait_for_results(rio, len(chunks))
        return run

    def get_async(side: str) -> Callable[[], None]:
        def run() -> None:
            rio = rios[side]
            for i, (k, slot) in enumerate(zip(keys(side), slots, strict=True)):
                rio.submit_get_into(i, k, slot, dtype="bfloat16", shape=shape)
            wait_for_results(rio, len(chunks))
        return run

    ops = [
        ("sync, 1 thread", "put", put_sync),
        ("sync, 1 thread", "get", get_sync),
        (f"RemoteIO, {rios['plain'].write_threads} threads", "put", put_async),
        (f"RemoteIO, {rios['plain'].read_threads} threads", "get", get_async),
    ]
    put_sync("plain")()
    put_sync("sealed")()
    rows = []
    for mode, op, make in ops:
        times: dict[str, list[float]] = {"plain": [], "sealed": []}
        fns = [("plain", make("plain")), ("sealed", make("sealed"))]
        for r in range(args.rounds):  # interleaved, alternating who goes first
            for side, fn in fns if r % 2 == 0 else fns[::-1]:
                times[side].append(_timed(fn))
            if op == "get":
                assert [bytes(s) for s in slots] == chunks, "a sealed chunk did not open"
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({
            "backend": case.name, "mode": mode, "op": op, "chunk_mib": size / MiB,
            "plain_gbps_median": total / med["plain"] / 1e9,
            "sealed_gbps_median": total / med["sealed"] / 1e9,
            "sealed_over_plain": med["plain"] / med["sealed"],
        })  # fmt: skip
    for rio in rios.values():
        rio.close()  # closes its tier too
    tier.close()
    return rows


def run_hit_latency(case: Case, args: argparse.Namespace, chunks: list[bytes]) -> dict:
    """Latency of one restart hit's fetches (a lookup run), plain and sealed alternating."""
    size = len(chunks[0])
    shape = [size // 2]
    n = args.hit_chunks
    hmac_key = b"bench-key" if args.hmac else None
    sides = {"plain": codec.Signer(hmac_key) if hmac_key else None,
             "sealed": codec.Signer(hmac_key, sealer=Sealer(os.urandom(32)))}  # fmt: skip
    writer = _open(case, args.putget_threads)
    for side, signer in sides.items():
        for i in range(n):
            k = f"hit-{side}-{i}"
            writer.put(k, codec.encode(k, chunks[i % len(chunks)], dtype="bfloat16",
                                       shape=shape, signer=signer))  # fmt: skip
    writer.close()
    rios = {side: RemoteIO(_open(case, args.putget_threads), threads=args.putget_threads,
                           queue_depth=n + 1, timeout_s=60.0, signer=signer,
                           backoff=ConstantBackoff(0.1))
            for side, signer in sides.items()}  # fmt: skip
    slots = [memoryview(bytearray(size)) for _ in range(n)]
    times: dict[str, list[float]] = {"plain": [], "sealed": []}
    reps = max(args.rounds, 3) * 5
    for r in range(reps + 2):  # two warm-up runs each
        for side in (("plain", "sealed") if r % 2 == 0 else ("sealed", "plain")):
            rio = rios[side]
            t0 = time.perf_counter()
            rio.submit_get_run([(i, f"hit-{side}-{i}", slots[i]) for i in range(n)],
                               dtype="bfloat16", shape=shape)  # fmt: skip
            got: list = []
            while len(got) < n:
                got += rio.poll()
                if len(got) < n:
                    time.sleep(0.0005)  # an engine asks again every step
            elapsed = time.perf_counter() - t0
            if any(not x.ok for x in got):
                raise RuntimeError(f"restart-hit fetch failed: {got}")
            if r >= 2:
                times[side].append(elapsed)
    for i in range(n):
        assert bytes(slots[i]) == chunks[i % len(chunks)], "a sealed chunk did not open"
    for rio in rios.values():
        rio.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"backend": case.name, "chunks": n, "chunk_mib": size / MiB, "runs": reps,
            "io_threads": args.putget_threads, "read_threads": rios["plain"].read_threads,
            "plain_ms_median": med["plain"] * 1000, "sealed_ms_median": med["sealed"] * 1000,
            "added_ms": (med["sealed"] - med["plain"]) * 1000}  # fmt: skip


def kv_like_chunks(size: int, n: int, seed: int = 0) -> list[bytes]:
    """bf16 chunks shaped like K/V: normal values with per-channel scales (a few channels
    much larger than the rest), rounded to bf16 (round to nearest even)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        scale = rng.uniform(0.1, 3.1, 128).astype(np.float32)
        scale[rng.choice(128, 4, replace=False)] *= 20  # outlier channels
        x = (rng.standard_normal((size // 256, 128)).astype(np.float32) * scale).reshape(-1)
        bits = x.view(np.uint32)
        bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        out.append(bf16.tobytes()[:size])
    return out


def engine_chunks(kv_dir: str) -> list[bytes]:
    """The payloads of the raw (unsealed, uncompressed) chunks a file:// tier holds."""
    out = []
    for root, _, files in os.walk(kv_dir):
        for name in sorted(files):
            if name.startswith("."):
                continue
            with open(os.path.join(root, name), "rb") as f:
                blob = f.read()
            try:
                out.append(bytes(codec.decode(blob, key=name)))
            except Exception:  # noqa: BLE001  # sealed, compressed or not a chunk: skipped
                continue
    if not out:
        raise SystemExit(f"--kv-dir {kv_dir}: no raw kvtier chunk found")
    return out


def compression_speed(chunks: list[bytes], rounds: int) -> list[dict]:
    """Stored ÷ raw and one-thread GB/s of each candidate on ``chunks`` (best of rounds)."""
    cands: dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes, memoryview], None]]] = {}
    comp = compress.Compressor()

    def unshuffle(c: bytes, d: memoryview) -> None:
        compress.decompress_into("blosc2", memoryview(c), d)

    cands["blosc2 shuffle+zstd-1 (kvtier)"] = (lambda b: comp.compress(memoryview(b), 2)[0],
                                               unshuffle)  # fmt: skip
    fp8 = compress.Fp8Compressor()

    def quantise(b: bytes) -> bytes:
        got = fp8.compress_chunk(memoryview(b), "bfloat16")
        assert got is not None
        return got[1]

    def dequantise(c: bytes, d: memoryview) -> None:
        compress.decompress_into("fp8e4m3", memoryview(c), d, "bfloat16")

    cands["fp8 e4m3, scale per 128 (lossy)"] = (quantise, dequantise)
    try:
        import numpy as np
        import zstandard
    except ImportError:
        pass
    else:
        zc, zd = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()

        def planes(b: bytes) -> bytes:
            return zc.compress(np.frombuffer(b, np.uint8).reshape(-1, 2).T.tobytes())

        def unplanes(c: bytes, d: memoryview) -> None:
            flat = np.frombuffer(zd.decompress(c, max_output_size=d.nbytes), np.uint8)
            np.frombuffer(d, np.uint8).reshape(-1, 2)[:] = flat.reshape(2, -1).T

        cands["zstandard-1 on byte planes"] = (planes, unplanes)
    rows = []
    raw = sum(len(c) for c in chunks)
    for name, (cfn, dfn) in cands.items():
        best_c = best_d = float("inf")
        stored = 0
        slot = memoryview(bytearray(len(chunks[0])))
        for _ in range(rounds):
            t0 = time.perf_counter()
            blobs = [cfn(c) for c in chunks]
            best_c = min(best_c, time.perf_counter() - t0)
            stored = sum(len(b) for b in blobs)
            t0 = time.perf_counter()
            for b, c in zip(blobs, chunks, strict=True):
                dfn(b, slot[: len(c)])
            best_d = min(best_d, time.perf_counter() - t0)
        assert "lossy" in name or bytes(slot[: len(chunks[-1])]) == chunks[-1], name
        rows.append({"codec": name, "ratio": stored / raw, "compress_gbps": raw / best_c / 1e9,
                     "decompress_gbps": raw / best_d / 1e9})  # fmt: skip
    return rows


class LinkTier(ObjectTier):
    """A tier behind a link of ``gbit`` Gbit/s that every read shares (a NIC, an uplink):
    each object read holds the link for its bytes' time on the wire."""

    def __init__(self, inner: ObjectTier, gbit: float) -> None:
        self.inner, self.name = inner, inner.name
        self.bytes_per_s = gbit * 1e9 / 8
        self._lock = threading.Lock()
        self._free_at = 0.0

    def _wire(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + nbytes / self.bytes_per_s
            wait = self._free_at - now
        time.sleep(wait)

    def exists(self, keys):  # type: ignore[no-untyped-def]
        return self.inner.exists(keys)

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        blob = self.inner.get(key, max_bytes)
        if blob is not None:
            self._wire(len(blob))
        return blob

    def read_into(self, key: str, dest: memoryview, max_head: int) -> bytes | None:
        head = self.inner.read_into(key, dest, max_head)
        if head is not None:
            self._wire(len(head) + dest.nbytes)
        return head

    def put(self, key, parts):  # type: ignore[no-untyped-def]
        self.inner.put(key, parts)

    def delete(self, keys):  # type: ignore[no-untyped-def]
        self.inner.delete(keys)

    def close(self) -> None:
        self.inner.close()


def run_compression_hit(
    case: Case, args: argparse.Namespace, chunks: list[bytes], link_gbit: float | None = None
) -> dict:
    """Latency of one restart hit's fetches (a lookup run), raw and compressed objects
    alternating, each read by an engine of that setting (RemoteIO with or without a
    compressor); with ``link_gbit``, through a link of that bandwidth."""
    size = len(chunks[0])
    shape = [size // 2]
    n = args.hit_chunks
    comp = compress.Compressor()
    writer = _open(case, args.putget_threads)
    stored = {"none": 0, "lossless": 0}
    for side in stored:
        for i in range(n):
            k, c = f"z-{side}-{i}", chunks[i % len(chunks)]
            z = ("blosc2", comp.compress(memoryview(c), 2)[0]) if side == "lossless" else None
            parts = codec.encode(k, c, dtype="bfloat16", shape=shape, compressed=z)
            stored[side] += codec.encoded_size(parts)
            writer.put(k, parts)
    writer.close()
    def reader() -> ObjectTier:
        tier = _open(case, args.putget_threads)
        return tier if link_gbit is None else LinkTier(tier, link_gbit)

    rios = {side: RemoteIO(reader(), threads=args.putget_threads,
                           queue_depth=n + 1, timeout_s=60.0, signer=None,
                           backoff=ConstantBackoff(0.1),
                           compressor=comp if side == "lossless" else None)
            for side in stored}  # fmt: skip
    slots = [memoryview(bytearray(size)) for _ in range(n)]
    times: dict[str, list[float]] = {side: [] for side in stored}
    reps = max(args.rounds, 3) * 5
    for r in range(reps + 2):  # two warm-up runs each
        for side in (("none", "lossless") if r % 2 == 0 else ("lossless", "none")):
            rio = rios[side]
            t0 = time.perf_counter()
            rio.submit_get_run([(i, f"z-{side}-{i}", slots[i]) for i in range(n)],
                               dtype="bfloat16", shape=shape)  # fmt: skip
            got: list = []
            while len(got) < n:
                got += rio.poll()
                if len(got) < n:
                    time.sleep(0.0005)
            if any(not x.ok for x in got):
                raise RuntimeError(f"restart-hit fetch failed: {got}")
            if r >= 2:
                times[side].append(time.perf_counter() - t0)
            for i in range(n):
                assert bytes(slots[i]) == chunks[i % len(chunks)], "not bit-exact"
    for rio in rios.values():
        rio.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    name = case.name if link_gbit is None else f"{case.name} @ {link_gbit:g} Gbit/s"
    return {"backend": name, "chunks": n, "chunk_mib": size / MiB, "runs": reps,
            "stored_over_raw": stored["lossless"] / stored["none"],
            "none_ms_median": med["none"] * 1000, "lossless_ms_median": med["lossless"] * 1000,
            "lossless_over_none": med["lossless"] / med["none"]}  # fmt: skip


def print_compression(speed: list[dict], hits: list[dict], source: str) -> None:
    print(f"\nCompression on {source}, one thread, best of the rounds (GB/s = 1e9 B/s)")
    print(f"{'codec':<32} {'stored/raw':>10} {'compress GB/s':>13} {'decompress GB/s':>15}")
    for r in speed:
        print(f"{r['codec']:<32} {r['ratio']:>10.3f} {r['compress_gbps']:>13.2f} "
              f"{r['decompress_gbps']:>15.2f}")  # fmt: skip
    if not hits:
        return
    r0 = hits[0]
    print(f"Restart-hit fetch with compression: a lookup run of {r0['chunks']} chunks of "
          f"{r0['chunk_mib']:.2f} MiB, raw and lossless alternating, median of {r0['runs']} runs")
    print(f"{'backend':<22} {'stored/raw':>10} {'none ms':>8} {'lossless ms':>11} "
          f"{'lossless/none':>13}")  # fmt: skip
    for r in hits:
        print(f"{r['backend']:<22} {r['stored_over_raw']:>10.3f} {r['none_ms_median']:>8.1f} "
              f"{r['lossless_ms_median']:>11.1f} {r['lossless_over_none']:>13.2f}")  # fmt: skip


def print_encryption(rows: list[dict], speed: dict[str, float], hmac_on: bool) -> float:
    """Print the encryption table; returns the lowest sealed ÷ plain ratio."""
    print(
        f"\nEncryption: AES-256-GCM on one core {speed['seal_gbps']:.2f} GB/s seal, "
        f"{speed['open_gbps']:.2f} GB/s open in place; {rows[0]['chunk_mib']:.0f} MiB chunks, "
        f"median of the rounds, hmac={'on' if hmac_on else 'off'} on both sides, "
        f"{os.cpu_count()} CPUs"
    )
    print(f"{'backend':<11} {'mode':<22} {'op':<4} {'plain GB/s':>10} {'sealed GB/s':>11} "
          f"{'sealed/plain':>12} {'goal':>5}")  # fmt: skip
    for r in rows:
        print(
            f"{r['backend']:<11} {r['mode']:<22} {r['op']:<4} {r['plain_gbps_median']:>10.2f} "
            f"{r['sealed_gbps_median']:>11.2f} {r['sealed_over_plain']:>12.2f} {0.9:>5.1f}"
        )
    low = min(r["sealed_over_plain"] for r in rows)
    print(f"lowest sealed/plain {low:.2f} (goal >= 0.9)")
    return low


def print_hit_latency(rows: list[dict]) -> None:
    r0 = rows[0]
    print(f"\nRestart-hit fetch: a lookup run of {r0['chunks']} chunks of {r0['chunk_mib']:.0f} "
          f"MiB into host slots (io_threads {r0['io_threads']}: {r0['read_threads']} read "
          f"threads), plain and sealed alternating, median of {r0['runs']} runs")  # fmt: skip
    print(f"{'backend':<11} {'plain ms':>9} {'sealed ms':>10} {'added ms':>9}")
    for r in rows:
        print(f"{r['backend']:<11} {r['plain_ms_median']:>9.1f} {r['sealed_ms_median']:>10.1f} "
              f"{r['added_ms']:>9.1f}")  # fmt: skip


GOALS = {"file": 0.8, "s3 (moto)": 0.9, "redis": 0.9}


def print_into(rows: list[dict], hmac_on: bool) -> float:
    """Print the read-into table; returns the lowest async ratio against its goal."""
    if not rows:
        return float("inf")
    r0 = rows[0]
    print(
        f"\nReads into host slots: {r0['chunk_mib']:.0f} MiB chunks, "
        f"{r0['bytes_per_round'] / MiB:.0f}-MiB rounds, median of {r0['rounds']} "
        f"(GB/s = 1e9 B/s), hmac={'on' if hmac_on else 'off'}, {os.cpu_count()} CPUs"
    )
    print(f"{'backend':<10} {'raw reader':<26} {'io_thr':>6} {'rd_thr':>6} {'conc':>4} "
          f"{'async GB/s':>10} {'sync GB/s':>9} {'raw GB/s':>8} {'async/raw':>9} "
          f"{'sync/raw':>8} {'goal':>5}")  # fmt: skip
    worst = float("inf")
    for r in rows:
        goal = GOALS.get(r["backend"], 0.9)
        worst = min(worst, r["async_over_raw"] / goal)
        print(
            f"{r['backend']:<10} {r['raw_reader']:<26} {r['io_threads']:>6} "
            f"{r['read_threads']:>6} {r['concurrency']:>4} {r['async_gbps_median']:>10.2f} "
            f"{r['sync_gbps_median']:>9.2f} {r['raw_gbps_median']:>8.2f} "
            f"{r['async_over_raw']:>9.2f} {r['sync_over_raw']:>8.2f} {goal:>5.1f}"
        )
    return worst


@contextmanager
def local_cluster(primaries: int = 3) -> Iterator[list[int]]:
    """A Redis Cluster of ``primaries`` primaries (no replicas) on loopback, the tests'
    helper (tests/rediscluster.py); yields the primaries' ports."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "tests"))  # fmt: skip
    from rediscluster import RedisCluster as LocalCluster

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

    from kvtier.tiers.redis_cluster import RedisClusterTier

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

    case = Case(f"cluster x{len(ports)}", lambda t: RedisClusterTier(url, io_threads=t),
                raw_put, raw_get, raw_read_object, "redis-py RedisCluster GET")  # fmt: skip
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
    return {"keys": n, "per_primary": dict(sorted(counts.items())),
            "min_share": per[0] / n, "max_share": per[-1] / n,
            "max_over_mean": per[-1] / (n / len(per))}  # fmt: skip


def run_cluster(args: argparse.Namespace, chunks: list[bytes]) -> tuple[list[tuple], dict]:
    """The put/get table on one node and on a 3-primary cluster, and the key spread."""
    node = redis_case(args)
    node.raw_key = lambda key: "raw/" + key  # type: ignore[attr-defined]
    rows = [("redis x1", *r[1:]) for r in run_case(node, args, chunks, fresh_puts=True)]
    with local_cluster(3) as ports:
        case = cluster_case(ports, args.putget_threads)
        rows += run_case(case, args, chunks, fresh_puts=True)
        spread = key_spread(case.client, args.spread_keys)  # type: ignore[attr-defined]
        case.client.close()  # type: ignore[attr-defined]
    return rows, spread


def print_cluster(rows: list[tuple], spread: dict, chunks: int, size: int, rounds: int) -> float:
    """Print the cluster table; returns the lowest median kvtier ÷ raw ratio."""
    print(f"\nRedis: 1 node and a 3-primary cluster, {chunks} chunks of {size / MiB:.1f} MiB, "
          f"best of {rounds} rounds (ratio median: of the median rounds), {os.cpu_count()} CPUs; "
          "raw: redis.Redis on the node, redis.cluster.RedisCluster on the cluster")  # fmt: skip
    print(f"{'target':<11} {'mode':<22} {'op':<4} {'kvtier MB/s':>12} {'raw MB/s':>10} "
          f"{'ratio best':>10} {'ratio median':>12}")  # fmt: skip
    for target, mode, op, kv, raw, median_ratio in rows:
        print(f"{target:<11} {mode:<22} {op:<4} {kv:>12.1f} {raw:>10.1f} {kv / raw:>10.2f} "
              f"{median_ratio:>12.2f}")  # fmt: skip
    low = min(r[5] for r in rows)
    print(f"lowest median ratio kvtier/raw {low:.2f} (goal >= 0.9)")
    shares = ", ".join(f"{n / spread['keys']:.3f}" for n in spread["per_primary"].values())
    print(f"{spread['keys']} random chunk keys over {len(spread['per_primary'])} primaries: "
          f"shares {shares}; busiest ÷ mean {spread['max_over_mean']:.3f}")  # fmt: skip
    return low


def float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated numbers, got {text!r}") from None


def _backends(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in BACKENDS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"backends are {', '.join(BACKENDS)}; got {text!r}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Put/get and read-into-slot throughput of kvtier's object tiers vs the "
        "raw file reader, boto3 and redis-py.",
    )
    parser.add_argument("--redis-url", help="use this Redis instead of starting redis-server")
    parser.add_argument("--s3-endpoint", help="use this S3 endpoint instead of starting moto")
    parser.add_argument("--bucket", default="kvtier-bench", help="S3 bucket (created if missing)")
    parser.add_argument("--chunk-mib", type=float, default=4.0, help="chunk size in MiB")
    parser.add_argument("--chunks", type=int, default=16,
                        help="chunks of the put/get table, objects stored for reads")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per figure")
    parser.add_argument("--threads", type=int_list, default=[1, 2, 4, 8],
                        help="io_threads values of the read-into table (RemoteIO reads on "
                        "ceil(n/2) of them), comma-separated")  # fmt: skip
    parser.add_argument("--concurrency", type=int_list, default=[4, 16],
                        help="chunks in flight (read-into table), comma-separated")  # fmt: skip
    parser.add_argument("--round-mib", type=float, default=64.0,
                        help="MiB read per round of the read-into table")  # fmt: skip
    parser.add_argument("--putget-threads", type=int, default=4,
                        help="io_threads of the put/get table (RemoteIO splits it)")  # fmt: skip
    parser.add_argument("--only", type=_backends, default=list(BACKENDS),
                        help="backends, comma-separated (file, s3, redis)")  # fmt: skip
    parser.add_argument("--skip-putget", action="store_true", help="only the read-into table")
    parser.add_argument("--skip-into", action="store_true", help="no read-into table")
    parser.add_argument("--skip-encryption", action="store_true",
                        help="no encryption (sealed ÷ plain) table")  # fmt: skip
    parser.add_argument("--only-encryption", action="store_true",
                        help="only the encryption tables")  # fmt: skip
    parser.add_argument("--hit-chunks", type=int, default=8,
                        help="chunks of the restart-hit fetch (8 x 4 MiB: a 2,048-token "
                        "prompt of bench/ttft.py's model)")  # fmt: skip
    parser.add_argument("--skip-compression", action="store_true",
                        help="no compression table")  # fmt: skip
    parser.add_argument("--only-compression", action="store_true",
                        help="only the compression tables")  # fmt: skip
    parser.add_argument("--link-gbit", type=float_list, default=[1.0, 5.0, 10.0, 25.0],
                        help="also fetch the compression table's file tier through a link "
                        "of these Gbit/s (shared by the read threads), comma-separated")
    parser.add_argument("--kv-dir", help="a file:// tier directory an engine wrote (raw "
                        "chunks): compress its chunks instead of synthetic KV-like ones")
    parser.add_argument("--skip-cluster", action="store_true",
                        help="no Redis Cluster table (1 node vs 3 primaries)")  # fmt: skip
    parser.add_argument("--only-cluster", action="store_true",
                        help="only the Redis Cluster table (starts redis-server and a "
                        "3-primary cluster on loopback)")  # fmt: skip
    parser.add_argument("--spread-keys", type=int, default=100_000,
                        help="random chunk keys mapped to primaries (key spread)")  # fmt: skip
    parser.add_argument("--hmac", action="store_true", help="sign and verify chunks (HMAC)")
    parser.add_argument("--skip-s3", action="store_true")
    parser.add_argument("--skip-redis", action="store_true")
    parser.add_argument("--json", help="also write every row to this JSON file")
    args = parser.parse_args(argv)
    args.skip_s3 = args.skip_s3 or "s3" not in args.only
    args.skip_redis = args.skip_redis or "redis" not in args.only
    args.skip_file = "file" not in args.only
    if args.only_encryption:
        args.skip_putget = args.skip_into = args.skip_compression = True
        args.skip_encryption = False
    if args.only_compression:
        args.skip_putget = args.skip_into = args.skip_encryption = True
        args.skip_compression = False
    # the cluster table needs a local redis-server to compare with and starts its cluster
    args.cluster = not args.skip_cluster and not args.redis_url and "redis" in args.only
    if args.only_cluster:
        args.skip_putget = args.skip_into = args.skip_encryption = True
        args.skip_compression = args.skip_s3 = args.skip_file = True
        args.skip_redis, args.cluster, args.redis_url = False, True, None
    if args.spread_keys < 1:
        parser.error("--spread-keys must be at least 1")
    if args.chunks < max(args.concurrency):
        parser.error("--chunks must be at least the largest --concurrency")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.setswitchinterval(0.001)  # as kvtier sets it in engine processes with an object tier
    size = int(args.chunk_mib * MiB) // 2 * 2
    base = os.urandom(size)
    chunks = [i.to_bytes(8, "little") + base[8:] for i in range(args.chunks)]
    rows: list[tuple] = []
    into: list[dict] = []
    enc: list[dict] = []
    hits: list[dict] = []
    zhits: list[dict] = []
    zspeed: list[dict] = []
    cluster_rows: list[tuple] = []
    spread: dict = {}
    if not args.skip_compression:
        if args.kv_dir:
            kv_chunks, source = engine_chunks(args.kv_dir), f"the chunks in {args.kv_dir}"
        else:
            kv_chunks = kv_like_chunks(size, min(args.chunks, 8))
            source = f"synthetic KV-like bf16 chunks of {size / MiB:.2f} MiB"
        zspeed = compression_speed(kv_chunks, args.rounds)
    with local_services(args):
        cases = []
        if not args.skip_file:
            cases.append(file_case(args))
        if not args.skip_s3:
            cases.append(s3_case(args))
        if not args.skip_redis and not args.only_cluster:
            cases.append(redis_case(args))
        for case in cases:
            if not args.skip_putget:
                rows += run_case(case, args, chunks)
            if not args.skip_into:
                into += run_into(case, args, chunks)
            if not args.skip_encryption:
                enc += run_encryption(case, args, chunks)
                hits.append(run_hit_latency(case, args, chunks))
            if not args.skip_compression:
                zhits.append(run_compression_hit(case, args, kv_chunks))
                if case.name == "file":
                    for gbit in args.link_gbit:
                        zhits.append(run_compression_hit(case, args, kv_chunks, gbit))
        if args.cluster:
            cluster_rows, spread = run_cluster(args, chunks)
    worst = float("inf")
    if rows:
        print(
            f"\n{args.chunks} chunks of {size / MiB:.1f} MiB, best of {args.rounds} rounds, "
            f"hmac={'on' if args.hmac else 'off'}, {os.cpu_count()} CPUs"
        )
        print(f"{'backend':<11} {'mode':<22} {'op':<4} {'kvtier MB/s':>12} {'raw MB/s':>10} "
              f"{'ratio best':>10} {'ratio median':>12}")  # fmt: skip
        for backend, mode, op, kv, raw, median_ratio in rows:
            ratio = kv / raw
            worst = min(worst, median_ratio)
            print(
                f"{backend:<11} {mode:<22} {op:<4} {kv:>12.1f} {raw:>10.1f} {ratio:>10.2f} "
                f"{median_ratio:>12.2f}"
            )
        print(f"lowest median ratio kvtier/raw {worst:.2f} (goal >= 0.9)")
    if into:
        low = print_into(into, args.hmac)
        print(f"lowest async ratio ÷ its goal {low:.2f} (>= 1 meets every goal)")
    speed: dict[str, float] = {}
    if enc:
        speed = aes_gcm_speed(size, args.rounds)
        print_encryption(enc, speed, args.hmac)
        print_hit_latency(hits)
    if zspeed:
        print_compression(zspeed, zhits, source)
    if args.cluster:
        print_cluster(cluster_rows, spread, args.chunks, size, args.rounds)
    if args.json:
        keys = ("backend", "mode", "op", "kvtier_mbps_best", "raw_mbps_best", "ratio_median")
        with open(args.json, "w") as f:
            json.dump({"putget": [dict(zip(keys, r, strict=True)) for r in rows],
                       "into": into, "encryption": enc, "aes_gcm": speed,
                       "restart_hit_fetch": hits, "compression": zspeed,
                       "compression_restart_hit_fetch": zhits,
                       "cluster": [dict(zip(keys, r, strict=True)) for r in cluster_rows],
                       "cluster_key_spread": spread}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
