"""A sliding-window-only model in a real engine (vLLM's CPU build): chunks with holes and
one-step loads cut to their window.

Every layer of a tiny random-weight Mistral attends to the last 128 tokens (one
``SlidingWindowSpec`` group: kvtier's single-group path). vLLM replaces a request's
blocks that left the window with its null block (zeros). Two ways that went wrong, each
compared with vLLM without kvtier:

- a chunk completed in a decode step, when its first blocks had left the window, was
  stored with the null block inside; a later request whose hit ended in that chunk
  loaded the zeros into a block it attends to;
- with one-step lookups on a local directory, the load of the hit's last chunk, cut to
  the blocks inside the window, lost the fetch it waits for: a chunk that failed its
  check at the read was copied anyway and reported loaded. And had the load failed,
  vLLM would recompute from the failed block with the window before it given up (its
  null block): so a sliding-window model's lookups read first (two steps), where a
  chunk that fails its check is a miss, never a load.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import run_engine
from tests.e2e.engine import max_logprob_diff
from tests.e2e.test_sliding_window import sliding_window_model  # noqa: F401 (a fixture)

pytestmark = pytest.mark.e2e

ENV = {"KVTIER_TEST_SCENARIO_MODULES": "tests.e2e.window_scenarios"}
#: a prompt split at a token off a block boundary (32-token blocks): chunked prefill
BUDGET = 63
#: S, the prompts' shared prefix: 4 chunks of 256 tokens (tests/e2e/window_scenarios.py)
S_CHUNKS = 4
#: a hit and vLLM's own hit of the same split compute the same tokens in the same steps; the
#: last bits of the logprobs are all they may differ in
CLOSE = 0.02


def close(got: dict, ref: dict) -> bool:
    return got["tokens"] == ref["tokens"] and max_logprob_diff(got, ref) <= CLOSE


@pytest.mark.isa
def test_chunks_with_holes_are_not_stored_and_a_chunk_failing_its_read_is_a_miss(
    sliding_window_model: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    model = sliding_window_model
    extra = {"cpu_bytes": "256MiB", "remote_url": f"file://{tmp_path / 'kv'}"}
    ref = run_engine("window_reference", model=model, env=ENV)

    w = run_engine("window_writer", model=model, extra=extra, env=ENV)
    totals = w["index"]["totals"]
    assert w["p"]["tokens"] == ref["p"]["tokens"]
    # chunk 1 of P completed in a decode step, its first half out of the window: not
    # stored (before, stored with zeros there, which P's reread loaded and attended to),
    # so P's reread is served chunk 0 alone and computes the rest, as vLLM's own prefix
    # hit of chunk 0 does (the reference splits there: the same tokens computed)
    assert totals["stores_window_gone"] >= 1, totals
    assert w["r"]["cached"] == ref["r"]["cached"] == 256, (w["r"], ref["r"])
    assert close(w["r"], ref["r"]), (w["r"], ref["r"])
    assert w["index"]["invariants"] is True and w["index"]["refs"] == 0

    r = run_engine("window_reader", model=model, extra=extra, budget=BUDGET, env=ENV)
    totals = r["index"]["totals"]
    assert len(r["spoiled"]) == 1, r["_log"][-3000:]
    # one-step lookups are refused: a failed load of the window could not be recomputed
    # right (vLLM has given up the blocks before it), so the lookup reads first
    assert r["one_step"] is False and totals["one_step_lookups"] == 0, totals
    assert any("sliding-window attention" in m for m in r["lookup_log"]), r["lookup_log"]
    # the spoiled chunk's read failed its check: a miss (the lookup ends before it), never
    # a load; S's first three chunks are served, vLLM computes from there
    assert totals["error_checksum"] >= 1 and totals["fetch_failed"] >= 1, totals
    assert totals["load_failed"] == 0 and totals["hit_tokens_remote"] == 768, totals
    assert r["b"]["cached"] == 768, r["b"]
    missed = sum(totals[f"miss_tokens_{why}"] for why in ("absent", "fetching", "tier_down"))
    assert missed >= 256, totals  # S's last chunk, counted as a miss
    idx = r["index"]
    assert idx["refs"] == 0 and idx["invariants"] is True and idx["pending_ops"] == 0

    # the same split without the spoiled chunk: a reader that finds S's last chunk gone
    # loads the same three chunks and computes from the same token in the same steps.
    # Not a byte of the spoiled chunk was loaded: the outputs are the same bits (a
    # whole prefill, or another split, is other bf16 arithmetic, near ties included)
    Path(r["spoiled"][0]).unlink()
    gone = run_engine(
        "window_reader", model=model, extra=extra, budget=BUDGET, env=ENV, spoil_chunk=S_CHUNKS
    )  # (no such chunk: nothing spoiled)
    assert gone["spoiled"] == [] and gone["index"]["totals"]["error_checksum"] == 0
    assert gone["b"]["cached"] == 768, gone["b"]
    assert (r["b"]["tokens"], r["b"]["logprobs"]) == (gone["b"]["tokens"], gone["b"]["logprobs"])
