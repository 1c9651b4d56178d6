"""``kvtier demo``: a real vLLM engine with kvtier on a locally built model.

Builds an 8-layer, 1024-wide Llama with random weights (nothing is downloaded),
then runs two engines, one after the other, each in its own process:

1. Engine 1 answers questions about a few long shared documents. vLLM's own
   prefix cache is flushed before every request, as GPU memory pressure would
   evict it in production; kvtier's host tier brings the document's KV back.
2. Engine 2 starts after engine 1 has exited, with an empty host tier, and gets
   its hits from the local-directory object tier engine 1 wrote.

It prints what each request cost: prompt tokens, tokens served by kvtier and from
which of its tiers, tokens vLLM's own prefix cache served, the prompt tokens kvtier
missed and why (``kvtier:miss_tokens`` reasons, the tail past the last full chunk
left out), and time to first token (TTFT), then TTFT cold vs with a kvtier hit.
vLLM's ``reset_prefix_cache()`` may refuse (while a finished request's blocks are
still held); the demo retries it and says so when it never succeeded, since vLLM's
own cache then serves what kvtier would have.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DOC_TOKENS = 1536
QUESTION_TOKENS = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the demo's flags."""
    parser.add_argument(
        "--workdir",
        help="where the model and the object tier go (default: a new temporary directory)",
    )
    parser.add_argument("--docs", type=int, default=3, help="shared documents (default 3)")
    parser.add_argument(
        "--questions", type=int, default=3, help="questions per document (default 3)"
    )
    parser.add_argument(
        "--small", action="store_true",
        help="a 4-layer, 256-wide model: faster, but prefill is too cheap to show savings",
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the process exit code."""
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvtier-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = workdir / ("model-small" if args.small else "model")
    tier_dir = workdir / "object-tier"
    shape = dict(layers=4, hidden=256) if args.small else dict(layers=8, hidden=1024)
    _say(f"building a {shape['layers']}-layer, {shape['hidden']}-wide Llama in {model_dir} ...")
    from kvtier.cli.tinymodel import build_tiny_llama

    build_tiny_llama(model_dir, heads=16 if not args.small else 4,
                     kv_heads=8 if not args.small else 2, **shape)
    common = {"model": str(model_dir), "tier": str(tier_dir), "docs": args.docs}
    _say("engine 1: host tier 1 GiB + local-directory object tier (vLLM starts in ~30 s) ...")
    first = _phase({**common, "phase": 1, "questions": args.questions})
    if first is None:
        return 1
    _say("engine 1 exited. engine 2: a new process with an empty host tier ...")
    second = _phase({**common, "phase": 2, "questions": 1})
    if second is None:
        return 1
    _report(first, second)
    return 0


def _say(msg: str) -> None:
    print(f"[kvtier demo] {msg}", file=sys.stderr, flush=True)


def _phase(spec: dict[str, Any]) -> list[dict[str, Any]] | None:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.demo", json.dumps(spec)],
        capture_output=True, text=True, env=env,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            rows: list[dict[str, Any]] = json.loads(line[7:])
            return rows
    sys.stderr.write(proc.stderr[-8000:])
    _say(f"engine {spec['phase']} failed (exit {proc.returncode}); its log is above")
    return None


def _source(r: dict[str, Any]) -> str:
    """Which of kvtier's tiers served the row: host, disk, both, or "-"."""
    parts = [name for name, key in (("host", "host_tokens"), ("disk", "remote_tokens"))
             if r.get(key)]
    return "+".join(parts) or "-"


def _missed(r: dict[str, Any]) -> str:
    """The prompt tokens kvtier missed, by reason (the tail left out), or "-"."""
    missed = {k: v for k, v in r.get("missed", {}).items() if v and k != "tail"}
    return ",".join(f"{k}:{v}" for k, v in sorted(missed.items())) or "-"


def _report(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> None:
    print()
    print(f"{'engine':>6} {'doc':>4} {'q':>3} {'prompt':>7} {'kvtier':>7} {'source':>9} "
          f"{'vllm':>6} {'missed':>14} {'TTFT ms':>8}")
    for phase, rows in ((1, first), (2, second)):
        for r in rows:
            vllm = f"{r['vllm_tokens']}{'' if r['reset'] else '!'}"
            print(f"{phase:>6} {r['doc']:>4} {r['q']:>3} {r['prompt_tokens']:>7} "
                  f"{r['kvtier_tokens']:>7} {_source(r):>9} {vllm:>6} {_missed(r):>14} "
                  f"{r['ttft_s'] * 1000:>8.1f}")
    rows = first + second
    print()
    print("kvtier: tokens kvtier's host tier or disk tier served; vllm: tokens vLLM's own "
          "prefix cache served; missed: tokens kvtier lacked, by reason")
    unreset = sum(not r["reset"] for r in rows)
    if unreset:
        print(f"! vLLM's prefix cache could not be flushed before {unreset} request(s): "
              "its own hits there stand in for kvtier's")
    cold = [r["ttft_s"] for r in rows if r["kvtier_tokens"] == 0 and r["vllm_tokens"] == 0]
    host = [r["ttft_s"] for r in first if r["kvtier_tokens"] > 0]
    remote = [r["ttft_s"] for r in second if r["kvtier_tokens"] > 0]
    prompt = sum(r["prompt_tokens"] for r in rows)
    served = sum(r["kvtier_tokens"] for r in rows)
    print()
    print(f"requests                   {len(rows)}")
    print(f"prompt tokens              {prompt}")
    print(f"tokens served by kvtier    {served} ({served / max(prompt, 1):.0%})")
    if cold:
        print(f"TTFT cold (median)         {statistics.median(cold) * 1000:.1f} ms")
    if host:
        print(f"TTFT host-tier hit         {statistics.median(host) * 1000:.1f} ms")
    if remote:
        print(f"TTFT after restart (disk)  {statistics.median(remote) * 1000:.1f} ms")
    if second and "canary" in second[0]:
        c = second[0]["canary"]
        print(f"canary (engine 2)          {c['match']} match, {c['mismatch']} mismatch: the "
              "stored KV checked against vLLM's own before engine 2 loads any")
    if cold and host:
        saved = 1 - statistics.median(host) / statistics.median(cold)
        print(f"TTFT saved by a hit        {saved:.0%}")


# ---- engine process --------------------------------------------------------------------------
def _reset_prefix_cache(llm: Any) -> bool:
    """Flush vLLM's own prefix cache; True once it said it did. vLLM refuses while blocks
    are still held (a finished request's, for a moment): a few tries, then False."""
    for _ in range(20):
        if llm.reset_prefix_cache():
            return True
        time.sleep(0.05)
    return False


def _tokens(seed: int, n: int) -> list[int]:
    return [((i * 7919 + seed * 104729 + seed * seed) % 480) + 5 for i in range(n)]


def _engine(spec: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier import metrics
    from kvtier.sizing.emit import shutdown_flags
    from kvtier.stats import total_name

    ktc: dict[str, Any] = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.connectors.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes": "1GiB", "cpu_headroom_bytes": "1GiB",
            "remote_url": f"file://{spec['tier']}",
        },
        # as kvtier advises: a failed load is recomputed, and the directory tier's
        # lookups answer in their own step (kvtier.connectors.one_step_lookups)
        "kv_load_failure_policy": "recompute",
    }
    # as kvtier advises: the engine's stop leaves the queued uploads time to flush
    env, stop = shutdown_flags(ktc["kv_connector_extra_config"])
    os.environ.update(env)
    llm = LLM(model=spec["model"], enforce_eager=True, block_size=32, max_model_len=4096,
              seed=0, kv_transfer_config=ktc, shutdown_timeout=int(stop[1]))
    side = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler \
        if hasattr(llm.llm_engine.engine_core, "engine_core") else None
    sp = SamplingParams(max_tokens=1, temperature=0)
    # warm-up: the first forward pass sets up kernels; keep it out of the figures
    llm.generate([TokensPrompt(prompt_token_ids=_tokens(7, 200))], sp, use_tqdm=False)
    # the check document: engine 1 (the directory's first writer) stores it; engine 2,
    # which finds another engine's chunks there, trusts them only once the KV vLLM computes
    # for this document matches the stored chunk (kvtier's canary), and loads after that
    canary = {"match": 0, "mismatch": 0}

    def checks(outcome: str) -> str:  # the canary's counter in the scheduler's totals
        return total_name(metrics.CANARY, (outcome,))

    check = TokensPrompt(prompt_token_ids=_tokens(99, DOC_TOKENS) + [1] * 8)
    if spec["phase"] == 2:
        before = dict(side.totals) if side else {}
        llm.generate([check], sp, use_tqdm=False)
        for _ in range(50):  # the workers report the comparisons in later steps
            if side is None or (side.canary.pending == 0 and any(
                    side.totals[checks(r)] > before.get(checks(r), 0) for r in canary)):
                break
            llm.generate([TokensPrompt(prompt_token_ids=_tokens(8, 16))], sp, use_tqdm=False)
        if side is not None:
            canary = {r: side.totals[checks(r)] - before.get(checks(r), 0)
                      for r in canary}
    rows = []
    for q in range(spec["questions"]):
        for d in range(spec["docs"]):
            prompt = _tokens(100 + d, DOC_TOKENS) + _tokens(1000 * spec["phase"] + 10 * d + q,
                                                            QUESTION_TOKENS)
            reset = _reset_prefix_cache(llm)  # what GPU memory pressure does to a prefix
            before = dict(side.totals) if side else {}
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
            ttft = time.perf_counter() - t0
            after = dict(side.totals) if side else {}
            delta = {k: after[k] - before.get(k, 0) for k in after}
            cached = out.num_cached_tokens or 0
            host, remote = delta.get("hit_tokens_host", 0), delta.get("hit_tokens_remote", 0)
            if side is None:  # (the engine in another process: the split is unknown)
                host = cached
            rows.append({
                "doc": d, "q": q, "prompt_tokens": len(prompt),
                "kvtier_tokens": host + remote, "host_tokens": host, "remote_tokens": remote,
                "vllm_tokens": max(0, cached - host - remote), "reset": reset,
                "missed": {k.removeprefix("miss_tokens_"): v for k, v in delta.items()
                           if k.startswith("miss_tokens_")},
                "ttft_s": ttft,
            })
    if spec["phase"] == 1:
        llm.generate([check], sp, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()  # flushes queued uploads to the object tier
    if spec["phase"] == 2:
        for row in rows:
            row["canary"] = canary
    return rows


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    result = _engine(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)
