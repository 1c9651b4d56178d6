"""Engine scenarios for tests/e2e/test_weight_routes.py: the weights of a running engine
replaced by each route vLLM offers besides the named reloads (``LLM.apply_model``, a
``worker_extension_cls`` method as RL trainers add, a function passed to
``collective_rpc``), and calls that only read."""

from __future__ import annotations

import functools
from typing import Any

from kvtier.connectors.scheduler.weights import read_only
from tests.e2e.engine import build_llm, generate, kvtier_side, register, settle, shutdown, toks

PROMPT = 1024 + 20
#: the prompt stored before the change, and one first asked after it
BEFORE, AFTER = 41, 42
EXTENSION = "tests.e2e.weight_route_scenarios.WeightSync"


def checkpoint(path: str) -> list[tuple[str, Any]]:
    """The tensors of a Hugging Face checkpoint directory, by their names there."""
    from pathlib import Path

    from safetensors.torch import load_file

    out: list[tuple[str, Any]] = []
    for f in sorted(Path(path).glob("*.safetensors")):
        out.extend(load_file(str(f)).items())
    return out


def plain_tensors(model: Any, path: str) -> list[tuple[str, Any]]:
    """The tensors of ``path``'s checkpoint that ``model`` computes with as they are: the
    embedding and the norms. vLLM's CPU backend repacks the linear layers' weights
    after the load (lm_head's too), so ``load_weights`` cannot change those in a running
    engine (on a GPU it can); a sync of the embedding alone changes every layer's KV."""
    params = dict(model.named_parameters())
    return [
        (n, t)
        for n, t in checkpoint(path)
        if n in params
        and tuple(params[n].shape) == tuple(t.shape)
        and (".embed_tokens." in n or n.endswith("norm.weight"))
    ]


def load_into(path: str, model: Any) -> list[str]:
    """``LLM.apply_model``'s function: vLLM's loader writes the tensors, as a trainer's
    sync does."""
    tensors = plain_tensors(model, path)
    model.load_weights(tensors)
    return [n for n, _ in tensors]


def load_on_worker(worker: Any, path: str) -> list[str]:
    """A function given to ``collective_rpc``: it runs with the worker as first argument."""
    return load_into(path, worker.model_runner.model)


def plain_names(path: str, model: Any) -> list[str]:
    return [n for n, _ in plain_tensors(model, path)]


class WeightSync:
    """A ``worker_extension_cls``, the route of vLLM's RLHF examples (``update_weight``,
    ``update_weights_from_ipc_handles``) and of TRL's server (``update_named_param``):
    one named tensor at a time."""

    model_runner: Any

    def update_named_param(self, name: str, weight: Any) -> None:
        self.model_runner.model.load_weights(weights=[(name, weight)])


@read_only
def count_params(model: Any) -> int:
    """A function that only reads, marked so: ``apply_model`` keeps the tiers."""
    return sum(p.numel() for p in model.parameters())


@read_only
def count_on_worker(worker: Any) -> int:
    """The same, given to ``collective_rpc``."""
    return count_params(worker.model_runner.model)


def change(llm: Any, route: str, other: str) -> list[str]:
    """Write ``other``'s tensors into the engine's weights through ``route``; the names
    written."""
    if route == "apply_model":
        return list(llm.apply_model(functools.partial(load_into, other))[0])
    if route == "extension":
        # which names to send: asked with a function marked read-only (no change yet)
        names = llm.apply_model(read_only(functools.partial(plain_names, other)))[0]
        tensors = dict(checkpoint(other))
        for name in names:
            llm.collective_rpc("update_named_param", args=(name, tensors[name]))
        return list(names)
    if route == "callable":
        return list(llm.collective_rpc(load_on_worker, args=(other,))[0])
    if route == "direct":
        # no call at all: an in-process engine's model written as TRL's colocate mode
        # does, then vLLM's prefix cache reset, as vLLM requires (and TRL does)
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        names = load_into(other, model)
        assert llm.reset_prefix_cache()
        return names
    if route == "read_only":
        # what vLLM calls itself (repr(llm)), a marked function both ways: nothing changes
        repr(llm)
        llm.collective_rpc("get_model_inspection")
        assert llm.collective_rpc("compute_weight_checksums")
        assert llm.apply_model(count_params) == llm.collective_rpc(count_on_worker)
        return []
    raise ValueError(route)


def mixed_checkpoint(base: str, other: str, names: list[str], out: str) -> str:
    """``base``'s checkpoint with ``names`` taken from ``other``: the weights an engine
    holds after :func:`change`, for a fresh reference engine."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    dst = Path(out)
    shutil.copytree(base, dst, dirs_exist_ok=True)
    new = dict(checkpoint(other))
    for f in sorted(dst.glob("*.safetensors")):
        tensors = load_file(str(f))
        tensors.update({n: new[n].clone() for n in names if n in tensors})
        save_file(tensors, str(f), metadata={"format": "pt"})
    (dst / "kvtier-model.json").unlink(missing_ok=True)
    return str(dst)


def _run(llm: Any, prompt: list[int], reset_connector: bool = False) -> dict[str, Any]:
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
    out["stored"] = after["store_ok"] - before["store_ok"]
    return out


@register
def weight_route(model: str, other: str, extra: dict[str, Any], route: str) -> dict[str, Any]:
    """Serve a prompt on ``model``'s weights (both tiers hold it), replace the weights by
    ``route``, ask for it again, then serve a new prompt (stored after the change)."""
    llm = build_llm(model, extra, worker_extension_cls=EXTENSION)
    side = kvtier_side(llm)
    p, q = toks(BEFORE, PROMPT), toks(AFTER, PROMPT)
    runs = {"cold": _run(llm, p)}
    runs["from_tier"] = _run(llm, p, reset_connector=True)  # the tier holds usable chunks
    slots = [side.index.used_slots]  # the host tier's chunks, before and after
    written = change(llm, route, other)
    slots.append(side.index.used_slots)
    runs["after"] = _run(llm, p)  # vLLM's own cache emptied: only kvtier could serve
    runs["new_prompt"] = _run(llm, q)
    report = {"totals": dict(side.totals), "weights_epoch": side.weights_epoch, "host_slots": slots}
    shutdown(llm)  # queued uploads flush
    return {"runs": runs, "side": report, "written": written}


@register
def old_weights_reader(model: str, extra: dict[str, Any]) -> dict[str, Any]:
    """A second engine on the old weights, sharing the tier: the prompt the changed engine
    stored after the change, then the one stored before it."""
    llm = build_llm(model, extra)
    runs = {
        "new_prompt": _run(llm, toks(AFTER, PROMPT)),
        "old_prompt": _run(llm, toks(BEFORE, PROMPT)),
    }
    shutdown(llm)
    return {"runs": runs}


@register
def reference(model: str) -> dict[str, Any]:
    """Both prompts on a fresh engine without kvtier: what the weights compute."""
    llm = build_llm(model, None)
    return {
        "before": generate(llm, [toks(BEFORE, PROMPT)])[0],
        "after": generate(llm, [toks(AFTER, PROMPT)])[0],
    }
