"""The Grafana dashboard and Prometheus rules in deploy/, against kvtier.metrics and Prometheus.

Why: a dashboard query with a typo'd metric name shows "No data" forever and an
alert on a renamed series never fires; neither fails anywhere else. So every
metric name in a panel or rule must be one kvtier defines, a vLLM metric on the
allowlist below (itself checked against the installed vLLM's source) or a
recording rule; every kvtier metric must be on the dashboard; and every
expression must actually evaluate in Prometheus against series shaped exactly
like the ones vLLM and kvtier export.

Needs Debian's ``prometheus`` and ``promtool`` on PATH (a missing one fails,
never skips). The live test starts its own Prometheus on a free loopback port
and stops it in the fixture; the module takes about 10 s.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import math
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kit import free_port

from kvtier.metrics import ALL, exported_names

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvtier.json"
RULES = ROOT / "deploy" / "prometheus" / "kvtier-rules.yaml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "kvtier-rules.test.yaml"

#: vLLM metrics the dashboard and rules may use, as exported (counters with ``_total``).
VLLM_ALLOWLIST = frozenset(
    {
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_to_first_token_seconds_count",
        "vllm:time_to_first_token_seconds_sum",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_cached_by_source_total",
    }
)

#: the label filter every dashboard selector must carry
FILTERS = ('model_name=~"$model_name"', 'instance=~"$instance"')

#: alerts an operator is promised (README, issue 5); each needs a firing and a quiet test
REQUIRED_ALERTS = (
    "KVTierHitRateNearZero",
    "KVTierAsyncLookupSlow",
    "KVTierRemoteErrors",
    "KVTierHostEvictionsHigh",
)

# ---------------------------------------------------------------------------
# PromQL metric-name extraction
# ---------------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(
    r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE
)
_TEMPLATE_VAR = re.compile(r"\$\{?\w+\}?")
_TOKEN = re.compile(r"(?P<num>\d[\w.]*|\.\d[\w.]*)|(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)|\S")
#: binary and set operators, modifiers, and the aggregation operators: after
#: `sum by (le) (...)` loses its grouping list, `sum` stands before `by`, not before `(`
_KEYWORDS = frozenset(
    """
    and or unless bool offset atan2 by without on ignoring group_left group_right inf nan
    sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk
    limit_ratio
    """.split()
)
_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(?P<expr>.*),)?\s*(?P<label>\w+)\s*\)\s*$")


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads: identifiers that are not labels or functions."""
    if "__name__" in expr:
        raise ValueError(f"selector by __name__ is not supported here: {expr!r}")
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(r" \1 ", text)
    text = _TEMPLATE_VAR.sub(" ", text)
    names: set[str] = set()
    tokens = list(_TOKEN.finditer(text))
    for i, tok in enumerate(tokens):
        ident = tok.group("ident")
        if ident is None or ident.lower() in _KEYWORDS:
            continue
        following = tokens[i + 1].group() if i + 1 < len(tokens) else ""
        if following == "(":  # a function call
            continue
        names.add(ident)
    return names


def template_query_expr(query: str) -> str:
    """The PromQL selector inside a Grafana ``label_values(selector, label)`` query."""
    m = _LABEL_VALUES.match(query)
    if m is None:
        raise ValueError(f"not a label_values() query: {query!r}")
    return m.group("expr") or ""


def grafana_to_promql(expr: str) -> str:
    """What Grafana sends for 'All' selected: variables become ``.*``, intervals ``1m``."""
    expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m")
    expr = expr.replace("$__range", "1m")
    return _TEMPLATE_VAR.sub(".*", expr)


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        (
            "histogram_quantile(0.99, sum by (le, outcome) (rate(kvtier:ttft_seconds_bucket"
            '{model_name=~"$model_name", outcome="miss"}[$__rate_interval])))',
            {"kvtier:ttft_seconds_bucket"},
        ),
        (
            'sum by (tier) (rate(a_total{x="y z", w=~"b_total|c"}[5m])) / ignoring (tier) '
            "group_left sum(rate(b_total[5m] offset 1h)) > bool 0.5e3 and on (model_name) c:d",
            {"a_total", "b_total", "c:d"},
        ),
        ("sum(rate(x_total[5m])) by (le, instance) or vector(0) * 1e-3", {"x_total"}),
        ("max_over_time(up[10m:1m]) unless absent(nan_metric) > Inf", {"up", "nan_metric"}),
        ('count(sum without (engine) (g{a="rate(h)"}))', {"g"}),
    ],
)
def test_metric_name_extractor(expr: str, expected: set[str]) -> None:
    """The extractor must find metrics and nothing else, or the name checks below mean little."""
    assert metric_names(expr) == expected


def test_template_query_parser() -> None:
    """label_values(selector, label) yields its selector; the label is no metric name."""
    q = 'label_values(vllm:x_count{model_name=~"$model_name"}, instance)'
    assert metric_names(template_query_expr(q)) == {"vllm:x_count"}
    assert template_query_expr("label_values(instance)") == ""


# ---------------------------------------------------------------------------
# Loading the two files
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PanelQuery:
    panel: str
    ref_id: str
    expr: str


