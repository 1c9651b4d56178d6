"""The worker exports what RemoteIO counts about compression: bytes before and after it,
and the seconds its I/O threads spent on it, by direction."""

from __future__ import annotations

import torch
from faketier import FakeTier, collect, make_rio

from kvtier import metrics
from kvtier.config import load_config
from kvtier.connectors.worker.side import WorkerSide
from kvtier.keys import Namespace
from kvtier.objects.compress import Compressor
from kvtier.stats import series_id

N = 16384  # bf16 elements


def test_worker_reports_compression_bytes_and_seconds() -> None:
    cfg = load_config({"cpu_bytes": "64MiB", "chunk_size": 128}, environ={})
    w = WorkerSide(cfg, Namespace("m", None, "bfloat16", "auto", 32, 128, 1), 40)
    rio = make_rio(FakeTier(), compressor=Compressor())
    w.remote = rio
    kv = torch.randn(N, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    data = kv.view(torch.uint8).numpy().tobytes()
    assert rio.submit_put(1, "c", memoryview(data), dtype="bfloat16", shape=[N])
    assert collect(rio, 1)[1].ok
    slot = memoryview(bytearray(len(data)))
    rio.submit_get_into(2, "c", slot, dtype="bfloat16", shape=[N])
    assert collect(rio, 1)[2].ok and bytes(slot) == data
    w.build_worker_meta()
    counters = w.get_stats()["counters"]
    for d in ("write", "read"):
        raw = counters[series_id(metrics.COMPRESS_RAW_BYTES, (d,))]
        stored = counters[series_id(metrics.COMPRESS_STORED_BYTES, (d,))]
        assert raw == len(data) and 0 < stored < 0.9 * raw, (d, raw, stored)
        assert counters[series_id(metrics.COMPRESS_SECONDS, (d,))] > 0
    w.build_worker_meta()
    assert series_id(metrics.COMPRESS_RAW_BYTES, ("read",)) not in w.get_stats()["counters"]
    rio.close()
