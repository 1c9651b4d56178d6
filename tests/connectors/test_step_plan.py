"""The step plan: every op the scheduler side's parts decide goes into one StepPlan, and
build_connector_meta hands it to vLLM whole, once; and the config's warning about a
secret written into ``--kv-transfer-config``."""

from __future__ import annotations

from kvtier.config import secret_in_config
from kvtier.connectors.metadata import StepPlan
from kvtier.ops import FetchOp, LoadOp, StoreOp, UploadOp

from .scheduler.test_scheduler_side import (
    BPC,
    CHUNK,
    empty_step,
    make_side,
    remote_side,
    request,
    run_prompt,
    schedule_new,
    store_prompt,
    write_back_side,
)


def test_take_hands_over_every_op_in_the_order_planned_and_starts_empty() -> None:
    plan = StepPlan()
    load = LoadOp(1, 0, 0, [5, 6])
    stores = [StoreOp(2, 1, [7], b"a", None), StoreOp(3, 2, [8], b"b", 4)]
    run = [FetchOp(5, 3, b"c"), FetchOp(6, 4, b"d")]
    upload = UploadOp(7, 5, b"e")
    plan.loads.append(load)
    plan.stores.extend(stores)
    plan.fetches.append(run)
    plan.uploads.append(upload)
    assert len(plan) == 6  # a fetch run counts its fetches
    meta = plan.take(
        step=3, host_bytes=1 << 20, null_block=0, weights_epoch=2, weights_salt=b"salt"
    )
    assert (meta.loads, meta.stores, meta.fetches, meta.uploads) == (
        [load],
        stores,
        [run],
        [upload],
    )
    assert (meta.step, meta.host_bytes, meta.null_block) == (3, 1 << 20, 0)
    assert (meta.weights_epoch, meta.weights_salt) == (2, b"salt")
    assert len(plan) == 0
    again = plan.take(step=4, host_bytes=1 << 20, null_block=None)
    assert again.loads == again.stores == again.fetches == again.uploads == []
    assert again.loads is not meta.loads  # the handed-over lists are not reused


def test_a_step_hands_over_the_loads_planned_before_it_once() -> None:
    """Loads are planned when vLLM allocates the request, before the step is built: they
    wait in the plan and the step's metadata carries each of them once."""
    side = make_side()
    store_prompt(side, request("a", 1, 2 * CHUNK + 10))
    b = request("b", 1, 2 * CHUNK + 10)
    n, _ = side.get_num_new_matched_tokens(b, 0)
    assert n == 2 * CHUNK
    side._kv_cache_manager.blocks["b"] = list(range(300, 300 + 3 * BPC))
    side.update_state_after_alloc(b, None, n)
    planned = list(side.plan.loads)
    assert len(planned) == 2 and len(side.plan) == 2
    meta = schedule_new(side, b, n, b.num_tokens - n, first_block=300)
    assert meta.loads == planned and len(side.plan) == 0
    assert empty_step(side).loads == []


def test_a_lookups_fetch_run_goes_out_with_the_next_step_once() -> None:
    side = remote_side()
    a = request("a", 1, 2 * CHUNK + 10)
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)
    meta = empty_step(side)
    assert [[op.block_hash for op in run] for run in meta.fetches] == [
        side._reqs["a"].chunk_hashes[:2]
    ]
    assert empty_step(side).fetches == []


def test_a_write_back_begun_between_steps_goes_out_with_the_next_step_once() -> None:
    """write_back on a host tier of 2 slots (a clean reserve of 1): once a prompt filled
    it, the next step begins the oldest chunk's upload and carries it."""
    side = write_back_side("128KiB")
    assert side.index.num_slots == 2 and side.write_back.clean_reserve == 1
    first = run_prompt(side, request("a", 1, 2 * CHUNK + 10), first_block=100)
    assert len(first.stores) == 2
    meta = empty_step(side)
    assert [up.block_hash for up in meta.uploads] == [first.stores[0].block_hash]
    assert side.totals["write_back"] == 1
    assert empty_step(side).uploads == [], "an upload under way is not begun again"
    assert len(side.plan) == 0


def test_a_password_written_into_the_config_is_warned_about() -> None:
    warning = secret_in_config({"remote_url": "redis://:hunter2@host:6379/0"})
    assert warning is not None and "KVTIER_REMOTE_URL" in warning
    assert "hunter2" not in warning
    assert secret_in_config({"remote_url": "redis://host:6379/0"}) is None
    assert secret_in_config({"cpu_bytes": "1GiB"}) is None
    assert secret_in_config(None) is None
    assert secret_in_config({"remote_url": 5}) is None
