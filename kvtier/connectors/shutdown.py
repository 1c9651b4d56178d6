"""Whether vLLM gives kvtier's queued object-tier writes time to flush when it is stopped.

kvtier flushes queued writes in the worker's ``shutdown`` (up to ``shutdown_flush_s``).
vLLM only calls it if it lets the engine wind down: with its default
``--shutdown-timeout 0`` the API server kills the engine on SIGTERM at once, and the
executor gives worker processes ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (5 s) before
it kills them. A rolling restart then loses the chunks of the last requests before it,
exactly the ones the next replica would hit. Startup says so, with the flags to set.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvtier.config import VLLM_WORKER_SHUTDOWN_ENV, KVTierConfig

from .engine_shape import EngineShape

#: vLLM's default for ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``
VLLM_WORKER_SHUTDOWN_DEFAULT_S = 5.0


def shutdown_window_warning(
    cfg: KVTierConfig, shape: EngineShape, environ: Mapping[str, str]
) -> str | None:
    """What vLLM's stop would cut short of kvtier's flush, and what to set; None when
    nothing is written to an object tier or vLLM allows for it."""
    need = cfg.vllm_shutdown_timeout_s()
    if need is None:
        return None
    short: list[str] = []
    engine = shape.shutdown_timeout_s  # vLLM >= 0.32
    if engine is not None and engine < need:
        short.append(f"--shutdown-timeout is {engine} (0 kills the engine at once)")
    if shape.executor_backend == "mp":  # the workers are processes of their own
        try:
            window = float(environ.get(VLLM_WORKER_SHUTDOWN_ENV, VLLM_WORKER_SHUTDOWN_DEFAULT_S))
        except ValueError:
            window = VLLM_WORKER_SHUTDOWN_DEFAULT_S
        if window < need:
            short.append(f"{VLLM_WORKER_SHUTDOWN_ENV} is {window:g}")
    if not short:
        return None
    return (
        f"vLLM's {' and '.join(short)}: when vLLM is stopped, object-tier writes still "
        f"queued (the last requests' chunks) are lost, not flushed (shutdown_flush_s="
        f"{cfg.shutdown_flush_s:g}). Start vLLM with --shutdown-timeout {need} and "
        f"{VLLM_WORKER_SHUTDOWN_ENV}={need}, and give it at least that long to stop (Kubernetes: "
        f"terminationGracePeriodSeconds); the Helm chart and `kvtier size --emit` set both"
    )
