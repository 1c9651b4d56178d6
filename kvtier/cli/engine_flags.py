"""The flags ``kvtier size`` and ``kvtier doctor`` share to describe an engine: the model,
the GPU, the host and vLLM's weight offload, and the planner's inputs made from them."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

#: vLLM's --mamba-cache-dtype choices (kvtier.sizing.state.MAMBA_DTYPES, kept here so
#: that building the parser imports nothing of the planner)
MAMBA_DTYPES = ("auto", "float32", "float16", "bfloat16")
#: vLLM's CPU build's own KV space, in GiB (kvtier.connectors.startup reads it too)
CPU_KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def _selectors(values: list[str] | None) -> tuple[str, ...]:
    """vLLM takes selectors space-separated; accept commas too."""
    out: list[str] = []
    for v in values or []:
        out += [s for s in v.split(",") if s]
    return tuple(out)


def add_plan_args(p: argparse.ArgumentParser, *, model_required: bool) -> None:
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        required=model_required,
        metavar="MODEL",
        help="model directory (config.json, optional *.safetensors), a config.json, "
        "or a Hugging Face hub id (org/name[@revision]): its config.json and "
        "safetensors index only, never weights, through huggingface_hub and its "
        "cache (HF_TOKEN for gated models; HF_HUB_OFFLINE=1 reads the cache alone)",
    )
    m.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel size (default 1)",
    )
    m.add_argument(
        "--dtype",
        default=None,
        help="weight dtype as vLLM's --dtype (default: config's, float32 -> bfloat16)",
    )
    m.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (model dtype), fp8, fp8_e4m3, fp8_e5m2, bfloat16, float16",
    )
    m.add_argument(
        "--mamba-cache-dtype",
        default="auto",
        choices=MAMBA_DTYPES,
        help="hybrid models: vLLM's --mamba-cache-dtype, the recurrent state's "
        "dtype (default auto: the model dtype)",
    )
    m.add_argument(
        "--mamba-ssm-cache-dtype",
        default="auto",
        choices=MAMBA_DTYPES,
        help="hybrid models: vLLM's --mamba-ssm-cache-dtype, the SSM state's "
        "alone (default auto: as --mamba-cache-dtype, or what the config asks "
        "for: Nemotron-H float32, Qwen3.5 its mamba_ssm_dtype)",
    )
    g = p.add_argument_group("GPU")
    g.add_argument("--gpu-memory", type=float, metavar="GiB", help="memory of one GPU")
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        metavar="F",
        help="vLLM's --gpu-memory-utilization (default 0.9)",
    )
    g.add_argument(
        "--overhead",
        type=float,
        default=2.0,
        metavar="GiB",
        help="activations, CUDA graphs and other non-KV GPU memory (default 2)",
    )
    g.add_argument(
        "--gpu-kv-memory",
        type=float,
        metavar="GiB",
        help="use this GPU KV budget instead of computing it (e.g. vLLM's "
        "'Available KV cache memory')",
    )
    h = p.add_argument_group("host and workload")
    h.add_argument("--host-memory", type=float, metavar="GiB", help="host RAM")
    h.add_argument(
        "--headroom",
        type=float,
        default=4.0,
        metavar="GiB",
        help="host RAM left to the OS and everything else (default 4)",
    )
    h.add_argument(
        "--cpu-kv-space",
        type=float,
        metavar="GiB",
        help="vLLM's CPU build: its own KV cache per worker, as "
        f"{CPU_KV_SPACE_ENV} (default: that variable when set); it and the "
        "weights are then planned in host memory beside kvtier's host tier",
    )
    h.add_argument(
        "--context",
        type=int,
        default=8192,
        metavar="TOKENS",
        help="average context per session (default 8192)",
    )
    h.add_argument(
        "--max-model-len",
        type=int,
        metavar="TOKENS",
        help="vLLM's --max-model-len (default: the config's max_position_embeddings)",
    )
    h.add_argument(
        "--warm-sessions",
        type=int,
        metavar="N",
        help="sessions whose KV should stay warm (decides the host tier)",
    )
    o = p.add_argument_group("vLLM weight offload (same flags as vllm serve)")
    o.add_argument("--offload-backend", choices=("auto", "uva", "prefetch"), default="auto")
    o.add_argument(
        "--cpu-offload-gb",
        type=float,
        default=0.0,
        metavar="GiB",
        help="UVA budget per GPU; vLLM reads it as GiB (x 1024**3)",
    )
    o.add_argument(
        "--cpu-offload-params",
        nargs="+",
        metavar="SEL",
        help="UVA selectors, e.g. experts (matched as '.SEL.' in layer-relative names)",
    )
    o.add_argument("--offload-group-size", type=int, default=0, metavar="N")
    o.add_argument("--offload-num-in-group", type=int, default=1, metavar="N")
    o.add_argument("--offload-prefetch-step", type=int, default=1, metavar="N")
    o.add_argument(
        "--offload-params",
        nargs="+",
        metavar="SEL",
        help="prefetch selectors (UVA never reads these)",
    )
    o.add_argument(
        "--disable-pin-memory",
        action="store_true",
        default=None,
        help="as VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY=1 (default: read that "
        "variable as vLLM does)",
    )
    o.add_argument(
        "--vllm-version",
        metavar="X.Y.Z",
        help="the vLLM version you run (older ones ignore offload silently)",
    )


def cpu_kv_space_bytes(args: argparse.Namespace, environ: Mapping[str, str]) -> int | None:
    """vLLM CPU's KV space per worker in bytes: ``--cpu-kv-space``, else
    VLLM_CPU_KVCACHE_SPACE read as vLLM 0.32 reads it (whole GiB, when set and not
    empty); None when neither is given (a GPU deployment)."""
    given = getattr(args, "cpu_kv_space", None)
    if given is not None:
        return int(given * 2**30)
    env = environ.get(CPU_KV_SPACE_ENV, "").strip()
    return int(env) * 2**30 if env.isdigit() else None


def plan_inputs(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Any:
    """The planner's inputs from the flags; ``args.cpu_bytes``, where present, is the
    ``cpu_bytes`` the config check resolved (bytes, or None for the plan's own tier)."""
    import os

    from kvtier.sizing.memory_plan import GiB, PlanInputs

    cpu_bytes = getattr(args, "cpu_bytes", None)
    return PlanInputs(
        model=args.model,
        tp=args.tp,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_gib=args.gpu_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        overhead_gib=args.overhead,
        gpu_kv_gib=args.gpu_kv_memory,
        host_memory_gib=args.host_memory,
        headroom_bytes=int(args.headroom * GiB),
        context=args.context,
        max_model_len=args.max_model_len,
        warm_sessions=args.warm_sessions,
        offload_backend=args.offload_backend,
        cpu_offload_gb=args.cpu_offload_gb,
        cpu_offload_params=_selectors(args.cpu_offload_params),
        offload_group_size=args.offload_group_size,
        offload_num_in_group=args.offload_num_in_group,
        offload_prefetch_step=args.offload_prefetch_step,
        offload_params=_selectors(args.offload_params),
        disable_pin_memory=args.disable_pin_memory,
        vllm_version=args.vllm_version,
        compression=getattr(args, "compression", "none"),
        compression_ratio=getattr(args, "compression_ratio", None),
        chunk_size=getattr(args, "chunk_size", 256),
        block_size=getattr(args, "block_size", 16),
        cpu_bytes=cpu_bytes if isinstance(cpu_bytes, int) else None,
        cpu_kv_space_bytes=cpu_kv_space_bytes(args, os.environ if environ is None else environ),
        mamba_cache_dtype=getattr(args, "mamba_cache_dtype", "auto"),
        mamba_ssm_cache_dtype=getattr(args, "mamba_ssm_cache_dtype", "auto"),
    )


def check_numbers(args: argparse.Namespace) -> str | None:
    if args.tp < 1:
        return "--tp must be >= 1"
    if args.context < 1:
        return "--context must be >= 1"
    if getattr(args, "cpu_kv_space", None) is not None and args.cpu_kv_space < 0:
        return "--cpu-kv-space must not be negative"
    if not 0 < args.gpu_memory_utilization <= 1:
        return "--gpu-memory-utilization must be in (0, 1]"
    for name in ("gpu_memory", "host_memory", "cpu_offload_gb", "headroom", "overhead"):
        v = getattr(args, name)
        if v is not None and v < 0:
            return f"--{name.replace('_', '-')} must not be negative"
    if args.warm_sessions is not None and args.warm_sessions < 0:
        return "--warm-sessions must not be negative"
    return None
