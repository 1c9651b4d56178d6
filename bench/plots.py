"""The benchmarks' plots: one figure helper (Agg backend, saved and closed whatever
happens), then each script's figure. matplotlib is imported only when a plot is asked for."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def figure(path: str, *, ncols: int = 1, figsize: tuple[float, float]) -> Iterator[tuple[Any, Any]]:
    """A figure of ``ncols`` axes side by side (one axes when 1), laid out and written to
    ``path`` at 110 dpi when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = (
        plt.subplots(1, ncols, figsize=figsize) if ncols > 1 else plt.subplots(figsize=figsize)
    )
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def trace_replay_plot(res: dict[str, Any], path: str) -> None:
    """bench/trace_replay.py: the planner's curve with the engine's measured points on it."""
    with figure(path, figsize=(7.5, 4.5)) as (_, ax):
        _trace_replay_axes(res, ax)


def _trace_replay_axes(res: dict[str, Any], ax: Any) -> None:
    mib = 1024**2
    xs = [p["bytes"] / mib for p in res["curve"] if p["bytes"]]
    ys = [p["hit_rate"] * 100 for p in res["curve"] if p["bytes"]]
    ax.plot(xs, ys, marker=".", label="kvtier size --trace (predicted)")
    pts = [p for p in res["points"] if not p["below_longest_prompt"] and p["batch"] == 1]
    low = [p for p in res["points"] if p["below_longest_prompt"]]
    batched = [p for p in res["points"] if p["batch"] > 1]
    ax.plot(
        [p["cpu_bytes"] / mib for p in pts],
        [p["measured_hit_rate"] * 100 for p in pts],
        "o",
        ms=9,
        mfc="none",
        mew=2,
        color="tab:red",
        label="vLLM + kvtier (measured)",
    )
    if low:
        ax.plot(
            [p["cpu_bytes"] / mib for p in low],
            [p["measured_hit_rate"] * 100 for p in low],
            "s",
            ms=8,
            mfc="none",
            mew=2,
            color="tab:orange",
            label="measured, tier smaller than the longest prompt",
        )
    if batched:
        ax.plot(
            [p["cpu_bytes"] / mib for p in batched],
            [p["measured_hit_rate"] * 100 for p in batched],
            "^",
            ms=8,
            mfc="none",
            mew=2,
            color="tab:purple",
            label=f"measured, {batched[0]['batch']} requests at a time",
        )
    ax.axvline(
        res["trace"]["max_request_chunks"] * res["planner_slot_bytes"] / mib,
        color="grey",
        ls=":",
        lw=1,
        label="longest prompt's chunks",
    )
    for p in res["points"]:
        text = f"{p['measured_hit_rate'] * 100:.1f} % (pred. {p['predicted_hit_rate'] * 100:.1f} %)"
        offset = (8, -12)
        if p["batch"] > 1:
            own = (p["cached_tokens_vllm"] - p["hit_tokens_host"]) / p["prompt_tokens"]
            text = f"{p['measured_hit_rate'] * 100:.1f} % + vLLM's own {own * 100:.1f} %"
            offset = (10, -4)
        elif p["below_longest_prompt"]:
            offset = (-50, 14)
        ax.annotate(
            text,
            (p["cpu_bytes"] / mib, p["measured_hit_rate"] * 100),
            textcoords="offset points",
            xytext=offset,
            fontsize=8,
        )
    ax.set_xscale("log")
    ax.set_ylim(-2, 102)
    ax.set_xlabel("host tier per worker, cpu_bytes (MiB)")
    ax.set_ylabel("prompt tokens served by kvtier's host tier (%)")
    t = res["trace"]
    kind = "hash-id (Mooncake-format) " if res.get("format") == "mooncake" else ""
    ax.set_title(
        f"Generated {kind}trace: {t['requests']} requests, {t['prompt_tokens']} "
        f"prompt tokens, chunk {res['chunk_size']}",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")


def scheduler_plot(result: dict[str, Any], path: str) -> None:
    """bench/scheduler_cost.py: step time ÷ no connector, metadata bytes, lookup latency."""
    with figure(path, ncols=3, figsize=(16, 4.6)) as (_, axes):
        _scheduler_axes(result, axes)


def _scheduler_axes(result: dict[str, Any], axes: Any) -> None:
    import matplotlib.pyplot as plt

    variants = [v for v in result["variants"] if v != "vllm"]
    sizes = sorted({r["index_chunks"] for r in result["steps"]})
    # a colour per connector, darker for a larger index; the line style is the phase
    maps = {"kvtier": plt.get_cmap("Blues"), "offloading": plt.get_cmap("Oranges")}
    shade = {n: 0.45 + 0.5 * i / max(1, len(sizes) - 1) for i, n in enumerate(sizes)}
    markers = dict(zip(sizes, ("o", "s", "^", "D"), strict=False))
    ax = axes[0]
    for v in variants:
        for phase, style in (("decode", "-"), ("prefill", "--")):
            for n in sizes:
                rs = [r for r in result["steps"] if r["phase"] == phase and r["index_chunks"] == n]
                ax.plot(
                    [r["running_requests"] for r in rs],
                    [r[f"{v}_ratio"] for r in rs],
                    style,
                    marker=markers.get(n, "o"),
                    color=maps[v](shade[n]),
                    label=f"{v} {phase} {n:,}",
                )
    ax.axhline(1.05, color="grey", lw=0.8, ls=":")
    ax.axhline(1.15, color="grey", lw=0.8, ls=":")
    ax.set(
        xscale="log",
        xlabel="running requests",
        ylabel="step time ÷ no connector",
        title="schedule()+update_from_output()",
    )
    ax.legend(fontsize=6)
    ax = axes[1]
    n = sizes[-1]
    for v, color in zip(("vllm", *variants), ("k", "C0", "C1"), strict=False):
        for phase, style in (("decode", "-"), ("prefill", "--")):
            rs = [r for r in result["steps"] if r["phase"] == phase and r["index_chunks"] == n]
            ax.plot(
                [r["running_requests"] for r in rs],
                [r[f"{v}_step_us"] / 1000 for r in rs],
                style,
                color=color,
                marker="o",
                label=f"{v} {phase}",
            )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="running requests",
        ylabel="ms per step",
        title=f"step time, index {n:,} chunks",
    )
    ax.legend(fontsize=7)
    ax = axes[2]
    for v in variants:
        for outcome, style in (("hit", "-"), ("partial", "--"), ("miss", ":")):
            rs = [r for r in result["lookups"] if r["connector"] == v and r["outcome"] == outcome]
            ax.plot(
                [r["index_chunks"] for r in rs],
                [r["p99_us"] for r in rs],
                style,
                marker="o",
                color=maps[v](0.8),
                label=f"{v} {outcome} p99",
            )
    ax.axhline(200, color="grey", lw=0.8, ls=":")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="index chunks",
        ylabel="µs",
        title="get_num_new_matched_tokens, 32k-token prompt",
    )
    ax.legend(fontsize=7)


