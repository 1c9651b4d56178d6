"""Engine scenarios for tests/e2e/test_load_pricing.py: restart reads through an object
tier whose speed the test sets, with lookups priced against recomputing (kvtier.costs)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from tests.e2e.engine import build_llm, generate, kvtier_side, register, settle, toks

PREFIX = 1024  # each prompt's full chunks
PROMPT = PREFIX + 20


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


def _warm(llm: Any, seeds: list[int]) -> None:
    """Prompts stored nowhere, each alone: vLLM computes them and kvtier measures the
    prefill per token."""
    for s in seeds:
        assert llm.reset_prefix_cache()
        generate(llm, [toks(s, PROMPT)])
    settle(llm)


def _what_kvtier_did(counters: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    """Tokens served from the object tier and declined, and lookups cut, since ``before``."""
    return {
        "served": _delta(counters, before, "kvtier:hit_tokens|remote"),
        "declined": _delta(counters, before, "kvtier:loads_declined_tokens"),
        "cut": _delta(counters, before, "kvtier:fetch_deadline_missed"),
    }


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
    _warm(llm, warm_seeds)
    outs = []
    for s in seeds:
        assert llm.reset_prefix_cache()
        before, reads = dict(counters), _fetches()
        out = generate(llm, [toks(s, PROMPT)])[0]
        settle(llm)
        out.update(_what_kvtier_did(counters, before), reads=_fetches() - reads)
        outs.append(out)
    spt = side.lookups.prefill.seconds_per_token(side.lookups.clock())
    return {"outs": outs, "prefill_s_per_token": spt, "counters": counters}


def _record_prices(side: Any) -> list[Any]:
    """Every :class:`kvtier.costs.Price` the scheduler side's lookups get, in order (the
    function wrapped where the lookups' module looks it up): its deadline and prediction,
    with the median engine step and the recompute of the chunks asked for, as priced."""
    import sys

    module = sys.modules[type(side.lookups).__module__]
    prices: list[Any] = []
    original = module.price_load

    def price_load(chunks: Any, **kwargs: Any) -> Any:
        price = original(chunks, **kwargs)
        prefill, now = kwargs["prefill"], kwargs["now"]
        spt = prefill.seconds_per_token(now) or 0.0
        prices.append(
            SimpleNamespace(
                deadline_s=price.deadline_s,
                predicted_s=price.predicted_s,
                step_s=prefill.step_seconds(now),
                recompute_s=kwargs["margin"] * spt * sum(t for _, t in chunks[: price.load]),
            )
        )
        return price

    module.price_load = price_load
    return prices


@register
def stalled_reads(
    model: str,
    extra: dict[str, Any],
    upstream: list[Any],
    warm_seeds: list[int],
    seeds: list[int],
    stall_seeds: list[int],
    stall_bytes: int,
) -> dict[str, Any]:
    """A restarted engine reading through a proxy of its own in front of ``upstream``
    (Redis): ``warm_seeds`` computed (the prefill measured), ``seeds`` read unthrottled
    (the tier's latency measured), then each of ``stall_seeds`` with the tier going silent
    after ``stall_bytes`` of it; per stalled prompt what was served and cut, the price
    (its deadline) and the prefill per token it was priced with."""
    from tests.faultproxy import FaultProxy

    proxy = FaultProxy((upstream[0], int(upstream[1]))).start()
    extra = {**extra, "remote_url": f"redis://127.0.0.1:{proxy.port}/0"}
    counters = _count_stats()
    llm = build_llm(model, extra)
    side = kvtier_side(llm)
    prices = _record_prices(side)
    _warm(llm, warm_seeds)
    outs = []
    for s in [*seeds, *stall_seeds]:
        assert llm.reset_prefix_cache()
        before, priced = dict(counters), len(prices)
        if s in stall_seeds:
            proxy.stall_after_bytes = stall_bytes
        t0 = time.monotonic()
        out = generate(llm, [toks(s, PROMPT)])[0]
        seconds = time.monotonic() - t0
        proxy.stall_after_bytes = None  # the rest of the fetch lands (in the host tier)
        settle(llm)
        out.update(
            _what_kvtier_did(counters, before),
            priced=[vars(p) for p in prices[priced:]],
            seconds=seconds,  # (printed by the bench-like debug runs, never asserted)
        )
        outs.append(out)
    proxy.close()
    return {"outs": outs, "counters": counters}


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
