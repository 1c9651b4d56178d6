"""A restart hit's run of fetches over a network link like a remote store's, two ways.

A lookup reads a prompt's first chunk alone (a prompt the store lacks then costs one
request) and the rest in parallel once the first was found. kvtier now queues the rest
as soon as the store's answer begins (S3's response headers, Redis's reply length),
not once the first chunk's payload is in: on a link where one connection moves
100 MB/s, a 4 MiB first chunk takes 40 ms more to arrive than its headers. Timed here,
alternating, on real servers (moto's S3, redis-server) behind a loopback proxy that
adds a one-way delay and caps each connection's throughput:

    python bench/run_over_link.py --latency-ms 5 --mb-per-s 100

``found``: kvtier as it is; ``after payload``: the same reads, the rest queued once the
first chunk's payload is in (the store's read told nothing earlier). Both through
kvtier's RemoteIO (two read threads, checksummed, signed), median of ``--reps`` runs.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from harness import Unavailable, create_bucket, start_moto, start_redis
from tier_cases import MiB, time_restart_runs

from kvtier.objects import codec
from kvtier.objects.backoff import ConstantBackoff
from kvtier.objects.remote import RemoteIO
from kvtier.objects.tiers.base import ObjectTier
from kvtier.objects.tiers.redis import RedisTier
from kvtier.objects.tiers.s3 import S3Tier

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from faultproxy import FaultProxy  # noqa: E402  (the tests' network-fault proxy)

SIDES = ("found", "after payload")
BUCKET = "kvtier-link"


def told_nothing_early(tier: ObjectTier) -> ObjectTier:
    """``tier`` as a store whose read says nothing before its payload is in."""
    for name in ("read_into", "read_into_hashed"):
        real = getattr(tier, name)

        def read(key: str, dest: memoryview, max_head: int, *, found: Any = None,
                 _real: Any = real) -> Any:  # fmt: skip
            got = _real(key, dest, max_head)
            if got is not None and found is not None:
                found()
            return got

        setattr(tier, name, read)
    return tier


def open_through(kind: str, address: str, io_threads: int) -> ObjectTier:
    """A tier of ``kind`` whose server is reached at ``address`` (the proxy)."""
    if kind == "s3":
        return S3Tier(f"s3://{BUCKET}/kv", endpoint_url=f"http://{address}",
                      io_threads=io_threads)  # fmt: skip
    return RedisTier(f"redis://{address}/0", io_threads=io_threads)


def measure(open_tier: Callable[[], ObjectTier], args: argparse.Namespace) -> dict[str, float]:
    size = int(args.chunk_mib * MiB)
    shape = [size // 2]
    signer = codec.Signer(b"bench")
    rios = {}
    for side in SIDES:
        tier = open_tier()
        rios[side] = RemoteIO(told_nothing_early(tier) if side != "found" else tier,
                              threads=args.io_threads, queue_depth=args.chunks + 1,
                              timeout_s=60.0, signer=signer,
                              backoff=ConstantBackoff(0.1))  # fmt: skip
        for i in range(args.chunks):
            key = f"hit-{side}-{i}"
            tier.put(key, codec.encode(key, os.urandom(size), dtype="bfloat16", shape=shape,
                                       signer=signer))  # fmt: skip
    slots = [memoryview(bytearray(size)) for _ in range(args.chunks)]
    times = time_restart_runs(rios, "hit", slots, shape, args.reps, lambda: None)
    for rio in rios.values():
        rio.close()
    return {side: statistics.median(t) * 1e3 for side, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiers", default="s3,redis", help="comma-separated: s3, redis")
    p.add_argument("--latency-ms", type=float, default=5.0, help="one-way delay")
    p.add_argument("--mb-per-s", type=float, default=100.0,
                   help="each connection's throughput, each way (0: uncapped)")
    p.add_argument("--chunks", type=int, default=8, help="the run's chunks (8: 2,048 tokens)")
    p.add_argument("--chunk-mib", type=float, default=4.0)
    p.add_argument("--io-threads", type=int, default=4, help="kvtier's io_threads (half read)")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    tiers = [t for t in args.tiers.split(",") if t]
    unknown = sorted(set(tiers) - {"s3", "redis"})
    if unknown:
        p.error(f"--tiers: unknown {unknown}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtier-link-") as work:
        for kind in tiers:
            try:
                if kind == "s3":
                    proc, server, aws = start_moto(Path(work))
                    os.environ.update(aws)
                    create_bucket(server, BUCKET)
                else:
                    proc, server = start_redis(Path(work))
            except Unavailable as exc:
                print(f"{kind}: unavailable ({exc})")
                continue
            where = urlsplit(server)
            proxy = FaultProxy((where.hostname, where.port)).start()
            proxy.latency_s = args.latency_ms / 1e3
            proxy.bandwidth_bps = args.mb_per_s * 1e6 or None
            try:
                opener = functools.partial(open_through, kind, proxy.address, args.io_threads)
                rows.append((kind, measure(opener, args)))
            finally:
                proxy.close()
                proc.stop()
    print(f"{args.chunks} chunks of {args.chunk_mib:g} MiB, {args.latency_ms:g} ms one-way, "
          f"{args.mb_per_s:g} MB/s per connection, {args.io_threads // 2} read threads, "
          f"median of {args.reps}, ms:")
    print(f"{'tier':<6} {'found':>9} {'after payload':>14} {'ratio':>7}")
    for kind, med in rows:
        print(f"{kind:<6} {med['found']:9.1f} {med['after payload']:14.1f} "
              f"{med['found'] / med['after payload']:6.2f}x")
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
