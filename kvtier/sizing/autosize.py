"""``cpu_bytes: "auto"``: size the host tier from what the host really has left.

The connector calls :func:`resolve_cpu_bytes` at engine start. It subtracts
vLLM's weight-offload host cost (pinned copies, power-of-two rounded) and the
headroom from the available memory, and refuses an explicit size that cannot
fit, so a wrong ``cpu_bytes`` stops startup with the plan instead of getting
the engine OOM-killed later. Imports nothing heavy.
"""

from __future__ import annotations

import os

from kvtier.config import format_size, parse_size
from kvtier.errors import ConfigError
from kvtier.sizing import offload as off

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


#: a cgroup v1 limit at or past this is "no limit" (the kernel shows 9223372036854771712)
_UNLIMITED = 1 << 60


def cgroup_available_bytes(
    root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup"
) -> int | None:
    """Memory this process's cgroup can still take: min(limit - usage) up to the root.

    The limit that kills a pod is often not on the process's own cgroup but on
    an ancestor (the pod's slice above a container, a systemd slice), so every
    level from the process's cgroup (read from ``proc_cgroup``) up to the mount
    at ``root`` counts; None when no level has a limit. cgroup v1 is used when
    ``proc_cgroup`` lists the ``memory`` controller and ``root``/memory exists,
    v2 otherwise. With a
    namespaced cgroup, or a path not under the mount, the mount root is the
    process's own cgroup.
    """
    v1_path, v2_path = _own_cgroup_paths(proc_cgroup)
    if v1_path is not None and os.path.isdir(os.path.join(root, "memory")):
        return _walk(os.path.join(root, "memory"), v1_path,
                     "memory.limit_in_bytes", "memory.usage_in_bytes")  # fmt: skip
    if v2_path is not None or os.path.exists(os.path.join(root, "memory.max")):
        got = _walk(root, v2_path or "/", "memory.max", "memory.current")
        if got is not None or v2_path is not None:
            return got
    # no /proc/self/cgroup (or nothing at its path): the mount roots, v2 then v1
    got = _walk(root, "/", "memory.max", "memory.current")
    if got is None:
        got = _walk(os.path.join(root, "memory"), "/",
                    "memory.limit_in_bytes", "memory.usage_in_bytes")  # fmt: skip
    return got


def _own_cgroup_paths(proc_cgroup: str) -> tuple[str | None, str | None]:
    """(v1 memory cgroup path, v2 cgroup path) of this process, each None when not listed."""
    v1 = v2 = None
    try:
        with open(proc_cgroup, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if not sep or not path.startswith("/"):
            continue
        if hier == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v1, v2


def _walk(mount: str, path: str, limit_name: str, usage_name: str) -> int | None:
    """The smallest limit - usage from ``mount``/``path`` up to ``mount``; None if unlimited.

    A level whose usage file is missing or unreadable is charged the largest usage
    seen below it (a parent holds at least what its child holds).
    """
    mount = os.path.realpath(mount)
    here = os.path.realpath(os.path.join(mount, path.lstrip("/")))
    if os.path.commonpath([mount, here]) != mount or not os.path.isdir(here):
        here = mount  # namespaced cgroup, or a path from outside this mount
    best: int | None = None
    usage = 0
    while True:
        level_usage = _read_int(os.path.join(here, usage_name))
        if level_usage is not None:
            usage = max(usage, level_usage)
        limit = _read_limit(os.path.join(here, limit_name))
        if limit is not None:
            left = max(0, limit - usage)
            best = left if best is None else min(best, left)
        if here == mount:
            return best
        here = os.path.dirname(here)


def _read_limit(path: str) -> int | None:
    """A memory limit in bytes; None for "max", a v1 "unlimited" value or no readable file."""
    value = _read_int(path)
    return None if value is None or value >= _UNLIMITED else value


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            text = f.read(64).strip()
    except OSError:
        return None
    if not text.isascii() or not text.isdigit() or len(text) > 20:
        return None
    return int(text)


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
