"""Weights replaced while the engine runs: the scheduler side drops the host tier and the
workers key their objects under a new identity, so nothing stored before the change is
served after it, and nothing written after it carries the old identity.

The engine core tells the scheduler side (``identity.follow_weight_changes``; the e2e
test runs it through a real ``reload_weights``); these drive the parts the way vLLM
does, with an object tier in a directory.
"""

from __future__ import annotations

from pathlib import Path

from kit import chunk_files

from tests.connectors.test_parallel_sides import (
    BPC,
    CHUNK,
    PAGE,
    PipelineEngine,
    make_request,
)

H_CHUNKS = 3


def engine(tmp_path: Path) -> PipelineEngine:
    return PipelineEngine([[0, 1]], cpu_bytes=16 * PAGE * 2 * BPC,
                          extra={"remote_url": f"file://{tmp_path / 'kv'}"})


def blocks(first: int) -> list[int]:
    return list(range(first, first + H_CHUNKS * BPC + 1))


def test_after_a_weight_change_neither_tier_serves_what_was_stored_before(
    tmp_path: Path,
) -> None:
    eng = engine(tmp_path)
    tokens = H_CHUNKS * CHUNK + 1
    assert eng.prefill(make_request(tokens), blocks(0)) == 0
    eng.settle()
    assert len(chunk_files(tmp_path / "kv")) == H_CHUNKS
    assert eng.prefill(make_request(tokens), blocks(20)) == H_CHUNKS * CHUNK  # host hit
    w = eng.workers[0]
    h = make_request(tokens).block_hashes[BPC - 1]
    old_key = w._object_key(h)

    eng.side.weights_changed("reload_weights")
    assert eng.side.index.used_slots == 0 and eng.side.totals["weights_changes"] == 1
    # host tier emptied; the object tier holds the chunks, but under the old identity
    assert eng.prefill(make_request(tokens), blocks(0)) == 0
    eng.settle()
    assert eng.side.totals["fetch_ok"] == 0
    assert w.weights_epoch == 1 and w._object_key(h) != old_key
    # what was computed after the change went in under the new identity, beside the old
    assert len(chunk_files(tmp_path / "kv")) == 2 * H_CHUNKS
    assert eng.prefill(make_request(tokens), blocks(20)) == H_CHUNKS * CHUNK
    eng.shutdown()


def test_stores_planned_before_a_change_and_settled_after_are_dropped(tmp_path: Path) -> None:
    """vLLM scheduled a step (its stores hold KV of the old weights), then ran the
    weight update before the step's results came back: those chunks never become hits."""
    eng = engine(tmp_path)
    build = eng.side.build_connector_meta

    def build_then_change(so):  # type: ignore[no-untyped-def]
        meta = build(so)
        if meta.stores:  # the prefill's step (not the lookup's idle steps before it)
            eng.side.weights_changed("update_weights")
        return meta

    eng.side.build_connector_meta = build_then_change  # type: ignore[method-assign]
    tokens = H_CHUNKS * CHUNK + 1
    assert eng.prefill(make_request(tokens), blocks(0)) == 0
    eng.side.build_connector_meta = build  # type: ignore[method-assign]
    eng.settle()
    assert eng.side.totals["store_ok"] == H_CHUNKS  # the workers did store them ...
    assert eng.side.index.used_slots == 0  # ... and the scheduler dropped them
    eng.side.index.check()
    # nor does the object tier give them back: they were uploaded under the old identity
    assert eng.prefill(make_request(tokens), blocks(20)) == 0
    eng.settle()
    assert eng.side.totals["fetch_ok"] == 0
    eng.shutdown()


def test_requests_begun_before_a_change_store_nothing_after_it(tmp_path: Path) -> None:
    """A prompt prefilled in pieces across the change: its first chunks' KV is the old
    weights', so the chunks it completes afterwards (built on them) are not stored."""
    eng = engine(tmp_path)
    req = make_request(H_CHUNKS * CHUNK + 1, seed=3)
    n, _ = eng.side.get_num_new_matched_tokens(req, 0)
    while n is None:  # the object-tier lookup (a miss) runs first
        eng.idle_step()
        n, _ = eng.side.get_num_new_matched_tokens(req, 0)
    eng.side.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]
    eng.step(req, 0, CHUNK, blocks(0))  # chunk 0 computed with the old weights
    eng.settle()
    assert eng.side.totals["store_ok"] == 1
    eng.side.weights_changed("reload_weights")
    eng.step(req, CHUNK, req.num_tokens - CHUNK, blocks(0))  # the rest, with the new ones
    eng.settle()
    assert eng.side.totals["store_ok"] == 1 and eng.side.index.used_slots == 0
    eng.side.request_finished(req, [])
    eng.shutdown()


def test_after_a_change_what_vllms_own_cache_served_is_not_stored(tmp_path: Path) -> None:
    """vLLM keeps its prefix cache across a weight change: blocks it serves may hold the
    old weights' KV, so kvtier stores only the chunks the request computed itself."""
    eng = engine(tmp_path)
    eng.side.weights_changed("reload_weights")
    req = make_request(H_CHUNKS * CHUNK + 1, seed=4)
    local = 2 * CHUNK  # vLLM's own cache served the first two chunks
    n, _ = eng.side.get_num_new_matched_tokens(req, local)
    while n is None:
        eng.idle_step()
        n, _ = eng.side.get_num_new_matched_tokens(req, local)
    assert n == 0
    eng.side.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]
    eng.step(req, local, req.num_tokens - local, blocks(0))
    eng.settle()
    assert eng.side.totals["store_ok"] == H_CHUNKS - 2  # the third chunk only
    eng.shutdown()
