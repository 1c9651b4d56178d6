"""Would copying each chunk into the KV cache as it lands pay, or reading it straight
there? A one-step lookup's bytes, with kvtier's own file tier and CPU copier, outside
the engine.

A restart hit from a local directory moves each chunk twice: the read (checked as it
lands) into its host slot, then the copy into vLLM's KV cache. kvtier reads all of a
run's chunks, then copies them. Two alternatives are timed beside it:

- copy as landed: each chunk copied on the calling thread as soon as its read is done,
  while the read threads go on with the rest (what a GPU host would do with its copy
  engine);
- read into the KV cache: no host slot and no copy; each layer's K and V regions of the
  chunk read with one ``preadv`` straight into the chunk's blocks (a run of them, as
  vLLM's allocator hands out) and checksummed there (CRC-32, as kvtier checks a chunk).
  Possible only on vLLM's CPU build, whose KV cache is host memory, for chunks stored
  raw (not sealed, not compressed), and it leaves no copy in the host tier.

All three, alternating, in one run:

    python bench/copy_overlap.py --tokens 8192 --reps 20

prints the median of each and its ratio to kvtier's way (read all, then copy). On a
host whose cores are all busy reading, the copies only move the same memory traffic to
another thread; on one with idle cores they can hide behind the reads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import torch
from paged_kv import add_args, paged_kv

from kvtier.host.layout import HostSlab
from kvtier.host.transfer import CpuCopier
from kvtier.objects.checksum import payload_crc32
from kvtier.objects.tiers.file import FileTier
from kvtier.ops import LoadOp, StoreOp

HEAD = 64  # bytes before the payload, as a chunk's header (not decoded here)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(p)
    p.add_argument("--read-threads", type=int, default=2,
                   help="kvtier's read threads (io_threads 4)")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)

    kv, layout, chunks, bpc, _ = paged_kv(args)
    slab = HostSlab(layout.slot_bytes * (chunks + 1), layout, commit=True)  # +1: a check's
    copier = CpuCopier(list(kv.values()), layout, slab)
    with tempfile.TemporaryDirectory() as root:
        tier = FileTier(root)
        keys = [f"chunk-{i}" for i in range(chunks)]
        payloads = [os.urandom(layout.slot_bytes) for _ in keys]
        for key, data in zip(keys, payloads, strict=True):
            tier.put(key, [bytes(HEAD), data])
        # each chunk's blocks: a run, every other chunk's place, as an allocator hands out
        loads = [LoadOp(i, i, 0, list(range(2 * i * bpc, (2 * i + 1) * bpc)))
                 for i in range(chunks)]  # fmt: skip

        def read(i: int) -> int:
            got = tier.read_into_hashed(keys[i], slab.slot_memoryview(i), HEAD)
            assert got is not None
            return i

        def read_all_then_copy(pool: ThreadPoolExecutor) -> float:
            t0 = time.perf_counter()
            list(pool.map(read, range(chunks)))
            assert all(r.ok for r in copier.submit(loads))
            return time.perf_counter() - t0

        def read_into_kv(i: int) -> int:
            b0 = loads[i].gpu_blocks[0]
            fd = os.open(tier.path(keys[i]), os.O_RDONLY)
            try:
                at, crc = HEAD, 0
                for layer in kv.values():
                    regions = [memoryview(layer[k, b0 : b0 + bpc].view(torch.uint8).numpy())
                               for k in (0, 1)]  # fmt: skip
                    n = os.preadv(fd, regions, at)
                    assert n == sum(r.nbytes for r in regions), "short read"
                    at += n
                    for r in regions:
                        crc = payload_crc32(r, crc)
                return crc
            finally:
                os.close(fd)

        def straight_into_kv(pool: ThreadPoolExecutor) -> float:
            t0 = time.perf_counter()
            got = list(pool.map(read_into_kv, range(chunks)))
            elapsed = time.perf_counter() - t0
            assert got == crcs, "a chunk read into the KV cache does not match its checksum"
            return elapsed

        def copy_as_landed(pool: ThreadPoolExecutor) -> float:
            t0 = time.perf_counter()
            for done in as_completed([pool.submit(read, i) for i in range(chunks)]):
                assert all(r.ok for r in copier.submit([loads[done.result()]]))
            return time.perf_counter() - t0

        crcs = [payload_crc32(p) for p in payloads]
        after, landed, direct = [], [], []
        with ThreadPoolExecutor(args.read_threads) as pool:
            read_all_then_copy(pool)  # page cache, slab and code paths warm
            straight_into_kv(pool)
            for _ in range(args.reps):
                after.append(read_all_then_copy(pool))
                landed.append(copy_as_landed(pool))
                direct.append(straight_into_kv(pool))
        tier.close()
        # every way moved every chunk's bytes into its blocks: copied back out, they match
        for i, op in enumerate(loads):
            copier.submit([StoreOp(chunks + i, chunks, op.gpu_blocks, b"check")])
            assert [r.ok for r in copier.poll()] == [True]
            assert bytes(slab.slot_memoryview(chunks)) == payloads[i], f"chunk {i}"
    a, b = statistics.median(after) * 1e3, statistics.median(landed) * 1e3
    c = statistics.median(direct) * 1e3
    mib = chunks * layout.slot_bytes / 2**20
    print(f"{chunks} chunks, {mib:.0f} MiB, {args.read_threads} read threads, "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
          f"median of {args.reps}:")
    print(f"  read all, then copy   {a:7.1f} ms")
    print(f"  copy as landed        {b:7.1f} ms   ({b / a:.2f}x)")
    print(f"  read into KV cache    {c:7.1f} ms   ({c / a:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
