"""A chunk a finished request stored is a hit for the next request of the same prefix.

The scheduler side is driven with vLLM's calls in the orders a loaded machine or vLLM's
async scheduling produce: a lookup's fetch reports split over several steps (an I/O
thread preempted between reporting a run's first miss and the misses behind it), a
lookup that times out with a read still going, and a request whose lookup runs while
another request's stores are still unreported. Before the fix the first two lost the
chunks for good (the store of a chunk whose fetch was unreported waited for a later step
the finished request never had) and the third was a miss.
"""

from __future__ import annotations

import time

import pytest

from kvtier import metrics
from kvtier.connectors.scheduler.side import SchedulerSide
from kvtier.stats import total_name
from tests.connectors.scheduler.test_scheduler_side import (
    CHUNK,
    answer,
    empty_step,
    make_side,
    remote_side,
    report,
    request,
    schedule_new,
    store_prompt,
)


def misses(side: SchedulerSide) -> dict[str, int]:
    return {r: side.totals[total_name(metrics.MISS_TOKENS, (r,))] for r in metrics.MISS_REASONS}


def alloc(side: SchedulerSide, req, offered: int, first_block: int = 300) -> None:
    """vLLM allocates ``req``'s blocks and tells kvtier it takes ``offered`` tokens."""
    side._kv_cache_manager.blocks[req.request_id] = list(
        range(first_block, first_block + -(-req.num_tokens // 32))
    )
    side.update_state_after_alloc(req, None, offered)


def prefill(side: SchedulerSide, req, offered: int):
    """vLLM schedules the whole prompt with ``offered`` tokens from kvtier; returns the meta."""
    side.update_state_after_alloc(req, None, offered)
    return schedule_new(side, req, 0, req.num_tokens)


@pytest.mark.parametrize("late_ok", [False, True])
def test_chunks_whose_fetches_report_late_are_stored_by_a_request_that_finishes(
    late_ok: bool,
) -> None:
    """What ``make demo`` showed on a loaded machine: the worker reported the first chunk's
    miss in one step and the misses behind it in a later one. The request was computed
    in between and finished with its prefill; its chunks 1-3 must still be stored, so the
    next request of the prefix loads all four from the host tier."""
    side = remote_side()
    a = request("a", 1, 4 * CHUNK + 10)
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)
    run = empty_step(side).fetches[0]
    answer(side, {run[0].op_id: [False]})  # chunk 0's miss alone
    assert side.get_num_new_matched_tokens(a, 0) == (0, False)
    meta = prefill(side, a, 0)
    stores = {op.block_hash for op in meta.stores}
    assert stores == set(side._reqs["a"].chunk_hashes[:4]), "every computed chunk is stored"
    fetch_slots = {op.slot for op in run[1:]}
    assert not fetch_slots & {op.slot for op in meta.stores}, "a slot still being read into"
    report(side, meta)
    side.request_finished(a, [])  # max_tokens=1: no later step for this request
    answer(side, {op.op_id: [late_ok] for op in run[1:]})  # the rest, late
    side.index.check()
    assert side.index.used_slots == 4 and side.index.superseded == 0
    assert side.pending_ops() == 0 and side.index.total_refs() == 0
    b = request("b", 1, 4 * CHUNK + 10)
    assert side.get_num_new_matched_tokens(b, 0) == (4 * CHUNK, False)
    assert empty_step(side).fetches == [], "a host hit asks the object tier nothing"


def test_a_lookup_that_timed_out_with_a_read_going_does_not_cost_the_next_request() -> None:
    """A tier slower than ``lookup_timeout_ms``: the lookup gives up while chunk 0's read
    is still going (a read that began reports only when it is over). The request computes
    the prompt and stores it; the next request hits the host tier, whatever the read
    does later. Before, nothing was stored and every request of the prefix timed out."""
    side = remote_side()
    side.lookups.timeout_s = 0.0
    a = request("a", 1, 4 * CHUNK + 10)
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)
    run = empty_step(side).fetches[0]
    time.sleep(0.001)
    assert side.get_num_new_matched_tokens(a, 0) == (0, False)  # timed out
    meta = prefill(side, a, 0)
    assert len(meta.stores) == 4
    assert misses(side)["fetching"] == 4 * CHUNK
    report(side, meta)
    side.request_finished(a, [])
    b = request("b", 1, 4 * CHUNK + 10)
    assert side.get_num_new_matched_tokens(b, 0) == (4 * CHUNK, False)
    answer(side, {op.op_id: [False] for op in run})  # the slow reads end, as misses
    side.index.check()
    assert side.index.used_slots == 4 and side.pending_ops() == 0


def test_a_superseded_fetch_keeps_its_slot_until_reported() -> None:
    """A full host tier: the stores that supersede fetches get other slots or are
    skipped (counted); never the slot a fetch may still be writing into."""
    side = remote_side("320KiB")  # 5 slots of 64 KiB
    a = request("a", 1, 4 * CHUNK + 10)
    side.get_num_new_matched_tokens(a, 0)
    run = empty_step(side).fetches[0]
    answer(side, {run[0].op_id: [False]})
    side.get_num_new_matched_tokens(a, 0)
    meta = prefill(side, a, 0)
    # 5 slots: 3 still held by fetches 1-3, so chunks 0 and 1 are stored, 2 and 3 skipped
    assert len(meta.stores) == 2 and side.totals["stores_skipped"] == 2
    assert not {op.slot for op in run[1:]} & {op.slot for op in meta.stores}
    side.index.check()
    report(side, meta)
    answer(side, {op.op_id: [False] for op in run[1:]})
    side.index.check()
    assert side.index.used_slots == 2 and side.index.superseded == 0


