"""Budgets, the host check and every warning code, on hand-computed numbers."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
from sizing_helpers import GiB, MiB, model

from kvtier.sizing.memory_plan import (
    CODES,
    PlanInputs,
    host_tier_bytes,
    host_total_bytes,
    k8s_quantity,
    make_plan,
    parse_k8s_quantity,
    warning,
)

SIZING = Path(__file__).resolve().parents[2] / "kvtier" / "sizing"

# Llama 3 8B per-layer tensors in bf16 and its whole checkpoint, by hand
QKV, O_PROJ, GATE_UP, DOWN, NORM = 48 * MiB, 32 * MiB, 224 * MiB, 112 * MiB, 8192
LAYER = QKV + O_PROJ + GATE_UP + DOWN + 2 * NORM
LLAMA8B = 32 * LAYER + 2 * 128256 * 4096 * 2 + NORM  # layers + embed + lm_head + final norm
UVA10 = 24 * LAYER + QKV + O_PROJ + GATE_UP  # what --cpu-offload-gb 10 moves


def codes(plan):
    return [w["code"] for w in plan["warnings"]]


def plan(**kw):
    kw.setdefault("model", model("llama3-8b"))
    return make_plan(PlanInputs(**kw))


def test_only_model_given_leaves_memory_figures_unknown():
    p = plan()
    assert p["kv_bytes_per_token"] == 131_072
    assert p["weight_bytes"] == LLAMA8B
    for key in (
        "gpu_kv_bytes",
        "gpu_kv_tokens",
        "warm_set_bytes",
        "host_tier_bytes",
        "host_bytes_total",
        "fits",
    ):
        assert p[key] is None, key
    assert p["warnings"] == []


def test_gpu_kv_budget_tokens_and_sessions():
    p = plan(gpu_memory_gib=24, gpu_memory_utilization=0.9, overhead_gib=2)
    budget = int(0.9 * 24 * GiB) - LLAMA8B - 2 * GiB
    assert p["gpu_kv_bytes"] == budget
    assert p["gpu_kv_tokens"] == budget // 131_072
    assert p["gpu_kv_sessions"] == budget // 2**30  # an 8k session is 1 GiB


def test_guide_200_warm_sessions_with_28_gib_gpu_kv_need_198_gib_host():
    p = plan(gpu_kv_gib=28, warm_sessions=200, context=8192)
    assert p["warm_set_bytes"] == 200 * GiB
    assert abs(p["host_tier_bytes"] / GiB - 197.8) < 0.01  # (200 - 28) x 1.15
    assert p["host_tier_needed"] is True


def test_host_tier_not_needed_when_gpu_holds_the_warm_set():
    p = plan(gpu_kv_gib=28, warm_sessions=10, host_memory_gib=64)
    assert p["host_tier_bytes"] is None and p["host_tier_needed"] is False
    assert p["host_bytes_total"] == 4 * GiB  # headroom only
    assert p["fits"] is True
    assert host_tier_bytes(10, 20) is None


def test_guide_24_gib_gpu_with_10_gib_offloaded_behaves_like_34():
    a = plan(gpu_memory_gib=24, cpu_offload_gb=10, gpu_memory_utilization=1.0, overhead_gib=0)
    b = plan(gpu_memory_gib=34, gpu_memory_utilization=1.0, overhead_gib=0)
    assert a["weight_offload_gpu_bytes"] == UVA10
    # the same, except that the last tensor taken overshoots the 10 GiB budget
    assert a["gpu_kv_bytes"] == b["gpu_kv_bytes"] + (UVA10 - 10 * GiB)
    assert abs(a["gpu_kv_bytes"] - b["gpu_kv_bytes"]) < 0.05 * GiB


def test_host_total_and_fit():
    p = plan(
        gpu_kv_gib=28,
        warm_sessions=200,
        host_memory_gib=256,
        cpu_offload_gb=10,
        disable_pin_memory=True,
    )
    tier = p["host_tier_bytes"]
    assert p["weight_offload_host_bytes"] == UVA10
    assert p["host_bytes_total"] == UVA10 + tier + 4 * GiB
    assert p["fits"] is True
    small = plan(gpu_kv_gib=28, warm_sessions=200, host_memory_gib=200)
    assert small["fits"] is False and "host-over-limit" in codes(small)


def test_tp_multiplies_workers_in_host_total():
    assert host_total_bytes(10, weight_offload_host_bytes=5, headroom_bytes=1, tp=4) == 61
    p = plan(tp=2, gpu_kv_gib=10, warm_sessions=100, context=8192)
    # per rank: 4 KV heads of 8, so half the bytes per token
    assert p["kv_bytes_per_token_per_rank"] == 65_536
    assert p["warm_set_bytes"] == 100 * 8192 * 65_536
    assert p["host_bytes_total"] == 2 * p["host_tier_bytes"] + 4 * GiB


def test_object_tier_holds_every_ranks_share_but_mla_once():
    """Per-rank KV is stored per rank (heads replicated past num_kv_heads included);
    MLA's latent, the same on every rank, is written once, by rank 0."""
    dense = plan(tp=2)
    assert dense["object_kv_bytes_per_token"] == 2 * 65_536 == dense["kv_bytes_per_token"]
    mla = plan(model=model("deepseek-v3"), tp=8)
    assert mla["kv_bytes_per_token_per_rank"] == mla["kv_bytes_per_token"] == 70_272
    assert mla["object_kv_bytes_per_token"] == 70_272
    moe = plan(model=model("qwen3-30b-a3b"), tp=8)  # 4 KV heads on 8 ranks: each twice
    assert moe["object_kv_bytes_per_token"] == 8 * 48 * 2 * 1 * 128 * 2


