"""The scheduler side's canary with fakes of vLLM's objects and of the workers' reports:
what an untrusted generation answers and plans, how checks' results move its trust."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.canary import Trust
from kvtier.connectors.metadata import KVTierWorkerMeta, WorkerKeys
from kvtier.connectors.scheduler.side import NEVER_STORE, SchedulerSide
from tests.connectors.scheduler.test_scheduler_side import (
    CHUNK,
    make_side,
    op_ids,
    request,
    schedule_new,
)


@pytest.fixture(autouse=True)
def canary_first_hit_off() -> None:
    """Overrides conftest's: these tests run with the canary's defaults."""


def side_of(**extra: object) -> SchedulerSide:
    return make_side(
        "4MiB", {"remote_url": "file:///nonexistent", "write_policy": "write_through", **extra}
    )


def say(side: SchedulerSide, *, meta=None, checks=None, fresh=None, ok=True) -> None:  # type: ignore[no-untyped-def]
    """The workers' report: every op of ``meta`` ``ok``, ``checks`` (op id -> result)."""
    results = {i: [ok] for i in op_ids(meta)} if meta is not None else {}
    results.update({u.op_id: [ok] for u in getattr(meta, "uploads", [])})
    out = KVTierWorkerMeta(
        steps=[meta.step] if meta is not None else [],
        results=results,
        checks={k: [v] for k, v in (checks or {}).items()},
        fresh_generation=fresh,
        check_worst={},
    )
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=out))


def new(  # type: ignore[no-untyped-def]
    side: SchedulerSide,
    rid: str,
    prefix: int,
    first_block: int = 100,
    chunks: int = 2,
):
    """A prompt of ``chunks`` full chunks, asked about, allocated and computed in one step."""
    req = request(rid, prefix, chunks * CHUNK + 10)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, SimpleNamespace(), 0)
    return schedule_new(side, req, 0, chunks * CHUNK + 10, first_block)


def upload_ids(meta) -> list[int]:  # type: ignore[no-untyped-def]
    return [op.upload_op_id for op in meta.stores if op.upload_op_id is not None]


def test_before_the_workers_answer_nothing_is_loaded_or_uploaded_and_checks_are_planned() -> None:
    """Every chunk of the first prompt is checked in its one step (4 chunks: the default
    1024-token budget), each slot held until checked; trusted once all four matched."""
    side = side_of()
    assert side.canary.trust.state is Trust.UNKNOWN
    req = request("a", 1, 4 * CHUNK + 10)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False), "no object-tier lookup"
    assert not side.may_load_async(req)
    side.update_state_after_alloc(req, SimpleNamespace(), 0)
    meta = schedule_new(side, req, 0, 4 * CHUNK + 10)
    assert len(meta.stores) == 4 and upload_ids(meta) == [] and meta.uploads == []
    assert [(c.slot, c.block_hash, c.store_op_id) for c in meta.checks] == [
        (s.slot, s.block_hash, s.op_id) for s in meta.stores
    ]
    assert [c.first for c in meta.checks] == [True, False, False, False], (
        "only the request's first check counts toward RECLAIM_AFTER when absent"
    )
    entries = [side.index.get(h) for h in side._reqs["a"].chunk_hashes[:4]]
    assert all(e is not None and e.refs == 1 for e in entries), "held until checked"
    assert side.pending_ops() == 8
    first, *rest = meta.checks
    say(side, meta=meta, checks={first.op_id: "match"})
    assert side.canary.trust.state is Trust.UNKNOWN and side.canary.pending == 3
    say(side, checks={c.op_id: "match" for c in rest})
    assert side.canary.trust.state is Trust.TRUSTED
    assert all(e is not None and e.refs == 0 for e in entries)
    assert side.totals["canary_checks_match"] == 4 and side.pending_ops() == 0


def test_a_first_writer_is_trusted_from_the_handshake_on() -> None:
    side = side_of()
    ns = side.namespace
    side.set_worker_keys([WorkerKeys(ns, 0, 0, 0, fresh_generation=True)])
    assert side.canary.trusted
    req = request("a", 1, 2 * CHUNK + 10)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False), "a lookup goes out"
    meta = new(side, "b", 2)
    assert len(upload_ids(meta)) == 2 and meta.checks == []


