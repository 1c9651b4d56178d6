"""kvtier in tensor- and pipeline-parallel engines of vLLM's CPU build.

Two cores: one worker process per rank, each bound to its own core
(``VLLM_CPU_OMP_THREADS_BIND=0|1``; vLLM's automatic binding wants one NUMA node per
worker). Each rank keeps its own host slab of ``cpu_bytes`` holding its own share of
every chunk (its KV heads, or its pipeline stage's layers) and reads and writes the
object tier under its own keys.

Pipeline parallelism does not run on vLLM's CPU build 0.32, with or without a
connector: the second stage's first forward fails in vLLM's model runner
(``assert self.intermediate_tensors is not None`` in
``sync_and_gather_intermediate_tensors``). ``test_pipeline_stages_are_driven_as_vllm_drives_them``
in tests/connectors/test_parallel_sides.py drives the scheduler side and one worker side
per stage the way vLLM does instead; the scenario below takes ``pp`` for a build where
it runs.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import run_engine

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

ENV = {"KVTIER_TEST_SCENARIO_MODULES": "tests.e2e.parallel_scenarios",
       "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
CHUNK = 256
CPU_BYTES = 32 * 1024 * 1024


def plan(model: str, tp: int) -> dict[str, Any]:
    """`kvtier size --json` for the model at this tensor-parallel size."""
    from kvtier.sizing.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["size", "--model", model, "--tp", str(tp), "--json"]) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize(("tp", "pp"), [(2, 1)], ids=["tp2"])
def test_parallel_engine_hits_host_and_object_tiers_with_exact_outputs(
    tp: int, pp: int, tiny_model: str, tmp_path: Path
) -> None:
    extra = {"cpu_bytes": CPU_BYTES, "remote_url": f"file://{tmp_path / 'kv'}"}
    w = run_engine("parallel_writer", env=ENV, model=tiny_model, extra=extra, tp=tp, pp=pp)
    # the host tier serves S (1,024 tokens) after vLLM's own cache was flushed, and the
    # output is vLLM's own prefix-cache output at the same parallel size, bit for bit
    assert w["b_ref"]["cached"] == 1024
    assert w["b"]["cached"] >= 1024 and w["b_host_hit_tokens"] == w["b"]["cached"]
    assert w["b"]["tokens"] == w["b_ref"]["tokens"]
    assert w["b"]["logprobs"] == w["b_ref"]["logprobs"]
    idx = w["index"]
    assert idx["refs"] == 0 and idx["invariants"] is True and idx["pending_ops"] == 0
    assert idx["totals"]["store_failed"] == 0 and idx["totals"]["upload_ok"] >= 4

    # one slab per rank, each exactly cpu_bytes (cpu_bytes is per worker), holding the
    # rank's share of a chunk; the scheduler plans the same slots for all of them
    workers = sorted(w["workers"], key=lambda r: (r["stage"], r["rank"]))
    assert [(r["rank"], r["stage"]) for r in workers] == (
        [(i, 0) for i in range(tp)] if pp == 1 else [(0, s) for s in range(pp)])
    sched = w["scheduler"]
    assert sched["world_size"] == tp * pp and sched["host_bytes"] == CPU_BYTES
    assert all(r["slab_bytes"] == CPU_BYTES for r in workers)
    whole = plan(tiny_model, 1)
    if pp == 1:
        # the planner's per-rank KV is what each rank stores per token
        per_rank = plan(tiny_model, tp)["kv_bytes_per_token_per_rank"]
        assert per_rank == whole["kv_bytes_per_token"] // tp
        assert all(r["layers"] == whole["kv_layers"] for r in workers)
    else:
        # pipeline stages split the layers (the planner has no pipeline input)
        per_rank = whole["kv_bytes_per_token"] // pp
        assert sum(r["layers"] for r in workers) == whole["kv_layers"]
    assert all(r["slot_bytes"] == per_rank * CHUNK for r in workers), workers
    assert sched["num_slots"] == CPU_BYTES // (per_rank * CHUNK), sched

    # a new engine at the same sizes, empty host tier: every rank fetches its own share
    r = run_engine("parallel_reader", env=ENV, model=tiny_model, extra=extra, tp=tp, pp=pp)
    assert r["b"]["cached"] >= 1024, r["_log"][-3000:]
    assert r["b"]["tokens"] == w["b_ref"]["tokens"]
    assert r["b"]["logprobs"] == w["b_ref"]["logprobs"]
    assert r["index"]["totals"]["hit_tokens_remote"] >= 1024
    assert r["index"]["totals"]["fetch_ok"] >= 4 and r["index"]["totals"]["fetch_failed"] == 0
    assert r["index"]["refs"] == 0 and r["index"]["invariants"] is True
