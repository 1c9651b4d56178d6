"""A model whose only KV cache group is sliding-window attention, driven for real.

vLLM's ``Scheduler`` (its block pool, null block and sliding-window manager) and a real
kvtier worker (:mod:`tests.connectors.window_engine`). vLLM frees a request's blocks as
they leave the window and puts its null block (all zeros) in their place; kvtier must
never store a chunk with such a hole, nor load a chunk whose one-step fetch failed, nor
skip a check because it cut the null blocks off the front of a load.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.connectors.metadata import WorkerKeys
from kvtier.ops import LoadOp
from tests.connectors.test_hma import prompt
from tests.connectors.window_engine import BPC, BS, CHUNK, WindowEngine


def corrupt(path: Path) -> None:
    """Flip bytes all through a stored chunk, every block of its KV."""
    data = bytearray(path.read_bytes())
    for i in range(256, len(data) - 256, 97):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_prefill_split_off_a_block_boundary_stores_no_chunk_with_a_hole(
    model_dir: str,
) -> None:
    """63 tokens a step: when chunk 0 completes (tokens 63..126), vLLM has already freed
    its first two blocks (outside the 32-token window of token 63): the chunk is not
    stored (counted), never with the null block inside. A later request whose hit would
    end inside that chunk attends to its KV bit for bit."""
    eng = WindowEngine(model_dir, "sliding", budget=63)
    assert eng.side.groups == () and len(eng.wc.kv_cache_groups) == 1
    tokens = prompt(4 * CHUNK + 10, seed=11)
    eng.run(eng.request(tokens))
    assert eng.holes_stored() == [], [op.gpu_blocks for op in eng.holes_stored()]
    assert eng.side.totals["stores_window_gone"] >= 1
    assert eng.sched.reset_prefix_cache()

    # chunk 0 alone: vLLM computes its last token itself, so a hit would end in chunk 0
    # (3 blocks), its window attending to blocks 1 and 2
    eng.poison(5)
    b = eng.request(tokens[:CHUNK], max_tokens=2)
    eng.step()
    eng.expect_attended(b)
    eng.run(b)
    eng.sched.shutdown()


def test_a_chunk_completed_while_decoding_stores_no_hole(model_dir: str) -> None:
    """A chunk completed by decode steps: its first blocks left the 32-token window steps
    ago. Not stored, rather than stored with zeros a later hit would load."""
    eng = WindowEngine(model_dir, "sliding")
    a = eng.request(prompt(3 * CHUNK + 40, seed=12), max_tokens=30)
    eng.run(a)
    assert eng.holes_stored() == []
    assert eng.side.totals["store_ok"] == 3 and eng.side.totals["stores_window_gone"] == 1
    eng.sched.shutdown()


@pytest.mark.parametrize("budget", [1024, 63], ids=["whole-prefill", "split-prefill"])
def test_a_one_step_load_cut_to_its_window_still_waits_for_its_fetch(
    model_dir: str,
    tmp_path: Path,
    budget: int,
) -> None:
    """One-step lookups on a local directory (``kv_load_failure_policy: recompute``),
    forced on (kvtier refuses them for this model: the next test). The restarted
    engine's hit of 4 chunks loads only the window of chunk 3: its first two blocks are
    vLLM's null block and are cut off the load. Chunk 3's object is corrupt: its fetch
    fails, so the load must copy nothing and hand its blocks (never the null block) to
    vLLM. Before, the cut load lost its fetch and copied the slot anyway."""
    extra = {"remote_url": f"file://{tmp_path / 'kv'}", "model_fingerprint": "window-test"}
    writer = WindowEngine(model_dir, "sliding", extra=extra)
    tokens = prompt(4 * CHUNK + 10, seed=13)
    writer.run(writer.request(tokens))
    writer.settle()
    assert writer.side.totals["upload_ok"] == 4
    chunk3 = writer.object_path(writer.stores[3].block_hash)
    writer.worker.shutdown()
    writer.sched.shutdown()
    corrupt(chunk3)

    eng = WindowEngine(model_dir, "sliding", budget=budget, policy="recompute", extra=extra)
    assert not eng.one_step, "refused for a sliding-window model (the next test)"
    eng.force_one_step()
    eng.poison(7)
    b = eng.request(tokens, max_tokens=3)
    seen: dict[str, object] = {}

    def admitted(so) -> None:
        (new,) = so.scheduled_new_reqs
        assert new.num_computed_tokens == 4 * CHUNK, "the one-step answer: 4 chunks"
        window = eng.block_ids(b.request_id)[0][4 * BPC - 2 : 4 * BPC]
        seen["window"] = window
        seen["before"] = eng.group_bits(0, window)
        seen["loads"] = list(so.kv_connector_metadata.loads)
        seen["fetches"] = [op for run in so.kv_connector_metadata.fetches_now for op in run]

    eng.step(after_loads=admitted)
    loads: list[LoadOp] = seen["loads"]  # type: ignore[assignment]
    assert len(loads) == 4 and all(op.fetch_op for op in loads)
    last = loads[3]
    assert last.gpu_blocks[:2] == [eng.null, eng.null], "chunk 3's load leads with null blocks"
    assert eng.results[last.fetch_op] is False, "chunk 3's fetch failed its check"
    assert eng.results[last.op_id] is False, "its load must fail with it"
    assert set(seen["window"]) <= eng.failed_blocks  # type: ignore[arg-type]
    assert eng.null not in eng.failed_blocks
    assert eng.side.totals["error_checksum"] >= 1 and eng.side.totals["load_failed"] >= 1
    assert b.num_computed_tokens == 4 * CHUNK - 2 * BS, "vLLM recomputes from the window"
    eng.expect_attended(b)  # no block holds what the failed fetch read
    while b.num_computed_tokens < len(tokens):  # every block it backs ends up true
        eng.step()
        eng.expect_attended(b)
    eng.run(b)
    eng.settle()
    eng.side.index.check()
    assert eng.side.index.total_refs() == 0
    eng.worker.shutdown()
    eng.sched.shutdown()


@pytest.mark.parametrize("kind", ["sliding", "hybrid", "full"])
def test_one_step_lookups_only_where_a_failed_load_can_be_recomputed(
    model_dir: str,
    tmp_path: Path,
    kind: str,
) -> None:
    """vLLM recomputes a failed load from its first failed block. With a sliding window it
    has already given up the blocks before the window (its null block, never backed
    again), so the recomputed KV would attend to zeros: a sliding-window model's lookups
    read first (two steps), where a chunk that fails its check is a miss, never a load.
    A model of full attention only keeps one-step lookups."""
    extra = {"remote_url": f"file://{tmp_path / 'kv'}", "model_fingerprint": "window-test"}
    eng = WindowEngine(model_dir, kind, policy="recompute", extra=extra)
    keys = WorkerKeys(eng.worker.namespace, 0, 0, 0)
    probe, refusal = eng.side._one_step_probe([keys])
    if kind == "full":
        assert eng.one_step and probe is not None and refusal == ""
    else:
        assert not eng.one_step and probe is None
        why = "sliding-window attention" if kind == "sliding" else "several KV cache groups"
        assert why in refusal, refusal
    eng.worker.shutdown()
    eng.sched.shutdown()
