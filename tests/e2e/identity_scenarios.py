"""Engine scenarios for tests/e2e/test_identity_weights.py: weights replaced while the
engine runs, and random (``--load-format dummy``) weights beside the real ones."""

from __future__ import annotations

from typing import Any

from tests.e2e.engine import (
    build_llm,
    generate,
    kvtier_side,
    register,
    settle,
    shutdown,
    toks,
)

PROMPT = 1024 + 20


def _remote_counters() -> dict[str, int]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()._worker
    return worker.remote.counters() if worker is not None and worker.remote else {}


def _run(llm, prompt: list[int], reset_connector: bool = False) -> dict[str, Any]:
    """The prompt once, vLLM's own prefix cache emptied first (and kvtier's host tier
    with ``reset_connector``): what kvtier served, by tier."""
    side = kvtier_side(llm)
    assert llm.reset_prefix_cache(reset_connector=reset_connector)
    before = dict(side.totals)
    out = generate(llm, [prompt])[0]
    settle(llm)
    after = dict(side.totals)
    out["hit_host"] = after["hit_tokens_host"] - before["hit_tokens_host"]
    out["hit_remote"] = after["hit_tokens_remote"] - before["hit_tokens_remote"]
    out["fetch_ok"] = after["fetch_ok"] - before["fetch_ok"]
    return out


@register
def reload_weights_run(model: str, other: str, extra: dict[str, Any], seed: int) -> dict[str, Any]:
    """Serve a prompt on ``model``'s weights (stored in both tiers), check the object tier
    serves it back, reload the weights from ``other`` through ``collective_rpc`` (as an RL
    trainer's sync or an operator does), then ask for the prompt again."""
    llm = build_llm(model, extra)
    side = kvtier_side(llm)
    p = toks(seed, PROMPT)
    runs = {"cold": _run(llm, p)}
    runs["from_tier"] = _run(llm, p, reset_connector=True)  # the tier holds usable chunks
    llm.collective_rpc("reload_weights", kwargs={"weights_path": other})
    runs["after_reload"] = _run(llm, p)  # vLLM's own cache emptied: only kvtier could serve
    runs["again"] = _run(llm, p)  # stored after the change: the host tier serves it
    runs["again_from_tier"] = _run(llm, p, reset_connector=True)  # ... and the object tier
    report = {"totals": dict(side.totals), "weights_epoch": side.weights_epoch}
    shutdown(llm)
    return {"runs": runs, "side": report}


@register
def one_prompt(
    model: str, extra: dict[str, Any] | None, seed: int, engine_kw: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One prompt, once (``extra`` None: without kvtier, the reference)."""
    llm = build_llm(model, extra, **(engine_kw or {}))
    p = toks(seed, PROMPT)
    if extra is None:
        return {"out": generate(llm, [p])[0]}
    out = _run(llm, p)
    remote = _remote_counters()
    ns = kvtier_side(llm).namespace
    shutdown(llm)
    return {"out": out, "remote": remote, "fingerprint": ns.fingerprint}
