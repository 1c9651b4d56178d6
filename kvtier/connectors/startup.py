"""What kvtier checks of an engine's config before vLLM starts a single worker.

vLLM builds the scheduler's connector last, after the workers loaded the model and
allocated their KV caches (and kvtier's workers their host slabs). A config that kvtier
refuses there is reported by every process it passes through, the better part of a
minute into startup, and a host tier that does not fit has been allocated (or killed
its worker) by then. So kvtier validates the engine's config where vLLM first touches
the connector: vLLM 0.32 imports this package while it builds its ``VllmConfig``
(``KVConnectorFactory.supports_hma_config``, in the process that parses the command
line), before any engine process exists. :func:`check_config_being_built` finds that
config and runs :func:`check_engine_config` on it: the config's values, the block size,
parallelism, the signing key and the host-memory plan (:func:`startup_plan`), vLLM's own
host memory included. A mistake is one ConfigError, once, before the model loads.

The connector runs the same value checks again in each process (it may be built by a
vLLM that imports kvtier elsewhere), and each worker checks its own slab against the
memory left just before it allocates it (:func:`kvtier.connectors.slots.allocate_slab`).
"""

from __future__ import annotations

import os

from kvtier.config import KVTierConfig, load_config
from kvtier.sizing.autosize import HostPlan, host_plan, vllm_cpu_host_bytes

from .engine_shape import EngineShape, shape_being_built

#: vLLM's CPU build's own KV space, in GiB (read as vLLM 0.32 reads it)
CPU_KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def check_config_being_built() -> KVTierConfig | None:
    """Validate the ``VllmConfig`` vLLM is building, when this import is part of building
    it (its ``__post_init__`` asks for the connector class); None otherwise.

    vLLM 0.32 passes the connector no config before it constructs it in the workers, so
    the config is found in the frame of ``VllmConfig.__post_init__`` below this one
    (:func:`~.engine_shape.shape_being_built`). A vLLM that builds its config another way
    is not found here: the later checks apply."""
    shape = shape_being_built()
    if shape is None or shape.connector != "KVTierConnector":
        return None
    return check_engine_config(shape)


def check_engine_config(shape: EngineShape) -> KVTierConfig:
    """Every check kvtier can make of an engine before its workers start: its config's
    values, chunk size against the block size, parallelism, the signing and encryption
    keys, and that the host tier fits the host (:func:`startup_plan`). Raises the first
    ConfigError; returns the config."""
    from .identity import check_parallel

    extra = dict(shape.connector_extra)
    cfg = load_config(extra)
    block_size = shape.block_size
    if isinstance(block_size, int) and block_size > 0:  # None until a GPU backend picks one
        cfg.check_block_size(block_size)
    check_parallel(shape)
    if cfg.remote_url:
        from kvtier.objects.codec import Signer

        Signer.from_config(cfg)  # a missing or short key stops startup here
    given = os.environ.get("KVTIER_CPU_BYTES") or extra.get("cpu_bytes", "auto")
    startup_plan(cfg, shape).check(cfg.cpu_bytes, given=given)
    return cfg


def startup_plan(
    cfg: KVTierConfig, shape: EngineShape, *, mem_available_bytes: int | None = None
) -> HostPlan:
    """The host-memory plan of an engine that has not started: the memory available now,
    less, for every worker on this host, vLLM's weight offload and, on vLLM's CPU build,
    its own KV cache and weights (:func:`vllm_cpu_host_bytes`), less the headroom."""
    from .identity import workers_on_node

    workers = workers_on_node(shape)
    offload_gb = shape.cpu_offload_gb
    model_dir = shape.model
    local = model_dir if os.path.isdir(model_dir) else None
    vllm_bytes, how = 0, ""
    if _on_cpu(shape):
        per_worker, how = vllm_cpu_host_bytes(
            _cpu_kv_space(shape),
            _weight_bytes(local, shape.tp_size),
            total_memory=_node_total_memory(),
            memory_utilization=shape.gpu_memory_utilization,
        )
        vllm_bytes = per_worker * workers
        if workers > 1:
            how += f", x {workers} workers"
    return host_plan(
        headroom_bytes=cfg.cpu_headroom_bytes,
        cpu_offload_gb=offload_gb * workers,
        mem_available_bytes=mem_available_bytes,
        model_dir=local,
        vllm_host_bytes=vllm_bytes,
        vllm_host_how=how,
        workers=workers,
    )


def _on_cpu(shape: EngineShape) -> bool:
    if shape.device_type is not None:
        return shape.device_type == "cpu"
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _cpu_kv_space(shape: EngineShape) -> int | None:
    """The CPU build's KV cache per worker when sized explicitly: vLLM 0.32 turns
    ``VLLM_CPU_KVCACHE_SPACE`` (GiB, when set and not empty) into ``kv_cache_memory_bytes``
    as it builds the config; ``--kv-cache-memory-bytes`` sets it directly. None: vLLM sizes
    it from ``--gpu-memory-utilization``."""
    if shape.kv_cache_memory_bytes is not None:
        return shape.kv_cache_memory_bytes
    space = os.environ.get(CPU_KV_SPACE_ENV, "")
    return int(space) * 2**30 if space.strip().isdigit() else None


def _weight_bytes(model_dir: str | None, tp: int) -> int | None:
    """Bytes of one worker's weights from a local checkpoint (None when not readable)."""
    if model_dir is None:
        return None
    from kvtier.sizing.model import ModelConfigError, load_shape
    from kvtier.sizing.weights import load_weights

    try:
        return load_weights(model_dir, load_shape(model_dir), tp).rank_bytes
    except (ModelConfigError, ValueError, OSError, KeyError, TypeError):
        return None


def _node_total_memory() -> int:
    """The memory vLLM's CPU worker takes its share of (its node's, capped by the cgroup)."""
    try:
        from vllm.utils.cpu_resource_utils import get_memory_node_info

        return int(get_memory_node_info(0).total_memory)
    except Exception:  # no such helper or node: the host's
        import psutil

        return int(psutil.virtual_memory().total)
