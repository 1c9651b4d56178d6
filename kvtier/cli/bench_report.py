"""What ``kvtier bench`` prints and draws: the summary of a run, its table and plot."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from .bench_records import RequestResult, TokenScale
from .promtext import (
    ANY_CACHE,
    KVTIER_HIT,
    KVTIER_LOOKUP,
    KVTIER_TTFT,
    OUTCOMES,
    VLLM_EXT_HIT,
    VLLM_EXT_QUERY,
    VLLM_HIT,
    VLLM_QUERY,
    Snapshot,
    bucket_delta,
    counter_delta,
    histogram_quantile,
    hit_rates,
    pick_hit_rate,
    quantile,
    token_shares,
    token_sources,
)


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _trace_workload(args: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
    return {
        "trace": info["path"],
        "format": info["format"],
        "formats": info["formats"],
        "block_size": info["block_size"],
        "speedup": args.speedup,
        "max_requests": args.max_requests,
        "max_input_tokens": args.max_input_tokens,
        "max_output_tokens": args.max_output_tokens,
        "max_concurrency": args.max_concurrency,
        "reset_prefix_cache": bool(args.reset_prefix_cache),
        "token_range": args.token_range,
    }


def _replay(
    results: list[RequestResult],
    info: dict[str, Any],
    sources: dict[str, float] | None,
    after: Snapshot | None,
    before: Snapshot | None,
) -> dict[str, Any]:
    """What a trace replay adds: lateness against the trace's clock, the lines skipped,
    and the planner's prediction beside what the server delivered."""
    lags = [max(0.0, r.start_s - r.due_s) for r in results if r.due_s is not None]
    sent = sum(r.prompt_tokens or 0 for r in results if r.ok)
    delivered: dict[str, float | None] = {"host_hit_rate": None, "gpu_hit_rate": None}
    if sources:
        total = sum(sources.values())
        if total > 0:
            delivered = {
                "host_hit_rate": sources["kvtier_host"] / total,
                "gpu_hit_rate": sources["gpu_prefix_cache"] / total,
            }
    elif sent:
        host = counter_delta(before, after, KVTIER_HIT, tier="host")
        delivered["host_hit_rate"] = None if host is None else host / sent
    pred = info["prediction"]
    diff = None
    if pred.get("host_hit_rate") is not None and delivered["host_hit_rate"] is not None:
        diff = (delivered["host_hit_rate"] - pred["host_hit_rate"]) * 100
    return {
        "bad_lines": info["bad_lines"],
        "bad_examples": info["bad_examples"],
        "late_requests": sum(lag > 0.1 for lag in lags),
        "lag_p50_s": quantile(lags, 0.5),
        "lag_p99_s": quantile(lags, 0.99),
        "prompt_tokens_sent": sent,
        "predicted": pred,
        "delivered": delivered,
        "host_difference_pp": diff,
        #: the replay's bounds and how often each acted (bench_trace.Bounds)
        "bounds": info.get("bounds"),
    }


