"""Engine scenarios for tests/e2e/test_tenant_quotas.py: two tenants on one small host tier
(issue 60), each request saying who it is in ``kv_transfer_params``."""

from __future__ import annotations

from typing import Any

from tests.e2e.engine import build_llm, index_report, kvtier_side, register, settle, summary, toks


def _generate(llm: Any, prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
    """One greedy request carrying ``{"kvtier": params}`` as its ``kv_transfer_params``:
    offline, vLLM reads them from ``SamplingParams.extra_args`` (``Request.__init__``), as
    its server does from the OpenAI request's field of that name."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(
        max_tokens=8,
        temperature=0,
        logprobs=3,
        extra_args={"kv_transfer_params": {"kvtier": params}},
    )
    [out] = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
    return summary(out)


@register
def tenant_flood(
    model: str,
    extra: dict[str, Any],
    prompt_tokens: int,
    kept: list[list[Any]],
    flood: list[int],
    flood_tenant: str,
) -> dict[str, Any]:
    """``kept``: [seed, params] each sent once, vLLM's prefix cache emptied first (computed
    whole: ``first``), then again at once (vLLM's own prefix cache serves its full blocks:
    ``own_hit``, the split of a kvtier hit). Then ``flood_tenant`` sends each of ``flood``,
    vLLM's prefix cache emptied before each (as memory pressure would). Then each of
    ``kept`` and the flood's last prompt again, vLLM's cache emptied first (``back``): what
    kvtier's host tier served each (``hit_host``)."""
    llm = build_llm(model, extra)
    side = kvtier_side(llm)

    def fresh(seed: int, params: dict[str, Any]) -> dict[str, Any]:
        assert llm.reset_prefix_cache()
        before = side.totals["hit_tokens_host"]
        out = _generate(llm, toks(seed, prompt_tokens), params)
        settle(llm)
        out["hit_host"] = side.totals["hit_tokens_host"] - before
        return out

    first, own_hit = [], []
    for seed, params in kept:
        first.append(fresh(seed, params))
        own_hit.append(_generate(llm, toks(seed, prompt_tokens), params))  # no flush
        settle(llm)
    flooded = [fresh(seed, {"tenant": flood_tenant}) for seed in flood]
    back = [fresh(seed, params) for seed, params in kept]
    last = fresh(flood[-1], {"tenant": flood_tenant})
    tenancy = side.tenancy
    result = {
        "first": first,
        "own_hit": own_hit,
        "flood": flooded,
        "back": back,
        "flood_last": last,
        "evicted_by": dict(side.index.evicted_by),
        "pinned": tenancy.pinned if tenancy is not None else 0,
        "usage": tenancy.usage_by_label() if tenancy is not None else {},
        "index": index_report(llm),
    }
    return result
