#!/usr/bin/env python3
"""Hand-off at drain (issue 61): the hot chunks a stopping engine writes to the object tier.

Goal: a drained engine with ``write_policy: write_back`` hands off >= 95 % of its hot
chunks (host-tier chunks it hit that the object tier lacks) within ``shutdown_flush_s``.

For each ``--flush-s`` value (default: kvtier's default, 10 s, and 1 s) this

1. starts vLLM's OpenAI server (CPU build) on the tiny random-weight Llama of
   bench/llm_engine.py with kvtier: a host tier of twice the documents' chunks (at
   least 256 MiB), 256-token chunks, ``write_back`` to a fresh ``file://`` directory
   tier, the canary off (as the other benches), and the stop window kvtier asks for
   (``--shutdown-timeout`` and ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``:
   ``kvtier.sizing.emit.shutdown_flags``);
2. serves ``--docs`` documents of ``--doc-tokens`` tokens once each (stored in the host
   tier; under write_back with room to spare none is uploaded), then the first
   ``--hot-docs`` of them ``--repeats`` more times, vLLM's own prefix cache reset before
   every request, so each repeat is a kvtier host hit of all its full chunks (the client
   checks its cached tokens): ``hot_docs x doc_tokens // 256`` hot chunks;
3. waits out the scheduler's send interval (``kvtier.hotset.SEND_S``, 30 s) after the
   last hit and sends one short request, whose step carries the hand-off list to the
   worker (connectors/hot.py) and the heat to the manifest; with ``--at-once`` it drains
   right after the last hit instead (the hand-off list is then the one the scheduler
   brought up to date within a second of the last hits; the manifest's hot list, which
   the check from the tier maps, was sent only if serving took 30 s);
4. drains the engine as an operator's rollout does: SIGTERM to the API server alone, then
   waits for it to exit (tests/e2e/test_serve_shutdown.py), timed;
5. measures from the tier: every kvtier object of the directory (``kvtier store``'s
   listing, kvtier/objects/store_admin.py), the generation manifest's hot list (the hits
   the engine sent) mapped to object keys (the namespace rebuilt from the manifest and
   checked against the generation id): which hot chunks are in the tier, how many
   chunk objects besides, and the span of their write times (mtimes); and from the
   server's log, the worker's ``handed off N of M hot chunks ... in S s; K left`` line
   (what ``kvtier:handoff_chunks{outcome}`` counts; that metric is recorded as the
   engine stops, after vLLM's last stats, so no scrape sees it here).

Prints, per flush value, hot chunks, the hand-off list, written, left, hot chunks found
in the tier, the share handed off, the hand-off's seconds (log, tier) and the stop's, and
the goal. ``--json`` prints one JSON object instead, ``--out FILE`` writes it too.
Progress goes to stderr. About 2 minutes per flush value on 2 cores (30 s of it the send
interval).

    make bench-handoff
    python bench/handoff.py --flush-s 10,1,0.05 --layers 4 --hidden 256 --heads 4 --kv-heads 2
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import Unavailable, VLLMServer, positive_int
from llm_engine import BLOCK_SIZE, CHUNK_TOKENS, prompt, seeds, tiny_model
from llm_engine import kv_bytes_per_token as llama_kv_bytes_per_token

#: hot chunks handed off / hot chunks held (issue 61's goal)
GOAL = 0.95
MiB = 2**20
SERVED = "handoff-bench"
#: the worker's line (kvtier/connectors/shutdown.py, HandoffReport.describe)
HANDED_OFF = re.compile(
    r"handed off (\d+) of (\d+) hot chunks .*? in ([\d.]+) s; (\d+) left "
    r"\((\d+) failed, (\d+) not written in time\)"
)
#: the flush of the queue after it (kvtier/connectors/worker.py, shutdown)
NOT_FLUSHED = re.compile(r"(\d+) queued object-tier writes were not written at shutdown")


def log(msg: str) -> None:
    print(f"[handoff bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _floats(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated seconds: {text!r}") from None
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from kvtier.config import load_config

    default_flush = load_config({}, environ={}).shutdown_flush_s
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n", 1)[0],
        epilog=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--flush-s",
        type=_floats,
        default=[default_flush, 1.0],
        help=f"shutdown_flush_s values, one engine each (default "
        f"{default_flush:g},1: kvtier's default and a smaller one)",
    )
    parser.add_argument("--docs", type=positive_int, default=16, help="documents served once")
    parser.add_argument(
        "--hot-docs",
        type=positive_int,
        default=8,
        help="of them, served --repeats more times (hot)",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=2,
        help="more requests of each hot document (host hits)",
    )
    parser.add_argument(
        "--doc-tokens",
        type=positive_int,
        default=1088,
        help="tokens per document (1088: 4 full chunks and 64 tokens)",
    )
    parser.add_argument("--layers", type=positive_int, default=4, help="the model's layers")
    parser.add_argument("--hidden", type=positive_int, default=256, help="its hidden size")
    parser.add_argument("--heads", type=positive_int, default=4, help="its attention heads")
    parser.add_argument("--kv-heads", type=positive_int, default=2, help="its KV heads")
    parser.add_argument(
        "--at-once",
        action="store_true",
        help="drain right after the last hit: no send interval waited, no "
        "further request (the hand-off list is then the last one sent while "
        "serving, if any)",
    )
    parser.add_argument(
        "--model-dir", help="where the tiny model is built (default: a temp directory per shape)"
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the tier directories and server logs (their path is logged)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="also write the result JSON to this file")
    args = parser.parse_args(argv)
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error("--hidden must be a multiple of --heads, --heads of --kv-heads")
    if args.hot_docs > args.docs:
        parser.error("--hot-docs must be at most --docs")
    if args.doc_tokens < CHUNK_TOKENS:
        parser.error(f"--doc-tokens must be at least one chunk ({CHUNK_TOKENS})")
    return args


# ---- the engine ---------------------------------------------------------------------------


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    return llama_kv_bytes_per_token(args.layers, args.hidden, args.heads, args.kv_heads)


def complete(client: Any, base: str, tokens: list[int]) -> int:
    """One greedy one-token completion of ``tokens``; its cached prompt tokens."""
    r = client.post(
        base + "/v1/completions",
        json={"model": SERVED, "prompt": tokens, "max_tokens": 1, "temperature": 0},
    )
    r.raise_for_status()
    details = r.json().get("usage", {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def serve(
    server: VLLMServer, args: argparse.Namespace, docs: list[list[int]], trigger: list[int]
) -> dict[str, Any]:
    """Every document once, the hot ones ``--repeats`` more times (vLLM's prefix cache reset
    before each request), the send interval waited out, the short request: what the
    client saw."""
    import httpx

    from kvtier.cli.bench_client import reset_prefix_cache
    from kvtier.hotset import SEND_S

    full = args.doc_tokens // CHUNK_TOKENS * CHUNK_TOKENS
    hits, short = 0, []
    t0 = time.monotonic()
    with httpx.Client(timeout=300, trust_env=False) as client:
        for tokens in docs:
            reset_prefix_cache(client, server.url)
            complete(client, server.url, tokens)
        log(f"served {len(docs)} documents once [{time.monotonic() - t0:.0f} s]")
        for r in range(args.repeats):
            for i in range(args.hot_docs):
                reset_prefix_cache(client, server.url)
                cached = complete(client, server.url, docs[i])
                hits += 1
                if cached < full:
                    short.append((r, i, cached))
        last_hit = time.monotonic()
        log(
            f"served the {args.hot_docs} hot documents {args.repeats} more times "
            f"[{last_hit - t0:.0f} s]"
        )
        if not args.at_once:
            log(f"waiting {SEND_S + 2:.0f} s for the scheduler's send")
            time.sleep(max(0.0, SEND_S + 2 - (time.monotonic() - last_hit)))
            complete(client, server.url, trigger)  # its step carries the hand-off list
    if short:
        log(
            f"{len(short)} hot requests got fewer cached tokens than their {full} "
            f"(repeat, doc, cached): {short[:5]}"
        )
    return {"hot_requests": hits, "hot_requests_short": len(short), "serve_s": last_hit - t0}


def drain(server: VLLMServer, window_s: int) -> dict[str, Any]:
    """SIGTERM to the API server alone, as Kubernetes stops a pod; then wait for it."""
    assert server.proc is not None and server.proc.proc is not None
    proc = server.proc.proc
    sent = time.time()
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    killed = False
    try:
        proc.wait(window_s + 30)
    except subprocess.TimeoutExpired:
        killed = True
    stop_s = time.monotonic() - t0
    server.stop()  # whatever of its process group is left
    return {
        "sigterm_at": sent,
        "stop_s": stop_s,
        "exit_code": proc.returncode,
        "killed_after_window": killed,
    }


# ---- what the tier holds ----------------------------------------------------------------------


def rebuilt_namespace(manifest: Any, generation: str) -> Any:
    """The engine's namespace from its manifest (the object tier's keys carry no model
    name); None when it does not give the generation's id."""
    from kvtier.keys import Namespace

    version, _, layers = manifest.layout.partition(":")
    for model in ("", manifest.model):
        ns = Namespace(
            model,
            manifest.revision or None,
            manifest.dtype,
            manifest.kv_cache_dtype,
            BLOCK_SIZE,
            manifest.chunk_size,
            manifest.tp_size,
            namespace=manifest.namespace,
            layout_version=int(version.lstrip("v")),
            pp_size=manifest.pp_size,
            fingerprint=manifest.fingerprint,
            layers=layers,
        )
        if ns.generation() == generation:
            return ns
    return None


