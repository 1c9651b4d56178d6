"""Collecting metric observations in a process and shipping them as a plain dict.

The scheduler and each worker record into a :class:`StatsRecorder`; vLLM moves
the dict (``take()``) to the API server's process, where the connector's
Prometheus class replays it onto the metrics defined in :mod:`kvtier.metrics`.
"""

from __future__ import annotations

import threading
from typing import Any

from kvtier.metrics import MetricSpec

StatsData = dict[str, dict[str, Any]]


def series_id(spec: MetricSpec, labels: tuple[str, ...] = ()) -> str:
    """Wire name of one series: the metric's name plus its label values."""
    if len(labels) != len(spec.labels):
        raise ValueError(f"{spec.name} takes labels {spec.labels}, got {labels}")
    return "|".join((spec.name, *labels))


def split_series_id(sid: str) -> tuple[str, tuple[str, ...]]:
    name, *labels = sid.split("|")
    return name, tuple(labels)


class StatsRecorder:
    """Thread-safe counters, gauges and histogram samples since the last ``take()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: StatsData = empty()

    def inc(self, spec: MetricSpec, amount: float = 1, labels: tuple[str, ...] = ()) -> None:
        if amount <= 0:
            return
        sid = series_id(spec, labels)
        with self._lock:
            counters = self._data["counters"]
            counters[sid] = counters.get(sid, 0) + amount

    def observe(self, spec: MetricSpec, value: float, labels: tuple[str, ...] = ()) -> None:
        sid = series_id(spec, labels)
        with self._lock:
            self._data["samples"].setdefault(sid, []).append(float(value))

    def set(self, spec: MetricSpec, value: float, labels: tuple[str, ...] = ()) -> None:
        sid = series_id(spec, labels)
        with self._lock:
            self._data["gauges"][sid] = float(value)

    def take(self) -> StatsData:
        with self._lock:
            data, self._data = self._data, empty()
        return data


def empty() -> StatsData:
    return {"counters": {}, "samples": {}, "gauges": {}}


def is_empty(data: StatsData) -> bool:
    return not (data.get("counters") or data.get("samples") or data.get("gauges"))


def merge(a: StatsData, b: StatsData) -> StatsData:
    """Combine two intervals (or two workers): counters add, samples concatenate,
    gauges take the later value."""
    out = empty()
    for part in (a, b):
        for sid, v in part.get("counters", {}).items():
            out["counters"][sid] = out["counters"].get(sid, 0) + v
        for sid, vs in part.get("samples", {}).items():
            out["samples"].setdefault(sid, []).extend(vs)
        out["gauges"].update(part.get("gauges", {}))
    return out
