"""Engine scenarios for tests/e2e/test_canary.py: engines of different weights sharing one
``model_fingerprint``, and what the canary (kvtier.canary) lets each load and store."""

from __future__ import annotations

from typing import Any

from tests.e2e.engine import build_llm, generate, kvtier_side, register, settle, shutdown, toks

PROMPT = 1024 + 20


def _record_comparisons() -> list[dict[str, Any]]:
    """Every chunk comparison this process's worker makes (engine core in-process)."""
    import kvtier.canary as canary

    seen: list[dict[str, Any]] = []
    real = canary.compare_chunk

    def recording(computed, stored, tolerance=canary.TOLERANCE):  # type: ignore[no-untyped-def]
        cmp = real(computed, stored, tolerance)
        seen.append({"result": cmp.result, "errors": list(cmp.errors)})
        return cmp

    canary.compare_chunk = recording  # type: ignore[assignment]
    return seen


@register
def canary_prompts(
    model: str,
    extra: dict[str, Any] | None,
    seeds: list[int],
    batch: bool = False,
    engine_kw: dict[str, Any] | None = None,
    then_single: bool = False,
    hits_after: list[int] | None = None,
) -> dict[str, Any]:
    """Each prompt once, vLLM's own prefix cache emptied first (``batch``: all at once
    instead); what kvtier served it, the canary's counts and every comparison made.
    ``extra`` None: vLLM without kvtier (the reference): each prompt computed whole
    (``outs``), then again served by vLLM's own prefix cache (``hits``: the same split as
    a kvtier hit of the prompt's full chunks, with 32-token blocks) over the KV computed
    as the writer of the chunks computed it (``hits_after``: these seeds' prompts at once,
    in one batch, after vLLM's cache was emptied; a row's bits depend on its batch).
    ``engine_kw``: vLLM's own
    settings (e.g. a small ``max_num_batched_tokens``: chunked prefill). ``then_single``:
    after the batch, each prompt again alone with kvtier's host tier emptied."""
    llm = build_llm(model, extra, **(engine_kw or {}))
    prompts = [toks(s, PROMPT) for s in seeds]
    if extra is None:  # one at a time, as the engines with kvtier run them
        outs = [generate(llm, [p])[0] for p in prompts]
        if hits_after is not None:
            assert llm.reset_prefix_cache()
            generate(llm, [toks(s, PROMPT) for s in hits_after])
        return {"outs": outs, "hits": [generate(llm, [p])[0] for p in prompts]}
    seen = _record_comparisons()
    side = kvtier_side(llm)
    outs = []
    if batch:
        outs = generate(llm, prompts)
        settle(llm)
    else:
        for p in prompts:
            assert llm.reset_prefix_cache()
            before = dict(side.totals)
            out = generate(llm, [p])[0]
            settle(llm)
            out["hit_remote"] = side.totals["hit_tokens_remote"] - before["hit_tokens_remote"]
            out["hit_host"] = side.totals["hit_tokens_host"] - before["hit_tokens_host"]
            outs.append(out)
    if then_single:  # again one at a time, the host tier emptied: what the tier serves
        for p in prompts:
            assert llm.reset_prefix_cache(reset_connector=True)
            before = dict(side.totals)
            out = generate(llm, [p])[0]
            settle(llm)
            out["hit_remote"] = side.totals["hit_tokens_remote"] - before["hit_tokens_remote"]
            outs.append(out)
    totals = dict(side.totals)
    state = side.canary.trust.state.value
    forks = [list(f) for f in side.canary.forks]
    shutdown(llm)
    return {"outs": outs, "totals": totals, "state": state, "comparisons": seen, "forks": forks}


@register
def refused_after_loading(model: str, extra: dict[str, Any], seeds: list[int]) -> dict[str, Any]:
    """A generation trusted at once (``canary_first_hit`` off) serves the first prompt;
    then every request is sampled, and the second prompt's check mismatches; then the
    first prompt again, vLLM's own prefix cache *not* emptied in between: what vLLM
    serves it from (``cached``) after the mismatch."""
    import time

    llm = build_llm(model, extra)
    side = kvtier_side(llm)
    first_prompt, second_prompt = (toks(s, PROMPT) for s in seeds)
    first = generate(llm, [first_prompt])[0]
    settle(llm)
    loaded = side.totals["hit_tokens_remote"]
    side.canary.trust.rate = 1.0  # the next request is a canary
    generate(llm, [second_prompt])
    deadline = time.time() + 60
    while side.canary.pending and time.time() < deadline:
        settle(llm)
    side.canary.trust.rate = 0.0
    again = generate(llm, [first_prompt])[0]
    settle(llm)
    result = {
        "first": first,
        "loaded": loaded,
        "again": again,
        "totals": dict(side.totals),
        "state": side.canary.trust.state.value,
        "forks": [list(f) for f in side.canary.forks],
    }
    shutdown(llm)
    return result
