"""A worker's host slab that does not fit is a ConfigError naming ``cpu_bytes`` with the
plan, never a raw ``OSError: [Errno 12] Cannot allocate memory`` from mmap (issue 48,
item 2), and the plan of an engine not yet started counts vLLM's own host memory."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from kvtier.config import load_config
from kvtier.connectors import slots, startup
from kvtier.connectors.engine_shape import EngineShape
from kvtier.errors import ConfigError
from kvtier.host.layout import SlotLayout
from kvtier.sizing import autosize
from kvtier.sizing.autosize import HostPlan, vllm_cpu_host_bytes

GiB, MiB = 2**30, 2**20


def layout() -> SlotLayout:
    return SlotLayout.from_kv_caches({"l0": torch.zeros(8, 2, 16, 64)}, 8, 2)


def test_the_kernels_refusal_is_a_config_error_naming_cpu_bytes() -> None:
    """A real mmap refused by the kernel: the process may map at most 6 GiB more than it
    has (RLIMIT_AS), and the slab asks for 16 GiB, which the plan (MemAvailable) may
    well allow on a large host: the ENOMEM itself must come back as the ConfigError."""
    code = textwrap.dedent("""
        import resource, torch
        from kvtier.config import load_config
        from kvtier.connectors import slots
        from kvtier.errors import ConfigError
        from kvtier.host.layout import SlotLayout
        from kvtier.sizing import autosize
        autosize._available = lambda: 1 << 50  # the plan allows it: only the kernel refuses
        lay = SlotLayout.from_kv_caches({"l0": torch.zeros(8, 2, 16, 64)}, 8, 2)
        used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + (6 << 30), resource.RLIM_INFINITY))
        cfg = load_config({"cpu_bytes": "16GiB", "cpu_headroom_bytes": 0}, environ={})
        try:
            slots.allocate_slab(cfg, 16 << 30, lay, pin=False, commit=False, rank=3)
        except ConfigError as e:
            print("REFUSED", e.key, "|", e)
        else:
            print("ALLOCATED")
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.startswith("REFUSED cpu_bytes |"), out.stdout + out.stderr
    assert "worker rank 3" in out.stdout and "could not be allocated" in out.stdout
    assert "Cannot allocate memory" in out.stdout  # the kernel's word, inside the error
    assert "the largest cpu_bytes that fits is" in out.stdout


def test_a_slab_larger_than_the_memory_left_is_refused_before_mmap(monkeypatch) -> None:
    """vLLM took its KV cache first (20.7 of 23.5 GiB in the issue): the slab is refused
    with the plan, not committed page by page until the OOM killer takes the worker."""
    monkeypatch.setattr(autosize, "_available", lambda: 3 * GiB)
    made: list[int] = []
    monkeypatch.setattr(slots, "HostSlab", lambda n, *a, **k: made.append(n))
    cfg = load_config({"cpu_bytes": "2GiB", "cpu_headroom_bytes": "2GiB"}, environ={})
    with pytest.raises(ConfigError) as info:
        slots.allocate_slab(cfg, 2 * GiB, layout(), pin=False, commit=True, rank=0)
    assert info.value.key == "cpu_bytes" and made == []
    msg = str(info.value)
    assert "available host memory 3.00 GiB" in msg and "headroom 2.00 GiB" in msg
    assert f"the largest cpu_bytes that fits is {GiB} (1.00 GiB)" in msg
    slots.allocate_slab(cfg, GiB, layout(), pin=False, commit=True, rank=0)
    assert made == [GiB]


def test_the_cpu_builds_own_memory_is_counted() -> None:
    explicit, how = vllm_cpu_host_bytes(
        2 * GiB, 500 * MiB, total_memory=32 * GiB, memory_utilization=0.92
    )
    assert explicit == 2 * GiB + 500 * MiB and "VLLM_CPU_KVCACHE_SPACE" in how
    share, how = vllm_cpu_host_bytes(None, 500 * MiB, total_memory=32 * GiB, memory_utilization=0.5)
    assert share == 16 * GiB and "unset" in how  # the weights are inside vLLM's share


def test_the_plan_is_shared_by_the_workers_of_one_host() -> None:
    plan = HostPlan(available=40 * GiB, headroom=4 * GiB, vllm=4 * GiB, vllm_how="x", workers=4)
    assert plan.largest_per_worker == 8 * GiB
    assert plan.check("8GiB") == 8 * GiB and plan.check("auto") == 8 * GiB
    with pytest.raises(ConfigError) as info:
        plan.check(9 * GiB, given="9GiB")
    assert info.value.value == "9GiB" and "8.00 GiB per worker x 4" in str(info.value)


def fake_engine(tmp_path, *, kv_bytes: int | None, tp: int = 1) -> EngineShape:
    return EngineShape.from_vllm(
        SimpleNamespace(  # type: ignore[arg-type]
            model_config=SimpleNamespace(model=str(tmp_path / "not-a-dir")),
            cache_config=SimpleNamespace(
                kv_cache_memory_bytes=kv_bytes,
                gpu_memory_utilization=0.9,
                cpu_offload_gb=0,
                block_size=32,
            ),
            parallel_config=SimpleNamespace(
                tensor_parallel_size=tp, pipeline_parallel_size=1, nnodes=1
            ),
            device_config=SimpleNamespace(device_type="cpu"),
            offload_config=None,
        )
    )


def test_the_startup_plan_of_a_cpu_engine(tmp_path, monkeypatch) -> None:
    """Before the workers start: every worker's host tier, KV cache and weights (unknown
    for a model that is not a local directory) and the headroom."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cfg = load_config({"cpu_bytes": "4GiB", "cpu_headroom_bytes": "1GiB"}, environ={})
    plan = startup.startup_plan(
        cfg, fake_engine(tmp_path, kv_bytes=2 * GiB, tp=2), mem_available_bytes=13 * GiB
    )
    assert plan.vllm == 4 * GiB and plan.workers == 2 and "weights unknown" in plan.vllm_how
    assert plan.check(4 * GiB) == 4 * GiB
    with pytest.raises(ConfigError):
        plan.check(5 * GiB)


def test_the_scheduler_does_not_count_the_allocated_slabs_twice(tmp_path, monkeypatch) -> None:
    """vLLM builds the scheduler after the workers allocated (and committed) their slabs:
    an explicit cpu_bytes checked again then against the memory left was refused when it
    was over half of what the host had. It was checked before the workers allocated; the
    scheduler takes it as it is. "auto" is still resolved there, as the workers' share."""
    monkeypatch.setattr(autosize, "_available", lambda: 3 * GiB)
    engine = fake_engine(tmp_path, kv_bytes=GiB, tp=2)
    cfg = load_config({"cpu_bytes": "8GiB", "cpu_headroom_bytes": "1GiB"}, environ={})
    assert slots.resolve_host_bytes(cfg, engine, 2) == 8 * GiB
    auto = load_config({"cpu_bytes": "auto", "cpu_headroom_bytes": "1GiB"}, environ={})
    assert slots.resolve_host_bytes(auto, engine, 2) == GiB
