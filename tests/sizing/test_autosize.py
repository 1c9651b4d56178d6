"""``resolve_cpu_bytes``: the connector's "auto" host tier and the explicit-size check."""

from __future__ import annotations

import subprocess
import sys

import pytest
from sizing_helpers import GiB, MiB

from kvtier.errors import ConfigError
from kvtier.sizing import autosize
from kvtier.sizing.autosize import mem_available_bytes, resolve_cpu_bytes

ENV = "VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


def test_auto_is_available_minus_headroom_without_offload():
    assert resolve_cpu_bytes("auto", headroom_bytes=4 * GiB, mem_available_bytes=64 * GiB) == (
        60 * GiB
    )


def test_auto_subtracts_pinned_upper_bound_of_cpu_offload_gb():
    # no checkpoint: 10 GiB budget, pinned -> rounded up to 16 GiB
    got = resolve_cpu_bytes(
        "auto", headroom_bytes=4 * GiB, cpu_offload_gb=10, mem_available_bytes=64 * GiB
    )
    assert got == (64 - 16 - 4) * GiB
    exact = resolve_cpu_bytes(
        "auto",
        headroom_bytes=4 * GiB,
        cpu_offload_gb=10,
        disable_pin_memory=True,
        mem_available_bytes=64 * GiB,
    )
    assert exact == (64 - 10 - 4) * GiB


def test_auto_reads_the_pin_env_var_like_vllm(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    got = resolve_cpu_bytes(
        "auto", headroom_bytes=0, cpu_offload_gb=10, mem_available_bytes=64 * GiB
    )
    assert got == 54 * GiB
    monkeypatch.setenv(ENV, "true")  # vLLM's int() would fail on this
    with pytest.raises(ConfigError) as e:
        resolve_cpu_bytes("auto", headroom_bytes=0, cpu_offload_gb=10, mem_available_bytes=GiB)
    assert e.value.key == ENV


def test_auto_uses_the_checkpoint_when_model_dir_has_safetensors(tiny_llama):
    # everything offloaded: per layer qkv 16,384 + o 8,192 + gate_up 24,576 -> 32,768 pinned
    # + down 12,288 -> 16,384 pinned + two 128 B norms
    per_layer_pinned = 16384 + 8192 + 32768 + 16384 + 128 + 128
    got = resolve_cpu_bytes(
        "auto",
        headroom_bytes=1000,
        cpu_offload_gb=1.0,
        mem_available_bytes=10**6,
        model_dir=tiny_llama,
    )
    assert got == 10**6 - 2 * per_layer_pinned - 1000
    sel = resolve_cpu_bytes(
        "auto",
        headroom_bytes=0,
        cpu_offload_gb=1.0,
        offload_params={"mlp"},
        mem_available_bytes=10**6,
        model_dir=tiny_llama,
    )
    assert sel == 10**6 - 2 * (32768 + 16384)


def test_auto_that_leaves_nothing_raises_with_the_plan():
    with pytest.raises(ConfigError) as e:
        resolve_cpu_bytes(
            "auto", headroom_bytes=4 * GiB, cpu_offload_gb=10, mem_available_bytes=18 * GiB
        )
    assert e.value.key == "cpu_bytes" and e.value.value == "auto"
    msg = str(e.value)
    assert "18.00 GiB" in msg and "16.00 GiB" in msg and "4.00 GiB" in msg


def test_explicit_size_that_fits_is_returned():
    assert resolve_cpu_bytes(8 * GiB, headroom_bytes=4 * GiB, mem_available_bytes=12 * GiB) == (
        8 * GiB
    )
    assert resolve_cpu_bytes("8GiB", headroom_bytes=0, mem_available_bytes=9 * GiB) == 8 * GiB


def test_explicit_size_that_does_not_fit_names_the_largest_that_does():
    with pytest.raises(ConfigError) as e:
        resolve_cpu_bytes(
            40 * GiB,
            headroom_bytes=4 * GiB,
            cpu_offload_gb=10,
            disable_pin_memory=True,
            mem_available_bytes=48 * GiB,
        )
    assert e.value.key == "cpu_bytes" and e.value.value == 40 * GiB
    assert f"largest cpu_bytes that fits is {34 * GiB}" in str(e.value)


def test_mem_available_is_meminfo_capped_by_the_cgroup(monkeypatch):
    monkeypatch.setattr(autosize, "_meminfo_available", lambda: 64 * GiB)
    for cgroup, want in ((None, 64 * GiB), (8 * GiB, 8 * GiB), (100 * GiB, 64 * GiB)):
        monkeypatch.setattr(autosize, "cgroup_available_bytes", lambda c=cgroup: c)
        assert mem_available_bytes() == want


def test_mem_available_reads_the_hosts_meminfo():
    meminfo = dict(line.split(":") for line in open("/proc/meminfo").read().splitlines())
    want = int(meminfo["MemAvailable"].split()[0]) * 1024
    cgroup = autosize.cgroup_available_bytes()
    want = want if cgroup is None else min(want, cgroup)
    assert abs(mem_available_bytes() - want) < 512 * MiB  # other processes allocate meanwhile


def test_autosize_imports_nothing_heavy():
    code = (
        "import sys, kvtier.sizing.autosize; "
        "print(any(m in sys.modules for m in ('torch', 'vllm', 'numpy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unreadable_checkpoint_falls_back_to_the_bound(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\x05")
    got = resolve_cpu_bytes(
        "auto",
        headroom_bytes=0,
        cpu_offload_gb=1,
        disable_pin_memory=True,
        mem_available_bytes=8 * GiB,
        model_dir=str(tmp_path),
    )
    assert got == 7 * GiB


def test_cgroup_limit_caps_available_memory(tmp_path) -> None:
    from kvtier.sizing.autosize import cgroup_available_bytes

    # no /proc/self/cgroup to read: the mount root is the process's cgroup
    # (tests/sizing/test_autosize_cgroup.py walks real hierarchies)
    no_proc = str(tmp_path / "no-proc-cgroup")
    (tmp_path / "memory.max").write_text("8589934592\n")
    (tmp_path / "memory.current").write_text("1073741824\n")
    assert cgroup_available_bytes(str(tmp_path), no_proc) == 7 * 1024**3
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_available_bytes(str(tmp_path), no_proc) is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(4 * 1024**3))
    (v1 / "memory" / "memory.usage_in_bytes").write_text(str(1024**3))
    assert cgroup_available_bytes(str(v1), no_proc) == 3 * 1024**3
    assert cgroup_available_bytes(str(tmp_path / "missing"), no_proc) is None
