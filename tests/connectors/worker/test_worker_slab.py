"""The worker allocates its host slab at startup when ``cpu_bytes`` gives its size, so a
restarted engine's first request does not wait while gigabytes of host memory are
committed (or pinned); with ``"auto"`` (sized by the scheduler) on the first step."""

from __future__ import annotations

import torch
from copyfakes import make_caches

from kvtier.config import load_config
from kvtier.connectors.metadata import KVTierMetadata, LoadOp, StoreOp
from kvtier.connectors.worker.side import WorkerSide
from kvtier.keys import Namespace

NUM_BLOCKS, BS, BPC = 16, 32, 2
KV_FIRST = (2, NUM_BLOCKS, BS, 2, 8)


def worker(cpu_bytes: str) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    cfg = load_config({"cpu_bytes": cpu_bytes, "chunk_size": BPC * BS}, environ={})
    ns = Namespace("m", None, "bfloat16", "auto", BS, BPC * BS, 1)
    w = WorkerSide(cfg, ns, NUM_BLOCKS)
    caches = make_caches(KV_FIRST)
    w.register_kv_caches(caches, rank=0)
    return w, caches


def test_explicit_size_allocates_at_startup_and_keeps_it() -> None:
    w, caches = worker("8MiB")
    slab = w.slab
    assert slab is not None and slab.nbytes == 8 << 20 and w.copier is not None
    assert slab.committed  # before the engine serves
    first = next(iter(caches.values()))
    first[:, 3].fill_(1.5)
    meta = KVTierMetadata(step=1, host_bytes=8 << 20, stores=[StoreOp(1, 0, [3, 4], b"h")])
    w.start_load_kv(meta)
    w.wait_for_save(meta)
    assert w.slab is slab  # the scheduler's size: the startup slab serves
    first[:, 3].zero_()
    load = KVTierMetadata(step=2, host_bytes=8 << 20, loads=[LoadOp(2, 0, 0, [3])])
    w.start_load_kv(load)
    w.wait_for_save(load)
    assert w.build_worker_meta().results == {1: [True], 2: [True]}
    assert bool((first[:, 3] == 1.5).all())


def test_slab_sized_otherwise_by_the_scheduler_is_allocated_again() -> None:
    w, _ = worker("8MiB")
    assert w.slab is not None
    meta = KVTierMetadata(step=1, host_bytes=w.layout.slot_bytes * 3)
    w.start_load_kv(meta)
    assert w.slab is not None and w.slab.nbytes == w.layout.slot_bytes * 3
    assert w.copier is not None and w.copier.slab is w.slab


def test_auto_size_allocates_on_the_first_step() -> None:
    w, _ = worker("auto")
    assert w.slab is None and w.copier is None
    w.start_load_kv(KVTierMetadata(step=1, host_bytes=w.layout.slot_bytes * 2))
    assert w.slab is not None and w.slab.nbytes == w.layout.slot_bytes * 2
