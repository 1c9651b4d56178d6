"""A LoRA adapter rewritten at the same name and path is a new identity in real engines.

vLLM's block hash names an adapter by name and path only; kvtier mixes a fingerprint
of the adapter's weights into every key of its chunks. Engine 1 stores a prompt under
two adapters with the same weights (v1) to a file object tier; then one of them is
retrained in place (v2). Engine 2, fresh: the unchanged adapter's chunks are object-tier
hits (the tier works for LoRA requests), the rewritten one's are not, and its greedy
output is the one an engine without kvtier gives with v2.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import run_engine
from tests.e2e.lora_scenarios import write_lora_adapter

pytestmark = [pytest.mark.e2e]

ENV = {"KVTIER_TEST_SCENARIO_MODULES": "tests.e2e.lora_scenarios"}


def test_adapter_retrained_in_place_gets_no_object_tier_hit(
    tiny_model: str, tmp_path: Path
) -> None:
    same, changed = tmp_path / "same", tmp_path / "changed"
    write_lora_adapter(same, tiny_model, seed=1)
    write_lora_adapter(changed, tiny_model, seed=1)
    adapters = [["same", 1, str(same)], ["changed", 2, str(changed)]]
    extra = {"cpu_bytes": "64MiB", "remote_url": f"file://{tmp_path / 'kv'}"}

    w = run_engine("lora_prompts", env=ENV, model=tiny_model, extra=extra, adapters=adapters)
    assert w["remote_hits"] == [0, 0]
    assert w["index"]["totals"]["upload_ok"] >= 8, w["_log"][-3000:]
    assert not any(v for k, v in w["index"]["totals"].items() if k.startswith("host_only_"))
    assert w["outs"][0]["tokens"] == w["outs"][1]["tokens"]  # the same weights

    write_lora_adapter(changed, tiny_model, seed=2)  # retrained, same name, path and size
    r = run_engine("lora_prompts", env=ENV, model=tiny_model, extra=extra, adapters=adapters)
    assert r["remote_hits"][0] == 1024, r["_log"][-3000:]  # same files: shared
    assert r["outs"][0]["cached"] == 1024 and r["outs"][0]["tokens"] == w["outs"][0]["tokens"]
    assert r["remote_hits"][1] == 0 and r["outs"][1]["cached"] == 0
    assert r["index"]["totals"]["fetch_failed"] >= 1  # it asked, under v2's keys
    assert r["index"]["refs"] == 0 and r["index"]["invariants"] is True

    ref = run_engine("lora_prompts", model=tiny_model, extra=None, adapters=adapters[1:], env=ENV)
    assert r["outs"][1]["tokens"] == ref["outs"][0]["tokens"]
    assert r["outs"][1]["logprobs"] == ref["outs"][0]["logprobs"]
    assert r["outs"][1]["tokens"] != w["outs"][1]["tokens"]  # v2 computes something else
