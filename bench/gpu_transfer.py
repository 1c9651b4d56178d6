#!/usr/bin/env python3
"""GPU <-> host copies of paged KV through kvtier's CUDA path, against the hardware's peak.

Why: the host tier only pays off if a load costs less than recomputing the
prefix, and only if its pinned slab does not eat more host RAM than asked
for. This measures, on one GPU, with only torch and kvtier:

- ``d2h`` / ``h2d``: paged KV blocks (random, non-contiguous block ids, every
  layer) through ``CudaCopier`` (save_layer / begin_loads, host-synchronized
  at the end) against one raw ``cudaMemcpyAsync`` of the same bytes between a
  contiguous GPU tensor and pinned host memory (``cudaHostAlloc`` via
  ``pin_memory=True``, and kvtier's registered slab). GB/s and kvtier ÷ raw.
- ``rss``: host RSS growth ÷ requested bytes for kvtier's slab
  (``cudaHostRegister`` of an exact-size mapping) and for
  ``torch.empty(..., pin_memory=True)`` (caching host allocator: rounds up).
- ``overlap``: a synthetic layer loop (matmuls sized to take as long as one
  layer's copy): compute alone, copies alone, copies then compute (serial) and
  kvtier's layer-wise overlap. ``hidden`` = share of the shorter of the two
  that the overlap hid (1.0: fully hidden).

Finishes in well under 5 minutes on one GPU with the defaults; without CUDA it
says so and exits 0.

    python bench/gpu_transfer.py [--layers 32 --blocks 4096 --chunks 64 --json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

try:
    import torch
except ImportError:  # pragma: no cover
    print("gpu_transfer: torch is not installed; nothing to measure")
    sys.exit(0)

try:
    import kvtier  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvtier.host import cuda as kcuda
from kvtier.host.cuda_copier import CudaCopier
from kvtier.host.layout import HostSlab, SlotLayout
from kvtier.ops import LoadOp, StoreOp

GB = 1e9


def layer_shape(layout: str, blocks: int, bs: int, heads: int, head_dim: int) -> tuple[int, ...]:
    if layout == "flash_attn":
        return (2, blocks, bs, heads, head_dim)
    if layout == "flashinfer":
        return (blocks, 2, bs, heads, head_dim)
    if layout == "mla":
        return (blocks, bs, 576)
    raise ValueError(layout)


def best_of(fn: Callable[[], float], repeats: int) -> tuple[float, float]:
    """(best, median) seconds of ``repeats`` runs after one warm-up."""
    fn()
    times = [fn() for _ in range(repeats)]
    return min(times), statistics.median(times)


def measure_rss(nbytes: int) -> dict[str, float]:
    """RSS growth ÷ requested, each buffer written end to end (a full host tier)."""
    torch.zeros(1, device="cuda")  # the CUDA context's own RSS must not count

    pin_s: list[float] = []

    def kvtier_slab(n: int) -> kcuda.PinnedBuffer:
        t0 = time.perf_counter()
        buf = kcuda.PinnedBuffer(n)  # what the worker's first step pays
        pin_s.append(time.perf_counter() - t0)
        buf.tensor.fill_(1)
        return buf

    def pin_memory(n: int) -> torch.Tensor:
        t = torch.empty(n, dtype=torch.uint8, pin_memory=True)  # caching host allocator
        t.fill_(1)
        return t

    ratio_kv, buf = kcuda.rss_ratio(kvtier_slab, nbytes)
    pinned = buf.pinned
    buf.close()
    del buf
    ratio_pt, t = kcuda.rss_ratio(pin_memory, nbytes)
    del t
    return {
        "requested_bytes": nbytes,
        "kvtier_rss_ratio": round(ratio_kv, 4),
        "kvtier_pinned": pinned,
        "kvtier_pin_seconds_per_gib": round(pin_s[0] / (nbytes / 2**30), 4),
        "pin_memory_rss_ratio": round(ratio_pt, 4),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="flash_attn", choices=["flash_attn", "flashinfer", "mla"])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=4096, help="GPU blocks per layer")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--chunk-blocks", type=int, default=16, help="blocks per chunk (slot)")
    ap.add_argument("--chunks", type=int, default=64, help="chunks moved per direction")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rss-bytes", type=int, default=(3 << 30) + 5 * 4096 + 1)
    ap.add_argument("--matmul", type=int, default=4096, help="side of the synthetic compute")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("gpu_transfer: CUDA is not available on this machine; nothing to measure")
        return 0
    t_start = time.perf_counter()
    dev = torch.device("cuda")
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(dev), "args": vars(args)}

    # RSS first, before any pinned memory is cached by torch's host allocator
    result["rss"] = measure_rss(args.rss_bytes)
    r = result["rss"]
    print(
        f"rss    requested {r['requested_bytes'] / 2**30:.3f} GiB: kvtier slab "
        f"x{r['kvtier_rss_ratio']:.3f} (pinned={r['kvtier_pinned']}), "
        f"Tensor.pin_memory x{r['pin_memory_rss_ratio']:.3f}; pinning took "
        f"{r['kvtier_pin_seconds_per_gib']:.3f} s/GiB"
    )

    shape = layer_shape(args.layout, args.blocks, args.block_size, args.heads, args.head_dim)
    kv = [
        torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_() for _ in range(args.layers)
    ]
    names = {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(kv)}
    layout = SlotLayout.from_kv_caches(names, args.blocks, args.chunk_blocks)
    slab = HostSlab(layout.slot_bytes * args.chunks, layout, pin=True)
    copier = CudaCopier(kv, layout, slab)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(args.blocks, generator=g).tolist()
    n = args.chunk_blocks
    stores = [StoreOp(i, i, tuple(perm[i * n : (i + 1) * n])) for i in range(args.chunks)]
    loads = [LoadOp(i, i, 0, tuple(perm[i * n : (i + 1) * n])) for i in range(args.chunks)]
    moved = sum(ll.nbytes for ll in layout.layers) * args.chunks  # bytes per direction
    result["bytes_per_direction"] = moved
    result["layer_block_bytes"] = layout.layers[0].nbytes // n

    def kv_d2h() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        copier.begin_saves(stores)
        for li in range(args.layers):
            copier.save_layer(li)
        out = copier.finish_saves()
        dt = time.perf_counter() - t0
        assert out and all(r.ok for r in out)
        return dt

    def kv_h2d() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = copier.begin_loads(loads)
        for li in range(args.layers):
            copier.wait_layer(li)
        out += copier.finish_loads()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        assert out and all(r.ok for r in out)
        return dt

    flat = torch.empty(moved, dtype=torch.uint8, device=dev)
    host_alloc = torch.empty(moved, dtype=torch.uint8, pin_memory=True)
    raw_stream = torch.cuda.Stream()

    def raw(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], float]:
        def run() -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(raw_stream):
                dst.copy_(src, non_blocking=True)
            raw_stream.synchronize()
            return time.perf_counter() - t0

        return run

    slab_bytes = slab.buffer[:moved]
    figures: dict[str, dict[str, float]] = {}
    for name, fn in [
        ("d2h_kvtier", kv_d2h),
        ("d2h_raw_hostalloc", raw(host_alloc, flat)),
        ("d2h_raw_registered", raw(slab_bytes, flat)),
        ("h2d_kvtier", kv_h2d),
        ("h2d_raw_hostalloc", raw(flat, host_alloc)),
        ("h2d_raw_registered", raw(flat, slab_bytes)),
    ]:
        best, med = best_of(fn, args.repeats)
        figures[name] = {"gbps_best": moved / best / GB, "gbps_median": moved / med / GB}
    for d in ("d2h", "h2d"):
        peak = max(
            figures[f"{d}_raw_hostalloc"]["gbps_best"], figures[f"{d}_raw_registered"]["gbps_best"]
        )
        k = figures[f"{d}_kvtier"]["gbps_best"]
        figures[f"{d}_ratio"] = {"kvtier_over_raw_peak": k / peak}
        print(
            f"{d}    {moved / GB:.2f} GB in {args.chunks} chunks x {args.layers} layers: "
            f"kvtier {k:.1f} GB/s, raw pinned peak {peak:.1f} GB/s "
            f"(hostalloc {figures[f'{d}_raw_hostalloc']['gbps_best']:.1f}, registered slab "
            f"{figures[f'{d}_raw_registered']['gbps_best']:.1f}), ratio {k / peak:.3f}"
        )
    result["copy"] = {k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in figures.items()}
    del flat, host_alloc

    result["overlap"] = overlap(copier, loads, stores, args.layers, dev, args.repeats, args.matmul)
    for d, o in result["overlap"].items():
        print(
            f"overlap {d}: compute {o['compute_ms']:.1f} ms, copies {o['copy_ms']:.1f} ms, "
            f"serial {o['serial_ms']:.1f} ms, layer-wise {o['layerwise_ms']:.1f} ms, "
            f"hidden {o['hidden']:.2f}"
        )
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    print("RESULT " + json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    slab.close()
    return 0


def hidden_share(compute_s: float, copy_s: float, layerwise_s: float) -> float:
    """The share (0..1) of the shorter of copy and compute that a layer-wise run hid."""
    return max(0.0, min(1.0, (compute_s + copy_s - layerwise_s) / min(compute_s, copy_s)))


def overlap(
    copier: CudaCopier,
    loads: list[LoadOp],
    stores: list[StoreOp],
    layers: int,
    dev: torch.device,
    repeats: int,
    side: int,
) -> dict[str, dict[str, float]]:
    """Layer loop with loads waited for per layer / saves started per layer."""
    a = torch.randn(side, side, device=dev, dtype=torch.bfloat16) / side**0.5

    def compute(k: int) -> None:
        x = a
        for _ in range(k):
            x = x @ a

    def timed(fn: Callable[[], None]) -> float:
        def run() -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        return best_of(run, repeats)[0]

    def loads_only() -> None:
        copier.begin_loads(loads)
        copier.finish_loads()

    def saves_only() -> None:
        copier.begin_saves(stores)
        for li in range(layers):
            copier.save_layer(li)
        copier.finish_saves()

    # matmuls per layer so that one layer's compute ~ one layer's copy
    one = timed(lambda: compute(10)) / 10
    out: dict[str, dict[str, float]] = {}
    for direction, only in (("h2d", loads_only), ("d2h", saves_only)):
        t_copy = timed(only)
        k = max(1, round(t_copy / layers / one))

        def compute_loop(k: int = k) -> None:
            for _ in range(layers):
                compute(k)

        def serial(k: int = k, only: Callable[[], None] = only) -> None:
            only()
            compute_loop(k)

        def layerwise_h2d(k: int = k) -> None:
            copier.begin_loads(loads)
            for li in range(layers):
                copier.wait_layer(li)
                compute(k)
            copier.finish_loads()

        def layerwise_d2h(k: int = k) -> None:
            copier.begin_saves(stores)
            for li in range(layers):
                compute(k)
                copier.save_layer(li)
            copier.finish_saves()

        t_comp = timed(compute_loop)
        t_serial = timed(serial)
        t_lw = timed(layerwise_h2d if direction == "h2d" else layerwise_d2h)
        out[direction] = {
            "matmuls_per_layer": k,
            "compute_ms": t_comp * 1e3,
            "copy_ms": t_copy * 1e3,
            "serial_ms": t_serial * 1e3,
            "layerwise_ms": t_lw * 1e3,
            "hidden": hidden_share(t_comp, t_copy, t_lw),
        }
    return out


if __name__ == "__main__":
    sys.exit(main())
