"""The worker exports what RemoteIO counts about the object tier: stuck calls and seals."""

from __future__ import annotations

import threading

from faketier import DT, SHAPE, SIZE, FakeTier, collect, make_rio, payload, until

from kvtier import metrics
from kvtier.config import load_config
from kvtier.connectors.worker.side import WorkerSide
from kvtier.keys import Namespace
from kvtier.objects import codec
from kvtier.objects.health import ConstantBackoff
from kvtier.objects.sealing import Sealer
from kvtier.stats import series_id


def test_worker_reports_stuck_reads_and_seals() -> None:
    cfg = load_config({"cpu_bytes": "64MiB", "chunk_size": 128}, environ={})
    w = WorkerSide(cfg, Namespace("m", None, "bfloat16", "auto", 32, 128, 1), 40)
    tier = FakeTier()
    tier.hold["s"] = threading.Event()
    rio = make_rio(
        tier,
        timeout_s=0.05,
        backoff=ConstantBackoff(60),
        signer=codec.Signer(sealer=Sealer(bytes(32))),
    )
    w.remote = rio
    for i in range(3):  # one chunk stored three times: sealed once
        assert rio.submit_put(i, "c", payload(1), dtype=DT, shape=SHAPE)
        collect(rio, 1)
    rio.submit_get_into(9, "s", memoryview(bytearray(SIZE)), dtype=DT, shape=SHAPE)
    until(lambda: "s" in tier.entered, "the read to begin")
    until(lambda: rio.stuck_reads == 1 or bool(rio.poll()), "the read to be stuck")
    w.build_worker_meta()
    data = w.get_stats()
    assert data["counters"][series_id(metrics.SEALS)] == 1
    assert data["gauges"][series_id(metrics.STUCK_OPS, ("read",))] == 1
    assert data["gauges"][series_id(metrics.STUCK_OPS, ("write",))] == 0
    w.build_worker_meta()
    assert series_id(metrics.SEALS) not in w.get_stats()["counters"]  # counted once
    tier.hold["s"].set()
    rio.close()


def test_worker_reports_reads_down_while_every_read_thread_is_stuck() -> None:
    """With its one read thread stuck in a hung call, the worker tells the scheduler that
    reads are down for at least the lookup deadline (no new lookup goes out meanwhile),
    though no read has failed yet, and up again once the call returns."""
    cfg = load_config({"cpu_bytes": "64MiB", "chunk_size": 128}, environ={})
    w = WorkerSide(cfg, Namespace("m", None, "bfloat16", "auto", 32, 128, 1), 40)
    tier = FakeTier()
    tier.hold["s"] = threading.Event()
    rio = make_rio(tier, timeout_s=0.05)
    w.remote = rio
    assert w.build_worker_meta().reads_down_s == 0.0
    rio.submit_get_into(9, "s", memoryview(bytearray(SIZE)), dtype=DT, shape=SHAPE)
    until(lambda: "s" in tier.entered, "the read to begin")
    until(lambda: rio.stuck_reads == 1 or bool(rio.poll()), "the read to be stuck")
    assert w.build_worker_meta().reads_down_s >= 0.05
    tier.hold["s"].set()
    until(lambda: rio.stuck_reads == 0 or bool(rio.poll()), "the read to return")
    rio.poll()
    assert w.build_worker_meta().reads_down_s == 0.0
    rio.close()
