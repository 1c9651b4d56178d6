"""``kvtier size --from-prometheus``: the ghost tiers' curve read from a real Prometheus
scraping kvtier-shaped series, and a recommended cpu_bytes that always fits (the
planner's largest_cpu_bytes_that_fits, then its own verdict on the size chosen)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvtier.cli.main import main
from kvtier.sizing import whatif
from tests.deploy.test_dashboard_rules import ExpositionServer, Prometheus, scraped_twice

GiB = 2**30
#: host hit tokens per 10,000 looked up, by ghost scale (today's tier: 1x = 50 %)
CURVE = {"0.5": 3000, "1": 5000, "2": 7000, "4": 7500, "8": 7550}
TODAY = 2 * GiB


def render(scrape: int) -> str:
    """/metrics after ``scrape`` scrapes: counters grow alike, the capacity stays."""
    lab = 'model_name="m",engine="0"'
    lines = [
        "# TYPE kvtier:lookup_tokens_total counter",
        f"kvtier:lookup_tokens_total{{{lab}}} {10000 * scrape}",
        "# TYPE kvtier:hit_tokens_total counter",
        f'kvtier:hit_tokens_total{{{lab},tier="host"}} {5000 * scrape}',
        f'kvtier:hit_tokens_total{{{lab},tier="remote"}} 0',
        "# TYPE kvtier:whatif_hit_tokens_total counter",
        *(
            f'kvtier:whatif_hit_tokens_total{{{lab},tier="host",scale="{s}"}} {v * scrape}'
            for s, v in CURVE.items()
        ),
        "# TYPE kvtier:host_bytes_capacity gauge",
        f"kvtier:host_bytes_capacity{{{lab}}} {TODAY}",
    ]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def prometheus() -> Iterator[Prometheus]:
    server = ExpositionServer(render)
    try:
        prom = Prometheus(f"127.0.0.1:{server.port}", rules=False)
        try:
            prom.wait(lambda: scraped_twice(prom, "kvtier:lookup_tokens_total"), 30, "two scrapes")
            yield prom
        finally:
            prom.stop()
    finally:
        server.close()


def run(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_recommends_the_knee_that_fits(prometheus: Prometheus, tiny_llama: str, capsys) -> None:
    """10 GiB of host RAM less 4 GiB headroom: 4 GiB (2x) fits, 8 GiB (4x) does not. The
    curve flattens past 2x anyway; 2x is the recommendation."""
    code, out, err = run(
        capsys,
        "size",
        "--model",
        tiny_llama,
        "--gpu-memory",
        "24",
        "--host-memory",
        "10",
        "--from-prometheus",
        prometheus.url,
        "--window",
        "1m",
        "--json",
    )
    assert code == 0, err
    import json

    rep = json.loads(out)
    assert rep["today_cpu_bytes"] == TODAY
    assert rep["measured_host_hit_rate"] == pytest.approx(0.5, rel=0.01)
    rates = {r["scale"]: r["hit_rate"] for r in rep["curve"]}
    assert rates == pytest.approx({s: v / 10000 for s, v in CURVE.items()}, rel=0.01)
    fits = {r["scale"]: r["fits"] for r in rep["curve"]}
    assert fits == {"0.5": True, "1": True, "2": True, "4": False, "8": False}
    assert rep["recommended"]["scale"] == "2" and rep["recommended"]["cpu_bytes"] == 4 * GiB
    # the table, today's size marked
    code, out, _ = run(
        capsys,
        "size",
        "--model",
        tiny_llama,
        "--gpu-memory",
        "24",
        "--host-memory",
        "10",
        "--from-prometheus",
        prometheus.url,
        "--window",
        "1m",
    )
    assert code == 0 and "<- today" in out and "recommended cpu_bytes: 4294967296" in out


def test_more_memory_recommends_up_to_the_flat_part(
    prometheus: Prometheus, tiny_llama: str, capsys
) -> None:
    """With room for 8x, the recommendation is 4x: 8x adds half a point, under the 1-point
    tolerance. The selector narrows to the engines asked about; a wrong one is an error."""
    code, out, err = run(
        capsys,
        "size",
        "--model",
        tiny_llama,
        "--gpu-memory",
        "24",
        "--host-memory",
        "40",
        "--from-prometheus",
        prometheus.url,
        "--window",
        "1m",
        "--json",
        "--prometheus-match",
        'model_name="m"',
    )
    assert code == 0, err
    import json

    assert json.loads(out)["recommended"]["scale"] == "4"
    code, _, err = run(
        capsys,
        "size",
        "--model",
        tiny_llama,
        "--from-prometheus",
        prometheus.url,
        "--window",
        "1m",
        "--prometheus-match",
        'model_name="other"',
    )
    assert code == 2 and "no kvtier:lookup_tokens_total" in err


def test_nothing_that_does_not_fit_is_recommended() -> None:
    """Fits from the planner's largest size first, then its own verdict on the choice."""
    m = whatif.Measured("1d", 10000, 5000, TODAY, {s: float(v) for s, v in CURVE.items()})
    small = whatif.report(m, {"largest_cpu_bytes_that_fits": GiB})
    assert small["recommended"]["scale"] == "0.5"
    none = whatif.report(m, {"largest_cpu_bytes_that_fits": GiB // 2})
    assert none["recommended"] is None
    # the planner says 4 GiB does not fit after all (e.g. pinned weights): the next size down
    verdicts: list[int] = []

    def check(cpu_bytes: int) -> dict[str, Any]:
        verdicts.append(cpu_bytes)
        return {"fits": cpu_bytes < 4 * GiB}

    rep = whatif.report(m, {"largest_cpu_bytes_that_fits": 6 * GiB}, check=check)
    assert verdicts == [4 * GiB] and rep["recommended"]["scale"] == "1"
    unknown = whatif.report(m, {"largest_cpu_bytes_that_fits": None})
    assert unknown["recommended"]["scale"] == "4"  # fit unknown: said so in the table
    assert "fit not checked" in whatif.format_report(unknown)


def test_engines_without_ghosts_are_an_error() -> None:
    def fetch(promql: str) -> list[dict[str, Any]]:
        if "lookup_tokens" in promql:
            return [{"metric": {}, "value": [0, "100"]}]
        return []

    with pytest.raises(whatif.PrometheusError, match="whatif: false"):
        whatif.read(fetch, "1d")
