#!/usr/bin/env python3
"""A restart hit's reads on the file tier, taken apart: where the bytes land, their check,
and kvtier's read path, outside the engine.

Why: ``bench/ttft.py`` sets kvtier's reads in the engine against the raw client, which
reads each chunk into a new buffer and checks nothing. kvtier must land every chunk of a
run in its own host slot and check every byte. This script times four ways of reading the
same stored chunks from the page cache on the same threads, in alternating order:

- ``new buffer``: ``open`` + ``readinto`` a new buffer per chunk (ttft.py's raw client);
- ``into slots``: each chunk into its own slice of one buffer touched beforehand, as
  kvtier's slots are (one ``preadv`` per chunk);
- ``+ CRC-32``: the same, with a CRC-32 of each piece as it lands (the checksum's piece);
- ``kvtier``: ``FileTier.read_into_hashed`` into the same slots (header parsed, payload
  checked as it lands).

    python bench/read_parts.py [--tokens 2048 8192 32768] [--chunk-mib 4] [--threads 2]

ms per run, median of ``--rounds``; the ratios are against ``into slots``.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvtier.objects import codec
from kvtier.objects.checksum import HASH_PIECE, payload_crc32
from kvtier.objects.remote import MAX_FRAME
from kvtier.objects.tiers.file import FileTier

MiB = 2**20
CHUNK_TOKENS = 256


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768],
                    help="prompt lengths; a run reads one chunk per 256 tokens")  # fmt: skip
    ap.add_argument("--chunk-mib", type=float, default=4.0,
                    help="payload per chunk (4: the CPU bench model's)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=2,
                    help="read threads (kvtier's at io_threads=4)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=9, help="timed rounds per way")
    ap.add_argument("--dir", help="where to store the chunks (default: a temporary directory)")
    args = ap.parse_args(argv)
    if args.threads < 1 or args.rounds < 1 or args.chunk_mib <= 0:
        ap.error("--threads and --rounds must be at least 1, --chunk-mib above 0")
    with contextlib.ExitStack() as stack:  # on failure too: the tier closed, a temporary root gone
        root = args.dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="kvtier-read-parts-"))  # fmt: skip
        tier = FileTier(root, background_sweep=False)
        stack.callback(tier.close)
        return _time_reads(args, tier)


def _time_reads(args: argparse.Namespace, tier: FileTier) -> int:
    """Store the chunks in ``tier``, check that the reads land them, time and print them."""
    size = int(args.chunk_mib * MiB)
    most = max(-(-n // CHUNK_TOKENS) for n in args.tokens)
    keys = [f"read-parts-{size}-{i}" for i in range(most)]
    print(f"storing {most} chunks of {args.chunk_mib:g} MiB in {tier.root}", file=sys.stderr)
    crcs = []
    for key in keys:
        payload = os.urandom(size)
        crcs.append(payload_crc32(payload))
        tier.put(key, codec.encode(key, payload, dtype="uint8", shape=[size]))
    paths = [tier.path(k) for k in keys]
    for p in paths:  # into the page cache, as a warm tier's are
        with open(p, "rb") as f:
            while f.read(64 * MiB):
                pass
    heads = [os.path.getsize(p) - size for p in paths]  # (a head holds its key: lengths vary)
    slab = mmap.mmap(-1, size * most)
    slab.write(b"\1" * (size * most))  # touched beforehand, as kvtier commits its slab
    view = memoryview(slab)

    def new_buffer(i: int) -> None:
        with open(paths[i], "rb", buffering=0) as f:
            buf = bytearray(os.fstat(f.fileno()).st_size)
            f.readinto(buf)

    def into_slot(i: int, crc: bool = False) -> int:
        slot = view[i * size : (i + 1) * size]
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            if not crc:
                os.preadv(fd, [slot], heads[i])
                return 0
            value = 0
            for off in range(0, size, HASH_PIECE):
                piece = slot[off : off + HASH_PIECE]
                os.preadv(fd, [piece], heads[i] + off)
                value = payload_crc32(piece, value)
            return value
        finally:
            os.close(fd)

    def kvtier(i: int) -> int:
        got = tier.read_into_hashed(keys[i], view[i * size : (i + 1) * size], MAX_FRAME)
        if got is None:
            raise RuntimeError(f"{keys[i]} not stored")
        return got[1]

    for i in range(most):  # the two checked ways read the stored payloads, to the bit
        if not into_slot(i, crc=True) == kvtier(i) == crcs[i]:
            raise RuntimeError(f"{keys[i]}: a read did not land the stored payload")

    ways: dict[str, Callable[[int], object]] = {
        "new buffer": new_buffer, "into slots": into_slot,
        "+ CRC-32": lambda i: into_slot(i, crc=True), "kvtier": kvtier,
    }  # fmt: skip
    print(f"file tier from the page cache, {args.threads} threads, {args.chunk_mib:g} MiB "
          f"chunks, ms per run (median of {args.rounds}), {os.cpu_count()} CPUs")  # fmt: skip
    print(f"{'tokens':>7} {'chunks':>6} " + " ".join(f"{w:>11}" for w in ways)
          + f" {'CRC ÷ slots':>11} {'kvtier ÷ CRC':>12}")  # fmt: skip
    with ThreadPoolExecutor(args.threads) as pool:
        for n in args.tokens:
            chunks = range(-(-n // CHUNK_TOKENS))
            times: dict[str, list[float]] = {w: [] for w in ways}
            names = list(ways)
            for r in range(args.rounds + 1):  # one warm-up round
                for w in names if r % 2 == 0 else reversed(names):
                    t0 = time.perf_counter()
                    list(pool.map(ways[w], chunks))
                    if r:
                        times[w].append((time.perf_counter() - t0) * 1e3)
            med = {w: statistics.median(v) for w, v in times.items()}
            print(f"{n:>7} {len(chunks):>6} " + " ".join(f"{med[w]:>11.2f}" for w in ways)
                  + f" {med['+ CRC-32'] / med['into slots']:>11.2f}"
                  f" {med['kvtier'] / med['+ CRC-32']:>12.2f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
