"""Engine scenarios for tests/e2e/test_kv_events.py: an engine that publishes KV events.

Loaded by tests/e2e/engine.py through ``KVTIER_TEST_SCENARIO_MODULES``. The engine
is started with vLLM's own ``kv_events_config`` (ZMQ publisher on ``endpoint``); the
test subscribes from its own process and decides from what arrives. The scenario
only drives requests, makes one store fail on purpose, and marks the phases in the
stream's timeline by returning the wall clock between them.
"""

from __future__ import annotations

import time
from typing import Any

from tests.e2e.engine import (
    build_llm,
    generate,
    index_report,
    kvtier_side,
    register,
    settle,
    toks,
)

#: 4 full chunks of 256 and 40 tokens: kvtier stores chunks 0-3 of each prompt
PROMPT_TOKENS = 1024 + 40


def _events_llm(model: str, extra: dict[str, Any], endpoint: str) -> Any:
    """The engine, its publisher bound, and a second for the test's subscriber (connected
    before the bind) to have its subscription through: a ZMQ publisher drops what it
    sends before a subscription arrives, so a fast engine's first batches (a reader's
    fetched chunks, before its prefill) would go to nobody."""
    from vllm.config import KVEventsConfig

    llm = build_llm(
        model,
        extra,
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=endpoint,
            topic="kv",
        ),
    )
    time.sleep(1.0)
    return llm


def _fail_store(llm: Any) -> dict[str, Any]:
    """Arm ``arm["nth"]``: the nth store op planned from then on is reported failed by
    every worker (the scheduler side then rolls the chunk back, as for a real failure)."""
    conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
    arm: dict[str, Any] = {"nth": None, "seen": 0, "op_id": None, "failed": 0}
    build, update = conn.build_connector_meta, conn.update_connector_output

    def build_meta(so: Any) -> Any:
        meta = build(so)
        if arm["nth"] is not None and arm["op_id"] is None:
            for op in meta.stores:
                if arm["seen"] == arm["nth"]:
                    arm["op_id"] = op.op_id
                    break
                arm["seen"] += 1
        return meta

    def update_output(out: Any) -> None:
        meta = out.kv_connector_worker_meta
        if meta is not None and arm["op_id"] in getattr(meta, "results", {}):
            oks = meta.results[arm["op_id"]]
            meta.results[arm["op_id"]] = [False] * len(oks)
            arm["failed"] += 1
        update(out)

    conn.build_connector_meta = build_meta
    conn.update_connector_output = update_output
    return arm


def _mark(marks: dict[str, float], name: str) -> None:
    time.sleep(0.5)  # vLLM's publisher thread sends a step's batch right after the step
    marks[name] = time.time()


@register
def events_writer(model: str, extra: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """A, then B with its third chunk's store failing, then C (the host tier holds 8
    chunks: C evicts A's three oldest), then a connector reset."""
    llm = _events_llm(model, extra, endpoint)
    arm = _fail_store(llm)
    marks: dict[str, float] = {}
    a, b, c = (toks(seed, PROMPT_TOKENS) for seed in (31, 32, 33))
    generate(llm, [a])
    settle(llm)  # uploads reported
    _mark(marks, "a")
    arm["nth"] = 2
    generate(llm, [b])
    settle(llm)
    _mark(marks, "b")
    generate(llm, [c])
    settle(llm)
    _mark(marks, "c")
    before_reset = index_report(llm)
    assert llm.reset_prefix_cache(reset_connector=True)
    settle(llm)  # a step: vLLM takes the connector's events in every step
    _mark(marks, "reset")
    side = kvtier_side(llm)
    return {
        "prompts": {"a": a, "b": b, "c": c},
        "marks": marks,
        "failed_reports": arm["failed"],
        "index_before_reset": before_reset,
        "index": index_report(llm),
        "events_dropped": side.events.dropped if side.events is not None else None,
        "events_tracked": side.events.tracked() if side.events is not None else None,
    }


@register
def events_reader(model: str, extra: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """A fresh engine (empty host tier) on the writer's object tier: A is fetched."""
    llm = _events_llm(model, extra, endpoint)
    a = toks(31, PROMPT_TOKENS)
    out = generate(llm, [a])[0]
    settle(llm)
    _mark({}, "done")
    return {"prompts": {"a": a}, "cached": out["cached"], "index": index_report(llm)}