def test_pin_rounding_pushes_host_over_the_limit():
    kw = dict(gpu_memory_gib=80, cpu_offload_gb=10, warm_sessions=0, host_memory_gib=15)
    p = plan(**kw)
    pinned = 24 * (64 + 32 + 256 + 128) * MiB + 24 * 2 * NORM + (64 + 32 + 256) * MiB
    assert p["weight_offload_host_bytes"] == pinned
    assert UVA10 + 4 * GiB <= 15 * GiB < pinned + 4 * GiB
    assert p["fits"] is False
    assert {"host-over-limit", "pin-rounding-over-host"} <= set(codes(p))
    unpinned = plan(**kw, disable_pin_memory=True)
    assert unpinned["fits"] is True and unpinned["weight_offload_host_bytes"] == UVA10


def test_pin_env_var_is_honoured():
    env = {"VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY": "1"}
    p = plan(cpu_offload_gb=10, environ=env)
    assert p["pin_memory"] is False and p["weight_offload_host_bytes"] == UVA10


@pytest.mark.parametrize(
    "version, warned", [("0.27.1", True), ("0.28.0", False), ("0.33.0", False)]
)
def test_old_vllm_ignores_offload(version, warned):
    p = plan(cpu_offload_gb=4, vllm_version=version)
    assert ("offload-ignored-old-vllm" in codes(p)) is warned
    assert "offload-ignored-old-vllm" not in codes(plan(vllm_version="0.20.0"))


def test_cpu_offload_gb_with_group_size_prefetch_wins():
    p = plan(cpu_offload_gb=10, offload_group_size=8, offload_num_in_group=2)
    assert "uva-discarded-by-prefetch" in codes(p)
    assert p["offload_backend"] == "prefetch"
    assert p["weight_offload_gpu_bytes"] == 8 * LAYER  # layers 6,7,14,15,...: not 10 GiB


def test_prefetch_backend_without_group_size_fails_validation():
    p = plan(offload_backend="prefetch")
    assert "prefetch-without-group-size" in codes(p)
    assert p["weight_offload_gpu_bytes"] == 0


def test_prefetch_reports_buffer_pool_and_resident_weights():
    p = plan(offload_group_size=4, offload_num_in_group=1, offload_prefetch_step=2)
    assert p["weight_offload_gpu_bytes"] == 8 * LAYER
    assert p["prefetch_buffer_bytes"] == 2 * LAYER
    assert p["resident_weight_bytes"] == LLAMA8B - 8 * LAYER + 2 * LAYER


def test_offload_params_is_not_read_by_uva():
    p = plan(cpu_offload_gb=4, offload_params=("mlp",))
    assert "offload-params-ignored" in codes(p)
    # UVA ignored the selector and took tensors in order, attention first
    assert p["weight_offload_gpu_bytes"] >= 4 * GiB


def test_selectors_that_match_nothing():
    p = plan(cpu_offload_gb=4, cpu_offload_params=("layers.0", "lm_head", "mlp"))
    msgs = [w["message"] for w in p["warnings"] if w["code"] == "selector-matches-nothing"]
    assert len(msgs) == 2 and any("'layers.0'" in m for m in msgs)