@pytest.mark.parametrize("remote", [False, True])
def test_a_lookup_waits_for_chunks_being_stored_then_hits(remote: bool) -> None:
    """vLLM's async scheduling plans step N+1 before step N's reports are in: a request
    that arrives then finds the prefix's chunks being stored. It asks again (None) and
    loads them once the store is reported; before, it was a miss."""
    side = remote_side() if remote else make_side()
    a = request("a", 1, 4 * CHUNK + 10)
    if remote:
        side.get_num_new_matched_tokens(a, 0)
        report(side, empty_step(side), ok=False)
    assert side.get_num_new_matched_tokens(a, 0) == (0, False)
    step_n = prefill(side, a, 0)
    b = request("b", 1, 4 * CHUNK + 10)
    assert side.get_num_new_matched_tokens(b, 0) == (None, False), "wait for a's stores"
    assert side.get_num_new_matched_tokens(b, 0) == (None, False)
    report(side, step_n)  # step N's reports
    side.request_finished(a, [])
    assert side.get_num_new_matched_tokens(b, 0) == (4 * CHUNK, False)
    alloc(side, b, 4 * CHUNK)
    assert misses(side)["storing"] == 0


def test_the_wait_for_a_store_is_bounded_and_its_miss_counted() -> None:
    """A store that is never reported costs a request at most ``store_waits.wait_s``; then the
    request is computed and its miss counted as "storing"."""
    side = make_side()
    side.store_waits.wait_s = 0.01
    a = request("a", 1, 4 * CHUNK + 10)
    side.get_num_new_matched_tokens(a, 0)
    prefill(side, a, 0)  # its stores are never reported
    b = request("b", 1, 4 * CHUNK + 10)
    assert side.get_num_new_matched_tokens(b, 0) == (None, False)
    time.sleep(0.02)
    assert side.get_num_new_matched_tokens(b, 0) == (0, False)
    assert side.get_num_new_matched_tokens(b, 0) == (0, False), "it does not wait again"
    side.update_state_after_alloc(b, None, 0)
    assert misses(side)["storing"] == 4 * CHUNK
    side.request_finished(b, [])
    assert side.store_waits.since == {}


@pytest.mark.parametrize("load_ok", [True, False])
def test_misses_by_reason_add_up_to_the_tokens_kvtier_was_asked_about(load_ok: bool) -> None:
    """Hits are counted once their load is reported: a failed load (vLLM computes its
    tokens) is a miss, "load_failed", never a hit."""
    side = make_side()
    lookup = total_name(metrics.LOOKUP_TOKENS)
    hits = total_name(metrics.HIT_TOKENS, ("host",))
    store_prompt(side, request("a", 1, 4 * CHUNK + 40))  # cold: 4 chunks absent
    assert misses(side) == {
        "absent": 4 * CHUNK,
        "tier_down": 0,
        "storing": 0,
        "fetching": 0,
        "evicting": 0,
        "tail": 32,
        "load_failed": 0,
        "declined": 0,
    }
    b = request("b", 1, 4 * CHUNK + 40)
    assert side.get_num_new_matched_tokens(b, 0) == (4 * CHUNK, False)
    alloc(side, b, 4 * CHUNK)
    meta = schedule_new(side, b, 4 * CHUNK, b.num_tokens - 4 * CHUNK)
    assert len(meta.loads) == 4 and side.totals[hits] == 0, "not counted before the report"
    report(side, meta, results={op.op_id: [load_ok] for op in meta.loads})
    assert misses(side)["tail"] == 64 and misses(side)["absent"] == 4 * CHUNK
    assert side.totals[hits] == (4 * CHUNK if load_ok else 0)
    assert misses(side)["load_failed"] == (0 if load_ok else 4 * CHUNK)
    assert side.totals[lookup] == side.totals[hits] + sum(misses(side).values())


def test_a_miss_while_the_object_tier_reads_fail_fast_is_counted_as_tier_down() -> None:
    """A fresh engine whose first read failed to reach the tier: the lookups that follow
    are answered at once (reads fail fast for the backoff) and their misses say why."""
    from types import SimpleNamespace

    from kvtier.connectors.metadata import KVTierWorkerMeta

    side = remote_side()
    a = request("a", 1, 4 * CHUNK + 10)
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)
    run = empty_step(side).fetches[0]
    out = KVTierWorkerMeta(steps=[], results={op.op_id: [False] for op in run}, reads_down_s=5.0)
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=out))
    assert side.get_num_new_matched_tokens(a, 0) == (0, False)
    side.update_state_after_alloc(a, None, 0)
    assert misses(side)["tier_down"] == 4 * CHUNK and misses(side)["absent"] == 0