def summarize(
    args: argparse.Namespace,
    model: str,
    scale: TokenScale,
    run: tuple[list[RequestResult], float],
    before: Snapshot | None,
    after: Snapshot | None,
    timeline: list[Snapshot],
    trace_info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The numbers the table, --json and --plot show (``trace_info``: a trace replay's)."""
    results, duration = run
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    rates = hit_rates(before, after)
    rate, source = pick_hit_rate(rates)
    sources = token_sources(before, after)
    by_outcome: dict[str, dict[str, Any]] = {}
    ttft_buckets: dict[str, list[tuple[float, float]]] = {}
    if after is not None and after.has(KVTIER_TTFT):
        ttft_buckets = bucket_delta(before, after, KVTIER_TTFT, "outcome")
        for outcome in sorted(ttft_buckets, key=_outcome_order):
            b = ttft_buckets[outcome]
            count = b[-1][1] if b else 0.0
            by_outcome[outcome] = {
                "count": int(round(count)),
                "p50_s": histogram_quantile(0.5, b),
                "p99_s": histogram_quantile(0.99, b),
            }
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    workload = (
        _trace_workload(args, trace_info)
        if trace_info is not None
        else {
            "sessions": args.sessions,
            "turns": args.turns,
            "shared_prefix_tokens": args.shared_prefix_tokens,
            "turn_tokens": args.turn_tokens,
            "output_tokens": args.output_tokens,
            "concurrency": args.concurrency,
            "request_rate": args.request_rate,
            "seed": args.seed,
            "reset_prefix_cache": bool(args.reset_prefix_cache),
            "tokens_per_word": round(scale.per_word, 4),
            "lead_tokens": round(scale.lead, 2),
        }
    )
    extra = (
        {"trace_replay": _replay(results, trace_info, sources, after, before)}
        if trace_info is not None
        else {}
    )
    return {
        "url": base_url(args.url),
        "model": model,
        "workload": workload,
        **extra,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "throughput_rps": len(ok) / duration if duration > 0 else 0.0,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else 0.0,
        "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None,
        "cached_tokens_total": sum(cached) if cached else None,
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "ttft_p50_s": quantile(ttfts, 0.5),
        "ttft_p99_s": quantile(ttfts, 0.99),
        "ttft_by_outcome": by_outcome,
        "ttft_buckets_by_outcome": {k: [[le, c] for le, c in v] for k, v in ttft_buckets.items()},
        "hit_rate": rate,
        "hit_rate_source": source,
        "hit_rate_by_source": token_shares(sources),
        "prompt_tokens_by_source": sources,
        "hit_rates": rates,
        "metrics_deltas": {
            name: counter_delta(before, after, name)
            for name in (
                KVTIER_HIT,
                KVTIER_LOOKUP,
                VLLM_HIT,
                VLLM_QUERY,
                VLLM_EXT_HIT,
                VLLM_EXT_QUERY,
            )
        },
        "hit_rate_timeline": _timeline(before, timeline, after, source),
        "errors": errors,
        "samples": [
            {k: v for k, v in asdict(r).items() if k not in ("text", "prompt")} for r in results
        ],
    }


def _outcome_order(outcome: str) -> tuple[int, str]:
    return (OUTCOMES.index(outcome) if outcome in OUTCOMES else len(OUTCOMES), outcome)


def _timeline(
    before: Snapshot | None, mids: list[Snapshot], after: Snapshot | None, source: str
) -> list[dict[str, float | None]]:
    """Hit rate in each scrape interval, by the same source the summary uses."""
    key = (
        "any_cache"
        if source == ANY_CACHE
        else "kvtier"
        if source.startswith("kvtier:")
        else "vllm_prefix_cache"
    )
    snaps = [s for s in (before, *mids, after) if s is not None]
    snaps.sort(key=lambda s: s.t)
    if len(snaps) < 2:
        return []
    t0 = snaps[0].t
    out = []
    for a, b in zip(snaps, snaps[1:], strict=False):
        out.append({"t_s": b.t - t0, "hit_rate": hit_rates(a, b)[key]})
    return out


def _fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.3f} s"


def format_table(result: dict[str, Any]) -> str:
    """The human-readable summary."""
    w = result["workload"]
    rows: list[tuple[str, str]] = [
        ("server", f"{result['url']}  model={result['model']}"),
        ("workload", _workload_line(w)),
        ("requests", f"{result['requests']} ({result['failed']} failed)"),
        ("duration", f"{result['duration_s']:.2f} s"),
        (
            "throughput",
            f"{result['throughput_rps']:.3f} req/s  "
            f"({result['output_tokens_per_s']:.1f} output tok/s)",
        ),
        (
            "TTFT p50 / p99",
            f"{_fmt_s(result['ttft_p50_s'])} / {_fmt_s(result['ttft_p99_s'])}  (client, streamed)",
        ),
    ]
    for outcome, d in result["ttft_by_outcome"].items():
        rows.append(
            (
                f"  TTFT {outcome}",
                f"{_fmt_s(d['p50_s'])} / {_fmt_s(d['p99_s'])}"
                f"  (n={d['count']}, server {KVTIER_TTFT})",
            )
        )
    hr = result["hit_rate"]
    rows.append(
        (
            "hit rate",
            ("-" if hr is None else f"{hr * 100:.1f} %") + f"  ({result['hit_rate_source']})",
        )
    )
    shares = result.get("hit_rate_by_source")
    if shares:
        rows.append(
            (
                "  from",
                ", ".join(
                    f"{k.replace('_', ' ')} {v * 100:.1f} %"
                    for k, v in shares.items()
                    if k != "computed"
                ),
            )
        )
        rows.append(("  computed", f"{shares['computed'] * 100:.1f} %"))
    for err, n in list(result["errors"].items())[:5]:
        rows.append(("error", f"{n} x {err}"))
    if "trace_replay" in result:
        rows += _replay_rows(result["trace_replay"])
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _workload_line(w: dict[str, Any]) -> str:
    if "trace" in w:
        kind = w["format"] or "empty"
        if w.get("block_size"):
            kind += f", {w['block_size']} tokens per hash id"
        cut = f", prompts cut to {w['max_input_tokens']} tokens" if w["max_input_tokens"] else ""
        return (
            f"trace {w['trace']} ({kind}) at {w['speedup']:g}x its rate, at most "
            f"{w['max_concurrency']} in flight{cut}"
        )
    return (
        f"{w['sessions']} sessions x {w['turns']} turns, shared "
        f"{w['shared_prefix_tokens']} + {w['turn_tokens']}/turn tokens, "
        f"{w['output_tokens']} out, concurrency {w['concurrency']}"
    )


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f} %"


