"""A step's uploads are queued together: one call into the write queue for all the chunks
the step stored, so the write threads are woken once, not once per chunk (each wake-up
took the GIL from the engine's step: ~0.1 ms a chunk on a 2-core CPU). Then every chunk
is written, as it was when each went alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.objects.io_queue import OpQueue
from tests.connectors.test_parallel_sides import BPC, CHUNK, PAGE, PipelineEngine, make_request


def test_the_chunks_a_step_stores_go_to_the_write_queue_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches: list[list[str]] = []
    real = OpQueue.submit_puts

    def submit_puts(self: OpQueue, puts):  # type: ignore[no-untyped-def]
        batches.append([p.key for p in puts])
        return real(self, puts)

    monkeypatch.setattr(OpQueue, "submit_puts", submit_puts)
    extra = {"remote_url": f"file://{tmp_path / 'kv'}", "write_policy": "write_through"}
    eng = PipelineEngine([[0, 1]], 16 * PAGE * 2 * BPC, extra=extra, seed=1)
    try:
        req = make_request(3 * CHUNK + 1, seed=5)
        # a miss, then the prompt's three chunks computed and stored in one step
        assert eng.prefill(req, list(range(3 * BPC + 1))) == 0
        eng.settle()
        assert [len(b) for b in batches] == [3], (
            batches,
            {k: v for k, v in eng.side.totals.items() if v},
        )
        assert len(set(batches[0])) == 3
        assert eng.side.totals["upload_ok"] == 3
        (w,) = eng.workers
        assert w.remote is not None and w.remote.tier.exists(batches[0]) == [True] * 3
    finally:
        eng.shutdown()
