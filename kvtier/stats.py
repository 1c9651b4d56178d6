"""Collecting metric observations in a process and shipping them as a plain dict.

The scheduler and each worker record into a :class:`StatsRecorder`; vLLM moves
the dict (``take()``) to the API server's process, where the connector's
Prometheus class replays it onto the metrics defined in :mod:`kvtier.metrics`.

A recorder may also keep :class:`Totals`: running totals since start, by name,
fed by the very increments that go to Prometheus (``kvtier:hit_tokens_total``
with ``tier="host"`` is the total ``hit_tokens_host``), for tests and
introspection. Their names are declared up front, so reading or writing a name
that does not exist fails instead of quietly reading 0.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from kvtier.metrics import PREFIX, MetricSpec

StatsData = dict[str, dict[str, Any]]


def series_id(spec: MetricSpec, labels: tuple[str, ...] = ()) -> str:
    """Wire name of one series: the metric's name plus its label values."""
    if len(labels) != len(spec.labels):
        raise ValueError(f"{spec.name} takes labels {spec.labels}, got {labels}")
    return "|".join((spec.name, *labels))


def split_series_id(sid: str) -> tuple[str, tuple[str, ...]]:
    name, *labels = sid.split("|")
    return name, tuple(labels)


def total_name(spec: MetricSpec, labels: tuple[str, ...] = ()) -> str:
    """The :class:`Totals` name of one counter series: ``kvtier:hit_tokens`` with
    ``("host",)`` is ``hit_tokens_host``."""
    return "_".join((spec.name.removeprefix(PREFIX), *labels))


class Totals(Mapping[str, int]):
    """Running totals since start under names declared up front (not thread-safe:
    the owner serialises access)."""

    def __init__(self, names: Iterable[str]) -> None:
        self._values = dict.fromkeys(names, 0)

    def __getitem__(self, name: str) -> int:
        value = self._values.get(name)
        if value is None:
            raise self._undeclared(name)
        return value

    def __setitem__(self, name: str, value: int) -> None:
        if name not in self._values:
            raise self._undeclared(name)
        self._values[name] = value

    def _undeclared(self, name: str) -> KeyError:
        return KeyError(f"no total named {name!r}; totals are {sorted(self._values)}")

    def __contains__(self, name: object) -> bool:
        return name in self._values  # (Mapping's would build a KeyError per miss)

    def get(self, name: str, default: object = None) -> int:
        """The total; an undeclared name raises even here (``.get(name, 0)`` on a
        renamed total must fail, not read 0)."""
        return self[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Totals({self._values})"


class StatsRecorder:
    """Thread-safe counters, gauges and histogram samples since the last ``take()``;
    with ``totals``, every counter increment whose :func:`total_name` is declared
    there is added to it too."""

    def __init__(self, totals: Totals | None = None) -> None:
        self._lock = threading.Lock()
        self._data: StatsData = empty()
        self.totals = totals
        # (metric, labels) -> (series id, its declared total or None): the scheduler
        # records per chunk and per lookup, so each name is built and checked once
        self._names: dict[tuple[str, tuple[str, ...]], tuple[str, str | None]] = {}

    def _series(self, spec: MetricSpec, labels: tuple[str, ...]) -> tuple[str, str | None]:
        names = self._names.get((spec.name, labels))
        if names is None:
            total = total_name(spec, labels)
            declared = self.totals is not None and total in self.totals
            names = self._names[(spec.name, labels)] = (
                series_id(spec, labels),
                total if declared else None,
            )
        return names

    def inc(self, spec: MetricSpec, amount: float = 1, labels: tuple[str, ...] = ()) -> None:
        if amount <= 0:
            return
        sid, total = self._series(spec, labels)
        with self._lock:
            counters = self._data["counters"]
            counters[sid] = counters.get(sid, 0) + amount
            if total is not None and self.totals is not None:
                self.totals[total] += int(amount)

    def observe(self, spec: MetricSpec, value: float, labels: tuple[str, ...] = ()) -> None:
        sid = self._series(spec, labels)[0]
        with self._lock:
            self._data["samples"].setdefault(sid, []).append(float(value))

    def observe_many(
        self, spec: MetricSpec, values: Iterable[float], labels: tuple[str, ...] = ()
    ) -> None:
        """Several samples of one series at once (what a caller buffered)."""
        sid = self._series(spec, labels)[0]
        with self._lock:
            self._data["samples"].setdefault(sid, []).extend(map(float, values))

    def set(self, spec: MetricSpec, value: float, labels: tuple[str, ...] = ()) -> None:
        sid = self._series(spec, labels)[0]
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
