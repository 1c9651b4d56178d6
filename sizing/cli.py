"""The ``kvtier`` command line: ``size``, ``doctor``, ``bench``, ``demo``.

Only the standard library is imported here; each subcommand imports its own
module when it runs, so ``kvtier size`` starts fast and never loads torch or vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvtier import __version__

DESCRIPTION = """\
Tiered KV-cache offload for vLLM: a host-RAM tier and a shared object-store tier
behind one KV connector. These commands plan memory before a deployment, check a
running one, and measure what offload buys."""

COMMANDS = {
    "size": "Plan GPU and host memory for a model: KV bytes/token, the GPU KV budget, the "
    "host tier, vLLM weight offload and its pinned-memory cost; --emit prints configs to paste",
    "doctor": "Read a vLLM server log (and optionally a PID) and report what weight offload "
    "and kvtier really did, flagging the silent failures",
    "bench": "Drive an OpenAI-compatible endpoint with a shared-prefix workload and report hit "
    "rate and TTFT",
    "demo": "Run a local vLLM engine with kvtier on a locally built model and show hits and "
    "TTFT saved",
}

SIZE_EPILOG = """\
All figures are per GPU / per vLLM worker; host_bytes_total adds up TP workers and the
headroom. Figures that need --gpu-memory, --host-memory or --warm-sessions are reported as
unknown without them. Exit status: 0, or 1 when the plan does not fit, 2 on bad input.

