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
import sys

from harness import int_list
from tables import (
    print_cluster,
    print_compression,
    print_encryption,
    print_hit_latency,
    print_into,
    print_putget,
)
from tier_cases import MiB, file_case, local_services, redis_case, s3_case
from tier_codecs import (
    aes_gcm_speed,
    compression_speed,
    engine_chunks,
    kv_like_chunks,
    run_compression_hit,
    run_encryption,
)
from tier_reads import run_case, run_cluster, run_hit_latency, run_into

BACKENDS = ("file", "s3", "redis")


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
    parser.add_argument(
        "--chunks",
        type=int,
        default=16,
        help="chunks of the put/get table, objects stored for reads",
    )
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per figure")
    parser.add_argument(
        "--threads",
        type=int_list,
        default=[1, 2, 4, 8],
        help="io_threads values of the read-into table (RemoteIO reads on "
        "ceil(n/2) of them), comma-separated",
    )
    parser.add_argument(
        "--concurrency",
        type=int_list,
        default=[4, 16],
        help="chunks in flight (read-into table), comma-separated",
    )
    parser.add_argument(
        "--round-mib", type=float, default=64.0, help="MiB read per round of the read-into table"
    )
    parser.add_argument(
        "--putget-threads",
        type=int,
        default=4,
        help="io_threads of the put/get table (RemoteIO splits it)",
    )
    parser.add_argument(
        "--only",
        type=_backends,
        default=list(BACKENDS),
        help="backends, comma-separated (file, s3, redis)",
    )
    parser.add_argument("--skip-putget", action="store_true", help="only the read-into table")
    parser.add_argument("--skip-into", action="store_true", help="no read-into table")
    parser.add_argument(
        "--skip-encryption", action="store_true", help="no encryption (sealed ÷ plain) table"
    )
    parser.add_argument("--only-encryption", action="store_true", help="only the encryption tables")
    parser.add_argument(
        "--hit-chunks",
        type=int,
        default=8,
        help="chunks of the restart-hit fetch (8 x 4 MiB: a 2,048-token "
        "prompt of bench/ttft.py's model)",
    )
    parser.add_argument("--skip-compression", action="store_true", help="no compression table")
    parser.add_argument(
        "--only-compression", action="store_true", help="only the compression tables"
    )
    parser.add_argument(
        "--link-gbit",
        type=float_list,
        default=[1.0, 5.0, 10.0, 25.0],
        help="also fetch the compression table's file tier through a link "
        "of these Gbit/s (shared by the read threads), comma-separated",
    )
    parser.add_argument(
        "--kv-dir",
        help="a file:// tier directory an engine wrote (raw "
        "chunks): compress its chunks instead of synthetic KV-like ones",
    )
    parser.add_argument(
        "--skip-cluster", action="store_true", help="no Redis Cluster table (1 node vs 3 primaries)"
    )
    parser.add_argument(
        "--only-cluster",
        action="store_true",
        help="only the Redis Cluster table (starts redis-server and a "
        "3-primary cluster on loopback)",
    )
    parser.add_argument(
        "--spread-keys",
        type=int,
        default=100_000,
        help="random chunk keys mapped to primaries (key spread)",
    )
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
    if rows:
        print_putget(rows, args.chunks, size, args.rounds, args.hmac)
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
            json.dump(
                {
                    "putget": [dict(zip(keys, r, strict=True)) for r in rows],
                    "into": into,
                    "encryption": enc,
                    "aes_gcm": speed,
                    "restart_hit_fetch": hits,
                    "compression": zspeed,
                    "compression_restart_hit_fetch": zhits,
                    "cluster": [dict(zip(keys, r, strict=True)) for r in cluster_rows],
                    "cluster_key_spread": spread,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
