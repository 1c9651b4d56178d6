"""Two teams on one host tier (issue 60, docs/operations.md "Two teams on one fleet"), end
to end in a real vLLM CPU engine: each request says who it is in ``kv_transfer_params``.

A host tier of 24 chunks (12 MiB; 512 KiB a chunk of the test model). team-b's two prompts
and team-a's system prompt (pinned: ``pin_ttl_s``) are cached; then team-a floods the tier
with eight other prompts (32 chunks), vLLM's prefix cache emptied before each request as
memory pressure would. With ``tenant_quotas`` giving team-b room (10 chunks) and
``pin_tenants: ["team-a"]``, team-b's prompts and the pinned one come back from the host
tier, answered as vLLM's own prefix hit answers them; team-a still hits its last prompt
(a quota is not a ban). The control: the same engine and requests without the tenant
settings, where the flood evicts them all (one LRU) and they are computed again.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.conftest import run_engine

pytestmark = pytest.mark.e2e

ENV = {"KVTIER_TEST_SCENARIO_MODULES": "tests.e2e.tenant_scenarios"}
PREFIX = 1024  # each prompt's full chunks: 4 of 256 tokens
PROMPT = PREFIX + 20
B = {"tenant": "team-b"}
KEPT = [[601, B], [602, B], [603, {"tenant": "team-a", "pin_ttl_s": 3600}]]
FLOOD = list(range(611, 619))  # team-a's: 32 chunks, more than the tier
TIER = {"cpu_bytes": "12MiB"}
TENANTS = {**TIER, "tenant_quotas": {"team-b": "5MiB"}, "pin_tenants": ["team-a"]}


def run(extra: dict[str, Any], model: str) -> dict[str, Any]:
    return run_engine(
        "tenant_flood",
        env=ENV,
        model=model,
        extra=extra,
        prompt_tokens=PROMPT,
        kept=KEPT,
        flood=FLOOD,
        flood_tenant="team-a",
    )


def answer(out: dict[str, Any]) -> tuple[Any, Any]:
    return out["tokens"], out["logprobs"]


def test_a_tenant_within_its_quota_and_a_pin_survive_a_flood(tiny_model: str) -> None:
    quotas = run(TENANTS, tiny_model)
    alone = run(TIER, tiny_model)  # the control: one LRU for everybody
    for r in (quotas, alone):
        assert r["index"]["num_slots"] == 24, r["index"]
        assert [o["hit_host"] for o in r["first"] + r["flood"]] == [0] * 11, r["first"]
        assert [o["cached"] for o in r["own_hit"]] == [PREFIX] * 3, r["own_hit"]
        # a quota is not a ban: team-a hits its own recent prompt either way
        assert r["flood_last"]["hit_host"] == PREFIX, r["flood_last"]
        idx = r["index"]
        assert idx["refs"] == 0 and idx["invariants"] is True and idx["pending_ops"] == 0

    # with the tenant settings: team-b's prompts and the pinned one are served by kvtier
    assert [o["hit_host"] for o in quotas["back"]] == [PREFIX] * 3, quotas["back"]
    assert [o["cached"] for o in quotas["back"]] == [PREFIX] * 3, quotas["back"]
    assert quotas["pinned"] == PREFIX // 256, quotas
    assert quotas["usage"]["team-b"] == 2 * PREFIX // 256, quotas["usage"]
    assert quotas["evicted_by"].get("lru", 0) > 0, quotas["evicted_by"]
    # without them the flood took every one of them: computed again
    assert [o["hit_host"] for o in alone["back"]] == [0] * 3, alone["back"]
    assert [o["cached"] for o in alone["back"]] == [0] * 3, alone["back"]

    # every answer is vLLM's own: a prompt computed whole as vLLM computes it whole (in
    # both engines), one kvtier served as vLLM's own prefix hit of the same split
    for i in range(3):
        assert answer(quotas["first"][i]) == answer(alone["first"][i]), i
        assert answer(quotas["own_hit"][i]) == answer(alone["own_hit"][i]), i
        assert answer(quotas["back"][i]) == answer(quotas["own_hit"][i]), (i, quotas["back"])
        assert answer(alone["back"][i]) == answer(alone["first"][i]), (i, alone["back"])
    for a, b in zip(quotas["flood"], alone["flood"], strict=True):
        assert answer(a) == answer(b)
    assert answer(quotas["flood_last"]) == answer(alone["flood_last"])
