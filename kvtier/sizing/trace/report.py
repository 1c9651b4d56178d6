"""The report of a trace's simulation: hit-rate curves of the host and object tiers,
the size that reaches the target, the text table and the plot."""

from __future__ import annotations

import math
import os
from typing import Any

from kvtier.sizing.trace.read import MAX_INPUT_LENGTH, MAX_LINE_BYTES, TraceStats
from kvtier.sizing.trace.sim import Simulation

#: kvtier's host slots are aligned to this many bytes (kvtier.host.layout.SLOT_ALIGN; that
#: module imports torch, which `kvtier size` must not)
SLOT_ALIGN = 4096
CURVE_POINTS = 40


def slot_bytes(kv_bytes_per_token_per_rank: int, chunk_size: int) -> int:
    """Host bytes one chunk takes in one worker's slab (kvtier aligns slots)."""
    n = kv_bytes_per_token_per_rank * chunk_size
    return (n + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


def _sizes(max_chunks: int, points: int = CURVE_POINTS) -> list[int]:
    """Chunk counts from 1 to ``max_chunks``, spaced evenly on a log scale."""
    if max_chunks < 1:
        return []
    out = {1, max_chunks}
    for i in range(points):
        out.add(max(1, round(max_chunks ** (i / (points - 1)))))
    return sorted(out)


def _smallest(served: list[int], need: float) -> int | None:
    """Fewest chunks whose served tokens reach ``need`` (None: never)."""
    lo, hi = 0, len(served) - 1
    if served[hi] < need:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if served[mid] >= need:
            hi = mid
        else:
            lo = mid + 1
    return lo


def report(
    sim: Simulation,
    stats: TraceStats,
    *,
    path: str,
    host_slot_bytes: int,
    object_chunk_bytes: int,
    target: float,
    host_tier_bytes: int | None,
    gpu_kv_tokens: int,
    gpu_kv_source: str,
    object_compression: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The curves and the recommendation, as ``--json`` prints them.

    ``object_chunk_bytes`` is what one chunk takes in the object tier as stored (after
    ``compression``, described by ``object_compression``: the plan's block of that name);
    host-tier bytes are always raw."""
    served = sim.served()
    total = sim.prompt_tokens
    rate = (lambda t: t / total) if total else (lambda t: 0.0)
    top = len(served) - 1
    # a tier smaller than a prompt's full chunks keeps that prompt's first chunks in the
    # connector (the chunks its own step loads and stores cannot be evicted, the rest are
    # skipped), where the LRU stack keeps its last ones: there the curve is only a model
    longest = sim.max_request_chunks
    host = [
        {
            "chunks": s,
            "bytes": s * host_slot_bytes,
            "hit_rate": rate(served[s]),
            "below_longest_prompt": s < longest,
        }
        for s in _sizes(top)
    ]
    h_chunks = 0 if host_tier_bytes is None else host_tier_bytes // host_slot_bytes
    h_served = served[min(h_chunks, top)]
    obj = [
        {"chunks": s, "bytes": s * object_chunk_bytes, "hit_rate": rate(served[s] - h_served)}
        for s in _sizes(top)
        if s > h_chunks
    ]
    need = target * total - sim.gpu_hit_tokens
    host_need = _smallest(served, need)
    obj_need = _smallest(served, need)
    if obj_need is not None and obj_need <= h_chunks:
        obj_need = 0
    dur = None
    if stats.min_timestamp is not None and stats.max_timestamp is not None:
        dur = stats.max_timestamp - stats.min_timestamp  # lines out of time order too
    per_s = (lambda x: x / dur) if dur else (lambda x: None)
    out_tokens = stats.output_tokens if stats.output_known else None
    return {
        "trace": {
            "path": os.path.basename(path),
            "format": stats.format,
            "formats": stats.formats,
            #: tokens per hash id (hash-id traces; None for token, text and chat traces)
            "block_size": (
                min(stats.block_sizes)
                if len(stats.block_sizes) == 1
                else sorted(stats.block_sizes) or None
            ),
            "requests": stats.requests,
            "bad_lines": stats.bad_lines,
            "bad_examples": stats.bad_examples,
            #: of the bad lines, those over a bound (prompt, output_length, line bytes)
            "over_cap_lines": stats.over_cap,
            "prompt_tokens": total,
            "output_tokens": out_tokens,
            "duration_s": dur,
            "requests_per_s": per_s(stats.requests),
            "prompt_tokens_per_s": per_s(total),
            "output_tokens_per_s": None if out_tokens is None else per_s(out_tokens),
            "distinct_chunks": sim.distinct_chunks,
            "max_request_chunks": longest,
        },
        "keys": {
            "block_size": sim.block_size,
            "chunk_size": sim.chunk_size,
            "host_slot_bytes": host_slot_bytes,
            "object_chunk_bytes": object_chunk_bytes,
            "max_chunks": sim.max_chunks,
            "object_compression": object_compression
            or {"setting": "none", "ratio": 1.0, "ratio_source": "no compression"},
        },
        "gpu_prefix_cache": {
            "tokens": gpu_kv_tokens,
            "source": gpu_kv_source,
            "hit_rate": rate(sim.gpu_hit_tokens),
        },
        "max_hit_rate": rate(sim.gpu_hit_tokens + served[top]),
        #: from this host-tier size on the curve is exact for requests one at a time
        "host_tier_exact_from_bytes": longest * host_slot_bytes,
        "host_tier": host,
        "object_tier": {"behind_host_bytes": h_chunks * host_slot_bytes, "curve": obj},
        "recommended": {
            "target_hit_rate": target,
            "host_bytes": None if host_need is None else host_need * host_slot_bytes,
            "host_hit_rate": None if host_need is None else rate(served[host_need]),
            "object_bytes": None if obj_need is None else obj_need * object_chunk_bytes,
        },
    }


def _size(n: int | None) -> str:
    if n is None:
        return "unreachable"
    for unit, div in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def _thin(points: list[dict[str, Any]], rows: int = 14) -> list[dict[str, Any]]:
    """At most about ``rows`` points for the text table (the JSON keeps them all)."""
    step = max(1, math.ceil(len(points) / rows))
    out = points[::step]
    return out if not points or out[-1] is points[-1] else [*out, points[-1]]


def _compression_line(c: dict[str, Any] | None) -> list[str]:
    """The object tier's compression, when there is one: setting, ratio and its source."""
    if not c or c["setting"] == "none":
        return []
    return [
        f"object compression {c['setting']}: stored = {c['ratio']:.4g} x raw "
        f"({c['ratio_source']}); object-tier sizes below are stored bytes"
    ]


def format_report(rep: dict[str, Any]) -> str:
    """The human-readable curves: sizes, hit rates beyond vLLM, and with vLLM's share."""
    t, g, rec = rep["trace"], rep["gpu_prefix_cache"], rep["recommended"]
    lines = [
        f"trace              {t['path']}: {t['requests']} requests, {t['prompt_tokens']} "
        f"prompt tokens, {t['distinct_chunks']} distinct chunks, {t['bad_lines']} bad lines",
    ]
    lines += [f"  bad              {e}" for e in t["bad_examples"]]
    if t.get("over_cap_lines"):
        lines.append(
            f"  over bounds      {t['over_cap_lines']} of the bad lines: a prompt over "
            f"{MAX_INPUT_LENGTH} tokens, an output_length over it or a line over "
            f"{MAX_LINE_BYTES} bytes"
        )
    fmt = t.get("format")
    if fmt:
        kind = fmt if fmt != "mixed" else ", ".join(f"{k} {v}" for k, v in t["formats"].items())
        if t.get("block_size"):
            kind += f", {t['block_size']} tokens per hash id"
        lines.append(f"  format           {kind}")
    if t.get("requests_per_s"):
        rate = (
            f"  rate             {t['requests_per_s']:.3g} requests/s over "
            f"{t['duration_s']:.0f} s, {t['prompt_tokens_per_s']:.4g} prompt tokens/s"
        )
        if t.get("output_tokens_per_s") is not None:
            rate += f", {t['output_tokens_per_s']:.4g} output tokens/s"
        lines.append(rate)
    k = rep["keys"]
    lines += [
        f"chunks             {k['chunk_size']} tokens (blocks of {k['block_size']}); "
        f"{_size(k['host_slot_bytes'])} per worker in the host tier, "
        f"{_size(k['object_chunk_bytes'])} in the object tier",
        *_compression_line(k.get("object_compression")),
        f"vLLM prefix cache  {g['tokens']} tokens ({g['source']}): "
        f"{g['hit_rate'] * 100:.1f} % of prompt tokens",
        f"all reuse          {rep['max_hit_rate'] * 100:.1f} % of prompt tokens come from some "
        f"cache with unbounded tiers",
        "",
        f"{'host tier / worker':>20}  {'beyond vLLM':>11}  {'with vLLM':>9}",
    ]
    for p in _thin(rep["host_tier"]):
        lines.append(
            f"{_size(p['bytes']):>20}  {p['hit_rate'] * 100:10.1f} %  "
            f"{(p['hit_rate'] + g['hit_rate']) * 100:8.1f} %"
            + ("  *" if p.get("below_longest_prompt") else "")
        )
    if any(p.get("below_longest_prompt") for p in rep["host_tier"]):
        lines.append(
            f"{'':>20}  * smaller than the longest prompt's chunks "
            f"({_size(rep['host_tier_exact_from_bytes'])}): kvtier keeps such a "
            "prompt's first chunks, the model its last; kvtier may serve more"
        )
    ot = rep["object_tier"]
    if ot["curve"]:
        lines += [
            "",
            f"{'object tier':>20}  {'beyond host':>11}   (behind a host tier of "
            f"{_size(ot['behind_host_bytes'])} per worker)",
        ]
        for p in _thin(ot["curve"]):
            lines.append(f"{_size(p['bytes']):>20}  {p['hit_rate'] * 100:10.1f} %")
    lines += [
        "",
        f"target {rec['target_hit_rate'] * 100:.0f} % of prompt tokens from any cache: host tier "
        f"{_size(rec['host_bytes'])} per worker; or object tier {_size(rec['object_bytes'])} "
        f"behind {_size(ot['behind_host_bytes'])}",
    ]
    return "\n".join(lines)


def write_plot(rep: dict[str, Any], path: str) -> None:
    """Hit rate against size for the host tier (per worker) and the object tier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = rep["gpu_prefix_cache"]["hit_rate"] * 100
    target = rep["recommended"]["target_hit_rate"] * 100
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    curves = [
        ("host tier, per worker", rep["host_tier"], gpu),
        ("object tier, behind the host tier", rep["object_tier"]["curve"], None),
    ]
    for ax, (title, pts, base) in zip(axes, curves, strict=True):
        if pts:
            xs = [p["bytes"] / 1024**3 for p in pts]
            ax.plot(xs, [p["hit_rate"] * 100 for p in pts], marker=".", label="beyond vLLM")
            if base is not None:
                ax.plot(
                    xs,
                    [p["hit_rate"] * 100 + base for p in pts],
                    marker=".",
                    label="with vLLM's prefix cache",
                )
                ax.axhline(target, color="grey", ls="--", lw=0.8, label="target")
                exact = rep.get("host_tier_exact_from_bytes", 0) / 1024**3
                if exact > xs[0]:
                    ax.axvspan(
                        xs[0],
                        exact,
                        color="grey",
                        alpha=0.12,
                        label="smaller than the longest prompt (model only)",
                    )
            ax.set_xscale("log")
            ax.legend(fontsize=8)
        ax.set_ylim(-2, 102)
        ax.set_xlabel("size (GiB)")
        ax.set_ylabel("prompt tokens served (%)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    t = rep["trace"]
    fig.suptitle(
        f"kvtier size --trace {t['path']}: {t['requests']} requests, vLLM prefix cache {gpu:.1f} %",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
