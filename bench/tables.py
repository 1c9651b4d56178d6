"""The benchmarks' printed tables: each script's rows as text, the figures as measured."""

from __future__ import annotations

import os
from typing import Any

MiB = 2**20


def print_trace_replay(res: dict[str, Any]) -> None:
    """bench/trace_replay.py: the trace, then predicted and measured hit rates per size."""
    t = res["trace"]
    print(
        f"\ntrace ({res.get('format', 'tokens')}): {t['requests']} requests, "
        f"{t['prompt_tokens']} prompt tokens, "
        f"{t['distinct_chunks']} distinct chunks of {res['chunk_size']} tokens; "
        f"slot {res['planner_slot_bytes']} B (engine: "
        f"{sorted({p['slot_bytes'] for p in res['points']})}); longest prompt "
        f"{t['max_request_chunks']} chunks; all reuse {res['max_hit_rate'] * 100:.1f} %"
    )
    print(
        f"{'cpu_bytes':>12} {'slots':>6} {'predicted':>10} {'measured':>9} {'diff':>8} "
        f"{'vLLM own':>9} {'requests differing':>19}"
    )
    for p in res["points"]:
        note = "  (below the longest prompt)" if p["below_longest_prompt"] else ""
        if p["batch"] > 1:
            note = f"  ({p['batch']} requests at a time)"
        differ = f"{p['requests_differing']:>10} of {p['requests']}" if p["batch"] == 1 else ""
        own = (p["cached_tokens_vllm"] - p["hit_tokens_host"]) / p["prompt_tokens"]
        print(
            f"{p['cpu_bytes']:>12} {p['slots']:>6} {p['predicted_hit_rate'] * 100:>9.1f}% "
            f"{p['measured_hit_rate'] * 100:>8.1f}% {p['difference_pp']:>+6.1f}pp "
            f"{own * 100:>8.1f}% {differ:>19}{note}"
        )


def scheduler_table(result: dict[str, Any]) -> str:
    """bench/scheduler_cost.py: Markdown tables of the step and lookup figures."""
    variants = [v for v in result["variants"] if v != "vllm"]
    head = "| running | index chunks | phase | vLLM µs |"
    sep = "|---|---|---|---|"
    for v in variants:
        head += f" {v} µs | {v} ÷ vLLM | {v} meta B |"
        sep += "---|---|---|"
    lines = [head, sep]
    for r in result["steps"]:
        row = (
            f"| {r['running_requests']} | {r['index_chunks']:,} | {r['phase']} | "
            f"{r['vllm_step_us']:.0f} |"
        )
        for v in variants:
            row += (
                f" {r[f'{v}_step_us']:.0f} | {r[f'{v}_ratio']:.2f} | "
                f"{r[f'{v}_meta_bytes_median']:,} |"
            )
        lines.append(row)
    lines += [
        "",
        "| connector | index chunks | outcome | matched | p50 µs | p99 µs |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["lookups"]:
        lines.append(
            f"| {r['connector']} | {r['index_chunks']:,} | {r['outcome']} | "
            f"{r['matched_tokens']:,} | {r['p50_us']:.0f} | {r['p99_us']:.0f} |"
        )
    lines += ["", scheduler_may_load_async_table(result.get("may_load_async", []))]
    lines += [
        "",
        "| worker side, step with no chunk moving: layers | median µs | p99 µs | metadata B |",
        "|---|---|---|---|",
    ]
    for r in result.get("worker", []):
        lines.append(
            f"| {r['layers']} | {r['worker_step_us']:.0f} | {r['worker_step_p99_us']:.0f} "
            f"| {r['meta_bytes']} |"
        )
    lines += [
        "",
        "| connector | chunks | bytes per chunk (RSS) | (tracemalloc) "
        "| GC-tracked objects per chunk | full collection ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["memory"]:
        lines.append(
            f"| {r['connector']} | {r['index_chunks']:,} | {r['bytes_per_chunk']:.0f} | "
            f"{r['heap_bytes_per_chunk']:.0f} | {r['gc_tracked_per_chunk']:.2f} | "
            f"{r['full_gc_ms']:.1f} |"
        )
    return "\n".join(lines)


def scheduler_may_load_async_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| may_load_async: index chunks | prompt held | answer | p50 µs | p99 µs |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['index_chunks']:,} | {r['outcome']} | {r['answer']} | "
            f"{r['p50_us']:.2f} | {r['p99_us']:.2f} |"
        )
    return "\n".join(lines)