def load_dashboard() -> dict[str, Any]:
    """The dashboard JSON (fails the test if it does not parse)."""
    return json.loads(DASHBOARD.read_text())


def iter_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """All panels, including those nested in collapsed rows."""
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))


def panel_queries(dash: dict[str, Any]) -> list[PanelQuery]:
    """Every PromQL target of every panel."""
    out = []
    for panel in iter_panels(dash["panels"]):
        for target in panel.get("targets", []):
            out.append(PanelQuery(panel["title"], target["refId"], target["expr"]))
    return out


def template_vars(dash: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dash["templating"]["list"]}


def variable_query(var: dict[str, Any]) -> str:
    q = var["query"]
    return q["query"] if isinstance(q, dict) else q


def load_rules() -> list[dict[str, Any]]:
    """All rules of all groups in the rule file."""
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def recording_names() -> set[str]:
    return {r["record"] for r in load_rules() if "record" in r}


def known_names() -> set[str]:
    kvtier = {n for spec in ALL for n in exported_names(spec)}
    return kvtier | VLLM_ALLOWLIST | recording_names()


def require_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"`{name}` is not on PATH: these tests run the real Prometheus tools. "
            "Install Debian's packages with `apt-get install -y prometheus` "
            "(it ships both prometheus and promtool).",
            pytrace=False,
        )
    return path


# ---------------------------------------------------------------------------
# Static checks
# ---------------------------------------------------------------------------


def test_promtool_check_rules() -> None:
    """The rule file is valid: YAML, PromQL, templates in annotations."""
    promtool = require_binary("promtool")
    res = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_test_rules() -> None:
    """Each alert fires on synthetic series that should fire it and stays quiet on the rest."""
    promtool = require_binary("promtool")
    res = subprocess.run(
        [promtool, "test", "rules", RULES_TEST.name],
        cwd=RULES_TEST.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_rule_tests_cover_every_alert_firing_and_quiet() -> None:
    """An alert without a firing case and a quiet case is untested in one direction."""
    doc = yaml.safe_load(RULES_TEST.read_text())
    assert doc["rule_files"] == [RULES.name]
    firing: set[str] = set()
    quiet: set[str] = set()
    for test in doc["tests"]:
        for case in test.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    alerts = {r["alert"] for r in load_rules() if "alert" in r}
    assert alerts - firing == set(), "alerts never shown firing"
    assert alerts - quiet == set(), "alerts never shown quiet"


def test_every_error_kind_is_alerted_on() -> None:
    """Each error kind kvtier counts reaches an alert: object-tier kinds through
    KVTierRemoteErrors' ``kind=~`` list, host-copy failures through KVTierLoadErrors. A kind
    added to kvtier.metrics and not here would count errors nobody is told about."""
    from kvtier.metrics import ERROR_KINDS

    alerts = {r["alert"]: r for r in load_rules() if "alert" in r}
    m = re.search(r'kind=~"([^"]+)"', alerts["KVTierRemoteErrors"]["expr"])
    assert m, "KVTierRemoteErrors selects its kinds with kind=~"
    remote = set(m.group(1).split("|"))
    assert remote <= set(ERROR_KINDS), remote - set(ERROR_KINDS)
    assert 'kind="load"' in alerts["KVTierLoadErrors"]["expr"]
    assert set(ERROR_KINDS) - remote == {"load"}, set(ERROR_KINDS) - remote
    alerts_doc = (ROOT / "docs" / "metrics.md").read_text()
    row = next(line for line in alerts_doc.splitlines() if "`KVTierRemoteErrors`" in line)
    assert all(kind in row for kind in remote), "docs/metrics.md's alert table lists every kind"


def test_rules_structure() -> None:
    """Alerts carry severity, summary and description; thresholds are listed up top."""
    rules = load_rules()
    alerts = {r["alert"]: r for r in rules if "alert" in r}
    assert set(REQUIRED_ALERTS) <= alerts.keys()
    header = RULES.read_text().split("groups:", 1)[0]
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, name
        assert rule.get("for"), f"{name}: an alert without `for` pages on one bad scrape"
        assert len(rule["annotations"]["summary"]) > 20, name
        assert "Check next" in rule["annotations"]["description"], name
        assert name in header, f"{name}: threshold not listed in the header comment"
    assert len(recording_names()) == len([r for r in rules if "record" in r]), "duplicate record"


def test_dashboard_structure() -> None:
    """uid, schema, variables, and the three meters as the first panels."""
    dash = load_dashboard()
    assert dash["uid"] == "kvtier"
    assert 36 <= dash["schemaVersion"] <= 41
    variables = template_vars(dash)
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("model_name", "instance"):
        var = variables[name]
        assert var["type"] == "query"
        assert var["datasource"]["uid"] == "${datasource}"
        m = _LABEL_VALUES.match(variable_query(var))
        assert m is not None and m.group("label") == name
    graphs = [p for p in iter_panels(dash["panels"]) if p["type"] != "row"]
    top = [p["title"] for p in graphs[:3]]
    assert "hit rate" in top[0].lower()
    assert "first token" in top[1].lower()
    assert "miss tail" in top[2].lower()
    assert all(p["gridPos"]["y"] <= 1 for p in graphs[:3]), "the three meters belong on top"
    ids = [p["id"] for p in iter_panels(dash["panels"])]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for panel in graphs:
        assert len(panel.get("description", "")) > 80, f"{panel['title']}: say how to read it"
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]


