"""``cpu_bytes: "auto"``: size the host tier from what the host really has left.

The connector calls :func:`resolve_cpu_bytes` at engine start. It subtracts
vLLM's weight-offload host cost (pinned copies, power-of-two rounded) and the
headroom from the available memory, and refuses an explicit size that cannot
fit, so a wrong ``cpu_bytes`` stops startup with the plan instead of getting
the engine OOM-killed later. Imports nothing heavy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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
        return _walk(
            os.path.join(root, "memory"), v1_path, "memory.limit_in_bytes", "memory.usage_in_bytes"
        )
    if v2_path is not None or os.path.exists(os.path.join(root, "memory.max")):
        got = _walk(root, v2_path or "/", "memory.max", "memory.current")
        if got is not None or v2_path is not None:
            return got
    # no /proc/self/cgroup (or nothing at its path): the mount roots, v2 then v1
    got = _walk(root, "/", "memory.max", "memory.current")
    if got is None:
        got = _walk(
            os.path.join(root, "memory"), "/", "memory.limit_in_bytes", "memory.usage_in_bytes"
        )
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


@dataclass(frozen=True, slots=True)
class HostPlan:
    """The host-memory plan kvtier's host tier is checked against, in bytes for the whole
    host (every worker): what is available now, less what vLLM will still take of it
    (weight offload; on the CPU build its own KV cache and weights), less the headroom.
    The same plan refuses a ``cpu_bytes`` before the workers start, in a worker before it
    allocates its slab, and in ``kvtier size``."""

    available: int
    headroom: int
    offload: int = 0
    offload_how: str = "no weight offload"
    pinned: bool = False
    #: host memory vLLM itself takes after this check (the CPU build's KV cache and
    #: weights, :func:`vllm_cpu_host_bytes`), and how it was counted
    vllm: int = 0
    vllm_how: str = ""
    #: the workers (TP x PP ranks) whose host tiers share this memory
    workers: int = 1

    @property
    def largest_total(self) -> int:
        return self.available - self.offload - self.vllm - self.headroom

    @property
    def largest_per_worker(self) -> int:
        """The largest ``cpu_bytes`` (per worker) that fits: 0 when nothing does."""
        return max(0, self.largest_total) // max(1, self.workers)

    def text(self) -> str:
        vllm = (
            f" - vLLM's own host memory {format_size(self.vllm)} ({self.vllm_how})"
            if self.vllm or self.vllm_how
            else ""
        )
        pinned = ", pinned" if self.pinned and self.offload else ""
        per = (
            f"; {format_size(self.largest_per_worker)} per worker x {self.workers}"
            if self.workers > 1
            else ""
        )
        return (
            f"plan: available host memory {format_size(self.available)} - weight offload "
            f"host bytes {format_size(self.offload)} ({self.offload_how}{pinned}){vllm} - "
            f"headroom {format_size(self.headroom)} = {format_size(self.largest_total)}{per}"
        )

    def fit_hint(self) -> str:
        most = self.largest_per_worker
        return f"the largest cpu_bytes that fits is {most} ({format_size(most)})"

    def check(self, cpu_bytes: int | str, *, given: object = None) -> int:
        """``cpu_bytes`` per worker (an int, a size string or "auto") resolved against the
        plan; a ConfigError naming ``cpu_bytes``, the plan and what would fit otherwise."""
        shown = cpu_bytes if given is None else given
        if isinstance(cpu_bytes, str) and cpu_bytes.strip().lower() == "auto":
            if self.largest_per_worker <= 0:
                raise ConfigError(
                    "cpu_bytes",
                    shown,
                    f"no host memory left for the host tier; {self.text()}. "
                    "Lower cpu_headroom_bytes, --cpu-offload-gb or vLLM's own KV cache "
                    "(VLLM_CPU_KVCACHE_SPACE on the CPU build), or add memory.",
                )
            return self.largest_per_worker
        value = parse_size("cpu_bytes", cpu_bytes)
        if value * self.workers > max(0, self.largest_total):
            raise ConfigError("cpu_bytes", shown, f"does not fit; {self.text()}; {self.fit_hint()}")
        return value


def vllm_cpu_host_bytes(
    kv_space_bytes: int | None,
    weight_bytes: int | None,
    *,
    total_memory: int,
    memory_utilization: float,
) -> tuple[int, str]:
    """Host memory one worker of vLLM's CPU build takes for itself, and how it was counted.

    ``kv_space_bytes``: its KV cache when sized explicitly (``VLLM_CPU_KVCACHE_SPACE``
    GiB, or ``--kv-cache-memory-bytes``); then the worker holds that plus the weights.
    None: vLLM 0.32's CPU worker sizes its KV cache itself, to ``--gpu-memory-utilization``
    (0.92 by default) of the node's memory less what the worker already holds (weights
    included): the worker grows to that share of ``total_memory``."""
    weights = weight_bytes or 0
    unknown = "" if weight_bytes is not None else ", weights unknown"
    if kv_space_bytes is not None:
        return kv_space_bytes + weights, (
            f"CPU build: KV cache {format_size(kv_space_bytes)} (VLLM_CPU_KVCACHE_SPACE) + "
            f"weights {format_size(weights)}{unknown}"
        )
    share = int(total_memory * memory_utilization)
    return share, (
        f"CPU build: VLLM_CPU_KVCACHE_SPACE unset, so vLLM sizes its KV cache to "
        f"{memory_utilization:g} (--gpu-memory-utilization) of {format_size(total_memory)}; "
        "set VLLM_CPU_KVCACHE_SPACE (GiB) to leave room for the host tier"
    )


def host_plan(
    *,
    headroom_bytes: int,
    cpu_offload_gb: float = 0.0,
    offload_params: set[str] | None = None,
    disable_pin_memory: bool | None = None,
    mem_available_bytes: int | None = None,
    model_dir: str | None = None,
    vllm_host_bytes: int = 0,
    vllm_host_how: str = "",
    workers: int = 1,
) -> HostPlan:
    """The :class:`HostPlan` of this host now. ``cpu_offload_gb`` is the whole host's
    (per worker x workers); ``vllm_host_bytes`` too."""
    available = mem_available_bytes if mem_available_bytes is not None else _available()
    try:
        pin = off.resolve_pin(disable_pin_memory)
    except ValueError as e:
        raise ConfigError(off.PIN_ENV, os.environ.get(off.PIN_ENV), str(e)) from None
    offload, how = weight_offload_host_bytes(
        cpu_offload_gb, offload_params, pin=pin, model_dir=model_dir
    )
    return HostPlan(
        available=available,
        headroom=headroom_bytes,
        offload=offload,
        offload_how=how,
        pinned=pin,
        vllm=vllm_host_bytes,
        vllm_how=vllm_host_how,
        workers=max(1, workers),
    )


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
    """The host-tier size in bytes for ``cpu_bytes`` (an int, a size string or ``"auto"``)
    on the whole host (one worker's plan).

    ``offload_params`` are the UVA selectors (vLLM's ``cpu_offload_params``).
    ``disable_pin_memory`` None reads VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY as vLLM does.
    """
    plan = host_plan(
        headroom_bytes=headroom_bytes,
        cpu_offload_gb=cpu_offload_gb,
        offload_params=offload_params,
        disable_pin_memory=disable_pin_memory,
        mem_available_bytes=mem_available_bytes,
        model_dir=model_dir,
    )
    return plan.check(requested)


def _available() -> int:
    return mem_available_bytes()
