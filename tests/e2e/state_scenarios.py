"""Engine scenarios for tests/e2e/test_recurrent_state.py: hybrid models with recurrent
state (a Mamba2 hybrid, a gated delta-net hybrid) whose chunks carry the state at their
end beside their attention KV.

vLLM keeps a state per block boundary only with ``mamba_cache_mode: align``, and its CPU
build computes those states only when a prefill step ends on a block boundary: the
engines run chunked prefill with 128-token steps. A hit's prompt is then computed in the
same steps after the hit as the whole prompt computed cold (each under a cache salt of
its own, so nothing serves it): the same arithmetic, so the outputs are equal bit for bit
when the loaded KV and state are the ones the cold run had at that point. Loaded by
tests/e2e/engine.py through ``KVTIER_TEST_SCENARIO_MODULES``.
"""

from __future__ import annotations

from typing import Any

from tests.e2e.engine import (
    build_llm,
    generate,
    index_report,
    kvtier_side,
    register,
    settle,
    shutdown,
    toks,
)

#: P: 4 chunks of 256 and a tail; Q: P's first 2 chunks, then fewer tokens of its own
#: than a chunk (nothing of Q's own is stored: a later hit on Q is P's 2 chunks again)
P = toks(11, 1024 + 20)
Q = P[:512] + toks(12, 200)
#: R: P's first 3 chunks, then its own (the restarted engine's partial hit)
R = P[:768] + toks(13, 200)

#: vLLM's settings for prefix caching of recurrent state on its CPU build
STATE_ENGINE: dict[str, Any] = {
    "block_size": None,  # vLLM picks the block (the attention page = the state page)
    "enable_prefix_caching": True,
    "mamba_cache_mode": "align",
    "enable_chunked_prefill": True,
    "max_num_batched_tokens": 128,
    "max_num_seqs": 4,
}


def _parallel(tp: int) -> dict[str, Any]:
    """Tensor parallelism over worker processes (each rank holds its shard of the state)."""
    return {} if tp == 1 else {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}


@register
def state_writer(model: str, extra: dict[str, Any], tp: int = 1) -> dict[str, Any]:
    """P and Q computed whole (each under a cache salt of its own: no hit from anyone),
    then P unsalted (computed, its chunks stored and uploaded) and, vLLM's cache emptied
    before each, P and Q again: kvtier's host tier serves 4 and 2 chunks."""
    llm = build_llm(model, extra, **STATE_ENGINE, **_parallel(tp))
    side = kvtier_side(llm)
    p_cold = generate(llm, [P], salt="p-cold")[0]
    q_cold = generate(llm, [Q], salt="q-cold")[0]
    generate(llm, [P])
    llm.reset_prefix_cache()
    p_hit = generate(llm, [P])[0]
    llm.reset_prefix_cache()
    q_hit = generate(llm, [Q])[0]
    settle(llm)
    groups = [[g.kind, g.blocks, len(g.layers)] for g in side.groups]
    report = index_report(llm)
    shutdown(llm)
    return {
        "p_cold": p_cold,
        "q_cold": q_cold,
        "p_hit": p_hit,
        "q_hit": q_hit,
        "groups": groups,
        "index": report,
    }


@register
def state_reader(model: str, extra: dict[str, Any], tp: int = 1) -> dict[str, Any]:
    """A restarted engine on the same object tier: P from the object tier (its host tier
    is empty); R computed whole (salted), then R with vLLM's cache and the host tier
    emptied: its first 3 chunks from the object tier."""
    llm = build_llm(model, extra, **STATE_ENGINE, **_parallel(tp))
    p_hit = generate(llm, [P])[0]
    r_cold = generate(llm, [R], salt="r-cold")[0]
    llm.reset_prefix_cache(reset_connector=True)
    r_hit = generate(llm, [R])[0]
    settle(llm)
    report = index_report(llm)
    shutdown(llm)
    return {"p_hit": p_hit, "r_cold": r_cold, "r_hit": r_hit, "index": report}


@register
def state_refused(model: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The engine with vLLM's default ``mamba_cache_mode``: its start fails; the error."""
    settings = {**STATE_ENGINE, "mamba_cache_mode": "none", "enable_prefix_caching": False}
    try:
        build_llm(model, extra, **settings)
    except Exception as exc:  # noqa: BLE001 - the test reads what the start raised
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": ""}
