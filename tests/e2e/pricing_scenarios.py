"""Engine scenarios for tests/e2e/test_load_pricing.py: restart reads through an object
tier whose speed the test sets, with lookups priced against recomputing (kvtier.costs)."""

from __future__ import annotations

from typing import Any

from tests.e2e.engine import build_llm, generate, kvtier_side, register, settle, toks

PROMPT = 1024 + 20


def _count_stats() -> dict[str, float]:
    """Every counter kvtier increments in this process, by series id (name|labels)."""
    from kvtier.stats import StatsRecorder

    seen: dict[str, float] = {}
    original = StatsRecorder.inc

    def inc(self, spec, amount=1, labels=()):  # type: ignore[no-untyped-def]
        if amount > 0:
            sid = "|".join((spec.name, *labels))
            seen[sid] = seen.get(sid, 0) + amount
        return original(self, spec, amount, labels)

    StatsRecorder.inc = inc  # type: ignore[method-assign]
    return seen


def _fetches() -> int:
    """Object-tier reads this engine's worker has made (in-process: uniproc executor)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()._worker
    return int(worker.remote.counters().get("ops_fetch", 0)) if worker.remote else 0


def _delta(now: dict[str, float], before: dict[str, float], prefix: str) -> int:
    return int(sum(v - before.get(k, 0) for k, v in now.items() if k.startswith(prefix)))


@register
def priced_reads(
    model: str, extra: dict[str, Any], warm_seeds: list[int], seeds: list[int]
) -> dict[str, Any]:
    """A restarted engine: ``warm_seeds`` first (stored nowhere: vLLM computes them, and
    kvtier measures the prefill per token), then each of ``seeds`` alone, vLLM's prefix
    cache emptied before each; per prompt what kvtier served, declined and cut, and the
    object-tier reads it made."""
    counters = _count_stats()
    llm = build_llm(model, extra)
    side = kvtier_side(llm)
    for s in warm_seeds:
        assert llm.reset_prefix_cache()
        generate(llm, [toks(s, PROMPT)])
    settle(llm)
    outs = []
    for s in seeds:
        assert llm.reset_prefix_cache()
        before, reads = dict(counters), _fetches()
        out = generate(llm, [toks(s, PROMPT)])[0]
        settle(llm)

        out.update(
            served=_delta(counters, before, "kvtier:hit_tokens|remote"),
            declined=_delta(counters, before, "kvtier:loads_declined_tokens"),
            cut=_delta(counters, before, "kvtier:fetch_deadline_missed"),
            reads=_fetches() - reads,
        )
        outs.append(out)
    spt = side.lookups.prefill.seconds_per_token(side.lookups.clock())
    return {"outs": outs, "prefill_s_per_token": spt, "counters": counters}


@register
def store_prompts(model: str, extra: dict[str, Any], seeds: list[int]) -> dict[str, Any]:
    """Each prompt alone, then a shutdown that flushes the uploads: the tier holds them."""
    from tests.e2e.engine import shutdown

    llm = build_llm(model, extra)
    outs = []
    for s in seeds:
        assert llm.reset_prefix_cache()
        outs.append(generate(llm, [toks(s, PROMPT)])[0])
    shutdown(llm)
    return {"outs": outs}
