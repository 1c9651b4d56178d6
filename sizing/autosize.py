"""``cpu_bytes: "auto"``: size the host tier from what the host really has left.

The connector calls :func:`resolve_cpu_bytes` at engine start. It subtracts
vLLM's weight-offload host cost (pinned copies, power-of-two rounded) and the
headroom from the available memory, and refuses an explicit size that cannot
fit, so a wrong ``cpu_bytes`` stops startup with the plan instead of getting
the engine OOM-killed later. Imports nothing heavy.
"""

from __future__ import annotations

import os

from kvtier.sizing import offload as off

from kvtier.config import format_size, parse_size
from kvtier.errors import ConfigError

GiB = 1024**3


def mem_available_bytes() -> int:
    """Memory this process can still get: MemAvailable, capped by its cgroup's limit.

    Inside a container /proc/meminfo shows the node, not the pod; without the cgroup
    cap an "auto" tier could be sized past the pod's limit and get it OOM-killed.
    """
    host = _meminfo_available()
    cgroup = cgroup_available_bytes()
    return host if cgroup is None else min(host, cgroup)


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil  # only where /proc/meminfo is missing (macOS)

    return int(psutil.virtual_memory().available)


def cgroup_available_bytes(root: str = "/sys/fs/cgroup") -> int | None:
    """Limit minus usage of this process's memory cgroup (v2, then v1); None if unlimited."""
    candidates = [
        (os.path.join(root, "memory.max"), os.path.join(root, "memory.current")),
        (
            os.path.join(root, "memory", "memory.limit_in_bytes"),
            os.path.join(root, "memory", "memory.usage_in_bytes"),
        ),
    ]
    for limit_path, usage_path in candidates:
        try:
            with open(limit_path, encoding="ascii") as f:
                raw = f.read().strip()
            with open(usage_path, encoding="ascii") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if raw == "max" or not raw.isdigit() or int(raw) >= 1 << 60:
            return None
        return max(0, int(raw) - usage)
    return None


def weight_offload_host_bytes(
    cpu_offload_gb: float,
    offload_params: set[str] | None = None,
    *,
    pin: bool = True,
    model_dir: str | None = None,
) -> tuple[int, str]:
    """Host bytes vLLM's UVA weight offload will take, and how that figure was obtained.

    Exact from the checkpoint's safetensors headers when ``model_dir`` has them;
    otherwise the budget itself (``cpu_offload_gb`` GiB, as vLLM reads it),
    rounded up to a power of two as pinning would.
    """
    if cpu_offload_gb <= 0:
        return 0, "no weight offload"
    if model_dir and os.path.isdir(model_dir):
        from kvtier.sizing.model import load_shape
        from kvtier.sizing.weights import weights_from_safetensors

        try:
            shape = load_shape(model_dir)
            weights = weights_from_safetensors(model_dir, shape)
        except (ValueError, OSError, KeyError, TypeError):  # unreadable: fall back to the bound
            weights = None
        if weights is not None:
            result = off.uva_offload(weights, cpu_offload_gb, offload_params or (), pin=pin)
            return result.host_bytes, f"from {len(result.tensors)} safetensors tensors"
    budget = int(cpu_offload_gb * GiB)
    return (off.next_pow2(budget) if pin else budget), "upper bound from --cpu-offload-gb"


def resolve_cpu_bytes(
    requested: int | str,
    *,
    headroom_bytes: int,
    cpu_offload_gb: float = 0.0,
    offload_params: set[str] | None = None,
    disable_pin_memory: bool | None = None,
    mem_available_bytes: int | None = None,
    model_dir: str | None = None,
) -> int:
    """The host-tier size in bytes for ``cpu_bytes`` (an int, a size string or ``"auto"``).

    ``offload_params`` are the UVA selectors (vLLM's ``cpu_offload_params``).
    ``disable_pin_memory`` None reads VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY as vLLM does.
    """
    available = mem_available_bytes if mem_available_bytes is not None else _available()
    try:
        pin = off.resolve_pin(disable_pin_memory)
    except ValueError as e:
        raise ConfigError(off.PIN_ENV, os.environ.get(off.PIN_ENV), str(e)) from None
    offload, how = weight_offload_host_bytes(
        cpu_offload_gb, offload_params, pin=pin, model_dir=model_dir
    )
    largest = available - offload - headroom_bytes
    plan = (
        f"plan: available host memory {format_size(available)} - weight offload host bytes "
        f"{format_size(offload)} ({how}{', pinned' if pin and offload else ''}) - headroom "
        f"{format_size(headroom_bytes)} = {format_size(largest)}"
    )
    auto = isinstance(requested, str) and requested.strip().lower() == "auto"
    if auto:
        if largest <= 0:
            raise ConfigError(
                "cpu_bytes", "auto", f"no host memory left for the host tier; {plan}. "
                "Lower cpu_headroom_bytes or --cpu-offload-gb, or add memory.",
            )  # fmt: skip
        return largest
    value = parse_size("cpu_bytes", requested)
    if value + offload + headroom_bytes > available:
        most = max(largest, 0)
        fit = f"the largest cpu_bytes that fits is {most} ({format_size(most)})"
        raise ConfigError("cpu_bytes", requested, f"does not fit; {plan}; {fit}")
    return value


def _available() -> int:
    return mem_available_bytes()