def scheduler_pricing_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| pricing: index chunks | what | p50 µs | p99 µs | added µs (paired median) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        added = r.get("added_us_paired_median")
        lines.append(
            f"| {r['index_chunks']:,} | {r['what']} | {r['p50_us']:.2f} | {r['p99_us']:.2f} | "
            f"{'' if added is None else f'{added:+.1f}'} |"
        )
    return "\n".join(lines)


def print_compression(speed: list[dict], hits: list[dict], source: str) -> None:
    print(f"\nCompression on {source}, one thread, best of the rounds (GB/s = 1e9 B/s)")
    print(f"{'codec':<32} {'stored/raw':>10} {'compress GB/s':>13} {'decompress GB/s':>15}")
    for r in speed:
        print(
            f"{r['codec']:<32} {r['ratio']:>10.3f} {r['compress_gbps']:>13.2f} "
            f"{r['decompress_gbps']:>15.2f}"
        )
    if not hits:
        return
    r0 = hits[0]
    print(
        f"Restart-hit fetch with compression: a lookup run of {r0['chunks']} chunks of "
        f"{r0['chunk_mib']:.2f} MiB, raw, lossless and auto alternating, median of "
        f"{r0['runs']} runs (auto: a replica that read its own uploads back first, then "
        "stored the run in the form it chose)"
    )
    print(
        f"{'backend':<22} {'stored/raw':>10} {'none ms':>8} {'lossless ms':>11} "
        f"{'lossless/none':>13} {'auto stores':>11} {'auto ms':>8} {'auto/none':>9}"
    )
    for r in hits:
        form = "compressed" if r["auto_compressing"] else "raw"
        print(
            f"{r['backend']:<22} {r['stored_over_raw']:>10.3f} {r['none_ms_median']:>8.1f} "
            f"{r['lossless_ms_median']:>11.1f} {r['lossless_over_none']:>13.2f} "
            f"{form:>11} {r['auto_ms_median']:>8.1f} {r['auto_over_none']:>9.2f}"
        )


def print_encryption(rows: list[dict], speed: dict[str, float], hmac_on: bool) -> float:
    """Print the encryption table; returns the lowest sealed ÷ plain ratio."""
    print(
        f"\nEncryption: AES-256-GCM on one core {speed['seal_gbps']:.2f} GB/s seal, "
        f"{speed['open_gbps']:.2f} GB/s open in place; {rows[0]['chunk_mib']:.0f} MiB chunks, "
        f"median of the rounds, hmac={'on' if hmac_on else 'off'} on both sides, "
        f"{os.cpu_count()} CPUs"
    )
    print(
        f"{'backend':<11} {'mode':<22} {'op':<4} {'plain GB/s':>10} {'sealed GB/s':>11} "
        f"{'sealed/plain':>12} {'goal':>5}"
    )
    for r in rows:
        print(
            f"{r['backend']:<11} {r['mode']:<22} {r['op']:<4} {r['plain_gbps_median']:>10.2f} "
            f"{r['sealed_gbps_median']:>11.2f} {r['sealed_over_plain']:>12.2f} {0.9:>5.1f}"
        )
    low = min(r["sealed_over_plain"] for r in rows)
    print(f"lowest sealed/plain {low:.2f} (goal >= 0.9)")
    return low


def print_hit_latency(rows: list[dict]) -> None:
    r0 = rows[0]
    print(
        f"\nRestart-hit fetch: a lookup run of {r0['chunks']} chunks of {r0['chunk_mib']:.0f} "
        f"MiB into host slots (io_threads {r0['io_threads']}: {r0['read_threads']} read "
        f"threads), plain and sealed alternating, median of {r0['runs']} runs"
    )
    print(f"{'backend':<11} {'plain ms':>9} {'sealed ms':>10} {'added ms':>9}")
    for r in rows:
        print(
            f"{r['backend']:<11} {r['plain_ms_median']:>9.1f} {r['sealed_ms_median']:>10.1f} "
            f"{r['added_ms']:>9.1f}"
        )


INTO_GOALS = {"file": 0.8, "s3 (moto)": 0.9, "redis": 0.9}