def tier_contents(root: Path, sigterm_at: float) -> dict[str, Any]:
    """The directory tier's chunks: all of them, the manifest's hot keys among them, and
    when they were written (seconds after the SIGTERM)."""
    from kvtier.keys import KeySpace
    from kvtier.objects.store_admin import usage
    from kvtier.objects.tiers import FileTier

    tier = FileTier(str(root), background_sweep=False)
    try:
        found = usage(tier, None)
    finally:
        tier.close()
    chunks = [c for g in found.generations for c in g.chunks]
    out: dict[str, Any] = {
        "generations": len(found.generations),
        "chunks": len(chunks),
        "chunk_mib": sum(c.size for c in chunks) / MiB,
        "hot_list": None,
        "hot_in_tier": None,
        "other_chunks": None,
        "keys_mapped": False,
        "first_write_s": None,
        "write_span_s": None,
    }
    if chunks:
        times = sorted(c.used for c in chunks)  # the file tier: its mtime
        out["first_write_s"] = times[0] - sigterm_at
        out["write_span_s"] = times[-1] - times[0]
    gens = [g for g in found.generations if g.manifest is not None]
    if len(gens) != 1:
        log(f"the tier holds {len(gens)} generations with a manifest, not one: hot keys not mapped")
        return out
    gen = gens[0]
    manifest = gen.manifest
    out["hot_list"] = len(manifest.hot)
    ns = rebuilt_namespace(manifest, gen.id)
    if ns is None:
        log(
            "the namespace rebuilt from the manifest does not give its generation: hot "
            "keys not mapped"
        )
        return out
    keys = KeySpace.worker(ns, 0, 0)
    stored = {c.key for c in gen.chunks}
    hot = [keys.key(k) for k, _heat in manifest.hot.entries]
    out["keys_mapped"] = True
    out["hot_in_tier"] = sum(k in stored for k in hot)
    out["other_chunks"] = len(stored - set(hot))
    return out