def test_an_existing_generation_is_checked_absent_chunks_move_on_a_mismatch_refuses() -> None:
    """Prompts of two chunks: the first two prompts' chunks are the budget's four checks
    in flight, a third prompt gets none; absent chunks free their places, matched ones
    count, and a mismatch refuses whatever matched before."""
    side = side_of()
    say(side, fresh=False)
    assert side.canary.trust.state is Trust.CHECKING
    m1 = new(side, "a", 1)
    m2 = new(side, "b", 2, 200)
    assert len(m1.checks) == len(m2.checks) == 2
    assert [c.first for c in m1.checks + m2.checks] == [True, False, True, False]
    m3 = new(side, "c", 3, 300)
    assert m3.checks == [], "no more checks in flight than the budget needs"
    say(side, meta=m1, checks={c.op_id: "absent" for c in m1.checks})
    say(side, meta=m2, checks={c.op_id: "match" for c in m2.checks})
    say(side, meta=m3)
    assert side.canary.trust.state is Trust.CHECKING, "512 of 1024 tokens matched"
    assert side.totals["canary_checks_absent"] == 2 and side.totals["canary_checks_match"] == 2
    for h in side._reqs["b"].chunk_hashes[:2]:  # b's chunks leave the host tier
        assert side.index.evict(h)
    again = new(side, "b2", 2, 500)  # computed again: the same evidence, counted once
    assert len(again.stores) == 2 and again.checks == []
    say(side, meta=again)
    m4 = new(side, "c2", 4, 600)
    c4a, c4b = m4.checks
    refused = side.canary.namespace.generation()
    say(side, meta=m4, checks={c4a.op_id: "match", c4b.op_id: "mismatch"})
    assert side.totals["canary_checks_mismatch"] == 1
    assert side.index.used_slots == 0, "the host tier's chunks of it are dropped"
    _assert_forked(side, refused)


def test_one_matching_chunk_is_not_enough_a_mismatch_on_the_third_refuses() -> None:
    """Weights that differ only on some tokens (an added token's embedding row, a LoRA on
    a few modules) can match on one chunk and not on the next: every chunk of the first
    prompt is checked in its one step (the 1024-token budget: 4 chunks), two matches
    trust nothing, and the third chunk's mismatch refuses the generation."""
    side = side_of()
    say(side, fresh=False)
    m = new(side, "a", 1, chunks=4)
    assert [c.block_hash for c in m.checks] == [s.block_hash for s in m.stores], (
        "every stored chunk checked, in one step"
    )
    c1, c2, c3, c4 = m.checks
    say(side, meta=m, checks={c1.op_id: "match", c2.op_id: "match"})
    assert side.canary.trust.state is Trust.CHECKING, "512 tokens matched: not trusted yet"
    assert side.totals["canary_checks_match"] == 2
    refused = side.canary.namespace.generation()
    say(side, checks={c3.op_id: "mismatch", c4.op_id: "match"})
    assert side.totals["canary_checks_mismatch"] == 1
    assert side.totals["canary_checks_match"] == 2, "the fork's stale check is not counted"
    _assert_forked(side, refused)


def _assert_forked(side: SchedulerSide, refused: str) -> None:
    """After a mismatch: the engine carries on under a fork of its own (new keys, the
    workers told in the next step's metadata), trusted as its first writer; it stores its
    own KV there and gets hits from it, and never looks at the refused generation again."""
    [(fork_id, before, gen)] = side.canary.forks
    assert before == refused and gen != refused and gen == side.canary.namespace.generation()
    assert side.canary.trust.state is Trust.TRUSTED, "its first writer: trusted at once"
    assert side.weights_salt[:8].hex() == fork_id and side.weights_epoch == 1
    assert side.namespace.after_weight_change(side.weights_salt).generation() == gen
    req = request("d", 9, 2 * CHUNK + 10)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False), "object-tier lookups again"
    say(side)  # the workers found nothing under the fork's keys yet
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, SimpleNamespace(), 0)
    m4 = schedule_new(side, req, 0, 2 * CHUNK + 10, 400)
    assert (m4.weights_epoch, m4.weights_salt) == (1, side.weights_salt), "the workers follow"
    assert len(upload_ids(m4)) == 2 and m4.checks == [], "its own KV stored into its fork"
    say(side, meta=m4)
    again = request("e", 9, 2 * CHUNK + 10)  # the same prompt: a hit from its own traffic
    assert side.get_num_new_matched_tokens(again, 0) == (2 * CHUNK, False)


