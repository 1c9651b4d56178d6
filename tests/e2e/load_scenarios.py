"""Engine scenarios for tests/e2e/test_hits_under_load.py: hits on a loaded machine.

Loaded by tests/e2e/engine.py through ``KVTIER_TEST_SCENARIO_MODULES``.
"""

from __future__ import annotations

import time
from typing import Any

from tests.e2e.engine import build_llm, index_report, kvtier_side, register, settle, toks


def reset_prefix_cache(llm) -> bool:
    """vLLM's own prefix cache flushed (what GPU memory pressure does to a prefix): its
    answer checked, a few tries (it refuses while a finished request's blocks are held)."""
    for _ in range(50):
        if llm.reset_prefix_cache():
            return True
        time.sleep(0.1)
    return False


@register
def stored_then_hit(
    model: str, extra: dict[str, Any], read_delay_s: float, doc_tokens: int
) -> dict[str, Any]:
    """Request A (a document and a question, one output token) on an empty host tier and
    an object tier whose reads take ``read_delay_s``, longer than ``lookup_timeout_ms``:
    A's lookup times out with its first read still going. Then vLLM's own prefix cache is
    flushed and request B asks another question about the same document. B must load the
    document from the host tier, where A stored it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.objects.tiers.file import FileTier

    def slowed(real: Any) -> Any:
        def slow_read(self: FileTier, *a: Any, **kw: Any) -> Any:
            time.sleep(read_delay_s)  # a slow mount or a loaded machine: the read is going
            return real(self, *a, **kw)

        return slow_read

    FileTier.read_into = slowed(FileTier.read_into)  # type: ignore[method-assign]
    FileTier.read_into_hashed = slowed(FileTier.read_into_hashed)  # type: ignore[method-assign]
    llm = build_llm(model, extra)
    side = kvtier_side(llm)
    sp = SamplingParams(max_tokens=1, temperature=0)
    doc = toks(11, doc_tokens)
    rows = []
    resets = []
    for q in range(2):
        resets.append(reset_prefix_cache(llm))
        before = dict(side.totals)
        prompt = doc + toks(200 + q, 40)
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
        after = dict(side.totals)
        rows.append(
            {
                "cached": out.num_cached_tokens or 0,
                "delta": {
                    k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k)
                },
            }
        )
    settle(llm, read_delay_s + 0.5)  # the slow reads report; their slots are freed
    report = index_report(llm)
    report["superseded"] = side.index.superseded
    return {"rows": rows, "resets": resets, "index": report}
