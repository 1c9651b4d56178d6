"""Hybrid models with recurrent state in a real engine (vLLM's CPU build) with kvtier.

Two tiny random-weight hybrids, built locally: a Mamba2 hybrid (GraniteMoeHybrid, as
Granite-4.0-H) and a gated delta-net hybrid (Qwen3-Next). vLLM gives each a state group
beside its attention group; kvtier stores a chunk's attention KV and the state at the
chunk's end, and a hit loads the state into the block vLLM runs the request on. Every
hit must give the tokens and logprobs of the same prefix served by vLLM's own prefix
cache, bit for bit: from the host tier, after a restart from the object tier, and for
partial hits (2 and 3 of 4 chunks shared).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import run_engine

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

SCENARIOS = "tests.e2e.state_scenarios"


def _tokenizer_into(out: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    from kvtier.cli.tinymodel import build_tiny_llama

    base = build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny4")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base / name).exists():
            shutil.copy(base / name, out / name)


def _save(model: Any, out: Path) -> str:
    import torch

    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return str(out)


@pytest.fixture(scope="module")
def mamba2_hybrid(tmp_path_factory: pytest.TempPathFactory) -> str:
    """GraniteMoeHybrid: Mamba2 layers 0 and 2, attention layers 1 and 3."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    out = tmp_path_factory.mktemp("tiny-granite-h")
    _tokenizer_into(out, tmp_path_factory)
    cfg = GraniteMoeHybridConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        layer_types=["mamba", "attention", "mamba", "attention"],
        mamba_n_heads=8,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=1,
        num_local_experts=0,
        num_experts_per_tok=0,
        shared_intermediate_size=512,
        position_embedding_type="rope",
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        initializer_range=0.08,
    )
    torch.manual_seed(0)
    return _save(GraniteMoeHybridForCausalLM(cfg), out)


@pytest.fixture(scope="module")
def gdn_hybrid(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3-Next: gated delta-net layers 0 and 2, attention layers 1 and 3."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    out = tmp_path_factory.mktemp("tiny-qwen3-next")
    _tokenizer_into(out, tmp_path_factory)
    cfg = Qwen3NextConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        initializer_range=0.08,
    )
    torch.manual_seed(0)
    return _save(Qwen3NextForCausalLM(cfg), out)


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]


@pytest.mark.parametrize(
    ("which", "tp"),
    [("mamba2_hybrid", 1), ("gdn_hybrid", 1), ("gdn_hybrid", 2)],
    ids=["mamba2", "gdn", "gdn-tp2"],
)
def test_state_hits_equal_the_cold_prompt_from_both_tiers_and_after_a_restart(
    which: str, tp: int, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Each hit against the same prompt computed cold in the same steps after the hit
    (the split is the same: the outputs must be equal bit for bit). Without the state
    loaded into the block the request runs on, Q's first token differs and the others'
    logprobs are off by up to 0.008 (float32). At TP=2 each rank stores and loads its
    shard of the state (the gated delta-net's heads are split across ranks)."""
    model = request.getfixturevalue(which)
    extra = {"cpu_bytes": "32MiB", "remote_url": f"file://{tmp_path / 'tier'}"}
    env = {"KVTIER_TEST_SCENARIO_MODULES": SCENARIOS}
    if tp > 1:  # one core per rank (vLLM's automatic binding wants a NUMA node per rank)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    w = run_engine("state_writer", env=env, model=model, extra=extra, tp=tp)
    assert w["groups"] and {g[0] for g in w["groups"]} == {"state", "full"}, w["groups"]
    assert [g[1] for g in w["groups"] if g[0] == "state"] == [1], "one state block per chunk"
    assert w["p_cold"]["cached"] == 0 and w["q_cold"]["cached"] == 0
    # kvtier's host tier, vLLM's cache emptied: 4 chunks of P, 2 of Q (a partial hit)
    assert w["p_hit"]["cached"] == 1024 and same(w["p_hit"], w["p_cold"]), (w["p_hit"], w["p_cold"])
    assert w["q_hit"]["cached"] == 512 and same(w["q_hit"], w["q_cold"]), (w["q_hit"], w["q_cold"])
    totals = w["index"]["totals"]
    assert totals["hit_tokens_host"] == 1024 + 512 and totals["load_failed"] == 0, totals
    assert totals["upload_ok"] >= 4, totals  # P's chunks are in the directory
    assert w["index"]["refs"] == 0 and w["index"]["invariants"] is True

    # restarted: the host tier is empty, the directory holds P's chunks
    r = run_engine("state_reader", env=env, model=model, extra=extra, tp=tp)
    assert r["p_hit"]["cached"] == 1024 and same(r["p_hit"], w["p_cold"]), (r["p_hit"], w["p_cold"])
    assert r["r_cold"]["cached"] == 0
    assert r["r_hit"]["cached"] == 768 and same(r["r_hit"], r["r_cold"]), (r["r_hit"], r["r_cold"])
    totals = r["index"]["totals"]
    assert totals["hit_tokens_remote"] == 1024 + 768 and totals["hit_tokens_host"] == 0, totals
    assert r["index"]["refs"] == 0 and r["index"]["invariants"] is True


def test_state_held_outside_align_mode_is_refused_with_what_to_run(
    mamba2_hybrid: str, tmp_path: Path
) -> None:
    """Without ``mamba_cache_mode: align`` vLLM keeps no state at chunk boundaries: the
    engine does not start, and the error names the setting to change."""
    env = {"KVTIER_TEST_SCENARIO_MODULES": SCENARIOS}
    r = run_engine("state_refused", env=env, model=mamba2_hybrid, extra={"cpu_bytes": "64MiB"})
    assert "--mamba-cache-mode align" in r["error"], r["error"]
    assert json.dumps(r).count("Traceback") == 0