def test_with_tp_a_check_settles_once_every_worker_answered_and_any_mismatch_refuses() -> None:
    side = side_of()
    side.canary.world_size = 2
    say(side, fresh=False)
    m = new(side, "a", 1)
    c, _ = m.checks
    say(side, checks={c.op_id: "match"})
    assert side.canary.trust.state is Trust.CHECKING and side.canary.pending == 2
    refused = side.canary.namespace.generation()
    say(side, checks={c.op_id: "mismatch"})
    assert side.totals["canary_checks_mismatch"] == 1
    _assert_forked(side, refused)


def test_a_sampled_mismatch_in_a_trusted_generation_forks_too() -> None:
    """canary_rate: a generation trusted (here as first writer) whose sampled check then
    differs is left the same way: chunks loaded from it are dropped, and requests begun
    before store nothing into the fork (their KV may hold what was loaded)."""
    side = side_of(canary_rate=1.0)
    say(side, fresh=True)
    refused = side.canary.namespace.generation()
    m = new(side, "a", 1)
    [c] = m.checks
    side.canary.trust.rate = 0.0
    say(side, meta=m, checks={c.op_id: "mismatch"})
    assert side._reqs["a"].next_store == NEVER_STORE
    _assert_forked(side, refused)


def test_sampled_requests_get_no_hit_are_not_uploaded_and_are_checked() -> None:
    side = side_of(canary_rate=1.0)
    say(side, fresh=True)
    req = request("a", 1, 2 * CHUNK + 10)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False), "recomputed: a canary"
    meta = schedule_new(side, req, 0, 2 * CHUNK + 10)
    assert upload_ids(meta) == [] and len(meta.checks) == 1
    assert all(side.index.get(h).remote for h in side._reqs["a"].chunk_hashes[:2]), (
        "never written back over the object its check reads"
    )
    say(side, meta=meta, checks={meta.checks[0].op_id: "match"})
    assert side.canary.trusted and side.totals["canary_checks_match"] == 1
    side.request_finished(req, [])
    assert side.canary._sampled == {}


def test_canary_check_tokens_sets_the_budget_and_a_sample_stays_one_chunk() -> None:
    """``canary_check_tokens: 256`` (one chunk): one check, one match trusts; a sampled
    request of a trusted generation (``canary_rate``) is one chunk checked, whatever its
    length."""
    side = side_of(canary_check_tokens=CHUNK, canary_rate=1.0)
    assert (side.canary.trust.check_tokens, side.canary.trust.chunk_tokens) == (CHUNK, CHUNK)
    say(side, fresh=False)
    m = new(side, "a", 1, chunks=4)
    [c] = m.checks
    assert c.block_hash == m.stores[0].block_hash
    say(side, meta=m, checks={c.op_id: "match"})
    assert side.canary.trusted and side.totals["canary_checks_match"] == 1
    sampled = new(side, "b", 2, 300, chunks=4)
    assert len(sampled.stores) == 4 and len(sampled.checks) == 1, "one chunk per sample"
    say(side, meta=sampled, checks={sampled.checks[0].op_id: "match"})
    assert side.totals["canary_checks_match"] == 2 and side.pending_ops() == 0


def test_a_host_tier_hit_is_not_sampled_its_recompute_would_check_nothing() -> None:
    """A request the host tier serves in full stores nothing when recomputed (its chunks
    are held), so no check could be made: it is never drawn as a canary; one whose
    chunks are not in the host tier (an object-tier hit) is."""
    side = side_of(canary_rate=1.0)
    say(side, fresh=True)
    side.canary.trust.rate = 0.0
    meta = new(side, "a", 1)  # stored into the host tier (and uploaded)
    say(side, meta=meta)
    side.canary.trust.rate = 1.0
    again = request("b", 1, 2 * CHUNK + 10)
    assert side.get_num_new_matched_tokens(again, 0) == (2 * CHUNK, False), "served"
    assert side.canary._sampled["b"] is False
    other = request("c", 2, 2 * CHUNK + 10)
    assert side.get_num_new_matched_tokens(other, 0) == (0, False), "drawn: recomputed"


