"""The readable form of a plan (``kvtier size`` without ``--json``)."""

from __future__ import annotations

from typing import Any

GiB = 1024**3


def _group_rows(p: dict[str, Any]) -> list[tuple[str, str]]:
    """One row per KV cache group (full and sliding-window layers apart): its bytes per
    token per rank and what kvtier stores of one chunk."""
    rows = []
    for g in p.get("kv_groups") or ():
        if g["kind"] == "state":
            shapes = " + ".join(
                f"{tuple(s)} {d}" for s, d in zip(g["shapes"], g["dtypes"], strict=True)
            )
            rows.append(
                (
                    f"  state group ({g['state_kind']})",
                    (
                        f"{g['layers']} {g['layer_type']} layers, {shapes} = "
                        f"{g['state_bytes_per_layer']:,} B/layer/rank (GPU page padded to "
                        f"{p['state_padded_page_bytes']:,} B); kvtier stores one state a layer "
                        f"a chunk: {g['chunk_bytes']:,} B"
                    ),
                )
            )
            continue
        window = f", window {g['window']:,}" if g["window"] else ""
        rows.append(
            (
                f"  {g['kind']} group",
                f"{g['layers']} layers{window}, "
                f"{g['bytes_per_token']:,} B/token/rank; "
                f"kvtier stores {g['stored_blocks_per_chunk']} of "
                f"{g['blocks_per_chunk']} blocks a chunk: {g['chunk_bytes']:,} B",
            )
        )
    return rows


def _b(n: int | None) -> str:
    """Bytes with GiB alongside, or "unknown"."""
    if n is None:
        return "unknown"
    if abs(n) >= GiB / 100:
        return f"{n / GiB:,.2f} GiB ({n:,} B)"
    return f"{n:,} B"


def _compression_rows(p: dict[str, Any]) -> list[tuple[str, str]]:
    """The object tier's stored bytes under ``compression``, with the ratio and its source."""
    c = p.get("object_compression")
    if not c or c["setting"] == "none":
        return []
    return [
        (
            f"  stored ({c['setting']})",
            f"{p['object_stored_bytes_per_token']:,.1f} B = "
            f"{c['ratio']:.4g} x raw ({c['stored_chunk_bytes']:,} B per {c['chunk_size']}-token "
            "chunk)",
        ),
        ("  ratio from", c["ratio_source"]),
    ]


