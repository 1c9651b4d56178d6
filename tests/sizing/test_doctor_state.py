"""`kvtier doctor` on logs of hybrid models with recurrent state: kvtier's own refusal of
state held outside align mode, and its warning that a chunk was not stored because a
prefill step ran past its end, each read back as a warning that says what to run. The
log lines are made from the connector's own messages, so a reworded message fails here."""

from __future__ import annotations

import logging

import pytest

from kvtier.connectors.engine_shape import CacheGroup, KVCacheShape, LayerSpec
from kvtier.connectors.groups import Refused, kv_groups
from kvtier.connectors.scheduler import plans
from kvtier.sizing import doctor

VLLM = "(EngineCore_DP0 pid=1) {level} 12-05 20:00:01 [{where}] {msg}"


def codes(lines: list[str]) -> dict[str, str]:
    return {w["code"]: w["message"] for w in doctor.diagnose(doctor.parse_log(lines))}


def test_state_held_outside_align_mode_reads_as_what_to_run() -> None:
    state = LayerSpec(
        "MambaSpec",
        attention=False,
        mamba=True,
        sliding=False,
        full=False,
        block_size=16,
        window=None,
        states=(((3, 16), "bfloat16"),),
        state_mode="none",
        state_bytes=96,
    )
    attn = LayerSpec(
        "FullAttentionSpec",
        attention=True,
        mamba=False,
        sliding=False,
        full=True,
        block_size=16,
        window=None,
    )
    kv = KVCacheShape(
        num_blocks=8,
        groups=(CacheGroup(("l0.mixer",), (state,), 1024), CacheGroup(("l1.attn",), (attn,), 1024)),
    )
    with pytest.raises(Refused) as err:
        kv_groups(kv, 16, 256)
    line = VLLM.format(
        level="ERROR",
        where="core.py:1",
        msg=f"ValueError: kvtier cannot serve /models/granite: {err.value}",
    )
    got = codes([line])
    assert "state-needs-align-mode" in got, got
    assert "--mamba-cache-mode align" in got["state-needs-align-mode"]
    assert "mamba_cache_mode none" in got["state-needs-align-mode"]


def test_a_state_chunk_not_stored_reads_as_the_step_setting(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        plans.logger.warning(plans.STATE_STEP_HINT, 3, 1024, 1152)
    line = VLLM.format(level="WARNING", where="plans.py:1", msg=caplog.records[-1].getMessage())
    got = codes([line])
    assert "state-chunks-not-stored" in got, got
    msg = got["state-chunks-not-stored"]
    assert "token 1024" in msg and "token 1152" in msg and "--max-num-batched-tokens" in msg


def test_a_healthy_hybrid_log_warns_of_neither() -> None:
    line = VLLM.format(
        level="INFO",
        where="worker.py:160",
        msg="kvtier worker rank 0: KV cache group state (window 0): 2 layers, "
        "1 of 2 blocks per chunk stored",
    )
    got = codes([line])
    assert "state-needs-align-mode" not in got and "state-chunks-not-stored" not in got
