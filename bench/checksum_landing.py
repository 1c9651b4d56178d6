#!/usr/bin/env python3
"""A chunk checksummed as it lands against read and then checksummed, per backend.

Why: a hit reads every chunk into its host slot and checks its CRC-32. Every tier now
checksums each piece of the slot right after it lands (``ObjectTier.read_into_hashed``),
while it is still in the CPU's cache, instead of a second pass over the slot once it is
in (``read_into``, then ``payload_crc32``). One thread, the same stored chunks, the two
ways alternating; ms per chunk (median of ``--rounds`` rounds of ``--chunks`` chunks).

    python bench/checksum_landing.py [--chunk-mib 4 32] [--only file,s3,redis]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

from tier_cases import MiB, file_case, local_services, open_case, redis_case, s3_case

from kvtier.objects import codec
from kvtier.objects.checksum import payload_crc32
from kvtier.objects.remote import MAX_FRAME
from kvtier.objects.tiers import ObjectTier

CASES = {"file": file_case, "s3": s3_case, "redis": redis_case}


def compare(tier: ObjectTier, size: int, chunks: int, rounds: int) -> tuple[float, float]:
    """(landing, after): ms per chunk, the two ways alternating over the same chunks."""
    keys = [f"landing-{size}-{i}" for i in range(chunks)]
    for key in keys:
        tier.put(key, codec.encode(key, os.urandom(size), dtype="uint8", shape=[size]))
    slot = memoryview(bytearray(size))

    def landing() -> None:
        for key in keys:
            if tier.read_into_hashed(key, slot, MAX_FRAME) is None:
                raise RuntimeError(f"{key} not stored")

    def after() -> None:
        for key in keys:
            if tier.read_into(key, slot, MAX_FRAME) is None:
                raise RuntimeError(f"{key} not stored")
            payload_crc32(slot)

    times: dict[Callable[[], None], list[float]] = {landing: [], after: []}
    for r in range(rounds + 2):  # two warm-up rounds
        for way in (landing, after) if r % 2 == 0 else (after, landing):
            t0 = time.perf_counter()
            way()
            if r >= 2:
                times[way].append((time.perf_counter() - t0) / chunks * 1e3)
    tier.delete(keys)
    return statistics.median(times[landing]), statistics.median(times[after])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk-mib", type=float, nargs="+", default=[4.0, 32.0],
                    help="chunk sizes in MiB (4: a 2,048-token prompt's chunk of the CPU "
                    "bench model; 32: Llama-3-8B's)")  # fmt: skip
    ap.add_argument("--chunks", type=int, default=8, help="chunks per round")
    ap.add_argument("--rounds", type=int, default=25, help="rounds per way")
    ap.add_argument("--only", default="file,s3,redis", help="backends, comma-separated")
    ap.add_argument("--redis-url", help="use this Redis instead of starting redis-server")
    ap.add_argument("--s3-endpoint", help="use this S3 endpoint instead of starting moto")
    ap.add_argument("--bucket", default="kvtier-bench", help="S3 bucket (created if missing)")
    args = ap.parse_args(argv)
    only = args.only.split(",")
    if unknown := set(only) - set(CASES):
        ap.error(f"--only: unknown {sorted(unknown)}; choose from {sorted(CASES)}")
    args.skip_s3, args.skip_redis = "s3" not in only, "redis" not in only
    args.threads = [1]
    print(f"ms per chunk, one thread, median of {args.rounds} rounds of {args.chunks} "
          f"chunks, {os.cpu_count()} CPUs")  # fmt: skip
    print(f"{'backend':10s} {'MiB':>5s} {'as it lands':>12s} {'then checksum':>14s} {'ratio':>6s}")
    with local_services(args):
        for name in only:
            tier = open_case(CASES[name](args), 1)
            try:
                for mib in args.chunk_mib:
                    size = int(mib * MiB)
                    land, after = compare(tier, size, args.chunks, args.rounds)
                    print(f"{name:10s} {mib:5g} {land:12.3f} {after:14.3f} "
                          f"{land / after:6.2f}", flush=True)  # fmt: skip
            finally:
                tier.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
