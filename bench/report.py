"""Turn a ``run_all.py`` results dict into ratios, goal checks, Markdown and PNG plots.

Kept apart from the runner so the numbers can be re-derived from a saved
``results.json`` (``python bench/report.py bench/results/results.json``)
without starting a server.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

KVTIER = "kvtier-host"
KVTIER_PERSISTENT = "kvtier-file"
PEERS = ("example", "lmcache")
COLUMNS = (  # (key, header)
    ("cold", "cold"),
    ("engine", "in-engine hit"),
    ("hit", "connector hit (prefix cache reset)"),
    ("restart", "hit after vLLM restart"),
    ("shared", "75 % shared (prefix cache reset)"),
    ("mt_ttft", "multi-turn TTFT p50"),
)


def ttft(res: dict[str, Any] | None, skip_first: bool = False) -> float | None:
    """Median client TTFT of a phase's successful requests (optionally not the first one)."""
    if not res:
        return None
    samples = sorted(res.get("samples", []), key=lambda s: s["start_s"])
    if skip_first:
        samples = samples[1:]
    vals = [s["ttft_s"] for s in samples if s["ok"] and s["ttft_s"] is not None]
    return statistics.median(vals) if vals else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Per-configuration medians, ratios against the references, peer ratios, goals."""
    cfgs = results["configs"]
    rows: dict[str, dict[str, Any]] = {}
    for name, rec in cfgs.items():
        ph = rec.get("phases", {})
        mt = ph.get("multiturn")
        rows[name] = {
            "label": rec.get("label", name),
            "unavailable": rec.get("unavailable"),
            "cold": ttft(ph.get("cold")),
            "engine": ttft(ph.get("repeat"), skip_first=True),
            "hit": ttft(ph.get("connector")),
            "restart": ttft(ph.get("restart")),
            "shared": ttft(ph.get("shared75"), skip_first=True),
            "mt_ttft": mt["ttft_p50_s"] if mt else None,
            "mt_rps": mt["throughput_rps"] if mt else None,
            "failed": sum(p.get("failed", 0) for p in ph.values()),
            "requests": sum(p.get("requests", 0) for p in ph.values()),
            "hit_rates": {k: p.get("hit_rates", {}) for k, p in ph.items()},
        }
    base = cfgs.get("vllm", {}).get("phases", {})
    ref = {
        "engine": ttft(base.get("repeat"), skip_first=True),
        "cold": ttft(base.get("cold")),
        "shared_cold": ttft(base.get("shared75")),
        "shared_engine": ttft(base.get("shared75_engine"), skip_first=True),
        "mt_rps": (base.get("multiturn") or {}).get("throughput_rps"),
    }
    for r in rows.values():
        r["ratios"] = {
            "hit_vs_engine": _div(r["hit"], ref["engine"]),
            "hit_vs_own_engine": _div(r["hit"], r["engine"]),
            "hit_vs_cold": _div(r["hit"], ref["cold"]),
            "restart_vs_engine": _div(r["restart"], ref["engine"]),
            "shared_vs_cold": _div(r["shared"], ref["shared_cold"]),
            "shared_vs_own_cold": _div(r["shared"], r["cold"]),
            "shared_vs_engine": _div(r["shared"], ref["shared_engine"]),
            "mt_rps_vs_none": _div(r["mt_rps"], ref["mt_rps"]),
        }
    peers: dict[str, dict[str, float | None]] = {}
    k, kp = rows.get(KVTIER, {}), rows.get(KVTIER_PERSISTENT, {})
    for peer in PEERS:
        p = rows.get(peer)
        if not p:
            continue
        peers[peer] = {
            "hit": _div(p["hit"], k.get("hit")),
            "restart": _div(p["restart"], kp.get("restart")),
            "shared": _div(p["shared"], k.get("shared")),
            "mt_ttft": _div(p["mt_ttft"], k.get("mt_ttft")),
            "mt_rps": _div(p["mt_rps"], k.get("mt_rps")),
        }
    kr = k.get("ratios", {})
    goals = [
        _goal(
            "host-tier hit ÷ in-engine hit (2,048-token prompt)",
            kr.get("hit_vs_engine"),
            "<=",
            1.10,
        ),
        _goal(
            "file-tier hit after restart ÷ in-engine hit",
            kp.get("ratios", {}).get("restart_vs_engine"),
            "<=",
            1.5,
        ),
        _goal("75 %-shared workload: TTFT ÷ cold", kr.get("shared_vs_cold"), "<=", 0.35),
        _goal(
            "multi-turn, small device cache: req/s ÷ no connector",
            kr.get("mt_rps_vs_none"),
            ">=",
            2.0,
        ),
    ]
    for peer, pr in peers.items():
        for key, what, op in (
            ("hit", "connector-hit TTFT", ">="),
            ("restart", "after-restart TTFT", ">="),
            ("shared", "75 %-shared TTFT", ">="),
            ("mt_rps", "multi-turn req/s", "<="),
        ):
            goals.append(_goal(f"{rows[peer]['label']} ÷ kvtier, {what}", pr.get(key), op, 1.0))
    return {"rows": rows, "ref": ref, "peers": peers, "goals": goals}


def _goal(text: str, value: float | None, op: str, target: float) -> dict[str, Any]:
    ok = None if value is None else (value <= target if op == "<=" else value >= target)
    return {"goal": text, "value": value, "op": op, "target": target, "met": ok}


def _s(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v * 1000:.0f} ms" if v < 10 else f"{v:.1f} s"


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v * 100:.0f} %"


def _loads(results: dict[str, Any]) -> str:
    parts = [
        f"{name} {la[0]:.1f}/{la[1]:.1f}"
        for name, rec in results["configs"].items()
        if (la := rec.get("load_avg_1m"))
    ]
    return ", ".join(parts) or "not recorded"


def markdown(results: dict[str, Any], summary: dict[str, Any]) -> str:
    """results.md: goals, medians, ratios, peers, hit rates, what was unavailable."""
    m = results["meta"]
    shape = m["model_shape"]
    rows = summary["rows"]
    out = [
        "# kvtier benchmark results",
        "",
        f"`{m['command']}` on {m['started']}, {m.get('duration_s', 0) / 60:.1f} min. "
        f"Machine: {m['machine']}. vLLM {m['vllm']} (CPU build), Python {m['python']}. "
        f"Model: random-weight Llama, {shape['layers']} layers, {shape['hidden']} wide, "
        f"{shape['heads']} heads / {shape['kv_heads']} KV heads, bf16. Every server: block size "
        f"32, `--kv-cache-memory-bytes {m['kv_cache_memory_bytes']}` "
        f"({m['device_cache_tokens']} tokens of device KV cache), max model length "
        f"{m['max_model_len']}, `VLLM_CPU_OMP_THREADS_BIND={m.get('omp_threads_bind', '?')}` "
        "(vLLM's automatic binding gives a server without a KV connector one compute thread "
        "fewer than one with a connector); "
        f"kvtier and LMCache use {m['chunk_size']}-token chunks. "
        f"1-minute load average before/after each configuration (other processes share "
        f"the machine): {_loads(results)}.",
        "",
        "## Goals",
        "",
        "| goal | measured | target | met |",
        "|---|---|---|---|",
    ]
    for g in summary["goals"]:
        met = {True: "yes", False: "**no**", None: "not measured"}[g["met"]]
        out.append(f"| {g['goal']} | {_x(g['value'])} | {g['op']} {g['target']:.2f} | {met} |")
    out += [
        "",
        "## Median TTFT and multi-turn throughput",
        "",
        "| configuration | "
        + " | ".join(h for _, h in COLUMNS)
        + " | multi-turn req/s | failed / requests |",
        "|---" * (len(COLUMNS) + 3) + "|",
    ]
    for r in rows.values():
        if r["unavailable"] and not r["requests"]:
            out.append(
                f"| {r['label']} | unavailable: {r['unavailable'][:160]} "
                + "| " * (len(COLUMNS) + 1)
                + "|"
            )
            continue
        cells = [_s(r[k]) for k, _ in COLUMNS]
        rps = "–" if r["mt_rps"] is None else f"{r['mt_rps']:.2f}"
        out.append(
            f"| {r['label']} | "
            + " | ".join(cells)
            + f" | {rps} | {r['failed']} / {r['requests']} |"
        )
    out += [
        "",
        "## Ratios",
        "",
        "References are vLLM without a connector on the same server settings: in-engine hit "
        "= the repeated prompt served from vLLM's own prefix cache; cold = distinct "
        "prompts of the same length; 75 % cold = the 75 %-shared prompts with the prefix "
        "cache reset. *Own in-engine* divides by the same server's in-engine hit, measured "
        "a few seconds earlier, and *own cold* by the same server's cold 2,048-token prompts "
        "(which, for a connector, include the cost of storing them); both are less exposed "
        "to load from other processes than the cross-server ratios.",
        "",
        "| configuration | hit ÷ in-engine | hit ÷ own in-engine | hit ÷ cold "
        "| restart ÷ in-engine | 75 % shared ÷ cold | 75 % shared ÷ own cold "
        "| 75 % shared ÷ in-engine | multi-turn req/s ÷ no connector |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows.values():
        if r["unavailable"] and not r["requests"]:
            continue
        q = r["ratios"]
        out.append(
            f"| {r['label']} | {_x(q['hit_vs_engine'])} | {_x(q['hit_vs_own_engine'])} | "
            f"{_x(q['hit_vs_cold'])} | "
            f"{_x(q['restart_vs_engine'])} | {_x(q['shared_vs_cold'])} | "
            f"{_x(q['shared_vs_own_cold'])} | {_x(q['shared_vs_engine'])} | "
            f"{_x(q['mt_rps_vs_none'])} |"
        )
    if summary["peers"]:
        out += [
            "",
            "## Each peer ÷ kvtier",
            "",
            "TTFT columns: above 1 means kvtier is faster. Throughput column: below 1 means "
            "kvtier serves more. Restart is compared with kvtier's file tier, the rest with "
            "its host tier.",
            "",
            "| peer | connector-hit TTFT | after-restart TTFT | 75 %-shared TTFT "
            "| multi-turn TTFT | multi-turn req/s |",
            "|---|---|---|---|---|---|",
        ]
        for peer, pr in summary["peers"].items():
            out.append(
                f"| {rows[peer]['label']} | {_x(pr['hit'])} | {_x(pr['restart'])} | "
                f"{_x(pr['shared'])} | {_x(pr['mt_ttft'])} | {_x(pr['mt_rps'])} |"
            )
    out += [
        "",
        "## Hit rates",
        "",
        "Token hit rates from each server's `/metrics` before and after the phase: "
        "**kvtier** = `kvtier:hit_tokens_total` ÷ `kvtier:lookup_tokens_total` (tokens beyond "
        "vLLM's own hit); **local** = `vllm:prefix_cache_hits_total` ÷ "
        "`vllm:prefix_cache_queries_total`; **ext** = vLLM's "
        "`vllm:external_prefix_cache_hits_total` ÷ `..._queries_total` (any connector).",
        "",
        "| configuration | connector hit | restart | 75 % shared | multi-turn |",
        "|---|---|---|---|---|",
    ]
    for r in rows.values():
        if r["unavailable"] and not r["requests"]:
            continue
        cells = []
        for phase in ("connector", "restart", "shared75", "multiturn"):
            rates = r["hit_rates"].get(phase)
            if rates is None:
                cells.append("–")
                continue
            parts = [
                f"{name} {_pct(rates.get(key))}"
                for name, key in (
                    ("kvtier", "kvtier"),
                    ("local", "vllm_prefix_cache"),
                    ("ext", "vllm_external"),
                )
                if rates.get(key) is not None
            ]
            cells.append(", ".join(parts) or "–")
        out.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    missing = [(r["label"], r["unavailable"]) for r in rows.values() if r["unavailable"]]
    if missing:
        out += ["", "## Unavailable here", ""]
        out += [f"- {label}: unavailable: {why}" for label, why in missing]
    out += [
        "",
        "## Workloads",
        "",
        "Driven by `kvtier bench` (streamed `/v1/completions`, temperature 0), one request "
        "at a time unless noted:",
        "",
        "1. **2,048-token prompt.** *cold*: distinct prompts; *in-engine hit*: one prompt "
        "repeated (first request excluded); *connector hit*: the same prompt with "
        "`POST /reset_prefix_cache` before each request, so vLLM's own cache is empty and only "
        "the connector can supply the prefix; *after restart*: vLLM stopped and started again "
        "(the connector's store kept), then the cold prompts again.",
        "2. **75 % shared.** 1,536 shared + 512 distinct tokens, prefix cache reset before each "
        "request; first request excluded from the median.",
        f"3. **Multi-turn.** {m['plan']['mt_sessions']} sessions × {m['plan']['mt_turns']} turns, "
        "256 shared + 256 new tokens per turn, 8 output tokens, 2 in flight; a turn's prompt is "
        "the previous prompt + answer + new text, and sessions interleave turn by turn, so the "
        "histories (several times the device cache) are evicted between a session's turns.",
        "",
        "## Plots",
        "",
        "![TTFT by configuration](ttft.png)",
        "",
        "![multi-turn throughput](multiturn.png)",
        "",
    ]
    for name, r in rows.items():
        if r["mt_rps"] is not None:
            out.append(f"![multi-turn, {r['label']}](multiturn-{name}.png)")
    return "\n".join(out) + "\n"


def console(summary: dict[str, Any]) -> str:
    """The ratios and goals, for the terminal."""
    lines = ["", "ratios (TTFT ÷ in-engine hit, TTFT ÷ cold, req/s ÷ no connector):"]
    for r in summary["rows"].values():
        if r["unavailable"] and not r["requests"]:
            lines.append(f"  {r['label']:<34} unavailable: {r['unavailable'][:120]}")
            continue
        q = r["ratios"]
        lines.append(
            f"  {r['label']:<34} hit/in-engine {_x(q['hit_vs_engine']):>7}  "
            f"hit/cold {_x(q['hit_vs_cold']):>7}  restart/in-engine "
            f"{_x(q['restart_vs_engine']):>7}  75%/cold {_x(q['shared_vs_cold']):>7}  "
            f"multi-turn {_x(q['mt_rps_vs_none']):>7}"
        )
    if summary["peers"]:
        lines.append("each peer ÷ kvtier (TTFT >1 and req/s <1: kvtier ahead):")
        for peer, pr in summary["peers"].items():
            lines.append(
                f"  {summary['rows'][peer]['label']:<34} hit {_x(pr['hit'])}  restart "
                f"{_x(pr['restart'])}  75% {_x(pr['shared'])}  multi-turn req/s "
                f"{_x(pr['mt_rps'])}"
            )
    lines.append("goals:")
    for g in summary["goals"]:
        met = {True: "met", False: "NOT MET", None: "not measured"}[g["met"]]
        lines.append(
            f"  [{met:^12}] {g['goal']}: {_x(g['value'])} (target {g['op']} {g['target']:.2f})"
        )
    return "\n".join(lines)


def plots(results: dict[str, Any], summary: dict[str, Any], out: Path) -> None:
    """ttft.png (median TTFT per phase and configuration) and multiturn.png (req/s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {k: r for k, r in summary["rows"].items() if r["requests"]}
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(12, 4.8))
    n = len(rows)
    width = 0.8 / n
    for i, (_, r) in enumerate(rows.items()):
        xs = [j + i * width for j in range(len(COLUMNS))]
        ys = [(r[k] or 0) * 1000 for k, _ in COLUMNS]
        ax.bar(xs, ys, width, label=r["label"])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(COLUMNS))])
    ax.set_xticklabels([h.replace(" (", "\n(") for _, h in COLUMNS], fontsize=8)
    ax.set_ylabel("median TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title("Time to first token by workload and configuration (log scale; lower is better)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "ttft.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [r["label"] for r in rows.values()]
    vals = [r["mt_rps"] or 0 for r in rows.values()]
    ax.barh(labels, vals, color="tab:blue")
    for y, v in enumerate(vals):
        ax.text(v, y, f" {v:.2f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("requests / s (higher is better)")
    ax.set_title("Multi-turn sessions, device KV cache smaller than the histories")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "multiturn.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    path = Path(
        sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results" / "results.json"
    )
    data = json.loads(path.read_text())
    summ = summarize(data)
    (path.parent / "results.md").write_text(markdown(data, summ))
    plots(data, summ, path.parent)
    print(console(summ))
