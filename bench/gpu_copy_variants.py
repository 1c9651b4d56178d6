#!/usr/bin/env python3
"""Host-to-device loads of paged KV on a GPU, three ways side by side: what kvtier's
CudaCopier does today against two candidates, so that the next copier is chosen by numbers.

Why: on one H200 kvtier's loads moved at half the bus (27.6 against 54.5 GB/s) and hid
0.07 of a layer loop's compute (``bench/gpu_transfer.py``). Per chunk and layer the copier
copies each K/V half (512 KiB with a Llama-3-8B shape) into staging, and scatters it on the
load stream between one layer's copies and the next one's.

- ``kvtier``: ``CudaCopier.begin_loads`` / ``wait_layer`` / ``finish_loads``.
- ``layer_copy``: per chunk and layer one copy of the layer's whole region (K and V are
  contiguous in the slot), every copy on the copy stream in layer order, one event per
  layer; each layer's scatter runs on the compute stream once that event passed.
- ``chunk_copy``: per chunk one copy of the whole slot (its layers are contiguous); every
  layer's scatter on the compute stream once all copies landed (no layer overlap).

Per variant: GB/s of copies and scatters alone, and a layer loop (matmuls sized so a layer's
compute takes about one layer's raw copy) with the loads waited for per layer; ``hidden`` is
the share of the shorter of copy and compute that overlapped (1.0: all of it). After every
run the loaded blocks are compared byte for byte with the slots. Without CUDA it runs on the
CPU without streams, to check the script (its figures mean nothing there).

    python bench/gpu_copy_variants.py [--layers 32 --chunks 64 --json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from gpu_transfer import hidden_share

try:
    import kvtier  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvtier.host.copiers import make_copier
from kvtier.host.layout import HostSlab, SlotLayout
from kvtier.ops import LoadOp

GB = 1e9


class Loads:
    """The three ways of loading ``chunks`` slots into their blocks (FlashAttention's
    ``[2, num_blocks, block_size, heads, head_dim]`` layers)."""

    def __init__(self, args: argparse.Namespace, dev: torch.device) -> None:
        self.dev, self.cuda = dev, dev.type == "cuda"
        self.n, self.layers = args.chunks, args.layers
        blocks = args.chunks * args.chunk_blocks + 64
        shape = (2, blocks, args.block_size, args.heads, args.head_dim)
        self.kv = [torch.zeros(shape, dtype=torch.bfloat16, device=dev)
                   for _ in range(args.layers)]  # fmt: skip
        self.layout = SlotLayout.from_kv_caches(
            {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(self.kv)}, blocks,
            args.chunk_blocks)  # fmt: skip
        self.slab = HostSlab(self.layout.slot_bytes * self.n, self.layout, pin=self.cuda,
                             commit=True)  # fmt: skip
        self.slab.buffer.copy_(torch.randint(0, 256, (self.slab.nbytes,), dtype=torch.uint8))
        perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(0)).tolist()
        bpc = args.chunk_blocks
        self.ids = [perm[c * bpc : (c + 1) * bpc] for c in range(self.n)]
        self.idx = torch.tensor(self.ids, dtype=torch.long, device=dev)  # [chunks, bpc]
        self.copier = make_copier(self.kv, self.layout, self.slab)
        self.loads = [LoadOp(c, c, 0, self.ids[c]) for c in range(self.n)]
        self.nbytes = sum(ll.nbytes for ll in self.layout.layers) * self.n
        slot = self.layout.slot_bytes
        self.staging = torch.empty(self.n * slot, dtype=torch.uint8, device=dev)
        self.copy_stream = torch.cuda.Stream(dev) if self.cuda else None
        self.host_slots = [self.slab.buffer[c * slot : (c + 1) * slot] for c in range(self.n)]
        self.dev_slots = self.staging.view(self.n, slot)

    # -- pieces --
    def _on_copy_stream(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.copy_stream) if self.copy_stream else contextlib.nullcontext()

    def _event(self) -> Any:
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.copy_stream)
        return ev

    def _wait(self, ev: Any) -> None:
        if ev is not None:
            torch.cuda.current_stream(self.dev).wait_event(ev)

    def _scatter(self, li: int) -> None:
        """Layer ``li`` of every chunk, from its region of the staged slots, into its
        blocks (on the current stream)."""
        ll = self.layout.layers[li]
        region = self.dev_slots[:, ll.offset : ll.offset + ll.nbytes].view(ll.dtype)
        src = region.view(self.n, *ll.slot_shape).transpose(0, 1)  # [2, chunks, bpc, ...]
        self.kv[li][:, self.idx] = src

    # -- the three ways; each enqueues, returns a per-layer wait --
    def begin(self, way: str) -> Callable[[int], None]:
        if way == "kvtier":
            self.copier.begin_loads(self.loads)
            return self.copier.wait_layer
        slot = self.layout.slot_bytes
        if way == "chunk_copy":
            with self._on_copy_stream():
                for c in range(self.n):
                    self.dev_slots[c].copy_(self.host_slots[c], non_blocking=True)
                done = self._event()
            waited: list[int] = []

            def wait_chunks(li: int) -> None:
                if not waited:
                    self._wait(done)
                    waited.append(li)
                self._scatter(li)

            return wait_chunks
        events = []
        with self._on_copy_stream():
            for ll in self.layout.layers:
                for c in range(self.n):
                    at = c * slot + ll.offset
                    self.staging[at : at + ll.nbytes].copy_(
                        self.slab.buffer[at : at + ll.nbytes], non_blocking=True)  # fmt: skip
                events.append(self._event())

        def wait_layer(li: int) -> None:
            self._wait(events[li])
            self._scatter(li)

        return wait_layer

    def finish(self, way: str) -> None:
        if way == "kvtier":
            assert all(r.ok for r in self.copier.finish_loads())
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def check(self, way: str) -> None:
        for li, kv in enumerate(self.kv):
            for c in range(self.n):
                got = kv[:, self.ids[c]].contiguous().view(torch.uint8).flatten().cpu()
                want = self.slab.layer_view(c, li).contiguous().view(torch.uint8).flatten()
                if not torch.equal(got, want):
                    raise AssertionError(f"{way}: layer {li} chunk {c} differs from its slot")

    def clear(self) -> None:
        for t in self.kv:
            t.zero_()
        if self.cuda:
            torch.cuda.synchronize(self.dev)


def timed(loads: Loads, fn: Callable[[], None], repeats: int) -> float:
    """Median seconds of ``fn`` (each run from a synchronized start to a synchronized end)."""
    out = []
    for _ in range(repeats + 1):
        loads.clear()
        t0 = time.perf_counter()
        fn()
        if loads.cuda:
            torch.cuda.synchronize(loads.dev)
        out.append(time.perf_counter() - t0)
    return statistics.median(out[1:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk-blocks", type=int, default=16, help="blocks per chunk")
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--matmul", type=int, default=4096, help="side of the synthetic compute")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loads = Loads(args, dev)
    name = torch.cuda.get_device_name(dev) if loads.cuda else "CPU (no CUDA)"
    side = args.matmul if loads.cuda else 64
    a = torch.randn(side, side, device=dev, dtype=torch.bfloat16) / side**0.5

    def compute(k: int) -> None:
        x = a
        for _ in range(k):
            x = x @ a

    raw_host = loads.slab.buffer[: loads.layout.slot_bytes * loads.n]
    raw = timed(loads, lambda: loads.staging.copy_(raw_host, non_blocking=True), args.repeats)
    one = timed(loads, lambda: compute(10), args.repeats) / 10
    k = max(1, round(raw / args.layers / one))
    t_comp = timed(loads, lambda: [compute(k) for _ in range(args.layers)], args.repeats)
    rows: dict[str, dict[str, float]] = {}
    print(f"device {name}; {loads.nbytes / GB:.2f} GB in {args.chunks} chunks x {args.layers} "
          f"layers; one raw copy {loads.nbytes / raw / GB:.1f} GB/s; compute "
          f"{t_comp * 1e3:.1f} ms ({k} matmuls a layer)")  # fmt: skip
    for way in ("kvtier", "layer_copy", "chunk_copy"):

        def alone(way: str = way) -> None:
            wait = loads.begin(way)
            for li in range(args.layers):
                wait(li)
            loads.finish(way)

        def layerwise(way: str = way) -> None:
            wait = loads.begin(way)
            for li in range(args.layers):
                wait(li)
                compute(k)
            loads.finish(way)

        t_copy = timed(loads, alone, args.repeats)
        loads.check(way)
        t_lw = timed(loads, layerwise, args.repeats)
        loads.check(way)
        rows[way] = {"gbps": loads.nbytes / t_copy / GB, "over_raw": raw / t_copy,
                     "copy_ms": t_copy * 1e3, "layerwise_ms": t_lw * 1e3,
                     "hidden": hidden_share(t_comp, t_copy, t_lw)}  # fmt: skip
        r = rows[way]
        print(f"{way:>10}: {r['gbps']:.1f} GB/s ({r['over_raw']:.2f}x one raw copy), "
              f"alone {r['copy_ms']:.1f} ms, with compute {r['layerwise_ms']:.1f} ms, "
              f"hidden {r['hidden']:.2f}", flush=True)  # fmt: skip
    result = {"device": name, "args": vars(args), "bytes": loads.nbytes, "rows": rows,
              "raw_gbps": loads.nbytes / raw / GB, "compute_ms": t_comp * 1e3}  # fmt: skip
    print("RESULT " + json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    loads.slab.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