def print_into(rows: list[dict], hmac_on: bool) -> float:
    """Print the read-into table; returns the lowest async ratio against its goal."""
    if not rows:
        return float("inf")
    r0 = rows[0]
    print(
        f"\nReads into host slots: {r0['chunk_mib']:.0f} MiB chunks, "
        f"{r0['bytes_per_round'] / MiB:.0f}-MiB rounds, median of {r0['rounds']} "
        f"(GB/s = 1e9 B/s), hmac={'on' if hmac_on else 'off'}, {os.cpu_count()} CPUs"
    )
    print(
        f"{'backend':<10} {'raw reader':<26} {'io_thr':>6} {'rd_thr':>6} {'conc':>4} "
        f"{'async GB/s':>10} {'sync GB/s':>9} {'raw GB/s':>8} {'async/raw':>9} "
        f"{'sync/raw':>8} {'goal':>5}"
    )
    worst = float("inf")
    for r in rows:
        goal = INTO_GOALS.get(r["backend"], 0.9)
        worst = min(worst, r["async_over_raw"] / goal)
        print(
            f"{r['backend']:<10} {r['raw_reader']:<26} {r['io_threads']:>6} "
            f"{r['read_threads']:>6} {r['concurrency']:>4} {r['async_gbps_median']:>10.2f} "
            f"{r['sync_gbps_median']:>9.2f} {r['raw_gbps_median']:>8.2f} "
            f"{r['async_over_raw']:>9.2f} {r['sync_over_raw']:>8.2f} {goal:>5.1f}"
        )
    return worst


def print_cluster(rows: list[tuple], spread: dict, chunks: int, size: int, rounds: int) -> float:
    """Print the cluster table; returns the lowest median kvtier ÷ raw ratio."""
    print(
        f"\nRedis: 1 node and a 3-primary cluster, {chunks} chunks of {size / MiB:.1f} MiB, "
        f"best of {rounds} rounds (ratio median: of the median rounds), {os.cpu_count()} CPUs; "
        "raw: redis.Redis on the node, redis.cluster.RedisCluster on the cluster"
    )
    print(
        f"{'target':<11} {'mode':<22} {'op':<4} {'kvtier MB/s':>12} {'raw MB/s':>10} "
        f"{'ratio best':>10} {'ratio median':>12}"
    )
    for target, mode, op, kv, raw, median_ratio in rows:
        print(
            f"{target:<11} {mode:<22} {op:<4} {kv:>12.1f} {raw:>10.1f} {kv / raw:>10.2f} "
            f"{median_ratio:>12.2f}"
        )
    low = min(r[5] for r in rows)
    print(f"lowest median ratio kvtier/raw {low:.2f} (goal >= 0.9)")
    shares = ", ".join(f"{n / spread['keys']:.3f}" for n in spread["per_primary"].values())
    print(
        f"{spread['keys']} random chunk keys over {len(spread['per_primary'])} primaries: "
        f"shares {shares}; busiest ÷ mean {spread['max_over_mean']:.3f}"
    )
    return low


def print_putget(rows: list[tuple], chunks: int, size: int, rounds: int, hmac: bool) -> None:
    """bench/tier_throughput.py's put/get table: kvtier's tier ÷ the raw client."""
    print(
        f"\n{chunks} chunks of {size / MiB:.1f} MiB, best of {rounds} rounds, "
        f"hmac={'on' if hmac else 'off'}, {os.cpu_count()} CPUs"
    )
    print(
        f"{'backend':<11} {'mode':<22} {'op':<4} {'kvtier MB/s':>12} {'raw MB/s':>10} "
        f"{'ratio best':>10} {'ratio median':>12}"
    )
    worst = float("inf")
    for backend, mode, op, kv, raw, median_ratio in rows:
        ratio = kv / raw
        worst = min(worst, median_ratio)
        print(
            f"{backend:<11} {mode:<22} {op:<4} {kv:>12.1f} {raw:>10.1f} {ratio:>10.2f} "
            f"{median_ratio:>12.2f}"
        )
    print(f"lowest median ratio kvtier/raw {worst:.2f} (goal >= 0.9)")


#: restart hit ÷ in-engine hit, the goal per tier
TTFT_GOALS = {"file": 1.2, "redis": 1.4, "s3": 1.6}


