"""``kvtier size --from-prometheus``: the host tier to give, from what the running engines
measured (their ghost tiers, :mod:`kvtier.whatif.host`), through the planner's memory math.

Reads over a window, from Prometheus' HTTP API: ``kvtier:whatif_hit_tokens_total`` by
scale (the host hit tokens a tier of 0.5x to 8x today's slots would have served),
``kvtier:lookup_tokens_total`` (the denominator), the measured host hits and
``kvtier:host_bytes_capacity`` (today's tier, every worker's together). The curve is hit
rate against ``cpu_bytes`` per worker; the recommendation is the smallest size within
``tolerance`` of the best hit rate among the sizes that fit beside everything else the
host holds (the planner's ``largest_cpu_bytes_that_fits``: weights offloaded to pinned
memory, vLLM's own buffers, the headroom). A size that does not fit is never recommended.

Only the standard library: ``kvtier size`` loads neither torch nor vLLM.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.metrics import WHATIF_SCALES

#: Prometheus ``/api/v1/query`` answer's ``data.result`` for one PromQL expression
Fetch = Callable[[str], list[dict[str, Any]]]

#: within this many points of the best hit rate that fits, the smaller tier is recommended
TOLERANCE = 0.01


class PrometheusError(Exception):
    """Prometheus could not be asked, or did not answer with the figures needed."""


def prometheus_fetch(url: str, timeout_s: float = 30.0) -> Fetch:
    """A :data:`Fetch` asking the Prometheus at ``url`` (``http://host:9090``)."""
    base = url.rstrip("/")

    def fetch(promql: str) -> list[dict[str, Any]]:
        q = urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(f"{base}/api/v1/query?{q}", timeout=timeout_s) as r:
                body = json.loads(r.read(16 << 20))
        except (OSError, ValueError) as e:  # URLError, HTTPError, timeouts, bad JSON
            raise PrometheusError(f"{base}: {e}") from None
        if not isinstance(body, dict) or body.get("status") != "success":
            why = body.get("error") if isinstance(body, dict) else body
            raise PrometheusError(f"{base}: {promql}: {why}")
        data = body.get("data", {})
        return list(data.get("result", [])) if isinstance(data, dict) else []

    return fetch


@dataclass(frozen=True)
class Measured:
    """What the engines served over the window, summed over the selected series."""

    window: str
    lookup_tokens: float
    host_hit_tokens: float
    #: today's host tier per worker, bytes (the capacity gauge over the workers)
    today_bytes: int
    #: scale -> host hit tokens a tier of that many times today's would have served
    whatif_tokens: dict[str, float]


def _one(result: list[dict[str, Any]]) -> float | None:
    if not result:
        return None
    v = float(result[0]["value"][1])
    return v if math.isfinite(v) else None


def read(fetch: Fetch, window: str, *, matchers: str = "", workers: int = 1) -> Measured:
    """The figures over ``window`` (a PromQL duration: ``1d``, ``6h``) for the series
    ``matchers`` selects (PromQL label matchers, e.g. ``model_name="llama"``)."""
    sel = f"{matchers}, " if matchers else ""
    lookup = _one(fetch(f"sum(increase(kvtier:lookup_tokens_total{{{matchers}}}[{window}]))"))
    if not lookup:
        raise PrometheusError(
            f"no kvtier:lookup_tokens_total over {window}"
            + (f" for {{{matchers}}}" if matchers else "")
            + ": no kvtier engine scraped, or no traffic"
        )
    host = (
        _one(fetch(f'sum(increase(kvtier:hit_tokens_total{{{sel}tier="host"}}[{window}]))')) or 0.0
    )
    rows = fetch(
        f'sum by (scale) (increase(kvtier:whatif_hit_tokens_total{{{sel}tier="host"}}[{window}]))'
    )
    whatif = {
        str(r["metric"].get("scale")): float(r["value"][1])
        for r in rows
        if r.get("metric", {}).get("scale") in WHATIF_SCALES
    }
    if not whatif:
        raise PrometheusError(
            "no kvtier:whatif_hit_tokens_total: the engines run with whatif: false, or a "
            "kvtier without ghost tiers"
        )
    capacity = _one(fetch(f"max(kvtier:host_bytes_capacity{{{matchers}}})"))
    if not capacity:
        raise PrometheusError("no kvtier:host_bytes_capacity: today's host tier is unknown")
    return Measured(window, lookup, host, int(capacity) // max(1, workers), whatif)


def curve(m: Measured, largest_fit: int | None) -> list[dict[str, Any]]:
    """One row per scale: cpu_bytes per worker, hit rate, and whether it fits."""
    rows = []
    for s in sorted(m.whatif_tokens, key=float):
        nbytes = int(float(s) * m.today_bytes)
        rows.append(
            {
                "scale": s,
                "cpu_bytes": nbytes,
                "hit_rate": m.whatif_tokens[s] / m.lookup_tokens,
                "today": s == "1",
                "fits": None if largest_fit is None else nbytes <= largest_fit,
            }
        )
    return rows


def recommend(rows: list[dict[str, Any]], tolerance: float = TOLERANCE) -> dict[str, Any] | None:
    """The smallest size within ``tolerance`` of the best hit rate among the sizes that fit
    (or whose fit is unknown); None when none fits."""
    ok = [r for r in rows if r["fits"] is not False]
    if not ok:
        return None
    best = max(r["hit_rate"] for r in ok)
    return min((r for r in ok if r["hit_rate"] >= best - tolerance), key=lambda r: r["cpu_bytes"])


def report(
    m: Measured,
    plan: dict[str, Any],
    *,
    tolerance: float = TOLERANCE,
    check: Callable[[int], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The curve and the recommendation; ``check(cpu_bytes)`` re-plans with that host tier
    (the planner's own verdict on the recommended size, when the host memory is known)."""
    largest = plan.get("largest_cpu_bytes_that_fits")
    rows = curve(m, largest)
    rec = recommend(rows, tolerance)
    verdict = None
    if rec is not None and check is not None:
        verdict = check(rec["cpu_bytes"]).get("fits")
        if verdict is False:  # the planner's own math has the last word
            rows = [{**r, "fits": r["fits"] and r["cpu_bytes"] < rec["cpu_bytes"]} for r in rows]
            rec = recommend(rows, tolerance)
    return {
        "window": m.window,
        "lookup_tokens": m.lookup_tokens,
        "measured_host_hit_rate": m.host_hit_tokens / m.lookup_tokens,
        "today_cpu_bytes": m.today_bytes,
        "largest_cpu_bytes_that_fits": largest,
        "host_memory_bytes": plan.get("host_memory_bytes"),
        "tolerance": tolerance,
        "curve": rows,
        "recommended": rec,
    }


def format_report(rep: dict[str, Any]) -> str:
    from kvtier.config import format_size

    lines = [
        f"host tier hit rate against size, measured over {rep['window']} "
        f"({rep['lookup_tokens']:,.0f} prompt tokens looked up; measured host hit rate "
        f"{rep['measured_host_hit_rate'] * 100:.1f} %):",
        f"  {'scale':>5}  {'cpu_bytes/worker':>16}  {'hit rate':>8}  fits",
    ]
    for r in rep["curve"]:
        fits = {True: "yes", False: "no", None: "?"}[r["fits"]]
        mark = "  <- today" if r["today"] else ""
        lines.append(
            f"  {r['scale'] + 'x':>5}  {format_size(r['cpu_bytes']):>16}  "
            f"{r['hit_rate'] * 100:7.1f}%  {fits}{mark}"
        )
    largest = rep["largest_cpu_bytes_that_fits"]
    if largest is None:
        lines.append(
            "fit not checked: pass --host-memory (and the GPU and offload flags) so "
            "the planner can say what fits beside the rest"
        )
    else:
        lines.append(f"largest cpu_bytes that fits beside the rest: {format_size(largest)}")
    rec = rep["recommended"]
    if rec is None:
        lines.append("no size on the curve fits: keep cpu_bytes at most the largest that fits")
    else:
        lines.append(
            f"recommended cpu_bytes: {rec['cpu_bytes']} ({format_size(rec['cpu_bytes'])}, "
            f"{rec['scale']}x today), host hit rate {rec['hit_rate'] * 100:.1f} % (the "
            f"smallest size within {rep['tolerance'] * 100:g} points of the best that fits)"
        )
    return "\n".join(lines)


def add_args(p: Any) -> None:
    """The ``kvtier size`` flags of this mode (an ``argparse`` parser)."""
    g = p.add_argument_group(
        "live what-if (hit rate against host tier size from running engines' ghost tiers)"
    )
    g.add_argument(
        "--from-prometheus",
        metavar="URL",
        help="read kvtier:whatif_hit_tokens_total and kvtier:lookup_tokens_total "
        "from this Prometheus (http://host:9090) and recommend cpu_bytes",
    )
    g.add_argument(
        "--window",
        default="1d",
        metavar="DURATION",
        help="PromQL duration to read the counters over (default 1d)",
    )
    g.add_argument(
        "--prometheus-match",
        default="",
        metavar="MATCHERS",
        help='PromQL label matchers selecting the engines, e.g. model_name="llama",'
        'namespace="prod" (default: every kvtier series)',
    )


def run(args: Any, plan: dict[str, Any], inp: Any, shape: Any, fetch: Fetch | None = None) -> int:
    """``kvtier size --from-prometheus``: print the curve and the recommendation (JSON
    with ``--json``). 0, 1 when no size fits, 2 when Prometheus has no answer."""
    import dataclasses
    import sys

    from kvtier.sizing.memory_plan import make_plan

    def check(cpu_bytes: int) -> dict[str, Any]:
        return make_plan(dataclasses.replace(inp, cpu_bytes=cpu_bytes), shape)

    try:
        m = read(
            fetch or prometheus_fetch(args.from_prometheus),
            args.window,
            matchers=args.prometheus_match,
            workers=args.tp,
        )
    except PrometheusError as e:
        print(f"kvtier size: error: {e}", file=sys.stderr)
        return 2
    rep = report(m, plan, check=check)
    print(json.dumps(rep, indent=2) if args.json else format_report(rep))
    return 0 if rep["recommended"] is not None else 1
