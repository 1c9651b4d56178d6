"""``kvtier size`` refuses what the connector refuses, in the same words (issue 48, item 3).

It used to plan a Jamba, ``--tp 3`` with 8 KV heads, ``--chunk-size 100`` and
``--remote-url ftp://x``, every one refused by the engine at startup, and to refuse
``--cpu-bytes 8GiB``, which the config key takes. Each case runs through both: the
connector (``KVTierConnector`` over vLLM's real config and KV cache groups) and
``kvtier size`` (its command line), and both must name the same key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

from kvtier.cli.main import main
from kvtier.connectors.vllm import KVTierConnector
from kvtier.errors import ConfigError
from tests.connectors.hybrid_engine import BS, CHUNK, engine_config

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "models"
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
MAMBA = MambaSpec(
    block_size=BS,
    shapes=((4, 8), (2, 8)),
    dtypes=(torch.bfloat16, torch.bfloat16),
    page_size_padded=FULL.page_size_bytes,
)


def attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def connector_refusal(model_dir: str, extra: dict, groups: list | None = None) -> ConfigError:
    vc = engine_config(model_dir, extra)
    kcc = KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[],
        kv_cache_groups=groups or [KVCacheGroupSpec([attn(i) for i in range(4)], FULL)],
    )
    with pytest.raises(ConfigError) as err:
        KVTierConnector(vc, KVConnectorRole.WORKER, kcc)
    return err.value


def size_refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = main(["size", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    return err


@pytest.mark.parametrize(
    ("extra", "flags", "key"),
    [
        ({"chunk_size": 100}, ["--chunk-size", "100"], "chunk_size"),  # not a multiple of 16
        ({"remote_url": "ftp://x"}, ["--remote-url", "ftp://x"], "remote_url"),
        ({"cpu_bytes": "-1"}, ["--cpu-bytes", "-1"], "cpu_bytes"),
        ({"cpu_bytes": "8 parsecs"}, ["--cpu-bytes", "8 parsecs"], "cpu_bytes"),
        ({"write_policy": "sometimes"}, ["--write-policy", "sometimes"], "write_policy"),
    ],
)
def test_a_setting_the_connector_refuses_kvtier_size_refuses(
    model_dir: str, capsys: pytest.CaptureFixture[str], extra: dict, flags: list[str], key: str
) -> None:
    want = connector_refusal(model_dir, {"chunk_size": CHUNK, **extra})
    assert want.key == key
    if key == "write_policy":  # argparse refuses it first, naming the flag
        with pytest.raises(SystemExit):
            main(["size", "--model", model_dir, *flags])
        assert "--write-policy" in capsys.readouterr().err
        return
    err = size_refusal(capsys, "--model", model_dir, "--block-size", str(BS), *flags)
    assert f"kvtier config '{key}'" in err
    assert want.allowed in err, (want.allowed, err)  # the same words


def test_a_mamba_hybrid_runs_in_align_mode_for_both(model_dir: str, capsys) -> None:
    """Jamba: attention layers with Mamba layers between them. The connector refuses its
    state group outside --mamba-cache-mode align; kvtier size plans it (issue 53) and gives
    vLLM that mode with the block size its chunks line up with, and refuses, as the
    connector would, a chunk size off the 80-token block vLLM raises --block-size 16 to."""
    want = connector_refusal(
        model_dir,
        {"chunk_size": CHUNK},
        [
            KVCacheGroupSpec([attn(0), attn(2)], FULL),
            KVCacheGroupSpec(["model.layers.1.mixer", "model.layers.3.mixer"], MAMBA),
        ],
    )
    assert want.key == "model" and "--mamba-cache-mode align" in str(want)
    jamba = str(FIXTURES / "jamba-v0.1")
    err = size_refusal(capsys, "--model", jamba)
    assert "kvtier config 'chunk_size'" in err and "80-token block" in err
    assert main(["size", "--model", jamba, "--chunk-size", "320", "--emit", "vllm-args"]) == 0
    assert "--mamba-cache-mode align --block-size 80" in capsys.readouterr().out


def test_an_attention_free_model_is_refused_by_both(tmp_path: Path, capsys) -> None:
    cfg = {
        "model_type": "mamba",
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "hidden_size": 64,
        "layer_types": ["mamba"] * 4,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    err = size_refusal(capsys, "--model", str(tmp_path))
    assert "kvtier config 'model'" in err and "attention-free" in err


@pytest.mark.parametrize("tp", ["3", "5", "64"])
def test_a_tensor_parallel_size_vllm_refuses_is_refused(capsys, tp: str) -> None:
    """Llama-3-8B: 32 attention heads, 8 KV heads (--tp 16 replicates them twice: fine)."""
    err = size_refusal(capsys, "--model", str(FIXTURES / "llama3-8b"), "--tp", tp)
    assert "kvtier config 'tensor_parallel_size'" in err and f"got {tp}" in err
    assert main(["size", "--model", str(FIXTURES / "llama3-8b"), "--tp", "16"]) == 0


@pytest.mark.parametrize("size", ["8GiB", "8589934592", "8 GiB", "8G"])
def test_cpu_bytes_takes_the_config_keys_size_strings(capsys, size: str) -> None:
    code = main(
        [
            "size",
            "--model",
            str(FIXTURES / "llama3-8b"),
            "--cpu-bytes",
            size,
            "--host-memory",
            "64",
            "--json",
        ]
    )
    plan = json.loads(capsys.readouterr().out)
    assert code == 0 and plan["cpu_bytes"] == plan["host_tier_bytes"] == 8 * 2**30


def test_a_plan_that_does_not_fit_prints_the_largest_that_does(capsys) -> None:
    """The README's first example: 200 warm sessions want 225 GiB beside a 128 GiB host:
    exit 1, and the largest cpu_bytes that fits, which then fits."""
    argv = [
        "size",
        "--model",
        str(FIXTURES / "llama3-8b"),
        "--gpu-memory",
        "24",
        "--host-memory",
        "128",
        "--warm-sessions",
        "200",
    ]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert "largest cpu_bytes that fits" in out
    assert "the largest cpu_bytes that fits is 133143986176 (124.00 GiB)" in err
    assert err.strip().endswith("--cpu-bytes 124GiB")
    assert main([*argv, "--cpu-bytes", "124GiB"]) == 0
    assert main([*argv, "--cpu-bytes", "125GiB"]) == 1


def test_vllm_cpus_own_kv_space_is_in_the_plan(capsys, monkeypatch) -> None:
    """On the CPU build vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE) and the weights share
    the host with the tier: 8 GiB fits 24 GiB alone, not beside 10 GiB of KV and 15 of
    weights; the variable is read as vLLM reads it when --cpu-kv-space is not given."""
    argv = [
        "size",
        "--model",
        str(FIXTURES / "llama3-8b"),
        "--cpu-bytes",
        "8GiB",
        "--host-memory",
        "24",
        "--json",
    ]
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["vllm_cpu_host_bytes"] is None and plan["fits"] is None  # GPU unknown
    assert main([*argv, "--cpu-kv-space", "10"]) == 1
    plan = json.loads(capsys.readouterr().out)
    assert plan["vllm_cpu_kv_bytes"] == 10 * 2**30
    assert plan["vllm_cpu_host_bytes"] == 10 * 2**30 + plan["weight_bytes_per_rank"]
    assert plan["host_bytes_total"] == 8 * 2**30 + plan["vllm_cpu_host_bytes"] + 4 * 2**30
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "10")
    assert main(argv) == 1
    assert json.loads(capsys.readouterr().out)["vllm_cpu_kv_bytes"] == 10 * 2**30