def _bounds_rows(b: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The replay's bounds that acted: what was cut, not sent, or sent sooner."""
    if not b:
        return []
    acted = []
    if b["inputs_cut"]:
        acted.append(f"{b['inputs_cut']} prompts cut to {b['input_tokens']} tokens")
    if b["inputs_not_sent"]:
        acted.append(
            f"{b['inputs_not_sent']} prompts over {b['input_tokens']} tokens "
            f"({b['input_source']}) not sent"
        )
    if b["over_cap_lines"]:
        acted.append(
            f"{b['over_cap_lines']} lines over {b['reader_input_tokens']} prompt "
            "tokens (or a bound on output_length or line bytes) skipped"
        )
    if b["outputs_capped"]:
        acted.append(f"{b['outputs_capped']} output lengths capped")
    if b["gaps_cut"]:
        acted.append(f"{b['gaps_cut']} gaps cut to {b['max_gap_s']:g} s (--max-gap)")
    if b["timestamps_backwards"]:
        acted.append(
            f"{b['timestamps_backwards']} lines timestamped before an earlier one sent at once"
        )
    return [("bounds", "; ".join(acted))] if acted else []


def _replay_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [
        (
            "late",
            f"{r['late_requests']} requests started > 0.1 s after their time "
            f"(lag p50 {_fmt_s(r['lag_p50_s'])}, p99 {_fmt_s(r['lag_p99_s'])})",
        )
    ]
    if r["bad_lines"]:
        rows.append(("bad lines", f"{r['bad_lines']} skipped; " + "; ".join(r["bad_examples"][:3])))
    rows += _bounds_rows(r.get("bounds"))
    p, d = r["predicted"], r["delivered"]
    if p.get("host_hit_rate") is not None:
        size = f"{p['host_tier_chunks']} chunks of {p['chunk_size']}"
        rows.append(
            (
                "host tier",
                f"predicted {_pct(p['host_hit_rate'])} (kvtier size --trace, "
                f"{size}), delivered {_pct(d['host_hit_rate'])}",
            )
        )
    else:
        rows.append(
            (
                "host tier",
                f"delivered {_pct(d['host_hit_rate'])}; no prediction: {p.get('why_none')}",
            )
        )
    if p.get("gpu_hit_rate") is not None:
        rows.append(
            (
                "vLLM cache",
                f"predicted {_pct(p['gpu_hit_rate'])} ({p['gpu_kv_tokens']} "
                f"tokens, {p['gpu_kv_source']}), delivered "
                f"{_pct(d['gpu_hit_rate'])}",
            )
        )
    return rows


def _iter_cdf(values: Iterable[float]) -> tuple[list[float], list[float]]:
    s = sorted(values)
    return s, [(i + 1) / len(s) for i in range(len(s))]


def write_plot(result: dict[str, Any], path: str) -> None:
    """TTFT distribution per outcome (left) and hit rate over time (right), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ttfts = [s["ttft_s"] for s in result["samples"] if s["ok"] and s["ttft_s"] is not None]
    if ttfts:
        xs, ys = _iter_cdf(ttfts)
        ax1.step(xs, ys, where="post", label=f"client, all (n={len(xs)})", color="black")
    for outcome, buckets in result["ttft_buckets_by_outcome"].items():
        total = buckets[-1][1] if buckets else 0
        finite = [(le, c) for le, c in buckets if not math.isinf(le)]
        if total <= 0 or not finite:
            continue
        # only the buckets where this outcome's CDF moves, so the x axis stays readable
        lo = max((i for i, (_, c) in enumerate(finite) if c == 0), default=0)
        hi = min((i for i, (_, c) in enumerate(finite) if c >= total), default=len(finite) - 1)
        finite = finite[lo : hi + 1]
        ax1.step(
            [le for le, _ in finite],
            [c / total for _, c in finite],
            where="post",
            label=f"server, {outcome} (n={int(total)})",
        )
    ax1.set_xscale("log")
    ax1.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax1.set_xlabel("time to first token (s)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("TTFT distribution")
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    tl = [p for p in result["hit_rate_timeline"] if p["hit_rate"] is not None]
    if tl:
        ax2.plot([p["t_s"] for p in tl], [p["hit_rate"] * 100 for p in tl], marker=".")
    else:
        ax2.text(
            0.5,
            0.5,
            "no hit-rate counters on /metrics",
            ha="center",
            va="center",
            transform=ax2.transAxes,
        )
    ax2.set_ylim(-2, 102)
    ax2.set_xlabel("time since start (s)")
    ax2.set_ylabel("hit rate per scrape interval (%)")
    what = (
        "prompt tokens from any cache"
        if result["hit_rate_source"] == ANY_CACHE
        else result["hit_rate_source"].split(" ")[0]
    )
    ax2.set_title(f"hit rate ({what})")
    ax2.grid(True, alpha=0.3)
    shares = result.get("hit_rate_by_source")
    if shares:  # the whole run's split, beside the curve
        ax2.text(
            0.02,
            0.02,
            "whole run:\n"
            + "\n".join(f"{k.replace('_', ' ')}: {v * 100:.1f} %" for k, v in shares.items()),
            transform=ax2.transAxes,
            fontsize=8,
            va="bottom",
            bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "0.8"},
        )
    w = result["workload"]
    what = f"trace {w['trace']}" if "trace" in w else f"{w['sessions']}x{w['turns']} turns"
    fig.suptitle(
        f"kvtier bench: {result['model']}, {what}, {result['requests']} requests", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
