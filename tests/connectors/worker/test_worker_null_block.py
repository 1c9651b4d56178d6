"""The worker's own checks around vLLM's null block and one-step fetches, op by op.

Beside the real-Scheduler tests (test_sliding_window_only.py, test_group_matrix.py):
these pin down what the worker does with an op the scheduler should never plan, and
that trimming a load keeps every field that guards it.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.connectors.metadata import LoadOp, StoreOp
from tests.connectors.worker.test_worker_side import make_worker, step_meta

NULL = 0


def test_a_trimmed_load_keeps_every_field_but_its_blocks() -> None:
    """``without_lead`` is the one way a load is cut: whatever field guards a load now or
    later (``fetch_op`` today) comes along."""
    op = LoadOp(7, 3, 1, [NULL, NULL, 5, 6], fetch_op=9)
    cut = op.without_lead(2)
    assert (cut.first, cut.gpu_blocks) == (3, [5, 6])
    for f in dataclasses.fields(LoadOp):
        if f.name not in ("first", "gpu_blocks"):
            assert getattr(cut, f.name) == getattr(op, f.name), f.name
    assert op.gpu_blocks == [NULL, NULL, 5, 6], "the planned op is left as it was"
    with pytest.raises(ValueError):
        LoadOp(1, 0, 0, [NULL, 5], more=((0, [6]),)).without_lead(1)
    with pytest.raises(ValueError):
        op.without_lead(5)


@pytest.mark.parametrize("fake_cuda", [True, False])
def test_a_store_naming_the_null_block_is_refused(monkeypatch, fake_cuda: bool) -> None:
    w, _caches, _ops = make_worker(monkeypatch, fake_cuda)
    meta = step_meta(
        1,
        w.layout.slot_bytes,
        stores=[StoreOp(7, 0, [NULL, NULL, 7, 8], b"h"), StoreOp(8, 1, [9, 10, 11, 12], b"x")],
    )
    meta.null_block = NULL
    w.start_load_kv(meta)
    w.wait_for_save(meta)
    assert w.build_worker_meta().results == {7: [False], 8: [True]}


@pytest.mark.parametrize("fake_cuda", [True, False])
def test_loads_never_write_or_report_the_null_block(monkeypatch, fake_cuda: bool) -> None:
    """A load led by null blocks copies the rest; one with the null block inside copies
    nothing and reports the rest; one held to a fetch this step does not carry copies
    nothing (it cannot know the slot holds the chunk)."""
    w, _caches, _ops = make_worker(monkeypatch, fake_cuda)
    sb = w.layout.slot_bytes
    fill = step_meta(1, sb, stores=[StoreOp(1, 0, [5, 6, 7, 8], b"h")])
    w.start_load_kv(fill)
    w.wait_for_save(fill)
    assert w.build_worker_meta().results == {1: [True]}
    meta = step_meta(
        2,
        sb,
        loads=[
            LoadOp(2, 0, 0, [NULL, NULL, 20, 21]),
            LoadOp(3, 0, 0, [22, NULL, 23, 24]),
            LoadOp(4, 0, 0, [NULL, 25, 26, 27], fetch_op=99),
        ],
    )
    meta.null_block = NULL
    w.start_load_kv(meta)
    w.wait_for_save(meta)
    assert w.build_worker_meta().results == {2: [True], 3: [False], 4: [False]}
    assert w.take_failed_blocks() == {22, 23, 24, 25, 26, 27}
