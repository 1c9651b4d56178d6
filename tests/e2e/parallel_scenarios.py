"""Engine scenarios for tests/e2e/test_parallel.py: kvtier in tensor- and
pipeline-parallel engines (one worker process per rank, each with its own host slab).

Loaded by tests/e2e/engine.py through ``KVTIER_TEST_SCENARIO_MODULES``. The engine
core runs in the scenario's process (its scheduler side is inspected as elsewhere);
the workers are vLLM's multiprocess executor's, asked through ``collective_rpc``.
"""

from __future__ import annotations

from typing import Any

from kvtier.connectors.scheduler.weights import read_only
from tests.e2e.engine import (
    build_llm,
    generate,
    index_report,
    ktc,
    kvtier_side,
    register,
    settle,
    shutdown,
    toks,
)


@read_only
def worker_tier(worker: Any) -> dict[str, Any]:
    """Run in each worker process: what its kvtier worker side allocated (marked
    read-only: any other function given to ``collective_rpc`` is a weight change)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group()._worker
    assert side is not None and side.layout is not None
    remote = side.remote.counters() if side.remote is not None else {}
    return {
        "rank": side.rank,
        "stage": side.stage,
        "layers": len(side.layout.layers),
        "slot_bytes": side.layout.slot_bytes,
        "slab_bytes": side.slab.nbytes if side.slab is not None else None,
        "uploads": side.uploads,
        "ops_upload": remote.get("ops_upload", 0),
        "ops_fetch": remote.get("ops_fetch", 0),
    }


def _parallel_llm(
    model: str, extra: dict[str, Any], tp: int, pp: int, policy: str | None = None
) -> Any:
    """``policy``: vLLM's ``kv_load_failure_policy`` (None: vLLM's default)."""
    kw: dict[str, Any] = {}
    if policy is not None:
        kw["kv_transfer_config"] = {**ktc(extra), "kv_load_failure_policy": policy}
    return build_llm(
        model,
        extra,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend="mp",
        **kw,
    )


def _scheduler_report(llm: Any) -> dict[str, Any]:
    side = kvtier_side(llm)
    return {
        "host_bytes": side.host_bytes,
        "slot_bytes": side.slot_bytes,
        "num_slots": side.index.num_slots,
        "world_size": side.world_size,
        "one_step": side.lookups.probe is not None,
    }


@register
def parallel_writer(model: str, extra: dict[str, Any], tp: int, pp: int) -> dict[str, Any]:
    """A = S+U1, then B = S+U2 served by vLLM's own prefix cache (the reference), then B
    again after a flush of vLLM's cache: only kvtier's host tier can serve S."""
    llm = _parallel_llm(model, extra, tp, pp)
    s, u1, u2 = toks(1, 1024), toks(2, 257), toks(3, 200)
    a = generate(llm, [s + u1])[0]
    b_ref = generate(llm, [s + u2])[0]
    llm.reset_prefix_cache()
    before = kvtier_side(llm).totals["hit_tokens_host"]
    b = generate(llm, [s + u2])[0]
    hit = kvtier_side(llm).totals["hit_tokens_host"] - before
    settle(llm)
    workers = llm.collective_rpc(worker_tier)
    report = {
        "a": a,
        "b_ref": b_ref,
        "b": b,
        "b_host_hit_tokens": hit,
        "workers": workers,
        "scheduler": _scheduler_report(llm),
        "index": index_report(llm),
    }
    shutdown(llm)  # queued uploads flush
    return report


@register
def parallel_reader(
    model: str, extra: dict[str, Any], tp: int, pp: int, policy: str | None = None
) -> dict[str, Any]:
    """A new engine at the same parallel sizes, empty host tier: B from the object tier."""
    llm = _parallel_llm(model, extra, tp, pp, policy)
    s, u2 = toks(1, 1024), toks(3, 200)
    b = generate(llm, [s + u2])[0]
    settle(llm)
    return {
        "b": b,
        "workers": llm.collective_rpc(worker_tier),
        "scheduler": _scheduler_report(llm),
        "index": index_report(llm),
    }


@register
def parallel_mla(
    model: str, extra: dict[str, Any], tp: int, policy: str | None = None
) -> dict[str, Any]:
    """An MLA model at tensor-parallel size ``tp``. The reference is the prompt computed
    cold; the second run, after vLLM's own prefix cache was emptied (its reference CPU
    MLA backend keeps none, its AMX one does), is served by kvtier's host tier; with an
    object tier, a third, after the host tier was emptied, by the object tier (every rank
    fetching rank 0's one copy)."""
    llm = _parallel_llm(model, extra, tp, 1, policy)
    p = toks(5, 1024 + 40)
    if llm.llm_engine.vllm_config.cache_config.enable_prefix_caching:
        # vLLM keeps a prefix cache (its AMX backend): the reference is its own hit of the
        # same 1,024 tokens (a split prefill rounds bf16 otherwise than one pass, and a
        # random-weight model has near ties); the first request stores those chunks
        cold = generate(llm, [p[: 1024 + 1]])[0]
        ref = generate(llm, [p])[0]
        assert llm.reset_prefix_cache()
    else:  # its reference backend keeps none: the prompt computed cold is the reference
        cold = ref = generate(llm, [p])[0]
    before = kvtier_side(llm).totals["hit_tokens_host"]
    warm = generate(llm, [p])[0]
    hit = kvtier_side(llm).totals["hit_tokens_host"] - before
    settle(llm)
    fetched, remote_hit = None, 0
    if extra.get("remote_url"):
        assert llm.reset_prefix_cache(reset_connector=True)
        before = kvtier_side(llm).totals["hit_tokens_remote"]
        fetched = generate(llm, [p])[0]
        remote_hit = kvtier_side(llm).totals["hit_tokens_remote"] - before
        settle(llm)
    return {
        "cold": cold,
        "ref": ref,
        "warm": warm,
        "warm_host_hit_tokens": hit,
        "fetched": fetched,
        "fetched_remote_hit_tokens": remote_hit,
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
        "workers": llm.collective_rpc(worker_tier),
        "scheduler": _scheduler_report(llm),
        "index": index_report(llm),
    }