def test_moe_without_experts_selector():
    q = model("qwen3-30b-a3b")
    assert "moe-no-experts-selector" in codes(plan(model=q, cpu_offload_gb=10))
    assert "moe-no-experts-selector" not in codes(
        plan(model=q, cpu_offload_gb=10, cpu_offload_params=("experts",))
    )
    assert "moe-no-experts-selector" not in codes(plan(cpu_offload_gb=10))  # dense model


def test_cpu_offload_gb_larger_than_the_layers_moves_no_kv():
    p = plan(cpu_offload_gb=100)
    assert p["weight_offload_gpu_bytes"] == 32 * LAYER  # every decoder layer, nothing else
    assert "cpu-offload-gb-not-kv" in codes(p)
    assert "cpu-offload-gb-not-kv" not in codes(plan(cpu_offload_gb=10))


def test_weights_exceed_gpu_and_kv_heads_replicated():
    p = plan(model=model("llama3.1-70b"), gpu_memory_gib=80)
    assert p["fits"] is False and "weights-exceed-gpu" in codes(p)
    assert p["gpu_kv_tokens"] == 0
    assert "kv-heads-replicated" in codes(plan(model=model("qwen3-30b-a3b"), tp=8))


def _emitted_codes() -> dict[str, set[str]]:
    """Every code a ``warning(...)`` call in sizing/ can pass, by module: the string
    constants of its first argument, or of what a name there was assigned."""
    found: dict[str, set[str]] = {}
    for path in sorted(SIZING.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        assigned: dict[str, list[ast.expr]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        assigned.setdefault(t.id, []).append(node.value)
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "warning"
                and node.args
            ):
                continue
            arg = node.args[0]
            exprs = assigned.get(arg.id, []) if isinstance(arg, ast.Name) else [arg]
            consts = {
                c.value
                for e in exprs
                for c in ast.walk(e)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            }
            assert consts, f"{path.name}:{node.lineno}: a warning code kvtier cannot read"
            found.setdefault(path.name, set()).update(consts)
    return found


def test_every_code_the_planner_and_doctor_emit_is_documented():
    emitted = _emitted_codes()
    assert {"memory_plan.py", "doctor.py"} <= set(emitted)
    every = set().union(*emitted.values())
    assert every <= set(CODES), f"undocumented: {sorted(every - set(CODES))}"
    assert set(CODES) <= every, f"documented, never emitted: {sorted(set(CODES) - every)}"
    assert all(len(text) > 20 for text in CODES.values())


def test_an_undocumented_code_is_an_error_not_an_assert():
    with pytest.raises(ValueError, match="'no-such-code' is not one of CODES"):
        warning("no-such-code", "a sentence")
    assert warning("host-over-limit", "m") == {"code": "host-over-limit", "message": "m"}


def test_k8s_quantity_round_trip():
    assert k8s_quantity(64 * GiB) == "64Gi"
    assert k8s_quantity(64 * GiB + 1) == "65Gi"
    assert k8s_quantity(3 * MiB) == "3Mi"
    assert parse_k8s_quantity("64Gi") == 64 * GiB
    assert parse_k8s_quantity("1.5G") == 1_500_000_000
    assert parse_k8s_quantity(123) == 123
    with pytest.raises(ValueError):
        parse_k8s_quantity("64 gigs")
    assert math.isclose(parse_k8s_quantity(k8s_quantity(200 * GiB)), 200 * GiB)


def test_full_context_sessions_use_max_model_len_and_sliding_windows():
    # Llama 3 8B: max_position_embeddings 8192 -> 1 GiB per full-context session
    assert plan(gpu_kv_gib=28)["gpu_kv_full_context_sessions"] == 28
    # --max-model-len 32768: 4 GiB each
    assert plan(gpu_kv_gib=28, max_model_len=32768)["gpu_kv_full_context_sessions"] == 7
    # Mistral 7B v0.1: every layer slides over 4096 tokens, so a 32k session holds 512 MiB
    m = plan(model=model("mistral-7b-v0.1"), gpu_kv_gib=28)
    assert m["max_model_len"] == 32768
    assert m["gpu_kv_full_context_sessions"] == 28 * GiB // (512 * MiB)