def format_plan(p: dict[str, Any]) -> str:
    """Sections: model, weights and offload, GPU, host, verdict, warnings."""
    kv_heads = (
        "MLA latent (replicated per rank)"
        if p["mla"]
        else (f"{p['num_kv_heads']} total, {p['kv_heads_per_rank']} per rank")
    )
    tier = p["host_tier_bytes"]
    tier_text = _b(tier)
    if p["host_tier_needed"] is False:
        tier_text = "not needed (GPU holds the warm set)"
    fits = {
        True: "yes",
        False: "NO",
        None: "unknown (give --gpu-memory, --host-memory, --warm-sessions)",
    }[p["fits"]]
    rows: list[tuple[str, str] | str] = [
        "model",
        ("config", f"{p['model']} ({p['model_type']}, {p['dtype']}, TP {p['tp']})"),
        (
            "layers holding KV",
            f"{p['kv_layers']} of {p['num_layers']}"
            + (
                f", {p['sliding_layers']} sliding ({p['sliding_window']} tokens)"
                if p["sliding_layers"]
                else ""
            ),
        ),
        ("KV heads", kv_heads),
        *(
            [
                (
                    "vLLM block size",
                    f"{p['engine_block_size']:,} tokens (raised from "
                    f"--block-size {p['block_size']} so that an attention page holds a state page)",
                )
            ]
            if p.get("state_layers") and p["engine_block_size"] != p["block_size"]
            else []
        ),
        ("KV bytes / token", f"{p['kv_bytes_per_token']:,} B ({p['kv_cache_dtype']} KV cache)"),
        ("KV bytes / token / rank", f"{p['kv_bytes_per_token_per_rank']:,} B"),
        *_group_rows(p),
        (
            "object tier bytes / token",
            f"{p['object_kv_bytes_per_token']:,} B"
            + (" (one copy for all ranks)" if p["mla"] and p["tp"] > 1 else ""),
        ),
        *_compression_rows(p),
        (f"one {p['context']:,}-token session", _b(p["session_kv_bytes_per_rank"]) + " per rank"),
        "weights",
        ("weights (" + p["weights_source"] + ")", _b(p["weight_bytes"])),
        *(
            [("checkpoint (index)", _b(p["checkpoint_bytes"]))]
            if p.get("checkpoint_bytes") is not None
            else []
        ),
        ("weights per rank", _b(p["weight_bytes_per_rank"])),
        ("offload backend", p["offload_backend"]),
        (
            "moved off GPU",
            _b(p["weight_offload_gpu_bytes"])
            + f" ({p['weight_offload_tensors']} tensors, {p['weight_offload_layers']} layers)",
        ),
        (
            "host RAM for them",
            _b(p["weight_offload_host_bytes"])
            + (" (pinned: power-of-two rounded)" if p["pin_memory"] else " (not pinned: exact)"),
        ),
        ("prefetch buffer pool (GPU)", _b(p["prefetch_buffer_bytes"])),
        ("resident on GPU", _b(p["resident_weight_bytes"])),
        "GPU (per rank)",
        ("GPU memory", _b(p["gpu_memory_bytes"])),
        (
            "KV budget",
            _b(p["gpu_kv_bytes"]) + f"  = {p['gpu_memory_utilization']:g} x GPU - "
            f"resident - {p['overhead_bytes'] / GiB:g} GiB overhead",
        ),
        ("KV tokens", "unknown" if p["gpu_kv_tokens"] is None else f"{p['gpu_kv_tokens']:,}"),
        (
            f"{p['context']:,}-token sessions",
            "unknown" if p["gpu_kv_sessions"] is None else f"{p['gpu_kv_sessions']:,}",
        ),
        (
            f"full-context sessions ({p['max_model_len'] or '?'})",
            "unknown"
            if p["gpu_kv_full_context_sessions"] is None
            else f"{p['gpu_kv_full_context_sessions']:,}",
        ),
        "host (per worker unless total)",
        (
            "warm set",
            _b(p["warm_set_bytes"])
            + ("" if p["warm_sessions"] is None else f" ({p['warm_sessions']} sessions)"),
        ),
        (
            "kvtier host tier",
            tier_text
            + (
                "  = --cpu-bytes"
                if p.get("cpu_bytes") is not None
                else "  = (warm - GPU KV) x 1.15"
                if tier
                else ""
            ),
        ),
        *(
            [
                (
                    "vLLM CPU KV + weights",
                    _b(p["vllm_cpu_host_bytes"])
                    + f"  (VLLM_CPU_KVCACHE_SPACE {_b(p['vllm_cpu_kv_bytes'])})",
                )
            ]
            if p.get("vllm_cpu_host_bytes") is not None
            else []
        ),
        ("headroom", _b(p["headroom_bytes"])),
        ("host total", _b(p["host_bytes_total"])),
        ("host memory", _b(p["host_memory_bytes"])),
        ("largest cpu_bytes that fits", _b(p.get("largest_cpu_bytes_that_fits"))),
        ("fits", fits),
    ]
    lines = []
    for r in rows:
        if isinstance(r, str):
            lines.append(r)
        else:
            lines.append(f"  {r[0]:<28} {r[1]}")
    lines.append("warnings" if p["warnings"] else "warnings: none")
    for w in p["warnings"]:
        lines.append(f"  [{w['code']}] {w['message']}")
    return "\n".join(lines)
