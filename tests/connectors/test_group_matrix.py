"""Every kind of KV cache grouping through every way a chunk comes back, for real.

The matrix: the model's KV cache groups (full attention only, sliding-window only, both)
x how a prefix comes back (the host tier; the object tier through a lookup of its own
step; the object tier answered in the lookup's step, one-step) x chunked prefill (the
whole prompt in a step, or 63 tokens a step: splits off block boundaries). Each cell
drives vLLM's real ``Scheduler`` and a real kvtier worker (:mod:`.window_engine`): a
writer serves a prompt and decodes past a chunk boundary (so chunks complete in a split
prefill and in decode steps), then a reader asks for the prefix: its hit ending inside
chunk 0, inside chunk 4, and past every stored chunk. On the object tier chunk 3's object is corrupt
(vLLM recomputes what it cannot load). Every cell checks that no chunk was stored with
vLLM's null block in it, and that after every step every block vLLM backs for the reader
holds its own tokens' KV, whatever was loaded, failed or recomputed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.v1.request import Request

from tests.connectors.test_hma import prompt
from tests.connectors.test_sliding_window_only import corrupt
from tests.connectors.window_engine import BPC, CHUNK, WindowEngine

KINDS = ["full", "sliding", "hybrid"]
WAYS = ["host", "two-step", "one-step"]


def run_checked(eng: WindowEngine, req: Request) -> None:
    """Step ``req`` to its end, checking the KV it attends to after every step."""
    for _ in range(200):
        eng.step()
        if req.is_finished():
            return
        eng.expect_attended(req)
    raise AssertionError("request did not finish")


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "split-prefill"])
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("kind", KINDS)
def test_what_comes_back_is_what_was_computed(
    model_dir: str,
    tmp_path: Path,
    kind: str,
    way: str,
    chunked: bool,
) -> None:
    budget = 63 if chunked else 1024
    policy = "recompute" if way == "one-step" else "fail"
    extra = (
        {}
        if way == "host"
        else {"remote_url": f"file://{tmp_path / 'kv'}", "model_fingerprint": f"matrix-{kind}"}
    )
    writer = WindowEngine(model_dir, kind, budget=budget, policy=policy, extra=extra)
    a = writer.request(prompt(4 * CHUNK + 10, seed=21), max_tokens=60)  # decodes into chunk 4
    run_checked(writer, a)
    text = list(a.all_token_ids)
    assert len(text) >= 5 * CHUNK
    assert writer.holes_stored() == [], [op.gpu_blocks for op in writer.holes_stored()]
    totals = writer.side.totals
    if kind == "sliding":  # chunk 4 completes in a decode step, its first blocks long gone
        assert totals["stores_window_gone"] >= 1, "the cell reaches a chunk with a hole"
    if kind == "full":
        assert totals["stores_window_gone"] == 0 and totals["store_ok"] == 5

    if way == "host":
        reader = writer
        assert reader.sched.reset_prefix_cache()  # vLLM's own cache forgets; kvtier's not
    else:
        writer.settle()
        writer.worker.shutdown()
        writer.sched.shutdown()
        chunk3 = writer.object_path(a.block_hashes[4 * BPC - 1])
        if chunk3.exists():
            corrupt(chunk3)
        reader = WindowEngine(model_dir, kind, budget=budget, policy=policy, extra=extra)
        # one-step lookups where vLLM may recompute a failed load right: one group, no window
        assert reader.one_step is (way == "one-step" and kind == "full")
    reader.poison(9)
    # hits ending inside chunk 0, inside chunk 4 (its window's blocks 1-2), past chunk 4
    for tokens in (text[:CHUNK], text[: 5 * CHUNK], text[: 5 * CHUNK + 5]):
        run_checked(reader, reader.request(tokens, max_tokens=3))
        assert reader.sched.reset_prefix_cache()  # the next one's hit is kvtier's again
    assert reader.holes_stored() == []
    if way != "host":
        reader.settle()
    assert reader.side.pending_ops() == 0 and reader.side.index.total_refs() == 0
    reader.side.index.check()
    if reader.one_step and reader.side.totals["one_step_lookups"]:
        assert reader.side.totals["error_checksum"] >= 1, reader.side.totals
    reader.worker.shutdown()
    reader.sched.shutdown()
