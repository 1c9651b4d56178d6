"""kvtier's figures on vLLM's own ``/metrics``, through vLLM's connector stats path.

``KVTierStats`` carries one interval's observations from the scheduler and
the workers to the API server process; ``KVTierPromMetrics`` replays them onto
the metrics that :mod:`kvtier.metrics` defines, with vLLM's own labels first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from prometheus_client import Counter, Gauge, Histogram
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvtier import metrics, stats


@dataclass
class KVTierStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.data = stats.empty()

    def reset(self) -> None:
        self.data = stats.empty()

    def aggregate(self, other: KVConnectorStats) -> KVTierStats:
        return KVTierStats(data=stats.merge(self.data, other.data))

    def reduce(self) -> dict[str, int | float]:
        """One line for vLLM's periodic log: counters summed per metric."""
        out: dict[str, int | float] = {}
        for sid, value in self.data.get("counters", {}).items():
            name, labels = stats.split_series_id(sid)
            short = name.removeprefix(metrics.PREFIX) + ("_" + "_".join(labels) if labels else "")
            out[short] = out.get(short, 0) + value
        return out

    def is_empty(self) -> bool:
        return stats.is_empty(self.data)


class KVTierPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        for spec in metrics.ALL:
            names = [*labelnames, *spec.labels]
            # vLLM's wrappers of prometheus-client classes take these keyword arguments
            counter, gauge, histogram = (
                cast(Any, metric_types[c]) for c in (Counter, Gauge, Histogram)
            )
            if spec.kind == "counter":
                m = counter(name=spec.name, documentation=spec.help, labelnames=names)
            elif spec.kind == "gauge":
                m = gauge(
                    name=spec.name,
                    documentation=spec.help,
                    labelnames=names,
                    multiprocess_mode="mostrecent",
                )
            else:
                m = histogram(
                    name=spec.name,
                    documentation=spec.help,
                    labelnames=names,
                    buckets=list(spec.buckets),
                )
            self._metrics[spec.name] = m
            # create every labelled child up front so dashboards see zeros, not gaps
            for engine_values in per_engine_labelvalues.values():
                for labels in _label_sets(spec):
                    m.labels(*engine_values, *labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine_values = self.per_engine_labelvalues[engine_idx]
        for sid, value in transfer_stats_data.get("counters", {}).items():
            name, labels = stats.split_series_id(sid)
            self._metrics[name].labels(*engine_values, *labels).inc(value)
        for sid, values in transfer_stats_data.get("samples", {}).items():
            name, labels = stats.split_series_id(sid)
            child = self._metrics[name].labels(*engine_values, *labels)
            for v in values:
                child.observe(v)
        for sid, value in transfer_stats_data.get("gauges", {}).items():
            name, labels = stats.split_series_id(sid)
            self._metrics[name].labels(*engine_values, *labels).set(value)


def _label_sets(spec: metrics.MetricSpec) -> list[tuple[str, ...]]:
    sets: list[tuple[str, ...]] = [()]
    for label in spec.labels:
        sets = [(*s, v) for s in sets for v in metrics.label_values(spec, label)]
    return sets


__all__ = ["KVTierStats", "KVTierPromMetrics"]
