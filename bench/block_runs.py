"""The CPU copier's loads and stores for block lists as vLLM's allocator hands them out,
copied run by run as slices against one index copy per layer and chunk.

A fresh block pool hands out ascending runs (``b, b+1, ...``). Once it has cycled, a
request's blocks mostly come in descending runs: vLLM frees a request's blocks in reverse
order and hands out the most recently freed first, so a chunk's 16 blocks are often
``b+15, b+14, ..., b``, or two such runs where two freed requests meet. Per list shape,
kvtier's ``CpuCopier`` (slices per run, :func:`kvtier.host.layout.block_runs`) against the
same copies forced through ``index_copy_`` / ``index_select`` (what it did for any list but
one ascending run), alternating, median of ``--reps``:

    python bench/block_runs.py --tokens 8192 --reps 15

prints ms per prompt's loads (slots -> KV cache: a hit) and stores (KV cache -> slots: a
prompt computed) and the ratio (runs ÷ index copy) for each shape.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import time
from unittest import mock

import torch
from paged_kv import add_args, paged_kv

from kvtier.host.layout import HostSlab
from kvtier.host.transfer import CpuCopier
from kvtier.ops import LoadOp, StoreOp


def shapes(chunks: int, bpc: int, num_blocks: int) -> dict[str, list[list[int]]]:
    """Each shape's block list per chunk, chunks placed apart as a cycled pool leaves them."""
    rng = random.Random(0)
    bases = [2 * i * bpc for i in range(chunks)]
    half = bpc // 2
    return {
        "ascending": [list(range(b, b + bpc)) for b in bases],
        "descending": [list(range(b + bpc - 1, b - 1, -1)) for b in bases],
        "two descending": [list(range(b + half - 1, b - 1, -1))
                           + list(range(b + bpc + half - 1, b + bpc - 1, -1))  # fmt: skip
                           for b in bases],
        "scattered": [rng.sample(range(num_blocks), bpc) for _ in bases],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(p)
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args(argv)

    kv, layout, chunks, bpc, num_blocks = paged_kv(args)
    slab = HostSlab(layout.slot_bytes * chunks, layout, commit=True)
    for i in range(chunks):
        slab.slot_bytes(i).copy_(torch.frombuffer(bytearray(os.urandom(layout.slot_bytes)),
                                                  dtype=torch.uint8))  # fmt: skip
    copier = CpuCopier(list(kv.values()), layout, slab)

    def copy(lists: list[list[int]], index_copy: bool, store: bool) -> float:
        ops = [StoreOp(i, i, blocks) if store else LoadOp(i, i, 0, blocks)
               for i, blocks in enumerate(lists)]  # fmt: skip
        forced = (mock.patch("kvtier.host.transfer.block_runs", lambda blocks: None)
                  if index_copy else contextlib.nullcontext())  # fmt: skip
        t0 = time.perf_counter()
        with forced:
            results = copier.submit(ops) + copier.poll()
        elapsed = time.perf_counter() - t0
        assert len(results) == len(ops) and all(r.ok for r in results)
        return elapsed

    def state() -> dict[str, torch.Tensor]:
        """The KV cache and the slab as bytes (random bf16 bits hold NaNs)."""
        out = {k: v.clone().view(torch.int16) for k, v in kv.items()}
        out["slab"] = slab.buffer.clone()
        return out

    print(f"{chunks} chunks of {layout.slot_bytes / 2**20:.0f} MiB, {args.layers} layers, "
          f"torch threads {torch.get_num_threads()}, median of {args.reps}, ms:")
    print(f"  {'blocks of a chunk':<16} {'':>6} {'runs':>8} {'index copy':>11}   ratio")
    for name, lists in shapes(chunks, bpc, num_blocks).items():
        for store in (False, True):
            runs_t, index_t = [], []
            copy(lists, False, store)
            copy(lists, True, store)
            for _ in range(args.reps):
                runs_t.append(copy(lists, False, store))
                index_t.append(copy(lists, True, store))
            # both ways put the same bytes in the same places
            want = state()
            copy(lists, False, store)
            got = state()
            assert all(torch.equal(want[k], got[k]) for k in want), name
            a, b = statistics.median(runs_t) * 1e3, statistics.median(index_t) * 1e3
            what = "stores" if store else "loads"
            print(f"  {name:<16} {what:>6} {a:8.1f} {b:11.1f}   {a / b:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
