"""``kvtier size``: its flags, the plan as a table, JSON or a config to paste, and with
``--trace`` the hit-rate curves of a request trace.

Only the standard library is imported at module level; the planner is imported when
the command runs, so ``kvtier size`` never loads torch or vLLM."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from kvtier.cli.engine_flags import add_plan_args, check_numbers, cpu_kv_space_bytes, plan_inputs

SIZE_EPILOG = """\
All figures are per GPU / per vLLM worker; host_bytes_total adds up TP workers and the
headroom. Figures that need --gpu-memory, --host-memory or --warm-sessions are reported as
unknown without them. Exit status: 0, or 1 when the plan does not fit, 2 on bad input.

examples:
  kvtier size --model /models/Llama-3-8B --gpu-memory 24 --host-memory 128 --warm-sessions 200
  kvtier size --model meta-llama/Meta-Llama-3-8B --gpu-memory 24   (a hub id: config and
      safetensors index fetched once and cached; offline, from the cache)
  kvtier size --model config.json --cpu-offload-gb 10 --cpu-offload-params experts --json
  kvtier size --model /models/m --gpu-memory 80 --warm-sessions 100 --emit helm-values
  kvtier size --model /models/m --gpu-memory 80 --trace requests.jsonl --plot curves.png"""

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
            f"{text} is not a whole number from 1 to {MAX_TRACE_CHUNKS}"
        )
    if not 1 <= v <= MAX_TRACE_CHUNKS:
        raise argparse.ArgumentTypeError(
            f"{text} chunks: must be from 1 to {MAX_TRACE_CHUNKS} (2**32)"
        )
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


def add_compression_args(p: argparse.ArgumentParser) -> None:
    from kvtier.sizing.compression import (  # the standard library only
        COMPRESSIONS,
        LOSSLESS_RATIO,
    )

    c = p.add_argument_group(
        "object-tier compression (kvtier's compression setting; the host tier is never compressed)"
    )
    c.add_argument(
        "--compression",
        choices=COMPRESSIONS,
        default="none",
        help="size the object tier's stored bytes for this setting: none "
        "(default), lossless (a measured ratio, see --compression-ratio), auto "
        "(compressed only where reads are faster so: sized raw unless "
        "--compression-ratio), fp8 "
        "(exact: 1 byte per bf16/fp16 value + 4 bytes per 128 values; fp8 or "
        "fp32 KV is stored as it is); --emit writes it into the config",
    )
    c.add_argument(
        "--compression-ratio",
        type=_ratio,
        metavar="R",
        help="lossless or auto: stored / raw to size with, in (0, 1], instead of the "
        f"README's measured {LOSSLESS_RATIO:g} (bf16 KV of the test models; no "
        "trained model measured). Take yours from a running tier: "
        "kvtier:compress_stored_bytes_total / kvtier:compress_raw_bytes_total "
        '(direction="write")',
    )


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], help_text: str) -> None:
    """``kvtier size`` under the ``kvtier`` command's subparsers."""
    from kvtier.sizing.emit import EMIT_FORMATS

    size = sub.add_parser(
        "size",
        help=help_text,
        description=help_text + ".",
        epilog=SIZE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_plan_args(size, model_required=True)
    out = size.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the plan as JSON")
    out.add_argument(
        "--emit",
        choices=EMIT_FORMATS,
        help="print what to paste: --kv-transfer-config JSON, vllm serve flags, a "
        "Helm values block, or the equivalent LMCache environment",
    )
    out.add_argument(
        "--chunk-size",
        type=int,
        default=256,
        help="kvtier chunk_size (default 256): a multiple of --block-size",
    )
    out.add_argument(
        "--cpu-bytes",
        metavar="SIZE",
        help="kvtier cpu_bytes per worker, as the config key takes it (8GiB, "
        "512MiB, a byte count, or auto): the plan checks this host tier instead "
        "of the one it derives from --warm-sessions; with --trace, the host tier "
        "in front of the object tier",
    )
    out.add_argument("--remote-url", help="kvtier object tier (s3://, redis://, file://)")
    out.add_argument(
        "--write-policy", default="write_through", choices=("write_through", "write_back", "none")
    )
    out.add_argument("--namespace", default="", help="kvtier key namespace")
    add_compression_args(size)
    tr = size.add_argument_group(
        "trace (hit rate against tier size for real traffic; see README, Sizing)"
    )
    tr.add_argument(
        "--trace",
        metavar="FILE.jsonl",
        help="request trace, one JSON object a line: prompt_token_ids, prompt or "
        "messages, optional timestamp (seconds) and cache_salt; or a hash-id "
        "line (hash_ids, input_length, output_length, timestamp). A line whose "
        "prompt is over 2**24 tokens however given (token ids, input_length, "
        "hash ids x block size), whose output_length is, or of over 256 MiB is "
        "a bad line, counted",
    )
    tr.add_argument(
        "--trace-format",
        default="auto",
        choices=("auto", "tokens", "text", "messages", "mooncake", "bailian"),
        help="auto (default): each line by its fields: prompt_token_ids or a "
        "list prompt = tokens, a text prompt = text, messages, hash_ids with "
        "chat_id, parent_chat_id or turn = bailian (16-token blocks, timestamp "
        "in seconds), other hash_ids = mooncake (512-token blocks, timestamp in "
        "milliseconds); naming one makes every other line a bad line",
    )
    tr.add_argument(
        "--trace-block-size",
        type=int,
        metavar="N",
        help="tokens per hash id (default: 512 for mooncake lines, 16 for "
        "bailian); --chunk-size must be a multiple of it or divide it",
    )
    tr.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer for text prompts and messages (default: --model's dir)",
    )
    tr.add_argument(
        "--gpu-kv-tokens",
        type=int,
        metavar="N",
        help="tokens vLLM's own prefix cache holds (default: the plan's GPU KV)",
    )
    tr.add_argument("--block-size", type=int, default=16, help="vLLM block size (default 16)")
    tr.add_argument(
        "--target-hit-rate",
        type=float,
        default=0.8,
        metavar="F",
        help="share of prompt tokens to serve from any cache (default 0.8)",
    )
    tr.add_argument("--plot", metavar="FILE.png", help="draw the curves to this PNG")
    tr.add_argument(
        "--trace-max-chunks",
        type=_chunk_count,
        default=1 << 20,
        metavar="N",
        help="deepest LRU position tracked; bounds memory (default 1048576, at most 2**32)",
    )
    from kvtier.sizing import whatif

    whatif.add_args(size)
    size.set_defaults(func=_size)


def connector_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``kv_connector_extra_config`` these flags describe (what ``--emit`` writes)."""
    extra: dict[str, Any] = {
        "chunk_size": args.chunk_size,
        "write_policy": args.write_policy,
        "namespace": args.namespace,
        "compression": args.compression,
    }
    if args.remote_url is not None:
        extra["remote_url"] = args.remote_url
    if args.cpu_bytes is not None:
        extra["cpu_bytes"] = args.cpu_bytes
    return extra


def _size(args: argparse.Namespace) -> int:
    from kvtier.errors import ConfigError
    from kvtier.sizing.emit import emit
    from kvtier.sizing.memory_plan import make_plan
    from kvtier.sizing.model import ModelConfigError, load_shape
    from kvtier.sizing.table import format_plan
    from kvtier.sizing.validate import check_deployment

    if err := check_numbers(args):
        print(f"kvtier size: error: {err}", file=sys.stderr)
        return 2
    try:
        shape = load_shape(args.model, dtype=args.dtype)
        # what the connector would refuse at startup is refused here, in the same words
        cfg = check_deployment(
            connector_settings(args),
            shape=shape,
            model=args.model,
            tp=args.tp,
            block_size=args.block_size,
            kv_cache_dtype=args.kv_cache_dtype,
            mamba_cache_dtype=args.mamba_cache_dtype,
            mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
            cpu_build=cpu_kv_space_bytes(args, os.environ) is not None,
        )
        args.cpu_bytes = cfg.cpu_bytes if isinstance(cfg.cpu_bytes, int) else None
        inp = plan_inputs(args)
        plan = make_plan(inp, shape)
    except (ConfigError, ModelConfigError, ValueError, KeyError) as e:
        print(f"kvtier size: error: {e}", file=sys.stderr)
        return 2
    if getattr(args, "from_prometheus", None):
        from kvtier.sizing import whatif

        return whatif.run(args, plan, inp, shape)
    if args.trace:
        return _size_trace(args, plan)
    if args.emit:
        print(
            emit(
                args.emit,
                plan,
                inp,
                chunk_size=args.chunk_size,
                remote_url=args.remote_url,
                write_policy=args.write_policy,
                namespace=args.namespace,
                compression=args.compression,
            )
        )
        for w in plan["warnings"]:
            print(f"kvtier size: warning [{w['code']}]: {w['message']}", file=sys.stderr)
    elif args.json:
        print(json.dumps(plan, indent=2))
    else:
        print(format_plan(plan))
    if plan["fits"] is False:
        print(f"kvtier size: {does_not_fit(plan)}", file=sys.stderr)
        return 1
    return 0


def does_not_fit(plan: dict[str, Any]) -> str:
    """Why the plan does not fit and, when it is the host, the largest cpu_bytes that does
    (as a size string to pass back as --cpu-bytes or to write into the config)."""
    from kvtier.config import format_size

    largest = plan.get("largest_cpu_bytes_that_fits")
    total, host = plan.get("host_bytes_total"), plan.get("host_memory_bytes")
    if total is not None and host is not None and total > host and largest is not None:
        if largest <= 0:
            return (
                f"the plan does not fit: host needs {format_size(total)} but has "
                f"{format_size(host)}, and no host tier fits beside the rest (weights, "
                "vLLM's own KV cache, headroom)"
            )
        hint = size_string(largest)
        return (
            f"the plan does not fit: host needs {format_size(total)} but has "
            f"{format_size(host)}; the largest cpu_bytes that fits is {largest} "
            f"({format_size(largest)}) per worker: --cpu-bytes {hint}"
        )
    return "the plan does not fit: " + "; ".join(
        w["message"] for w in plan["warnings"] if w["code"] == "weights-exceed-gpu"
    )


def size_string(n: int) -> str:
    """``n`` bytes rounded down to a whole GiB or MiB, as the config key takes it."""
    return f"{n // 2**30}GiB" if n >= 2**30 else f"{max(0, n) // 2**20}MiB"


def _size_trace(args: argparse.Namespace, plan: dict[str, Any]) -> int:
    """``kvtier size --trace``: hit rate against tier size for the traffic in a trace."""
    from kvtier.sizing import trace as tr

    if not 0 < args.target_hit_rate <= 1:
        print("kvtier size: error: --target-hit-rate must be in (0, 1]", file=sys.stderr)
        return 2
    if args.block_size < 1 or args.chunk_size < 1 or args.chunk_size % args.block_size:
        print(
            "kvtier size: error: --chunk-size must be a positive multiple of --block-size",
            file=sys.stderr,
        )
        return 2
    form = tr.TraceFormat(args.trace_format, args.trace_block_size)
    if args.trace_block_size is not None:
        if not 1 <= args.trace_block_size <= tr.MAX_TRACE_BLOCK_SIZE:
            print(
                f"kvtier size: error: --trace-block-size must be from 1 to "
                f"{tr.MAX_TRACE_BLOCK_SIZE}",
                file=sys.stderr,
            )
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
    tokenizer = args.tokenizer or (
        args.model if _is_dir(args.model) or _is_hub_id(args.model) else None
    )
    try:
        sim, stats = tr.plan_trace(
            args.trace,
            tokenizer=tokenizer,
            block_size=args.block_size,
            chunk_size=args.chunk_size,
            gpu_kv_tokens=gpu_tokens,
            max_chunks=args.trace_max_chunks,
            progress=sys.stderr.isatty(),
            form=form,
        )
    except tr.TraceError as e:
        print(f"kvtier size: error: {e}", file=sys.stderr)
        return 2
    host_slot = int(plan["host_slot_bytes"])  # every KV cache group's stored blocks
    rep = tr.report(
        sim,
        stats,
        path=args.trace,
        host_slot_bytes=host_slot,
        object_chunk_bytes=int(plan["object_compression"]["stored_chunk_bytes"]),
        object_compression=plan["object_compression"],
        target=args.target_hit_rate,
        host_tier_bytes=host_tier,
        gpu_kv_tokens=gpu_tokens,
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
        print(
            f"kvtier size: warning: {stats.bad_lines} bad lines in the trace skipped",
            file=sys.stderr,
        )
    return 0 if stats.requests else 2


def _emit_from_trace(
    args: argparse.Namespace, plan: dict[str, Any], rep: dict[str, Any], requests: int
) -> int:
    """``--trace`` with ``--emit``: the config to paste, its ``cpu_bytes`` the host tier the
    trace needs for ``--target-hit-rate`` (or, out of reach, the size where the curve stops
    rising); the report goes to stderr so stdout is only the config."""
    from kvtier.sizing import trace as tr
    from kvtier.sizing.emit import emit

    host = rep["recommended"]["host_bytes"]
    if host is None:
        top = rep["host_tier"][-1] if rep["host_tier"] else None
        host = next(
            (
                p["bytes"]
                for p in rep["host_tier"]
                if top is not None and p["hit_rate"] >= top["hit_rate"]
            ),
            None,
        )
        print(
            f"kvtier size: warning: the trace never reaches "
            f"{args.target_hit_rate * 100:g} % of prompt tokens from a cache; cpu_bytes is "
            "where its curve stops rising",
            file=sys.stderr,
        )
    print(tr.format_report(rep), file=sys.stderr)
    print(
        emit(
            args.emit,
            {**plan, "host_tier_bytes": host},
            plan_inputs(args),
            chunk_size=args.chunk_size,
            remote_url=args.remote_url,
            write_policy=args.write_policy,
            namespace=args.namespace,
            compression=args.compression,
        )
    )
    return 0 if requests else 2


def _is_dir(path: str) -> bool:
    import os

    return os.path.isdir(path)


def _is_hub_id(model: str) -> bool:
    """A hub id names the tokenizer too (transformers fetches it the same way)."""
    from kvtier.sizing.hub import is_hub_id

    return is_hub_id(model)