def test_canary_first_hit_false_trusts_at_once_and_a_weight_change_is_a_new_generation() -> None:
    off = side_of(canary_first_hit=False)
    assert off.canary.trusted
    on = side_of()
    say(on, fresh=False)
    on.weights_changed("reload_weights")
    assert on.canary.trusted, "keys no other engine has: its first writer"
    assert on.canary.forks == [], "a weight change is not a fork"
    assert on.canary.namespace == on.namespace.after_weight_change(on.weights_salt)


# ---- the worker's side: read the stored chunk into scratch, compare with the slot ----
def _worker(root, seed: int):  # type: ignore[no-untyped-def]
    """A worker with a file:// object tier and KV caches of ``seed`` (another seed: the KV
    of other weights under the same name)."""
    from copyfakes import make_caches

    from kvtier.config import load_config
    from kvtier.connectors.worker.side import WorkerSide
    from kvtier.keys import Namespace
    from kvtier.objects.remote import RemoteIO
    from kvtier.objects.tiers import FileTier

    bs, bpc = 32, 4
    cfg = load_config(
        {"cpu_bytes": "16MiB", "chunk_size": bs * bpc, "remote_url": f"file://{root}"}, environ={}
    )
    ns = Namespace("m", None, "bfloat16", "auto", bs, bs * bpc, 1, fingerprint="build-7")

    def remote(c):  # type: ignore[no-untyped-def]
        return RemoteIO(FileTier(str(root)), threads=1, queue_depth=8, timeout_s=5, signer=None)

    w = WorkerSide(cfg, ns, 40, remote)
    w.register_kv_caches(make_caches((2, 40, bs, 4, 16), layers=2, seed=seed), rank=0)
    return w


def _reports(w, want: set[int]):  # type: ignore[no-untyped-def]
    import time

    results: dict[int, list[bool]] = {}
    checks: dict[int, list[str]] = {}
    worst: dict[int, tuple[str, float]] = {}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not want <= results.keys() | checks.keys():
        meta = w.build_worker_meta()
        results.update(meta.results)
        checks.update(meta.checks)
        worst.update(meta.check_worst)
        time.sleep(0.01)
    return results, checks, worst


def test_the_worker_compares_the_stored_chunk_with_the_one_vllm_computed(tmp_path) -> None:
    from kvtier.connectors.metadata import CheckOp, KVTierMetadata, StoreOp

    root = tmp_path / "kv"
    h, other = b"\x11" * 32, b"\x22" * 32

    steps = iter(range(1, 100))

    def step(w, check: CheckOp | None, upload: bool = False):  # type: ignore[no-untyped-def]
        store = StoreOp(1, 0, [5, 6, 7, 8], h, upload_op_id=2 if upload else None)
        meta = KVTierMetadata(
            step=next(steps),
            host_bytes=w.layout.slot_bytes * 4,
            stores=[store],
            checks=[check] if check else [],
        )
        w.start_load_kv(meta)
        w.wait_for_save(meta)
        return _reports(w, {1, *([2] if upload else []), *([check.op_id] if check else [])})

    a = _worker(root, seed=10)
    assert a.fresh_generation is True, "an empty tier: A writes the generation first"
    assert a.build_worker_meta().fresh_generation is True  # said once, then not again
    assert a.build_worker_meta().fresh_generation is None
    results, _, _ = step(a, None, upload=True)
    assert results[2] == [True]
    a.shutdown()  # its manifest is in the tier now

    same = _worker(root, seed=10)
    assert same.fresh_generation is False
    _, checks, worst = step(same, CheckOp(3, 0, h, store_op_id=1))
    assert checks == {3: ["match"]} and worst[3][1] == 0.0
    _, checks, _ = step(same, CheckOp(4, 0, other, store_op_id=1))
    assert checks == {4: ["absent"]}, "the tier does not hold that chunk"
    failed = StoreOp(6, 0, [5, 6, 7, 8], h)  # a store this step did not carry: not stored
    _, checks, _ = step(same, CheckOp(7, 0, h, store_op_id=failed.op_id))
    assert checks == {7: ["error"]}, "nothing computed in the slot: nothing compared"
    same.shutdown()

    wrong = _worker(root, seed=11)  # other weights' KV under the same name
    _, checks, worst = step(wrong, CheckOp(5, 0, h, store_op_id=1))
    assert checks == {5: ["mismatch"]}
    layer, err = worst[5]
    assert layer.startswith("model.layers.") and err > 0.5
    wrong.shutdown()
