"""Reading a server's Prometheus ``/metrics`` for ``kvtier bench``: the text
format, scrapes, counter deltas between two scrapes, hit rates, token sources and
histogram quantiles. Standard library only."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

KVTIER_HIT = "kvtier:hit_tokens_total"
KVTIER_LOOKUP = "kvtier:lookup_tokens_total"
KVTIER_TTFT = "kvtier:ttft_seconds"
VLLM_HIT = "vllm:prefix_cache_hits_total"
VLLM_QUERY = "vllm:prefix_cache_queries_total"
VLLM_EXT_HIT = "vllm:external_prefix_cache_hits_total"
VLLM_EXT_QUERY = "vllm:external_prefix_cache_queries_total"
#: every prompt token by where it came from (vLLM >= 0.32): computed, GPU cache, connector
VLLM_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
OUTCOMES = ("hit", "partial", "miss")


_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')

MetricSample = tuple[str, dict[str, str], float]


def parse_metrics(text: str) -> list[MetricSample]:
    """Parse Prometheus text exposition into (name, labels, value) samples."""
    samples: list[MetricSample] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        name, raw_labels, raw_value = m.groups()
        try:
            value = float(raw_value)
        except ValueError:
            continue
        labels = {
            k: v.replace('\\"', '"').replace("\\\\", "\\")
            for k, v in _LABEL.findall(raw_labels or "")
        }
        samples.append((name, labels, value))
    return samples


@dataclass(slots=True)
class Snapshot:
    """One scrape of ``/metrics``: when, and what it said."""

    t: float
    samples: list[MetricSample] = field(default_factory=list)

    def total(self, name: str, **where: str) -> float | None:
        """Sum over every series of ``name`` (vLLM labels by model and engine) whose labels
        include ``where``; None if absent."""
        vals = [
            v
            for n, labels, v in self.samples
            if n == name and all(labels.get(k) == x for k, x in where.items())
        ]
        return sum(vals) if vals else None

    def has(self, name: str) -> bool:
        """Whether any series of ``name`` (or its histogram parts) is exported."""
        return any(n == name or n.startswith(name + "_") for n, _, _ in self.samples)

    def buckets(self, name: str, label: str) -> dict[str, dict[float, float]]:
        """Histogram ``name`` as {label value: {le: cumulative count}}, summed over other labels."""
        out: dict[str, dict[float, float]] = {}
        for n, labels, v in self.samples:
            if n != name + "_bucket" or "le" not in labels:
                continue
            le = float(labels["le"])  # "+Inf" parses as inf
            per = out.setdefault(labels.get(label, ""), {})
            per[le] = per.get(le, 0.0) + v
        return out


def counter_delta(
    before: Snapshot | None, after: Snapshot | None, name: str, **where: str
) -> float | None:
    """Increase of a counter over the run; a series that appeared mid-run started at 0."""
    if after is None:
        return None
    end = after.total(name, **where)
    if end is None:
        return None
    start = before.total(name, **where) if before is not None else None
    return end - (start or 0.0)


#: where a prompt token came from, as the headline's split shows it
TOKEN_SOURCES = (
    "gpu_prefix_cache",
    "kvtier_host",
    "kvtier_object_tier",
    "other_connector",
    "computed",
)


def token_sources(before: Snapshot | None, after: Snapshot | None) -> dict[str, float] | None:
    """Prompt tokens of the run by source, from vLLM's ``prompt_tokens_by_source`` and
    kvtier's hit counters; None when the server does not export the former."""

    def delta(name: str, **where: str) -> float:
        return counter_delta(before, after, name, **where) or 0.0

    if counter_delta(before, after, VLLM_BY_SOURCE) is None:
        return None
    external = delta(VLLM_BY_SOURCE, source="external_kv_transfer")
    host, remote = delta(KVTIER_HIT, tier="host"), delta(KVTIER_HIT, tier="remote")
    return {
        "gpu_prefix_cache": delta(VLLM_BY_SOURCE, source="local_cache_hit"),
        "kvtier_host": host,
        "kvtier_object_tier": remote,
        "other_connector": max(0.0, external - host - remote),
        "computed": delta(VLLM_BY_SOURCE, source="local_compute"),
    }


def token_shares(sources: dict[str, float] | None) -> dict[str, float] | None:
    """Each source's share of the run's prompt tokens."""
    total = sum(sources.values()) if sources else 0.0
    if not sources or total <= 0:
        return None
    return {k: v / total for k, v in sources.items()}


def hit_rates(before: Snapshot | None, after: Snapshot | None) -> dict[str, float | None]:
    """Every hit rate the server lets us compute, by source."""

    def ratio(hit: str, query: str) -> float | None:
        h, q = counter_delta(before, after, hit), counter_delta(before, after, query)
        if h is None or q is None or q <= 0:
            return None
        return h / q

    shares = token_shares(token_sources(before, after))
    return {
        "any_cache": None if shares is None else 1.0 - shares["computed"],
        "kvtier": ratio(KVTIER_HIT, KVTIER_LOOKUP),
        "vllm_prefix_cache": ratio(VLLM_HIT, VLLM_QUERY),
        "vllm_external": ratio(VLLM_EXT_HIT, VLLM_EXT_QUERY),
    }


#: the headline's meaning, by the key of hit_rates() it was taken from
ANY_CACHE = "share of prompt tokens from any cache (vllm:prompt_tokens_by_source)"


def pick_hit_rate(rates: dict[str, float | None]) -> tuple[float | None, str]:
    """The share of prompt tokens served from any cache (GPU prefix cache, kvtier, another
    connector) when vLLM exports it; else kvtier's own counters (tokens beyond vLLM's
    cache), else vLLM's prefix cache; and which was used."""
    if rates.get("any_cache") is not None:
        return rates["any_cache"], ANY_CACHE
    if rates.get("kvtier") is not None:
        return rates["kvtier"], f"{KVTIER_HIT} / {KVTIER_LOOKUP}"
    if rates.get("vllm_prefix_cache") is not None:
        return rates["vllm_prefix_cache"], f"{VLLM_HIT} / {VLLM_QUERY}"
    return None, "none (no hit counters on /metrics)"


def bucket_delta(
    before: Snapshot | None, after: Snapshot, name: str, label: str
) -> dict[str, list[tuple[float, float]]]:
    """Histogram buckets added during the run: {label value: [(le, cumulative count)]}."""
    end = after.buckets(name, label)
    start = before.buckets(name, label) if before is not None else {}
    out = {}
    for key, per in end.items():
        base = start.get(key, {})
        out[key] = sorted((le, c - base.get(le, 0.0)) for le, c in per.items())
    return out


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus-style quantile: linear interpolation inside the bucket holding rank q."""
    if not buckets:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


def quantile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated quantile of raw samples (numpy's default method)."""
    if not values:
        return None
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
