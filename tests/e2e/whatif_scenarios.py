"""Engine scenarios for tests/e2e/test_whatif.py: a skewed workload on a host tier too
small for it, and what the ghost tiers (kvtier.whatif.host) make of it.

Loaded by tests/e2e/engine.py through ``KVTIER_TEST_SCENARIO_MODULES``.
"""

from __future__ import annotations

import random
from typing import Any

from tests.e2e.engine import build_llm, generate, index_report, kvtier_side, register, settle, toks


def zipf_requests(n_docs: int, n_requests: int, seed: int) -> list[int]:
    """Which document each request reads: Zipf (weight 1/rank), the same for a seed."""
    rng = random.Random(seed)
    return rng.choices(range(n_docs), [1 / (d + 1) for d in range(n_docs)], k=n_requests)


@register
def whatif_zipf(
    model: str,
    extra: dict[str, Any],
    n_docs: int = 16,
    doc_tokens: int = 1024,
    n_requests: int = 64,
    seed: int = 3,
) -> dict[str, Any]:
    """Each request is one document (Zipf over ``n_docs``) plus a question of its own,
    vLLM's own prefix cache emptied before each, so kvtier's tiers serve the document."""
    llm = build_llm(model, extra)
    docs = [toks(200 + d, doc_tokens) for d in range(n_docs)]
    order = zipf_requests(n_docs, n_requests, seed)
    for i, d in enumerate(order):
        llm.reset_prefix_cache()
        generate(llm, [docs[d] + toks(5000 + i, 24)], max_tokens=1)
    settle(llm)
    side = kvtier_side(llm)
    ghosts = side.ghosts
    capacity = None
    if ghosts is not None:
        capacity = {s: ghosts.capacity(s) for s in ghosts.scales}
    return {"index": index_report(llm), "ghost_capacity": capacity}