def ttft_sweep_plot(result: dict[str, Any], path: str) -> None:
    """bench/ttft.py --sweep: TTFT by prompt length (log-log), and TTFT ÷ cold prefill."""
    import statistics

    rows = result["sweep"]
    xs = [r["prompt_tokens"] for r in rows]
    series = [
        ("cold prefill", [r["cold_ttft_s"] for r in rows], "k", "-", "o"),
        # the restarted engines' own (the writing engine's is taken while its
        # uploads run, and reads high): what each restart hit is divided by
        (
            "in-engine prefix hit (vLLM, restarted engines' median)",
            [
                statistics.median(t["engine_hit_ttft_s"] for t in r["restart"].values())
                for r in rows
            ],
            "tab:gray",
            "--",
            "s",
        ),
        ("kvtier host-tier hit", [r["kvtier_hit_ttft_s"] for r in rows], "tab:purple", ":", "^"),
    ]
    colors = {"file": "tab:blue", "s3": "tab:orange", "redis": "tab:red"}
    names = {"file": "file://", "s3": "S3 (moto)", "redis": "Redis"}
    for t in rows[0]["restart"]:
        series.append(
            (
                f"{names[t]} hit after restart",
                [r["restart"][t]["restart_hit_ttft_s"] for r in rows],
                colors[t],
                "-",
                "D",
            )
        )
    cold = series[0][1]
    with figure(path, ncols=2, figsize=(13, 5.2)) as (fig, (ax1, ax2)):
        for label, ys, color, ls, marker in series:
            ax1.plot(xs, [y * 1000 for y in ys], ls, color=color, marker=marker, label=label)
            if label != "cold prefill":
                ax2.plot(
                    xs,
                    [y / c for y, c in zip(ys, cold, strict=True)],
                    ls,
                    color=color,
                    marker=marker,
                    label=label,
                )
        for ax in (ax1, ax2):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_yscale("log")
            ax.set_xlabel("prompt tokens")
            ax.grid(True, which="both", alpha=0.3)
        ax1.set_ylabel("TTFT (ms)")
        ax1.set_title("Time to first token")
        ax2.axhline(1.0, color="k", lw=1)
        ax2.set_ylabel("TTFT ÷ cold prefill of the same prompt")
        ax2.set_title("Below 1: the hit beats recomputing")
        ax1.legend(fontsize=8)
        fig.suptitle(
            f"{result['model']} Llama, vLLM CPU build, {result['machine']['cpus']} "
            f"cores, median of {result['samples']}"
        )
