"""A warm start (``warmup: true``, issue 61), end to end in real vLLM CPU engines.

Engine 1 serves three hot prompts on a directory tier, a real redis-server or S3 (each
then hit from kvtier's host tier: its chunks go to the generation's hot list in the
manifest) and one cold prompt
(stored, never hit), and stops. Engine 2 starts with ``warmup: true``: before it serves it
reads the hot list and the hot chunks into its host tier, so its first pass over the hot
prompts is served from its host tier (no object-tier read on the request path), with
vLLM's own outputs of the same split; the cold prompt, not on the list, still comes from
the object tier. The canary is off here to isolate warm-up (tests/connectors/test_warmup.py
covers warm chunks held until the generation is checked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kit import chunk_files

from tests.e2e.conftest import object_tier, run_engine

pytestmark = pytest.mark.e2e

ENV = {"KVTIER_TEST_SCENARIO_MODULES": "tests.e2e.warmup_scenarios"}
PREFIX = 1024  # each prompt's full chunks: 4 of 256 tokens
HOT, COLD = [61, 62, 63], [64]


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["tokens"], a["logprobs"]) == (b["tokens"], b["logprobs"])


@pytest.mark.parametrize("kind", ["file", "redis", "s3"])
def test_a_warm_start_serves_the_hot_prompts_from_its_host_tier(
    tiny_model: str, tmp_path: Path, kind: str, request: pytest.FixtureRequest
) -> None:
    remote, tier_env = object_tier(kind, tmp_path, request)
    extra = {"cpu_bytes": "64MiB", **remote}
    env = {**ENV, **tier_env}
    one = run_engine(
        "warm_fleet", env=env, model=tiny_model, extra=extra, hot=HOT, cold=COLD, serve_hot=True
    )
    assert one["totals"]["hit_tokens_host"] == len(HOT) * PREFIX, one["totals"]
    if kind == "file":
        assert len(chunk_files(tmp_path / "kv")) == (len(HOT) + len(COLD)) * 4
    for out, ref, hit in zip(one["outs"], one["refs"], one["hits"], strict=True):
        assert out["cached"] == 0 and ref["cached"] == PREFIX and same(hit, ref), (hit, ref)

    two = run_engine(
        "warm_fleet",
        env=env,
        model=tiny_model,
        extra={**extra, "warmup": True, "warmup_timeout_s": 120},
        hot=HOT,
        cold=COLD,
        serve_hot=False,
    )
    log = two["_log"]
    assert "warm-up done: 12 of 12 chunks" in log, log[-4000:]
    assert two["warm"]["adopted"] == len(HOT) * 4 and two["warm"]["held"] == 0, two["warm"]
    assert two["totals"]["warmup_bytes"] > 0, two["totals"]
    hot_served, cold_served = two["served"][: len(HOT)], two["served"][len(HOT) :]
    for out, ref in zip(hot_served, one["refs"], strict=True):
        assert (out["hit_host"], out["hit_remote"]) == (PREFIX, 0), out
        assert same(out, ref), (out, ref)  # vLLM's own prefix hit of the same split
    assert two["totals"]["warmup_hit_tokens"] == len(HOT) * PREFIX, two["totals"]
    assert two["totals"]["fetch_ok"] == 4, "only the cold prompt read on the request path"
    [cold] = cold_served
    assert cold["hit_host"] == 0 and cold["hit_remote"] == PREFIX, cold
