"""StatsRecorder and Totals: the counters Prometheus and the tests read come from one
increment, and a total that does not exist cannot be read as 0."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvtier import metrics
from kvtier.stats import StatsRecorder, Totals, series_id, total_name


def test_an_increment_feeds_prometheus_and_the_declared_total() -> None:
    totals = Totals(["hit_tokens_host", "lookup_tokens"])
    rec = StatsRecorder(totals)
    rec.inc(metrics.HIT_TOKENS, 96, ("host",))
    rec.inc(metrics.HIT_TOKENS, 32, ("remote",))  # no such total: Prometheus only
    rec.inc(metrics.LOOKUP_TOKENS, 0)  # nothing happened: neither
    data = rec.take()
    assert data["counters"] == {
        series_id(metrics.HIT_TOKENS, ("host",)): 96,
        series_id(metrics.HIT_TOKENS, ("remote",)): 32,
    }
    assert dict(totals) == {"hit_tokens_host": 96, "lookup_tokens": 0}
    rec.inc(metrics.HIT_TOKENS, 4, ("host",))
    assert rec.take()["counters"] == {series_id(metrics.HIT_TOKENS, ("host",)): 4}
    assert totals["hit_tokens_host"] == 100, "totals run since start; take() resets intervals"
    # the recorder builds each series' names once; a wrong label set is still refused
    for record in (rec.inc, rec.observe, rec.set):
        with pytest.raises(ValueError, match="takes labels"):
            record(metrics.HIT_TOKENS, 1, ())


def test_an_undeclared_total_raises_on_every_access() -> None:
    totals = Totals(["store_ok"])
    totals["store_ok"] += 2
    assert totals.get("store_ok", 0) == 2
    for read in (lambda: totals["store_okay"], lambda: totals.get("store_okay", 0)):
        with pytest.raises(KeyError, match="store_okay.*store_ok"):
            read()
    with pytest.raises(KeyError):
        totals["store_okay"] = 1
    assert "store_okay" not in totals and len(totals) == 1


def test_total_names_follow_the_metric_and_its_labels() -> None:
    assert total_name(metrics.HIT_TOKENS, ("remote",)) == "hit_tokens_remote"
    assert total_name(metrics.STORES_SKIPPED) == "stores_skipped"


def _totals_written(source: str) -> tuple[set[str], set[str]]:
    """The names a module writes with ``….totals[name]``: literal names, and the literal
    prefix of names built by an f-string."""
    names: set[str] = set()
    prefixes: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "totals"
        ):
            continue
        key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            names.add(key.value)
        elif isinstance(key, ast.JoinedStr) and isinstance(key.values[0], ast.Constant):
            prefixes.add(str(key.values[0].value))
    return names, prefixes


def test_the_scheduler_declares_every_total_it_writes() -> None:
    """Every name the scheduler side's parts write is declared (a typo is a KeyError the
    unit tests would hit only on that path): the literal names in their source, each
    family an f-string builds over every value it can take, the settled ops, and the
    counters' own names resolve to metrics that exist."""
    from kvtier.connectors.scheduler import ledger, lookup, plans, requests
    from kvtier.connectors.scheduler import side as scheduler
    from kvtier.connectors.scheduler.side import SCHEDULER_TOTALS

    declared = set(SCHEDULER_TOTALS)
    names: set[str] = set()
    prefixes: set[str] = set()
    for module in (scheduler, plans, ledger, lookup, requests):
        found = _totals_written(Path(str(module.__file__)).read_text())
        names |= found[0]
        prefixes |= found[1]
    assert {"write_back", "weights_changes"} <= names  # the walk sees the writes
    assert names <= declared, sorted(names - declared)
    families = {
        "error_": {metrics.error_kind_label(k) for k in metrics.ERROR_KINDS},
        "host_only_": set(requests.HOST_ONLY_REASONS),
    }
    assert prefixes == set(families), prefixes
    for prefix, values in families.items():
        assert {prefix + v for v in values} <= declared, prefix
    assert set(ledger.SETTLED_TOTALS.values()) <= declared
    counter_names = {total_name(spec, ()) for spec in metrics.ALL if spec.kind == "counter"}
    for name in ("lookup_tokens", "evictions", "stores_skipped"):
        assert name in declared and name in counter_names
    assert {"hit_tokens_host", "hit_tokens_remote", "fetch_failed", "error_sealed"} <= declared


def test_observe_many_records_every_sample_of_its_series() -> None:
    rec = StatsRecorder()
    rec.observe(metrics.LOOKUP_DELAY, 0.5, ("sync",))
    rec.observe_many(metrics.LOOKUP_DELAY, (1, 0.25), ("sync",))
    rec.observe_many(metrics.LOOKUP_DELAY, [], ("async",))
    samples = rec.take()["samples"]
    assert samples == {
        series_id(metrics.LOOKUP_DELAY, ("sync",)): [0.5, 1.0, 0.25],
        series_id(metrics.LOOKUP_DELAY, ("async",)): [],
    }
    with pytest.raises(ValueError, match="takes labels"):
        rec.observe_many(metrics.LOOKUP_DELAY, [1.0], ())


@pytest.mark.parametrize("spec", metrics.ALL, ids=lambda s: s.name)
def test_every_label_of_every_metric_has_its_values(spec: metrics.MetricSpec) -> None:
    """vLLM's metrics are built up front from these (connectors/stats.py): a label with no
    declared values stopped every engine at its start."""
    for label in spec.labels:
        values = metrics.label_values(spec, label)
        assert values and all(isinstance(v, str) for v in values), (spec.name, label)
