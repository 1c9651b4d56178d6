"""Engine scenarios for tests/e2e/test_handoff.py: an engine under ``write_back`` that
serves hot prompts from its host tier and drains, handing its hot chunks off to the object
tier (kvtier.connectors.worker.shutdown). The engine that starts after it is
tests/e2e/warmup_scenarios.py's ``warm_fleet`` without a warm-up."""

from __future__ import annotations

from typing import Any

from tests.e2e.engine import build_llm, generate, kvtier_side, register, settle, shutdown, toks
from tests.e2e.warmup_scenarios import PROMPT


@register
def leaving_replica(
    model: str, extra: dict[str, Any], tier: str, hot: list[int], cold: list[int], hits: int
) -> dict[str, Any]:
    """Each hot prompt computed whole (``outs``), served by vLLM's own prefix cache
    (``refs``: the split of a kvtier hit of its 4 chunks, over KV vLLM computed), then,
    vLLM's cache emptied, ``hits`` times by kvtier's host tier (the hits that make its
    chunks hot: the hand-off list is brought up to date every step here instead of every
    second); each cold prompt once (stored in the host tier, never hit). Under
    ``write_back`` nothing reaches the object tier before the drain (``files_before``). Then
    the drain, and what the worker made of it: its hand-off report and the counters it
    recorded after vLLM's last stats pass (``unreported``: never sent to vLLM)."""
    from pathlib import Path

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvtier import metrics
    from kvtier.stats import series_id

    llm = build_llm(model, extra)
    side = kvtier_side(llm)
    side.hot.handoff_s = 0.0
    worker = get_kv_transfer_group()._worker  # in-process: the uniproc executor's worker
    outs, refs, served = [], [], []
    for s in hot:
        p = toks(s, PROMPT)
        outs.append(generate(llm, [p])[0])
        refs.append(generate(llm, [p])[0])
        for _ in range(hits):
            assert llm.reset_prefix_cache()
            served.append(generate(llm, [p])[0])
    for s in cold:
        assert llm.reset_prefix_cache()
        generate(llm, [toks(s, PROMPT)])
    settle(llm)  # the stores reported, the hand-off list sent to the worker
    totals = dict(side.totals)
    files_before = [  # chunk objects only (tests/kit.py's chunk_files)
        p.name
        for p in Path(tier).rglob("*")
        if p.is_file() and not p.name.startswith(".") and not p.name.endswith("%2Fmanifest")
    ]
    shutdown(llm)
    report = worker.last_handoff
    left = worker.get_stats()["counters"]
    unreported = {
        outcome: left.get(series_id(metrics.HANDOFF_CHUNKS, (outcome,)), 0)
        for outcome in metrics.HANDOFF_OUTCOMES
    }
    return {
        "outs": outs,
        "refs": refs,
        "served": served,
        "totals": totals,
        "files_before": files_before,
        "listed": len(worker.handoff),
        "handoff": None
        if report is None
        else {"chunks": report.chunks, "written": report.written, "failed": report.failed},
        "unreported": unreported,
    }
