"""Engine scenarios for tests/e2e/test_object_bound.py: a bounded directory object tier
(``file_max_bytes``) under a real vLLM engine, written well past its bound, and what its
ghosts (kvtier.whatif.objects) make of it.

Loaded by tests/e2e/engine.py through ``KVTIER_TEST_SCENARIO_MODULES``.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from tests.e2e.engine import build_llm, generate, index_report, kvtier_side, register, settle, toks
from tests.e2e.whatif_scenarios import zipf_requests
from tests.kit import directory_usage


@register
def bounded_zipf(
    model: str,
    extra: dict[str, Any],
    root: str,
    n_docs: int = 16,
    doc_tokens: int = 1024,
    n_requests: int = 64,
    seed: int = 3,
    settle_between: bool = True,
) -> dict[str, Any]:
    """Zipf over ``n_docs`` documents with vLLM's prefix cache emptied before each request
    (kvtier's tiers serve the document). The directory is measured every 10 ms while the
    engine runs (``peak``), after every request (``peaks``) and after the engine settled.
    With ``settle_between`` each request's uploads land before the next request looks up
    (the ghosts count an upload when it is planned, the real tier has it once written)."""
    llm = build_llm(model, extra)
    docs = [toks(200 + d, doc_tokens) for d in range(n_docs)]
    order = zipf_requests(n_docs, n_requests, seed)
    peaks: list[int] = []
    sampled = {"peak": 0, "samples": 0}
    done = threading.Event()

    def sample() -> None:  # between the requests' uploads too, not only after each request
        while not done.wait(0.01):
            sampled["peak"] = max(sampled["peak"], directory_usage(root)["bytes"])
            sampled["samples"] += 1

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for i, d in enumerate(order):
        if settle_between and i:
            settle(llm)
        llm.reset_prefix_cache()
        generate(llm, [docs[d] + toks(5000 + i, 24)], max_tokens=1)
        peaks.append(directory_usage(root)["bytes"])
    settle(llm)
    done.set()
    sampler.join()
    ghosts = kvtier_side(llm).lookups.ghosts
    manifests = [n for _, _, ns in os.walk(root) for n in ns if n.endswith("%2Fmanifest")]
    return {
        "index": index_report(llm),
        "peaks": peaks,
        **sampled,
        "after": directory_usage(root),
        "manifests": len(manifests),
        "ghost_capacity": None if ghosts is None else [g.capacity for g in ghosts.ghosts],
    }