def handoff_log(text: str) -> dict[str, Any]:
    """The worker's hand-off line(s) and the flush's, summed over workers."""
    lines = HANDED_OFF.findall(text)
    out = {
        "lines": len(lines),
        "written": 0,
        "listed": 0,
        "seconds": 0.0,
        "left": 0,
        "failed": 0,
        "late": 0,
        "not_flushed": sum(int(n) for n in NOT_FLUSHED.findall(text)),
    }
    for written, listed, secs, left, failed, late in lines:
        out["written"] += int(written)
        out["listed"] += int(listed)
        out["seconds"] = max(out["seconds"], float(secs))
        out["left"] += int(left)
        out["failed"] += int(failed)
        out["late"] += int(late)
    return out


# ---- one run --------------------------------------------------------------------------------


def run_one(
    flush_s: float, args: argparse.Namespace, model: Path, max_len: int, workdir: Path
) -> dict[str, Any]:
    from kvtier.sizing.emit import FAILURE_POLICY, connector_config, shutdown_flags

    root = workdir / f"tier-{flush_s:g}"
    root.mkdir(parents=True)
    chunks_per_doc = args.doc_tokens // CHUNK_TOKENS
    # room for every document's chunks twice over: write_back uploads nothing ahead of
    # eviction, and every chunk in the tier is a hand-off's
    host = max(256 * MiB, 2 * args.docs * chunks_per_doc * CHUNK_TOKENS * kv_bytes_per_token(args))
    extra = {
        "cpu_bytes": host,
        "chunk_size": CHUNK_TOKENS,
        "remote_url": f"file://{root}",
        "write_policy": "write_back",
        "shutdown_flush_s": flush_s,
        "canary_first_hit": False,
    }
    env, stop_args = shutdown_flags(extra)
    window = int(stop_args[1])
    ktc = {**connector_config(extra), "kv_load_failure_policy": FAILURE_POLICY}
    # the device cache: twice the model's length (vLLM's own prefix cache is reset anyway)
    kv_bytes = 2 * max_len * kv_bytes_per_token(args)
    server = VLLMServer(
        python=sys.executable,
        model=model,
        log=workdir / f"vllm-{flush_s:g}.log",
        kv_transfer=ktc,
        kv_cache_bytes=kv_bytes,
        max_model_len=max_len,
        env=env,
        served_name=SERVED,
        args=stop_args,
    )
    docs = [prompt(s, args.doc_tokens) for s in seeds(1, args.docs)]
    trigger = prompt(seeds(1, args.docs + 1)[-1], CHUNK_TOKENS // 2)  # no full chunk
    log(
        f"flush {flush_s:g} s: starting vLLM ({' '.join(stop_args)}, "
        f"{' '.join(f'{k}={v}' for k, v in env.items())})"
    )
    try:
        server.start()
        log(f"flush {flush_s:g} s: server up in {server.start_s:.0f} s")
        served = serve(server, args, docs, trigger)
        log(f"flush {flush_s:g} s: draining (SIGTERM to the API server)")
        stopped = drain(server, window)
    finally:
        server.stop()
    text = server.log.read_text(errors="replace")
    handed = handoff_log(text)
    tier = tier_contents(root, stopped["sigterm_at"])
    hot = args.hot_docs * chunks_per_doc
    # the manifest's hot list maps the hot chunks; without it (not sent yet: --at-once),
    # every chunk object, which under write_back with room to spare only the drain wrote
    in_tier = tier["hot_in_tier"] if tier["keys_mapped"] and tier["hot_list"] else tier["chunks"]
    share = in_tier / hot if hot else 0.0
    within = handed["lines"] > 0 and handed["seconds"] <= flush_s
    log(
        f"flush {flush_s:g} s: {hot} hot chunks, hand-off list {handed['listed']}, written "
        f"{handed['written']}, left {handed['left']}; hot in tier {in_tier} "
        f"({share:.0%}), hand-off {handed['seconds']:.1f} s, stop {stopped['stop_s']:.1f} s"
    )
    if not handed["lines"]:
        log(f"flush {flush_s:g} s: no hand-off line in {server.log}")
    return {
        "shutdown_flush_s": flush_s,
        "at_once": args.at_once,
        "stop_window_s": window,
        "server_start_s": server.start_s,
        "cpu_bytes": host,
        "hot_chunks": hot,
        "chunk_bytes": CHUNK_TOKENS * kv_bytes_per_token(args),
        **served,
        "log": handed,
        "tier": tier,
        "stop": stopped,
        "handed_off": in_tier,
        "share": share,
        "within_flush": within,
        "goal": GOAL,
        "met": share >= GOAL and within,
        "server_log": str(server.log) if args.keep else None,
    }


# ---- output -----------------------------------------------------------------------------------


def print_table(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(
        f"\nHand-off at drain (write_back, file:// tier; {cfg['docs']} documents of "
        f"{cfg['doc_tokens']} tokens, {cfg['hot_docs']} hot ({cfg['repeats']} host hits "
        f"each); chunks of {cfg['chunk_bytes'] / MiB:.2f} MiB; goal >= {GOAL:.0%} of the "
        f"hot chunks handed off within shutdown_flush_s; drained "
        f"{'right after the last hit' if cfg['at_once'] else 'after the send interval'})"
    )
    print(
        "| shutdown_flush_s | hot chunks | hot list (manifest) | hand-off list | written "
        "| left | hot chunks in tier | other chunks in tier | handed off | hand-off s "
        "(log) | writes' span s (tier) | stop s | goal | met |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in result["runs"]:
        lg, t = r["log"], r["tier"]
        span = "-" if t["write_span_s"] is None else f"{t['write_span_s']:.3f}"
        other = "-" if t["other_chunks"] is None else t["other_chunks"]
        print(
            f"| {r['shutdown_flush_s']:g} | {r['hot_chunks']} | {t['hot_list']} "
            f"| {lg['listed']} | {lg['written']} | {lg['left']} | {r['handed_off']} "
            f"| {other} | {r['share']:.0%} | {lg['seconds']:.1f} | {span} "
            f"| {r['stop']['stop_s']:.1f} | >= {GOAL:.0%} | {'yes' if r['met'] else 'NO'} |"
        )
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    model, max_len = tiny_model(
        [args.doc_tokens],
        args.layers,
        args.hidden,
        model_dir=args.model_dir,
        heads=args.heads,
        kv_heads=args.kv_heads,
    )
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-handoff-bench-"))
    if args.keep:
        log(f"tier directories and logs under {workdir}")
    result: dict[str, Any] = {"runs": [], "unavailable": {}}
    try:
        for flush_s in args.flush_s:
            try:
                result["runs"].append(run_one(flush_s, args, model, max_len, workdir))
            except Unavailable as exc:
                log(f"flush {flush_s:g} s: unavailable: {exc}")
                result["unavailable"][f"{flush_s:g}"] = str(exc)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    result["config"] = {
        "docs": args.docs,
        "hot_docs": args.hot_docs,
        "repeats": args.repeats,
        "doc_tokens": args.doc_tokens,
        "at_once": args.at_once,
        "layers": args.layers,
        "hidden": args.hidden,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "chunk_tokens": CHUNK_TOKENS,
        "block_size": BLOCK_SIZE,
        "chunk_bytes": CHUNK_TOKENS * kv_bytes_per_token(args),
        "goal": GOAL,
        "seconds": time.monotonic() - t0,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
        for flush, why in result["unavailable"].items():
            print(f"\nshutdown_flush_s {flush}: unavailable: {why}")
    return 0 if result["runs"] and not result["unavailable"] else 1


if __name__ == "__main__":
    sys.exit(main())
