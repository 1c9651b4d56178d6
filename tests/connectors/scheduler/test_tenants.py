"""Tenants on the scheduler side: requests tagged from ``kv_transfer_params``, quotas and
soft pins through vLLM's calls (fake requests, no engine), and their metrics."""

from __future__ import annotations

import logging

import pytest

from kvtier import metrics
from kvtier.connectors.scheduler.side import SchedulerSide
from kvtier.stats import series_id
from tests.connectors.scheduler.test_scheduler_side import (
    empty_step,
    make_side,
    report,
    request,
    schedule_new,
    store_prompt,
)

PROMPT = 1024  # four 256-token chunks; a slot is 64 KiB (make_side)


def req(rid: str, prefix: int, tenant: object = None, ttl: object = None, n: int = PROMPT):
    r = request(rid, prefix, n)
    ours: dict[str, object] = {}
    if tenant is not None:
        ours["tenant"] = tenant
    if ttl is not None:
        ours["pin_ttl_s"] = ttl
    r.kv_transfer_params = {"kvtier": ours}
    return r


def hit_tokens(side: SchedulerSide, r) -> int:
    n, _ = side.get_num_new_matched_tokens(r, 0)
    side.request_finished(r, [])
    return n or 0


def take_hit(side: SchedulerSide, r) -> int:
    """vLLM takes what kvtier offers: the blocks are allocated, the loads planned."""
    n, _ = side.get_num_new_matched_tokens(r, 0)
    side._kv_cache_manager.blocks[r.request_id] = list(range(100, 100 + r.num_tokens // 32))
    side.update_state_after_alloc(r, None, n or 0)
    return n or 0


def test_a_tenant_within_its_quota_keeps_its_prompts_through_another_tenants_flood() -> None:
    """Issue 60's reproduction: B's two prompts are cached, A sends prompts worth 10x the
    tier; B's prompts still hit in full, A hits on its own latest prompt."""
    side = make_side("1MiB", {"tenant_quotas": {"b": "512KiB"}})  # 16 slots, b: 8
    store_prompt(side, req("b1", 1, "b"))
    store_prompt(side, req("b2", 2, "b"))
    for i in range(40):  # 160 chunks, 10x the tier
        store_prompt(side, req(f"a{i}", 100 + i, "a"))
    assert hit_tokens(side, req("b3", 1, "b")) == PROMPT - 32
    assert hit_tokens(side, req("b4", 2, "b")) == PROMPT - 32
    assert hit_tokens(side, req("a99", 139, "a")) == PROMPT - 32
    assert side.index.evicted_by["tenant_quota"] == 0


def test_a_tenant_over_its_quota_loses_its_own_oldest_counted_by_reason() -> None:
    side = make_side("1MiB", {"tenant_quotas": {"*": "256KiB"}})  # 4 slots each
    store_prompt(side, req("b1", 1, "b"))
    for i in range(3):
        store_prompt(side, req(f"a{i}", 100 + i, "a"))
    assert hit_tokens(side, req("b2", 1, "b")) == PROMPT - 32  # b untouched
    assert hit_tokens(side, req("a9", 100, "a")) == 0  # a's oldest went
    assert hit_tokens(side, req("a8", 102, "a")) == PROMPT - 32
    stats = side.get_stats()
    tq = series_id(metrics.EVICTIONS, ("tenant_quota",))
    assert stats["counters"][tq] == 8 and side.totals["evictions"] == 8
    assert side.totals["evictions_tenant_quota"] == 8 and side.totals["evictions_lru"] == 0
    per_slot = 64 * 1024
    gauges = stats["gauges"]
    assert gauges[series_id(metrics.TENANT_BYTES, ("host", "a"))] == 4 * per_slot
    assert gauges[series_id(metrics.TENANT_BYTES, ("host", "b"))] == 4 * per_slot
    empty_step(side)  # nothing changed: no gauge is sent again
    assert not [g for g in side.get_stats()["gauges"] if "tenant" in g or "pinned" in g]


def test_a_pinned_prompt_survives_a_flood_of_ten_times_the_tier() -> None:
    side = make_side("1MiB", {"pin_tenants": ["sys"], "pin_max_fraction": 0.5})
    store_prompt(side, req("s1", 1, "sys", ttl=600))
    for i in range(40):
        store_prompt(side, req(f"a{i}", 100 + i, "a"))
    assert hit_tokens(side, req("s2", 1)) == PROMPT - 32
    assert side.get_stats()["gauges"][series_id(metrics.PINNED_BYTES)] == 4 * 64 * 1024


def test_a_pin_from_a_tenant_not_in_pin_tenants_is_ignored_and_logged_once(caplog) -> None:
    side = make_side("1MiB", {"pin_tenants": ["sys"]})
    with caplog.at_level(logging.ERROR, logger="kvtier.scheduler"):
        store_prompt(side, req("x1", 1, "crawl", ttl=600))
        store_prompt(side, req("x2", 2, "crawl", ttl=600))
    assert side.tenancy is not None and side.tenancy.pinned == 0
    lines = [r.getMessage() for r in caplog.records if "may not pin" in r.getMessage()]
    assert len(lines) == 1 and "'crawl'" in lines[0]


@pytest.mark.parametrize(
    "params",
    [
        {"kvtier": {"tenant": "bad name"}},
        {"kvtier": {"tenant": "x" * 64}},
        {"kvtier": {"tenant": 7}},
        {"kvtier": {"tenant": "other"}},
        {"kvtier": "team-a"},
        {"kvtier": {"tenant": "ok", "pin_ttl_s": float("nan")}},
        {"kvtier": {"tenant": "ok", "pin_ttl_s": -1}},
        {"kvtier": {"tenant": "ok", "pin_ttl_s": True}},
    ],
)
def test_a_bad_tag_is_logged_and_the_request_runs_untagged_or_unpinned(caplog, params) -> None:
    side = make_side("1MiB", {"pin_tenants": ["*"], "default_tenant": "web"})
    r = request("r", 1, PROMPT)
    r.kv_transfer_params = params
    with caplog.at_level(logging.ERROR, logger="kvtier.scheduler"):
        store_prompt(side, r)
        r2 = request("r2", 2, PROMPT)
        r2.kv_transfer_params = params
        store_prompt(side, r2)  # the same mistake again: not logged again
    errors = [rec for rec in caplog.records if rec.levelno == logging.ERROR]
    assert len(errors) == 1, [e.getMessage() for e in errors]
    t = side.tenancy
    assert t is not None and t.pinned == 0 and side.index.used_slots == 8
    tenant = "ok" if "pin_ttl_s" in str(params) else "untagged"
    assert t.usage_by_label()[tenant] == 8


def test_untagged_requests_are_the_default_tenants_and_labels_are_bounded() -> None:
    side = make_side("1MiB", {"default_tenant": "web", "tenant_metrics_max": 2})
    store_prompt(side, req("u", 1))
    for i, name in enumerate(("t1", "t2", "t3")):
        store_prompt(side, req(name, 10 + i, name))
    assert take_hit(side, req("u2", 1)) == PROMPT - 32
    counters = side.get_stats()["counters"]
    lookups = {
        sid.split("|")[1]: v
        for sid, v in counters.items()
        if sid.startswith(metrics.TENANT_LOOKUP_TOKENS.name)
    }
    # web and t1 are named, t2 and t3 are "other" (tenant_metrics_max: 2)
    assert lookups == {"web": 2 * (PROMPT - 32), "t1": PROMPT - 32, "other": 2 * (PROMPT - 32)}
    hits = series_id(metrics.TENANT_HIT_TOKENS, ("web",))
    assert counters[hits] == PROMPT - 32
    assert all(v in metrics.LABEL_VALUES["tenant"] for v in lookups)


def test_a_hit_of_a_pinning_request_pins_and_renews() -> None:
    side = make_side("1MiB", {"pin_tenants": ["sys"]})
    store_prompt(side, req("s1", 1))  # stored unpinned (untagged)
    assert side.tenancy is not None and side.tenancy.pinned == 0
    assert take_hit(side, req("s2", 1, "sys", ttl=60)) == PROMPT - 32
    assert side.tenancy.pinned == 4


def test_without_tenant_settings_kv_transfer_params_are_not_read() -> None:
    side = make_side("1MiB")
    store_prompt(side, req("a", 1, "team-a", ttl=60))
    assert side.tenancy is None and side.index.tenancy is None
    assert side.get_stats()["counters"].get(series_id(metrics.EVICTIONS, ("lru",))) is None


def test_a_pin_expires_unless_a_hit_renews_it() -> None:
    """The clock is the tenancy's (injected): a hit within the TTL renews it, a pin left
    alone past its TTL is an ordinary chunk, which the next flood takes."""
    side = make_side("1MiB", {"pin_tenants": ["sys"]})
    assert side.tenancy is not None
    now = [100.0]
    side.tenancy.clock = lambda: now[0]
    store_prompt(side, req("s1", 1, "sys", ttl=60))
    store_prompt(side, req("s2", 2, "sys", ttl=60))
    assert side.tenancy.pinned == 8
    now[0] += 50
    h = req("h", 1)
    assert take_hit(side, h) == PROMPT - 32  # an untagged hit renews s1's pins
    report(side, schedule_new(side, h, PROMPT - 32, 32))  # its loads done: no refs held
    side.request_finished(h, [])
    assert side.index.total_refs() == 0
    now[0] += 20  # s2's pins expired, s1's have 40 s left
    for i in range(8):
        store_prompt(side, req(f"a{i}", 100 + i, "a"))
    assert side.tenancy.pinned == 4
    assert hit_tokens(side, req("s3", 1)) == PROMPT - 32
    assert hit_tokens(side, req("s4", 2)) == 0


def test_pin_max_fraction_zero_pins_nothing() -> None:
    side = make_side("1MiB", {"pin_tenants": ["*"], "pin_max_fraction": 0})
    store_prompt(side, req("s1", 1, "sys", ttl=60))
    assert side.tenancy is not None and side.tenancy.pinned == 0
    assert not side.tenancy._pending