examples:
  kvtier size --model /models/Llama-3-8B --gpu-memory 24 --host-memory 128 --warm-sessions 200
  kvtier size --model config.json --cpu-offload-gb 10 --cpu-offload-params experts --json
  kvtier size --model /models/m --gpu-memory 80 --warm-sessions 100 --emit helm-values
  kvtier size --model /models/m --gpu-memory 80 --trace requests.jsonl --plot curves.png"""

DOCTOR_EPILOG = """\
vLLM logs the UVA offload in GiB and the prefetch offload in GB; both are shown as
printed and converted. Warning codes are the same as `kvtier size`."""


def _selectors(values: list[str] | None) -> tuple[str, ...]:
    """vLLM takes selectors space-separated; accept commas too."""
    out: list[str] = []
    for v in values or []:
        out += [s for s in v.split(",") if s]
    return tuple(out)


#: the deepest LRU position ``--trace-max-chunks`` may ask for (memory follows the
#: trace's distinct chunks, about 150 bytes each, up to this many)
MAX_TRACE_CHUNKS = 2**32


def _chunk_count(text: str) -> int:
    """``--trace-max-chunks``: a whole number of chunks, 1 to 2**32 (``1e6`` is accepted)."""
    try:
        v = float(text) if any(c in text.lower() for c in ".e") else int(text)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if isinstance(v, float) and not (v.is_integer() and 1 <= v <= MAX_TRACE_CHUNKS):
        raise argparse.ArgumentTypeError(
            f"{text} is not a whole number from 1 to {MAX_TRACE_CHUNKS}")
    if not 1 <= v <= MAX_TRACE_CHUNKS:
        raise argparse.ArgumentTypeError(
            f"{text} chunks: must be from 1 to {MAX_TRACE_CHUNKS} (2**32)")
    return int(v)


def _ratio(text: str) -> float:
    """``--compression-ratio``: stored ÷ raw, in (0, 1]."""
    from kvtier.sizing.compression import check_ratio

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if err := check_ratio(v):
        raise argparse.ArgumentTypeError(err.removeprefix(f"--compression-ratio {v:g}: "))
    return v


def _add_compression_args(p: argparse.ArgumentParser) -> None:
    from kvtier.sizing.compression import LOSSLESS_RATIO  # the standard library only

    c = p.add_argument_group(
        "object-tier compression (kvtier's compression setting; the host tier is never "
        "compressed)")
    c.add_argument("--compression", choices=("none", "lossless", "fp8"), default="none",
                   help="size the object tier's stored bytes for this setting: none "
                   "(default), lossless (a measured ratio, see --compression-ratio), fp8 "
                   "(exact: 1 byte per bf16/fp16 value + 4 bytes per 128 values; fp8 or "
                   "fp32 KV is stored as it is); --emit writes it into the config")
    c.add_argument("--compression-ratio", type=_ratio, metavar="R",
                   help="lossless only: stored / raw to size with, in (0, 1], instead of the "
                   f"README's measured {LOSSLESS_RATIO:g} (bf16 KV of the test models; no "
                   "trained model measured). Take yours from a running tier: "
                   "kvtier:compress_stored_bytes_total / kvtier:compress_raw_bytes_total "
                   "(direction=\"write\")")


def _add_plan_args(p: argparse.ArgumentParser, *, model_required: bool) -> None:
    m = p.add_argument_group("model")
    m.add_argument("--model", required=model_required, metavar="PATH",
                   help="model directory (config.json, optional *.safetensors) or a config.json")
    m.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1, metavar="N",
                   help="tensor-parallel size (default 1)")
    m.add_argument("--dtype", default=None,
                   help="weight dtype as vLLM's --dtype (default: config's, float32 -> bfloat16)")
    m.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (model dtype), fp8, fp8_e4m3, fp8_e5m2, bfloat16, float16")
    g = p.add_argument_group("GPU")
    g.add_argument("--gpu-memory", type=float, metavar="GiB", help="memory of one GPU")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                   help="vLLM's --gpu-memory-utilization (default 0.9)")
    g.add_argument("--overhead", type=float, default=2.0, metavar="GiB",
                   help="activations, CUDA graphs and other non-KV GPU memory (default 2)")
    g.add_argument("--gpu-kv-memory", type=float, metavar="GiB",
                   help="use this GPU KV budget instead of computing it (e.g. vLLM's "
                   "'Available KV cache memory')")
    h = p.add_argument_group("host and workload")
    h.add_argument("--host-memory", type=float, metavar="GiB", help="host RAM")
    h.add_argument("--headroom", type=float, default=4.0, metavar="GiB",
                   help="host RAM left to the OS and everything else (default 4)")
    h.add_argument("--context", type=int, default=8192, metavar="TOKENS",
                   help="average context per session (default 8192)")
    h.add_argument("--max-model-len", type=int, metavar="TOKENS",
                   help="vLLM's --max-model-len (default: the config's max_position_embeddings)")
    h.add_argument("--warm-sessions", type=int, metavar="N",
                   help="sessions whose KV should stay warm (decides the host tier)")
    o = p.add_argument_group("vLLM weight offload (same flags as vllm serve)")
    o.add_argument("--offload-backend", choices=("auto", "uva", "prefetch"), default="auto")
    o.add_argument("--cpu-offload-gb", type=float, default=0.0, metavar="GiB",
                   help="UVA budget per GPU; vLLM reads it as GiB (x 1024**3)")
    o.add_argument("--cpu-offload-params", nargs="+", metavar="SEL",
                   help="UVA selectors, e.g. experts (matched as '.SEL.' in layer-relative names)")
    o.add_argument("--offload-group-size", type=int, default=0, metavar="N")
    o.add_argument("--offload-num-in-group", type=int, default=1, metavar="N")
    o.add_argument("--offload-prefetch-step", type=int, default=1, metavar="N")
    o.add_argument("--offload-params", nargs="+", metavar="SEL",
                   help="prefetch selectors (UVA never reads these)")
    o.add_argument("--disable-pin-memory", action="store_true", default=None,
                   help="as VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY=1 (default: read that "
                   "variable as vLLM does)")
    o.add_argument("--vllm-version", metavar="X.Y.Z",
                   help="the vLLM version you run (older ones ignore offload silently)")


def _inputs(args: argparse.Namespace) -> Any:
    from kvtier.sizing.plan import GiB, PlanInputs

    return PlanInputs(
        model=args.model, tp=args.tp, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_gib=args.gpu_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        overhead_gib=args.overhead, gpu_kv_gib=args.gpu_kv_memory,
        host_memory_gib=args.host_memory, headroom_bytes=int(args.headroom * GiB),
        context=args.context, max_model_len=args.max_model_len,
        warm_sessions=args.warm_sessions,
        offload_backend=args.offload_backend, cpu_offload_gb=args.cpu_offload_gb,
        cpu_offload_params=_selectors(args.cpu_offload_params),
        offload_group_size=args.offload_group_size,
        offload_num_in_group=args.offload_num_in_group,
        offload_prefetch_step=args.offload_prefetch_step,
        offload_params=_selectors(args.offload_params),
        disable_pin_memory=args.disable_pin_memory, vllm_version=args.vllm_version,
        compression=getattr(args, "compression", "none"),
        compression_ratio=getattr(args, "compression_ratio", None),
        chunk_size=getattr(args, "chunk_size", 256),
        block_size=getattr(args, "block_size", 16),
    )  # fmt: skip


def _check_numbers(args: argparse.Namespace) -> str | None:
    if args.tp < 1:
        return "--tp must be >= 1"
    if args.context < 1:
        return "--context must be >= 1"
    if getattr(args, "chunk_size", 1) < 1:
        return "--chunk-size must be >= 1"
    if not 0 < args.gpu_memory_utilization <= 1:
        return "--gpu-memory-utilization must be in (0, 1]"
    for name in ("gpu_memory", "host_memory", "cpu_offload_gb", "headroom", "overhead"):
        v = getattr(args, name)
        if v is not None and v < 0:
            return f"--{name.replace('_', '-')} must not be negative"
    if args.warm_sessions is not None and args.warm_sessions < 0:
        return "--warm-sessions must not be negative"
    return None


def _size(args: argparse.Namespace) -> int:
    from kvtier.sizing.emit import emit
    from kvtier.sizing.model import ModelConfigError
    from kvtier.sizing.plan import make_plan
    from kvtier.sizing.table import format_plan

    if err := _check_numbers(args):
        print(f"kvtier size: error: {err}", file=sys.stderr)
        return 2
    inp = _inputs(args)
    try:
        plan = make_plan(inp)
    except (ModelConfigError, ValueError, KeyError) as e:
        print(f"kvtier size: error: {e}", file=sys.stderr)
        return 2
    if args.trace:
        return _size_trace(args, plan)
    if args.emit:
        print(emit(args.emit, plan, inp, chunk_size=args.chunk_size, remote_url=args.remote_url,
                   write_policy=args.write_policy, namespace=args.namespace,
                   compression=args.compression))  # fmt: skip
        for w in plan["warnings"]:
            print(f"kvtier size: warning [{w['code']}]: {w['message']}", file=sys.stderr)
    elif args.json:
        print(json.dumps(plan, indent=2))
    else:
        print(format_plan(plan))
    return 1 if plan["fits"] is False else 0


def _size_trace(args: argparse.Namespace, plan: dict[str, Any]) -> int:
    """``kvtier size --trace``: hit rate against tier size for the traffic in a trace."""
    from kvtier.sizing import trace as tr

    if not 0 < args.target_hit_rate <= 1:
        print("kvtier size: error: --target-hit-rate must be in (0, 1]", file=sys.stderr)
        return 2
    if args.block_size < 1 or args.chunk_size < 1 or args.chunk_size % args.block_size:
        print("kvtier size: error: --chunk-size must be a positive multiple of --block-size",
              file=sys.stderr)
        return 2
    if args.cpu_bytes is not None and args.cpu_bytes < 0:
        print("kvtier size: error: --cpu-bytes must not be negative", file=sys.stderr)
        return 2
    form = tr.TraceFormat(args.trace_format, args.trace_block_size)
    if args.trace_block_size is not None:
        if not 1 <= args.trace_block_size <= tr.MAX_TRACE_BLOCK_SIZE:
            print(f"kvtier size: error: --trace-block-size must be from 1 to "
                  f"{tr.MAX_TRACE_BLOCK_SIZE}", file=sys.stderr)
            return 2
        if err := tr.block_size_error(args.chunk_size, args.trace_block_size):
            print(f"kvtier size: error: {err}", file=sys.stderr)
            return 2
    elif args.trace_format in tr.HASH_BLOCK_SIZE:
        if err := tr.block_size_error(args.chunk_size, tr.HASH_BLOCK_SIZE[args.trace_format]):
            print(f"kvtier size: error: {err}", file=sys.stderr)
            return 2
    if args.gpu_kv_tokens is not None:
        gpu_tokens, source = max(0, args.gpu_kv_tokens), "--gpu-kv-tokens"
    elif plan.get("gpu_kv_tokens") is not None:
        gpu_tokens, source = int(plan["gpu_kv_tokens"]), "the plan"
    else:
        gpu_tokens, source = 0, "unknown, taken as 0: pass --gpu-memory or --gpu-kv-tokens"
    host_tier = args.cpu_bytes if args.cpu_bytes is not None else plan.get("host_tier_bytes")
    tokenizer = args.tokenizer or (args.model if _is_dir(args.model) else None)
    try:
        sim, stats = tr.plan_trace(
            args.trace, tokenizer=tokenizer, block_size=args.block_size,
            chunk_size=args.chunk_size, gpu_kv_tokens=gpu_tokens,
            max_chunks=args.trace_max_chunks, progress=sys.stderr.isatty(), form=form,
        )
    except tr.TraceError as e:
        print(f"kvtier size: error: {e}", file=sys.stderr)
        return 2
    host_slot = int(plan["host_slot_bytes"])  # every KV cache group's stored blocks
    rep = tr.report(
        sim, stats, path=args.trace, host_slot_bytes=host_slot,
        object_chunk_bytes=int(plan["object_compression"]["stored_chunk_bytes"]),
        object_compression=plan["object_compression"],
        target=args.target_hit_rate, host_tier_bytes=host_tier, gpu_kv_tokens=gpu_tokens,
        gpu_kv_source=source,
    )
    if args.emit:
        return _emit_from_trace(args, plan, rep, stats.requests)
    print(json.dumps(rep, indent=2) if args.json else tr.format_report(rep))
    if args.plot:
        tr.write_plot(rep, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    if stats.bad_lines:
        print(f"kvtier size: warning: {stats.bad_lines} bad lines in the trace skipped",
              file=sys.stderr)
    return 0 if stats.requests else 2


def _emit_from_trace(args: argparse.Namespace, plan: dict[str, Any], rep: dict[str, Any],
                     requests: int) -> int:
    """``--trace`` with ``--emit``: the config to paste, its ``cpu_bytes`` the host tier the
    trace needs for ``--target-hit-rate`` (or, out of reach, the size where the curve stops
    rising); the report goes to stderr so stdout is only the config."""
    from kvtier.sizing import trace as tr
    from kvtier.sizing.emit import emit

    host = rep["recommended"]["host_bytes"]
    if host is None:
        top = rep["host_tier"][-1] if rep["host_tier"] else None
        host = next((p["bytes"] for p in rep["host_tier"]
                     if top is not None and p["hit_rate"] >= top["hit_rate"]), None)
        print(f"kvtier size: warning: the trace never reaches "
              f"{args.target_hit_rate * 100:g} % of prompt tokens from a cache; cpu_bytes is "
              "where its curve stops rising", file=sys.stderr)
    print(tr.format_report(rep), file=sys.stderr)
    print(emit(args.emit, {**plan, "host_tier_bytes": host}, _inputs(args),
               chunk_size=args.chunk_size, remote_url=args.remote_url,
               write_policy=args.write_policy, namespace=args.namespace,
               compression=args.compression))
    return 0 if requests else 2


def _is_dir(path: str) -> bool:
    import os

    return os.path.isdir(path)


def _doctor(args: argparse.Namespace) -> int:
    from kvtier.sizing import doctor

    try:
        if args.log in (None, "-"):
            facts = doctor.parse_log(sys.stdin)
        else:
            with open(args.log, encoding="utf-8", errors="replace") as f:
                facts = doctor.parse_log(f)
    except OSError as e:
        print(f"kvtier doctor: error: {e}", file=sys.stderr)
        return 2
    proc = None
    if args.pid is not None:
        try:
            proc = doctor.read_proc_status(args.pid)
        except OSError as e:
            print(f"kvtier doctor: error: cannot read process {args.pid}: {e}", file=sys.stderr)
            return 2
    plan = None
    if args.model:
        from kvtier.sizing.model import ModelConfigError
        from kvtier.sizing.plan import make_plan

        a = facts["args"]
        args.cpu_offload_gb = args.cpu_offload_gb or float(a.get("cpu_offload_gb", 0))
        args.offload_group_size = args.offload_group_size or int(a.get("offload_group_size", 0))
        args.cpu_offload_params = args.cpu_offload_params or a.get("cpu_offload_params")
        args.offload_params = args.offload_params or a.get("offload_params")
        args.vllm_version = args.vllm_version or facts["vllm_version"]
        if args.tp == 1 and a.get("tensor_parallel_size"):
            args.tp = int(a["tensor_parallel_size"])
        # the object tier as the logged kvtier config stores it
        cfg = facts.get("kvtier_config") or {}
        if cfg.get("compression") in ("none", "lossless", "fp8"):
            args.compression = cfg["compression"]
        if isinstance(cfg.get("chunk_size"), int) and cfg["chunk_size"] > 0:
            args.chunk_size = cfg["chunk_size"]
        try:
            plan = make_plan(_inputs(args))
        except (ModelConfigError, ValueError, KeyError) as e:
            print(f"kvtier doctor: error: {e}", file=sys.stderr)
            return 2
    rep = doctor.report(facts, proc, plan)
    print(json.dumps(rep, indent=2) if args.json else doctor.format_report(rep))
    return 1 if rep["warnings"] else 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; ``bench``/``demo`` modules are imported only when that command is used."""
    from kvtier.sizing.emit import EMIT_FORMATS

    parser = argparse.ArgumentParser(
        prog="kvtier", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    size = sub.add_parser("size", help=COMMANDS["size"], description=COMMANDS["size"] + ".",
                          epilog=SIZE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_plan_args(size, model_required=True)
    out = size.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the plan as JSON")
    out.add_argument("--emit", choices=EMIT_FORMATS,
                     help="print what to paste: --kv-transfer-config JSON, vllm serve flags, a "
                     "Helm values block, or the equivalent LMCache environment")
    out.add_argument("--chunk-size", type=int, default=256, help="kvtier chunk_size (default 256)")
    out.add_argument("--remote-url", help="kvtier object tier (s3://, redis://, file://)")
    out.add_argument("--write-policy", default="write_through",
                     choices=("write_through", "write_back", "none"))
    out.add_argument("--namespace", default="", help="kvtier key namespace")
    _add_compression_args(size)
    tr = size.add_argument_group(
        "trace (hit rate against tier size for real traffic; see README, Sizing)")
    tr.add_argument("--trace", metavar="FILE.jsonl",
                    help="request trace, one JSON object a line: prompt_token_ids, prompt or "
                    "messages, optional timestamp (seconds) and cache_salt; or a hash-id "
                    "line (hash_ids, input_length, output_length, timestamp)")
    tr.add_argument("--trace-format", default="auto",
                    choices=("auto", "tokens", "text", "messages", "mooncake", "bailian"),
                    help="auto (default): each line by its fields: prompt_token_ids or a "
                    "list prompt = tokens, a text prompt = text, messages, hash_ids with "
                    "chat_id, parent_chat_id or turn = bailian (16-token blocks, timestamp "
                    "in seconds), other hash_ids = mooncake (512-token blocks, timestamp in "
                    "milliseconds); naming one makes every other line a bad line")
    tr.add_argument("--trace-block-size", type=int, metavar="N",
                    help="tokens per hash id (default: 512 for mooncake lines, 16 for "
                    "bailian); --chunk-size must be a multiple of it or divide it")
    tr.add_argument("--tokenizer", metavar="PATH",
                    help="tokenizer for text prompts and messages (default: --model's dir)")
    tr.add_argument("--gpu-kv-tokens", type=int, metavar="N",
                    help="tokens vLLM's own prefix cache holds (default: the plan's GPU KV)")
    tr.add_argument("--block-size", type=int, default=16, help="vLLM block size (default 16)")
    tr.add_argument("--cpu-bytes", type=int, metavar="BYTES",
                    help="host tier per worker in front of the object tier (default: the "
                    "plan's host tier)")
    tr.add_argument("--target-hit-rate", type=float, default=0.8, metavar="F",
                    help="share of prompt tokens to serve from any cache (default 0.8)")
    tr.add_argument("--plot", metavar="FILE.png", help="draw the curves to this PNG")
    tr.add_argument("--trace-max-chunks", type=_chunk_count, default=1 << 20, metavar="N",
                    help="deepest LRU position tracked; bounds memory (default 1048576, "
                    "at most 2**32)")
    size.set_defaults(func=_size)

    doc = sub.add_parser("doctor", help=COMMANDS["doctor"], description=COMMANDS["doctor"] + ".",
                         epilog=DOCTOR_EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    doc.add_argument("log", nargs="?", help="vLLM server log file ('-' or omitted: stdin)")
    doc.add_argument("--pid", type=int, help="vLLM process to read VmRSS/RssShmem from")
    doc.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_plan_args(doc, model_required=False)
    doc.set_defaults(func=_doctor)

    for name in ("bench", "demo"):
        p = sub.add_parser(name, help=COMMANDS[name], description=COMMANDS[name] + ".")
        if command == name:
            import importlib

            mod = importlib.import_module(f"kvtier.tools.{name}")
            mod.add_arguments(p)
            p.set_defaults(func=mod.run)
    return parser


def _command(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvtier`` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command(argv))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
