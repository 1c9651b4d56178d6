"""Engine scenarios for tests/e2e/test_warmup.py: an engine that serves hot prompts on a
directory tier (its hits go to the generation's hot list), then a warm start
(``warmup: true``, kvtier.connectors.worker.warmup)."""

from __future__ import annotations

from typing import Any

from tests.e2e.engine import build_llm, generate, kvtier_side, register, settle, shutdown, toks

PROMPT = 1024 + 20  # 4 full chunks of 256


@register
def warm_fleet(
    model: str, extra: dict[str, Any], hot: list[int], cold: list[int], serve_hot: bool
) -> dict[str, Any]:
    """``serve_hot``: the serving engine. Each hot prompt computed whole (``outs``), then
    served by vLLM's own prefix cache (``refs``: the split of a kvtier hit of its 4 chunks,
    over KV vLLM computed), then, vLLM's cache emptied, by kvtier's host tier (a hit: its
    chunks go to the hot list, sent every step here instead of every 30 s); each cold prompt
    once (stored, never hit). The manifest writer writes the list at shutdown.
    Else the starting engine: what its warm-up brought, then each hot and cold prompt once,
    with where kvtier served it from."""
    llm = build_llm(model, extra)
    side = kvtier_side(llm)
    if serve_hot:
        side.hot.send_s = 0.0
        outs, refs, hits = [], [], []
        for s in hot:
            p = toks(s, PROMPT)
            outs.append(generate(llm, [p])[0])
            refs.append(generate(llm, [p])[0])
            assert llm.reset_prefix_cache()
            hits.append(generate(llm, [p])[0])
        for s in cold:
            assert llm.reset_prefix_cache()
            generate(llm, [toks(s, PROMPT)])
        settle(llm)  # uploads reported, the last hits sent to the manifest writer
        result = {"outs": outs, "refs": refs, "hits": hits, "totals": dict(side.totals)}
        shutdown(llm)
        return result
    warm = {
        "held": len(side.warm.held),
        "adopted": side.warm.adopted,
        "free": side.index.free_slots,
        "slots": side.index.num_slots,
    }
    served = []
    for s in [*hot, *cold]:
        assert llm.reset_prefix_cache()
        before = dict(side.totals)
        out = generate(llm, [toks(s, PROMPT)])[0]
        for tier in ("host", "remote"):
            out[f"hit_{tier}"] = side.totals[f"hit_tokens_{tier}"] - before[f"hit_tokens_{tier}"]
        served.append(out)
    settle(llm)
    result = {"warm": warm, "served": served, "totals": dict(side.totals)}
    shutdown(llm)
    return result