def print_ttft_breakdown(rows: list[dict]) -> None:
    """bench/ttft.py: restart hit = in-engine hit + raw client + kvtier's own, per tier
    and length."""
    print(
        "\nrestart hit = in-engine hit + raw client (same chunks, same threads) + kvtier's own (ms)"
    )
    print(
        f"{'tokens':>6} {'tier':>5} {'restart':>8} {'in-eng':>7} {'raw':>7} {'raw 1st+':>8}"
        f" {'own':>7} {'own goal':>8} {'÷in-eng':>7} {'goal':>5} {'chunks':>6} {'MiB':>5}"
    )
    for r in rows:
        for kind, d in r["restart"].items():
            raw = d.get("raw")
            if raw is None:
                continue
            print(
                f"{r['prompt_tokens']:>6} {kind:>5} {d['restart_hit_ttft_s'] * 1000:>8.1f} "
                f"{d['engine_hit_ttft_s'] * 1000:>7.1f} {raw['parallel_s'] * 1000:>7.1f} "
                f"{raw['first_then_rest_s'] * 1000:>8.1f} {d['kvtier_own_s'] * 1000:>7.1f} "
                f"{d['kvtier_own_goal_s'] * 1000:>8.1f} {d['over_engine_hit']:>7.2f} "
                f"{TTFT_GOALS[kind]:>5} {raw['objects']:>6} {raw['bytes'] / 2**20:>5.0f}"
            )
    inproc = [
        (r["prompt_tokens"], kind, d)
        for r in rows
        for kind, d in r["restart"].items()
        if "inprocess" in d
    ]
    if inproc:
        print(
            "\nthe same hits, in-process engine (--profile) beside the multiprocess"
            " one (vllm serve's), ms:"
        )
        print(
            f"{'tokens':>6} {'tier':>5} {'in-proc':>8} {'in-eng':>7} {'÷':>5}"
            f" {'multi':>8} {'in-eng':>7} {'÷':>5}"
        )
        for n, kind, d in inproc:
            ip = d["inprocess"]
            a, b = ip["restart_hit_ttft_s"], ip["engine_hit_ttft_s"]
            c, e = d["restart_hit_ttft_s"], d["engine_hit_ttft_s"]
            print(
                f"{n:>6} {kind:>5} {a * 1000:>8.1f} {b * 1000:>7.1f} {a / b:>5.2f}"
                f" {c * 1000:>8.1f} {e * 1000:>7.1f} {c / e:>5.2f}"
            )
    firsts = (
        [
            (kind, d["first_request"])
            for kind, d in rows[0]["restart"].items()
            if "first_request" in d
        ]
        if rows
        else []
    )
    if firsts:
        print("\nthe restarted engine's first request (a restart hit right after startup), ms:")
        for kind, f in firsts:
            print(
                f"{f['tokens']:>6} {kind:>5} {f['ttft_s'] * 1000:>8.1f}"
                f"   ({f['cached']} tokens cached)"
            )


def print_ttft_one(result: dict) -> None:
    """bench/ttft.py at one prompt length: (a) to (d), the ratios and the breakdown."""
    a, b, c = (result[k] * 1000 for k in ("cold_ttft_s", "engine_hit_ttft_s", "kvtier_hit_ttft_s"))
    print(
        f"\nTTFT, median of {result['samples']}, {result['prompt_tokens']}-token prompt, "
        f"{result['model']}"
    )
    print(f"  (a) cold prefill                  {a:8.1f} ms")
    print(
        f"  (b) vLLM in-engine prefix hit     {b:8.1f} ms"
        f"   ({result['cached_tokens_engine']} tokens cached)"
    )
    print(
        f"  (c) kvtier host-tier hit          {c:8.1f} ms"
        f"   ({result['cached_tokens_kvtier']} tokens loaded)"
    )
    print(f"  c/b = {c / b:.3f}   (goal <= 1.10)")
    print(f"  c/a = {c / a:.3f}   (goal <= 0.06)")
    for kind, r in result["restart"].items():
        d, b2 = r["restart_hit_ttft_s"] * 1000, r["engine_hit_ttft_s"] * 1000
        print(
            f"  (d) {kind:5} tier hit after an engine restart {d:8.1f} ms;"
            f" ÷ in-engine hit there ({b2:.1f} ms) = {r['over_engine_hit']:.2f}"
            f"   (goal <= {TTFT_GOALS[kind]}; {r['cached'][0]} tokens cached)"
        )
    print_ttft_breakdown([result])


def print_ttft_sweep(result: dict) -> None:
    """bench/ttft.py --sweep: a row per prompt length, then the breakdown."""
    tiers = list(result["sweep"][0]["restart"])
    print(f"\nTTFT (ms), median of {result['samples']} per length, {result['model']}")
    head = f"{'tokens':>6} {'cold':>8} {'in-engine':>9} {'host':>7}"
    head += "".join(f" {t + ' restart':>14} {'÷ in-eng':>8}" for t in tiers)
    print(head)
    for r in result["sweep"]:
        line = (
            f"{r['prompt_tokens']:>6} {r['cold_ttft_s'] * 1000:>8.1f} "
            f"{r['engine_hit_ttft_s'] * 1000:>9.1f} {r['kvtier_hit_ttft_s'] * 1000:>7.1f}"
        )
        for t in tiers:
            d = r["restart"][t]
            line += f" {d['restart_hit_ttft_s'] * 1000:>14.1f} {d['over_engine_hit']:>8.2f}"
        print(line)
    print_ttft_breakdown(result["sweep"])
