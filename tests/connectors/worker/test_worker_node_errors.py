"""The worker exports a Redis Cluster tier's per-node failures as kvtier:node_errors{node}."""

from __future__ import annotations

from faketier import FakeTier, make_rio

from kvtier import metrics
from kvtier.config import load_config
from kvtier.connectors.worker.side import WorkerSide
from kvtier.keys import Namespace
from kvtier.stats import series_id


class NodeFailingTier(FakeTier):
    def __init__(self) -> None:
        super().__init__()
        self.pending = {"10.0.0.7:6379": 3, "other": 1}

    def take_node_errors(self) -> dict[str, int]:
        taken, self.pending = self.pending, {}
        return taken


def test_worker_reports_node_errors_once() -> None:
    cfg = load_config({"cpu_bytes": "64MiB", "chunk_size": 128}, environ={})
    w = WorkerSide(cfg, Namespace("m", None, "bfloat16", "auto", 32, 128, 1), 40)
    rio = make_rio(NodeFailingTier())
    w.remote = rio
    w.build_worker_meta()
    counters = w.get_stats()["counters"]
    assert counters[series_id(metrics.NODE_ERRORS, ("10.0.0.7:6379",))] == 3
    assert counters[series_id(metrics.NODE_ERRORS, ("other",))] == 1
    w.build_worker_meta()
    assert not any(s.startswith(metrics.NODE_ERRORS.name) for s in w.get_stats()["counters"])
    rio.close()


def test_node_label_values_are_addresses() -> None:
    """Known only at run time: only "other" is created up front (the series exists at 0
    before any node fails), any host:port is allowed."""
    values = metrics.LABEL_VALUES["node"]
    assert list(values) == ["other"]
    assert "10.0.0.7:6379" in values and "[::1]:7000" in values and "other" in values
    assert "a|b" not in values and "" not in values and "10.0.0.7" not in values
