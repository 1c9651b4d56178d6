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
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

from kvtier.config import KVTierConfig, load_config
from kvtier.sizing.autosize import HostPlan, host_plan, vllm_cpu_host_bytes

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: vLLM's CPU build's own KV space, in GiB (read as vLLM 0.32 reads it)
CPU_KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def check_config_being_built() -> KVTierConfig | None:
    """Validate the ``VllmConfig`` vLLM is building, when this import is part of building
    it (its ``__post_init__`` asks for the connector class); None otherwise.

    vLLM 0.32 passes the connector no config before it constructs it in the workers, so
    the config is read from the frame of ``VllmConfig.__post_init__`` below this one. A
    vLLM that builds its config another way is not found here: the later checks apply."""
    config = _vllm_config_in_frames()
    if config is None or getattr(config, "kv_transfer_config", None) is None:
        return None
    if getattr(config.kv_transfer_config, "kv_connector", None) != "KVTierConnector":
        return None
    return check_engine_config(config)


def _vllm_config_in_frames() -> Any:
    try:
        from vllm.config import VllmConfig
    except ImportError:  # pragma: no cover - vLLM is a dependency of the connector
        return None
    code = getattr(VllmConfig.__post_init__, "__code__", None)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


def check_engine_config(vllm_config: VllmConfig) -> KVTierConfig:
    """Every check kvtier can make of an engine before its workers start: its config's
    values, chunk size against the block size, parallelism, the signing and encryption
    keys, and that the host tier fits the host (:func:`startup_plan`). Raises the first
    ConfigError; returns the config."""
    from .identity import check_parallel

    transfer = vllm_config.kv_transfer_config
    extra = (transfer.kv_connector_extra_config if transfer is not None else None) or {}
    cfg = load_config(extra)
    block_size = getattr(vllm_config.cache_config, "block_size", None)
    if isinstance(block_size, int) and block_size > 0:  # None until a GPU backend picks one
        cfg.check_block_size(block_size)
    check_parallel(vllm_config)
    if cfg.remote_url:
        from kvtier.objects.codec import Signer

        Signer.from_config(cfg)  # a missing or short key stops startup here
    given = os.environ.get("KVTIER_CPU_BYTES") or extra.get("cpu_bytes", "auto")
    startup_plan(cfg, vllm_config).check(cfg.cpu_bytes, given=given)
    return cfg


def startup_plan(
    cfg: KVTierConfig, vllm_config: VllmConfig, *, mem_available_bytes: int | None = None
) -> HostPlan:
    """The host-memory plan of an engine that has not started: the memory available now,
    less, for every worker on this host, vLLM's weight offload and, on vLLM's CPU build,
    its own KV cache and weights (:func:`vllm_cpu_host_bytes`), less the headroom."""
    from .identity import workers_on_node

    workers = workers_on_node(vllm_config)
    offload = getattr(vllm_config, "offload_config", None)
    offload_gb = float(getattr(getattr(offload, "uva", None), "cpu_offload_gb", 0.0) or 0.0)
    if not offload_gb:
        offload_gb = float(getattr(vllm_config.cache_config, "cpu_offload_gb", 0.0) or 0.0)
    model_dir = str(vllm_config.model_config.model)
    local = model_dir if os.path.isdir(model_dir) else None
    vllm_bytes, how = 0, ""
    if _on_cpu(vllm_config):
        per_worker, how = vllm_cpu_host_bytes(
            _cpu_kv_space(vllm_config), _weight_bytes(local, vllm_config),
            total_memory=_node_total_memory(),
            memory_utilization=float(vllm_config.cache_config.gpu_memory_utilization),
        )  # fmt: skip
        vllm_bytes = per_worker * workers
        if workers > 1:
            how += f", x {workers} workers"
    return host_plan(
        headroom_bytes=cfg.cpu_headroom_bytes, cpu_offload_gb=offload_gb * workers,
        mem_available_bytes=mem_available_bytes, model_dir=local,
        vllm_host_bytes=vllm_bytes, vllm_host_how=how, workers=workers,
    )  # fmt: skip


def _on_cpu(vllm_config: VllmConfig) -> bool:
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    if device is not None:
        return str(device) == "cpu"
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _cpu_kv_space(vllm_config: VllmConfig) -> int | None:
    """The CPU build's KV cache per worker when sized explicitly: vLLM 0.32 turns
    ``VLLM_CPU_KVCACHE_SPACE`` (GiB, when set and not empty) into ``kv_cache_memory_bytes``
    as it builds the config; ``--kv-cache-memory-bytes`` sets it directly. None: vLLM sizes
    it from ``--gpu-memory-utilization``."""
    explicit = getattr(vllm_config.cache_config, "kv_cache_memory_bytes", None)
    if explicit is not None:
        return int(explicit)
    space = os.environ.get(CPU_KV_SPACE_ENV, "")
    return int(space) * 2**30 if space.strip().isdigit() else None


def _weight_bytes(model_dir: str | None, vllm_config: VllmConfig) -> int | None:
    """Bytes of one worker's weights from a local checkpoint (None when not readable)."""
    if model_dir is None:
        return None
    from kvtier.sizing.model import ModelConfigError, load_shape
    from kvtier.sizing.weights import load_weights

    tp = int(vllm_config.parallel_config.tensor_parallel_size)
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