def test_every_selector_filters_by_model_and_instance() -> None:
    """Every metric a panel reads is filtered by both template variables."""
    for q in panel_queries(load_dashboard()):
        for name in metric_names(q.expr):
            pattern = rf"(?<![\w:]){re.escape(name)}(?![\w:])(\{{[^{{}}]*\}})?"
            for m in re.finditer(pattern, q.expr):
                matchers = m.group(1) or ""
                for f in FILTERS:
                    assert f in matchers, f"{q.panel} {q.ref_id}: {name} lacks {f}"


def unknown_names(dash: dict[str, Any], rules: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Names each panel, variable or rule reads that are not kvtier, allowlisted or recorded."""
    known = known_names()
    used: dict[str, set[str]] = {}
    for q in panel_queries(dash):
        used[f"panel {q.panel!r} {q.ref_id}"] = metric_names(q.expr)
    for name, var in template_vars(dash).items():
        if var["type"] == "query":
            used[f"variable {name}"] = metric_names(template_query_expr(variable_query(var)))
    for rule in rules:
        used[f"rule {rule.get('record') or rule.get('alert')}"] = metric_names(rule["expr"])
    assert all(used.values()), "an expression that reads no metric"
    return {where: names - known for where, names in used.items() if names - known}


def test_every_name_is_known() -> None:
    """No panel, variable or rule reads a metric that kvtier/vLLM do not export."""
    assert unknown_names(load_dashboard(), load_rules()) == {}


def test_name_check_catches_a_typo() -> None:
    """The name check is not vacuous: a misspelt name in a panel and in a rule is reported."""
    dash = load_dashboard()
    target = next(p for p in iter_panels(dash["panels"]) if p.get("targets"))["targets"][0]
    assert "kvtier:hit_tokens_total" in target["expr"]
    target["expr"] = target["expr"].replace("kvtier:hit_tokens_total", "kvtier:hit_tokens")
    rules = load_rules()
    assert "kvtier:lookup_tokens_total" in rules[0]["expr"]
    rules[0]["expr"] = rules[0]["expr"].replace("lookup_tokens_total", "lookup_token_total")
    found = {frozenset(v) for v in unknown_names(dash, rules).values()}
    assert found == {frozenset({"kvtier:hit_tokens"}), frozenset({"kvtier:lookup_token_total"})}


def test_every_kvtier_metric_is_on_the_dashboard() -> None:
    """A metric nobody sees is either dead code or a missing panel."""
    on_dashboard: set[str] = set()
    for q in panel_queries(load_dashboard()):
        on_dashboard |= metric_names(q.expr)
    missing = [s.name for s in ALL if not set(exported_names(s)) & on_dashboard]
    assert missing == []


def test_vllm_allowlist_matches_installed_vllm() -> None:
    """The allowlisted vLLM names are what the installed vLLM really registers."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin, "vLLM is not installed in this environment"
    source = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    for name in VLLM_ALLOWLIST:
        base = re.sub(r"_(total|bucket|count|sum)$", "", name)
        assert f'name="{base}"' in source, f"{base} is not registered by vLLM's loggers.py"


# ---------------------------------------------------------------------------
# Live: a real Prometheus scraping vLLM/kvtier-shaped series
# ---------------------------------------------------------------------------

#: What the API server's /metrics shows with kvtier loaded, one engine, model "tiny-llama":
#: vLLM puts model_name and engine first. Counter and histogram values are per scrape and
#: grow with every scrape (so rates are non-zero); gauges stay put.
EXPOSITION = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{model_name="tiny-llama",engine="0"} 8192
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{model_name="tiny-llama",engine="0"} 2048
# HELP vllm:prompt_tokens_cached_by_source_total Prefix-cache hit tokens by the cache tier.
# TYPE vllm:prompt_tokens_cached_by_source_total counter
vllm:prompt_tokens_cached_by_source_total{model_name="tiny-llama",engine="0",source="device"} 2048
vllm:prompt_tokens_cached_by_source_total{model_name="tiny-llama",engine="0",source="host"} 3072
vllm:prompt_tokens_cached_by_source_total{model_name="tiny-llama",engine="0",source="p2p"} 0
vllm:prompt_tokens_cached_by_source_total{model_name="tiny-llama",engine="0",source="disk"} 0
vllm:prompt_tokens_cached_by_source_total{model_name="tiny-llama",engine="0",source="external_unspecified"} 1024
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{model_name="tiny-llama",engine="0",le="0.04"} 1
vllm:time_to_first_token_seconds_bucket{model_name="tiny-llama",engine="0",le="0.1"} 5
vllm:time_to_first_token_seconds_bucket{model_name="tiny-llama",engine="0",le="0.25"} 7
vllm:time_to_first_token_seconds_bucket{model_name="tiny-llama",engine="0",le="1.0"} 8
vllm:time_to_first_token_seconds_bucket{model_name="tiny-llama",engine="0",le="+Inf"} 8
vllm:time_to_first_token_seconds_count{model_name="tiny-llama",engine="0"} 8
vllm:time_to_first_token_seconds_sum{model_name="tiny-llama",engine="0"} 1.1
# HELP kvtier:lookup_tokens_total Prompt tokens kvtier was asked about.
# TYPE kvtier:lookup_tokens_total counter
kvtier:lookup_tokens_total{model_name="tiny-llama",engine="0"} 6144
# HELP kvtier:hit_tokens_total Prompt tokens served from kvtier, by tier.
# TYPE kvtier:hit_tokens_total counter
kvtier:hit_tokens_total{model_name="tiny-llama",engine="0",tier="host"} 3072
kvtier:hit_tokens_total{model_name="tiny-llama",engine="0",tier="remote"} 1024
# HELP kvtier:ttft_seconds Time from arrival to the end of prefill, by kvtier outcome.
# TYPE kvtier:ttft_seconds histogram
kvtier:ttft_seconds_bucket{model_name="tiny-llama",engine="0",outcome="hit",le="0.04"} 1
kvtier:ttft_seconds_bucket{model_name="tiny-llama",engine="0",outcome="hit",le="0.1"} 4
kvtier:ttft_seconds_bucket{model_name="tiny-llama",engine="0",outcome="hit",le="+Inf"} 4
kvtier:ttft_seconds_count{model_name="tiny-llama",engine="0",outcome="hit"} 4
kvtier:ttft_seconds_sum{model_name="tiny-llama",engine="0",outcome="hit"} 0.2
kvtier:ttft_seconds_bucket{model_name="tiny-llama",engine="0",outcome="partial",le="0.04"} 0
kvtier:ttft_seconds_bucket{model_name="tiny-llama",engine="0",outcome="partial",le="0.1"} 1
kvtier:ttft_seconds_bucket{model_name="tiny-llama",engine="0",outcome="partial",le="+Inf"} 1
kvtier:ttft_seconds_count{model_name="tiny-llama",engine="0",outcome="partial"} 1
kvtier:ttft_seconds_sum{model_name="tiny-llama",engine="0",outcome="partial"} 0.07
kvtier:ttft_seconds_bucket{model_name="tiny-llama",engine="0",outcome="miss",le="0.04"} 0
kvtier:ttft_seconds_bucket{model_name="tiny-llama",engine="0",outcome="miss",le="0.1"} 0
kvtier:ttft_seconds_bucket{model_name="tiny-llama",engine="0",outcome="miss",le="0.25"} 2
kvtier:ttft_seconds_bucket{model_name="tiny-llama",engine="0",outcome="miss",le="1.0"} 3
kvtier:ttft_seconds_bucket{model_name="tiny-llama",engine="0",outcome="miss",le="+Inf"} 3
kvtier:ttft_seconds_count{model_name="tiny-llama",engine="0",outcome="miss"} 3
kvtier:ttft_seconds_sum{model_name="tiny-llama",engine="0",outcome="miss"} 0.83
# HELP kvtier:lookup_delay_seconds Lookup delay, sync and async.
# TYPE kvtier:lookup_delay_seconds histogram
kvtier:lookup_delay_seconds_bucket{model_name="tiny-llama",engine="0",mode="sync",le="0.0001"} 7
kvtier:lookup_delay_seconds_bucket{model_name="tiny-llama",engine="0",mode="sync",le="0.001"} 8
kvtier:lookup_delay_seconds_bucket{model_name="tiny-llama",engine="0",mode="sync",le="+Inf"} 8
kvtier:lookup_delay_seconds_count{model_name="tiny-llama",engine="0",mode="sync"} 8
kvtier:lookup_delay_seconds_sum{model_name="tiny-llama",engine="0",mode="sync"} 0.0009
kvtier:lookup_delay_seconds_bucket{model_name="tiny-llama",engine="0",mode="async",le="0.0001"} 0
kvtier:lookup_delay_seconds_bucket{model_name="tiny-llama",engine="0",mode="async",le="0.01"} 1
kvtier:lookup_delay_seconds_bucket{model_name="tiny-llama",engine="0",mode="async",le="0.1"} 2
kvtier:lookup_delay_seconds_bucket{model_name="tiny-llama",engine="0",mode="async",le="+Inf"} 2
kvtier:lookup_delay_seconds_count{model_name="tiny-llama",engine="0",mode="async"} 2
kvtier:lookup_delay_seconds_sum{model_name="tiny-llama",engine="0",mode="async"} 0.06
# HELP kvtier:priced_fetch_seconds Priced lookups: the wait predicted and measured.
# TYPE kvtier:priced_fetch_seconds histogram
kvtier:priced_fetch_seconds_bucket{model_name="tiny-llama",engine="0",tier="remote",value="predicted",le="0.01"} 1
kvtier:priced_fetch_seconds_bucket{model_name="tiny-llama",engine="0",tier="remote",value="predicted",le="0.1"} 2
kvtier:priced_fetch_seconds_bucket{model_name="tiny-llama",engine="0",tier="remote",value="predicted",le="+Inf"} 2
kvtier:priced_fetch_seconds_count{model_name="tiny-llama",engine="0",tier="remote",value="predicted"} 2
kvtier:priced_fetch_seconds_sum{model_name="tiny-llama",engine="0",tier="remote",value="predicted"} 0.05
kvtier:priced_fetch_seconds_bucket{model_name="tiny-llama",engine="0",tier="remote",value="measured",le="0.01"} 0
kvtier:priced_fetch_seconds_bucket{model_name="tiny-llama",engine="0",tier="remote",value="measured",le="0.1"} 2
kvtier:priced_fetch_seconds_bucket{model_name="tiny-llama",engine="0",tier="remote",value="measured",le="+Inf"} 2
kvtier:priced_fetch_seconds_count{model_name="tiny-llama",engine="0",tier="remote",value="measured"} 2
kvtier:priced_fetch_seconds_sum{model_name="tiny-llama",engine="0",tier="remote",value="measured"} 0.05
# HELP kvtier:bytes_total KV bytes moved, by tier and direction.
# TYPE kvtier:bytes_total counter
kvtier:bytes_total{model_name="tiny-llama",engine="0",tier="host",direction="read"} 3145728
kvtier:bytes_total{model_name="tiny-llama",engine="0",tier="host",direction="write"} 6291456
kvtier:bytes_total{model_name="tiny-llama",engine="0",tier="remote",direction="read"} 1048576
kvtier:bytes_total{model_name="tiny-llama",engine="0",tier="remote",direction="write"} 6291456
# HELP kvtier:transfer_seconds Time to move one chunk.
# TYPE kvtier:transfer_seconds histogram
kvtier:transfer_seconds_bucket{model_name="tiny-llama",engine="0",op="load",le="0.001"} 10
kvtier:transfer_seconds_bucket{model_name="tiny-llama",engine="0",op="load",le="0.01"} 12
kvtier:transfer_seconds_bucket{model_name="tiny-llama",engine="0",op="load",le="+Inf"} 12
kvtier:transfer_seconds_count{model_name="tiny-llama",engine="0",op="load"} 12
kvtier:transfer_seconds_sum{model_name="tiny-llama",engine="0",op="load"} 0.02
kvtier:transfer_seconds_bucket{model_name="tiny-llama",engine="0",op="fetch",le="0.001"} 0
kvtier:transfer_seconds_bucket{model_name="tiny-llama",engine="0",op="fetch",le="0.01"} 3
kvtier:transfer_seconds_bucket{model_name="tiny-llama",engine="0",op="fetch",le="+Inf"} 4
kvtier:transfer_seconds_count{model_name="tiny-llama",engine="0",op="fetch"} 4
kvtier:transfer_seconds_sum{model_name="tiny-llama",engine="0",op="fetch"} 0.06
# HELP kvtier:host_bytes_used Bytes of the host tier holding chunks.
# TYPE kvtier:host_bytes_used gauge
kvtier:host_bytes_used{model_name="tiny-llama",engine="0"} 1.34217728e+08
# HELP kvtier:host_bytes_capacity Size of the host tier (its one slab), bytes.
# TYPE kvtier:host_bytes_capacity gauge
kvtier:host_bytes_capacity{model_name="tiny-llama",engine="0"} 2.68435456e+08
# HELP kvtier:evictions_total Chunks evicted from the host tier to make room.
# TYPE kvtier:evictions_total counter
kvtier:evictions_total{model_name="tiny-llama",engine="0"} 3
# HELP kvtier:writes_dropped_total Object-tier writes dropped because the write queue was full.
# TYPE kvtier:writes_dropped_total counter
kvtier:writes_dropped_total{model_name="tiny-llama",engine="0"} 1
# HELP kvtier:stores_skipped_total Chunks not stored because every host slot was busy loading, fetching or uploading.
# TYPE kvtier:stores_skipped_total counter
kvtier:stores_skipped_total{model_name="tiny-llama",engine="0"} 1
# HELP kvtier:errors_total Chunks or operations that failed and became misses, by kind.
# TYPE kvtier:errors_total counter
kvtier:errors_total{model_name="tiny-llama",engine="0",kind="timeout"} 1
kvtier:errors_total{model_name="tiny-llama",engine="0",kind="checksum"} 0
# HELP kvtier:stuck_ops Object-tier calls past their deadline that have not returned.
# TYPE kvtier:stuck_ops gauge
kvtier:stuck_ops{model_name="tiny-llama",engine="0",direction="read"} 1
kvtier:stuck_ops{model_name="tiny-llama",engine="0",direction="write"} 0
# HELP kvtier:seals_total Chunks sealed with the engine's encryption key.
# TYPE kvtier:seals_total counter
kvtier:seals_total{model_name="tiny-llama",engine="0"} 6
# HELP kvtier:miss_tokens_total Prompt tokens kvtier was asked about and did not serve, by why.
# TYPE kvtier:miss_tokens_total counter
kvtier:miss_tokens_total{model_name="tiny-llama",engine="0",reason="absent"} 1024
kvtier:miss_tokens_total{model_name="tiny-llama",engine="0",reason="fetching"} 256
kvtier:miss_tokens_total{model_name="tiny-llama",engine="0",reason="tail"} 40
# HELP kvtier:node_errors_total Object-tier calls that failed because one Redis Cluster node could not be reached.
# TYPE kvtier:node_errors_total counter
kvtier:node_errors_total{model_name="tiny-llama",engine="0",node="10.0.0.7:6379"} 5
# HELP kvtier:compress_raw_bytes_total KV bytes of the chunks the object tier wrote or served.
# TYPE kvtier:compress_raw_bytes_total counter
kvtier:compress_raw_bytes_total{model_name="tiny-llama",engine="0",direction="write"} 2097152
kvtier:compress_raw_bytes_total{model_name="tiny-llama",engine="0",direction="read"} 1048576
# HELP kvtier:compress_stored_bytes_total The same chunks' payload bytes as stored.
# TYPE kvtier:compress_stored_bytes_total counter
kvtier:compress_stored_bytes_total{model_name="tiny-llama",engine="0",direction="write"} 1447034
kvtier:compress_stored_bytes_total{model_name="tiny-llama",engine="0",direction="read"} 723517
# HELP kvtier:compress_seconds_total Seconds the object-tier I/O threads spent compressing.
# TYPE kvtier:compress_seconds_total counter
kvtier:compress_seconds_total{model_name="tiny-llama",engine="0",direction="write"} 0.006
kvtier:compress_seconds_total{model_name="tiny-llama",engine="0",direction="read"} 0.001
# HELP kvtier:whatif_hit_tokens_total Prompt tokens a host tier of scale times today's slots would have served.
# TYPE kvtier:whatif_hit_tokens_total counter
kvtier:whatif_hit_tokens_total{model_name="tiny-llama",engine="0",tier="host",scale="0.5"} 2048
kvtier:whatif_hit_tokens_total{model_name="tiny-llama",engine="0",tier="host",scale="1"} 3072
kvtier:whatif_hit_tokens_total{model_name="tiny-llama",engine="0",tier="host",scale="2"} 4096
kvtier:whatif_hit_tokens_total{model_name="tiny-llama",engine="0",tier="host",scale="4"} 4608
kvtier:whatif_hit_tokens_total{model_name="tiny-llama",engine="0",tier="host",scale="8"} 4864
# HELP kvtier:canary_checks_total Chunks vLLM computed and compared with the object tier's chunk of the same name.
# TYPE kvtier:canary_checks_total counter
kvtier:canary_checks_total{model_name="tiny-llama",engine="0",outcome="match"} 2
kvtier:canary_checks_total{model_name="tiny-llama",engine="0",outcome="mismatch"} 0
kvtier:canary_checks_total{model_name="tiny-llama",engine="0",outcome="absent"} 1
kvtier:canary_checks_total{model_name="tiny-llama",engine="0",outcome="error"} 0
# HELP kvtier:loads_declined_tokens_total Prompt tokens a lookup did not ask the object tier for.
# TYPE kvtier:loads_declined_tokens_total counter
kvtier:loads_declined_tokens_total{model_name="tiny-llama",engine="0",tier="remote",reason="slower_than_prefill"} 2048
kvtier:loads_declined_tokens_total{model_name="tiny-llama",engine="0",tier="remote",reason="queued"} 0
# HELP kvtier:fetch_deadline_missed_total Lookups whose fetch was still running at its deadline.
# TYPE kvtier:fetch_deadline_missed_total counter
kvtier:fetch_deadline_missed_total{model_name="tiny-llama",engine="0",tier="remote"} 1
# HELP kvtier:tier_read_bytes_per_second Read throughput of a tier as lookups see it.
# TYPE kvtier:tier_read_bytes_per_second gauge
kvtier:tier_read_bytes_per_second{model_name="tiny-llama",engine="0",tier="host"} 0
kvtier:tier_read_bytes_per_second{model_name="tiny-llama",engine="0",tier="remote"} 1e+08
# HELP kvtier:prefill_seconds_per_token This engine's compute per prompt token.
# TYPE kvtier:prefill_seconds_per_token gauge
kvtier:prefill_seconds_per_token{model_name="tiny-llama",engine="0"} 0.00046
# HELP kvtier:handoff_chunks_total Hot host-tier chunks the object tier lacked when the engine drained.
# TYPE kvtier:handoff_chunks_total counter
kvtier:handoff_chunks_total{model_name="tiny-llama",engine="0",outcome="written"} 12
kvtier:handoff_chunks_total{model_name="tiny-llama",engine="0",outcome="left"} 1
# HELP kvtier:tenant_bytes Bytes of a tier holding a tenant's chunks.
# TYPE kvtier:tenant_bytes gauge
kvtier:tenant_bytes{model_name="tiny-llama",engine="0",tier="host",tenant="team-a"} 8388608
kvtier:tenant_bytes{model_name="tiny-llama",engine="0",tier="host",tenant="untagged"} 2097152
# HELP kvtier:pinned_bytes Bytes of the host tier holding soft-pinned chunks.
# TYPE kvtier:pinned_bytes gauge
kvtier:pinned_bytes{model_name="tiny-llama",engine="0"} 1048576
# HELP kvtier:warmup_bytes_total Bytes a starting engine's warm-up fetched into its host tier.
# TYPE kvtier:warmup_bytes_total counter
kvtier:warmup_bytes_total{model_name="tiny-llama",engine="0"} 33554432
# HELP kvtier:warmup_seconds How long the engine's warm-up took.
# TYPE kvtier:warmup_seconds gauge
kvtier:warmup_seconds{model_name="tiny-llama",engine="0"} 2.5
# HELP kvtier:warmup_hit_tokens_total Prompt tokens loaded from warmed chunks.
# TYPE kvtier:warmup_hit_tokens_total counter
kvtier:warmup_hit_tokens_total{model_name="tiny-llama",engine="0"} 1024
# HELP kvtier:tenant_hit_tokens_total Prompt tokens kvtier offered a tenant's requests and vLLM took.
# TYPE kvtier:tenant_hit_tokens_total counter
kvtier:tenant_hit_tokens_total{model_name="tiny-llama",engine="0",tenant="team-a"} 1024
kvtier:tenant_hit_tokens_total{model_name="tiny-llama",engine="0",tenant="untagged"} 0
# HELP kvtier:tenant_lookup_tokens_total Prompt tokens kvtier was asked about for a tenant's requests.
# TYPE kvtier:tenant_lookup_tokens_total counter
kvtier:tenant_lookup_tokens_total{model_name="tiny-llama",engine="0",tenant="team-a"} 2048
kvtier:tenant_lookup_tokens_total{model_name="tiny-llama",engine="0",tenant="untagged"} 1024
"""  # noqa: E501 (exposition lines are as long as vLLM writes them)

_GAUGES = frozenset(s.name for s in ALL if s.kind == "gauge")


def exposition(scrape: int) -> str:
    """EXPOSITION after ``scrape`` scrapes: counters and histograms scaled, gauges as is."""
    lines = []
    for line in EXPOSITION.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            if series.split("{", 1)[0] not in _GAUGES:
                line = f"{series} {float(value) * scrape:g}"
        lines.append(line)
    return "\n".join(lines) + "\n"


class ExpositionServer:
    """A loopback /metrics endpoint that serves a scrape-count-dependent exposition text."""

    def __init__(self, render: Any) -> None:
        self.scrapes = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                outer.scrapes += 1
                body = render(outer.scrapes).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


class Prometheus:
    """A real ``prometheus`` on a free loopback port, 1 s scrapes, with the kvtier rules."""

    def __init__(self, target: str, *, rules: bool = True) -> None:
        binary = require_binary("prometheus")
        self.workdir = Path(tempfile.mkdtemp(prefix="kvtier-prometheus-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {
                "scrape_interval": "1s",
                "evaluation_interval": "1s",
                "scrape_timeout": "1s",
            },
            "rule_files": [str(RULES)] if rules else [],
            "scrape_configs": [{"job_name": "vllm", "static_configs": [{"targets": [target]}]}],
        }
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(self.workdir / "prometheus.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={self.workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
        )
        self.client = httpx.Client(base_url=self.url, timeout=10)
        try:
            self.wait(self._ready, 30, "prometheus to become ready")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        try:
            return self.client.get("/-/ready").status_code == 200
        except httpx.TransportError:
            return False

    def wait(self, check: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.proc.returncode}):\n{self.tail()}")
            if check():
                return
            time.sleep(0.2)
        raise TimeoutError(f"timed out waiting for {what}; prometheus log:\n{self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        return (self.workdir / "prometheus.log").read_text(errors="replace")[-3000:]

    def query(self, expr: str) -> dict[str, Any]:
        """/api/v1/query; returns the whole JSON answer (status, data or error)."""
        resp = self.client.get("/api/v1/query", params={"query": expr})
        return resp.json()

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def scraped_twice(prom: Prometheus, series: str) -> bool:
    """True once ``series`` has at least two raw samples in Prometheus (enough for rate())."""
    ans = prom.query(f"count_over_time({series}[1m])")
    result = ans.get("data", {}).get("result", [])
    return bool(result) and float(result[0]["value"][1]) >= 2


def check_expressions(
    prom: Prometheus, dash: dict[str, Any] | None = None, *, require_recorded: bool = True
) -> dict[str, Any]:
    """Evaluate every dashboard, variable and rule expression; return answers by place.

    Fails on any Prometheus error; requires data from every panel and recording rule
    and, with ``require_recorded``, from every recording rule's stored series.
    """
    dash = dash if dash is not None else load_dashboard()
    answers: dict[str, Any] = {}
    problems: list[str] = []

    def run(where: str, expr: str, need_data: bool) -> None:
        promql = grafana_to_promql(expr)
        ans = prom.query(promql)
        answers[where] = ans
        if ans.get("status") != "success":
            problems.append(f"{where}: {ans.get('errorType')}: {ans.get('error')}\n  {promql}")
        elif need_data and not ans["data"]["result"]:
            problems.append(f"{where}: no data\n  {promql}")

    for q in panel_queries(dash):
        run(f"panel {q.panel!r} {q.ref_id}", q.expr, True)
    for name, var in template_vars(dash).items():
        if var["type"] == "query":
            run(f"variable {name}", template_query_expr(variable_query(var)), True)
    for rule in load_rules():
        if "record" in rule:
            run(f"record {rule['record']}", rule["expr"], True)
            if require_recorded:
                run(f"stored {rule['record']}", rule["record"], True)
        else:  # an alert's expression is empty while it does not fire
            run(f"alert {rule['alert']}", rule["expr"], False)
    assert not problems, "\n".join(problems)
    return answers


def scalar(answer: dict[str, Any]) -> float:
    """The value of a one-sample vector answer."""
    result = answer["data"]["result"]
    assert len(result) == 1, result
    return float(result[0]["value"][1])


@pytest.fixture(scope="module")
def live_prometheus() -> Iterator[tuple[Prometheus, ExpositionServer]]:
    """Prometheus scraping EXPOSITION every second, after at least two scrapes and a rule run."""
    server = ExpositionServer(exposition)
    try:
        prom = Prometheus(f"127.0.0.1:{server.port}")
        try:
            prom.wait(
                lambda: scraped_twice(prom, "kvtier:lookup_tokens_total"),
                30,
                "two scrapes of the exposition server",
            )
            rule = "kvtier:hit_rate:ratio_rate5m"
            prom.wait(
                lambda: bool(prom.query(rule).get("data", {}).get("result")),
                15,
                f"the recording rule {rule} to be evaluated",
            )
            yield prom, server
        finally:
            prom.stop()
    finally:
        server.close()


def test_live_rules_load_without_errors(live_prometheus: tuple[Prometheus, Any]) -> None:
    """Prometheus itself loaded and evaluated every rule (no rule in error state)."""
    prom, _ = live_prometheus
    groups = prom.client.get("/api/v1/rules").json()["data"]["groups"]
    loaded = {r["name"]: r for g in groups for r in g["rules"]}
    expected = {r.get("record") or r.get("alert") for r in load_rules()}
    assert loaded.keys() == expected
    bad = {name: r.get("lastError") for name, r in loaded.items() if r["health"] == "err"}
    assert bad == {}


def test_live_every_expression_evaluates(live_prometheus: tuple[Prometheus, Any]) -> None:
    """Every panel, variable and rule query succeeds and returns data from real scrapes."""
    prom, server = live_prometheus
    assert server.scrapes >= 2
    answers = check_expressions(prom)
    # the three meters return numbers that match the exposition text
    hit = answers["panel '① Prefix-cache hit rate' B"]
    assert scalar(hit) == pytest.approx((3072 + 1024) / 6144)
    vllm_hit = answers["panel '① Prefix-cache hit rate' C"]
    assert scalar(vllm_hit) == pytest.approx(2048 / 8192)
    by_tier = {
        r["metric"]["tier"]: float(r["value"][1])
        for r in answers["panel '① Prefix-cache hit rate' A"]["data"]["result"]
    }
    assert by_tier == pytest.approx({"host": 0.5, "remote": 1024 / 6144})
    for ref in ("A", "B", "C", "D"):
        for r in answers[f"panel '② Time to first token, p50 and p99' {ref}"]["data"]["result"]:
            assert math.isfinite(float(r["value"][1])), (ref, r)
    tail = answers["panel '③ Miss tail: TTFT p99 of misses and lookup delay p99' B"]
    assert 0.01 < scalar(tail) <= 0.1  # async p99 falls in the (0.01, 0.1] bucket
    # the one alert this data should trip at once (pending: `for` has not passed)
    # the what-if curve: each size's host hit rate, and 1x on the measured one
    curve = {
        r["metric"]["scale"]: float(r["value"][1])
        for r in answers["panel 'Host hit rate a host tier of each size would have had' A"]["data"][
            "result"
        ]
    }
    assert curve == pytest.approx(
        {"0.5": 2048 / 6144, "1": 0.5, "2": 4096 / 6144, "4": 0.75, "8": 4864 / 6144}
    )
    saved = {
        r["metric"]["scale"]: float(r["value"][1])
        for r in answers[
            "panel 'Mean TTFT each host tier size would save against today (estimate)' A"
        ]["data"]["result"]
    }
    gap = 0.83 / 3 - 0.2 / 4  # mean miss TTFT - mean hit TTFT
    assert saved == pytest.approx({s: (curve[s] - 0.5) * gap for s in curve})
    assert answers["alert KVTierRemoteErrors"]["data"]["result"], "timeout errors not seen"
    assert not answers["alert KVTierHostEvictionsHigh"]["data"]["result"]


def test_live_check_catches_broken_queries(live_prometheus: tuple[Prometheus, Any]) -> None:
    """The live check is not vacuous: a misspelt metric (no data) and bad PromQL both fail it."""
    prom, _ = live_prometheus
    dash = load_dashboard()
    targets = [t for p in iter_panels(dash["panels"]) for t in p.get("targets", [])]
    targets[0]["expr"] = targets[0]["expr"].replace("kvtier:hit_tokens_total", "kvtier:hit_tokens")
    targets[1]["expr"] = targets[1]["expr"] + " by"
    with pytest.raises(AssertionError) as err:
        check_expressions(prom, dash, require_recorded=False)
    message = str(err.value)
    assert "A: no data" in message and "B: bad_data" in message, message
