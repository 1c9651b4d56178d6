"""Weights that change while the engine runs, by whatever route, and how kvtier follows.

Every route vLLM offers into a running engine's workers goes through the engine core's
``collective_rpc``: a named worker method (``reload_weights``, the weight-transfer API,
a ``worker_extension_cls`` method such as vLLM's RLHF ``update_weight`` or TRL's
``update_named_param``), ``LLM.apply_model(fn)`` (the method ``apply_model``), or any
callable. What an unknown method or a callable does cannot be known, so every call is
followed as a weight change except the few known to leave the weights alone
(:data:`READ_ONLY_RPCS`, or a callable marked with :func:`read_only`). A read-only call
taken for a change costs hits; a change taken for a read-only call would serve wrong KV.

Code that writes the parameters without any call (an in-process engine's model reached
through ``llm.llm_engine.model_executor``, as TRL's colocate mode syncs) is seen when
vLLM's prefix cache is reset, which vLLM requires after every weight change: each reset
compares a digest of every parameter and buffer (:func:`weights_digest`) with the one
taken when the engine started, or at the last reset (the first reset after a followed
call takes it anew and compares nothing). A function marked read-only is trusted.

The scheduler side then drops the host tier and gives the object keys an identity of
their own (``SchedulerSide.weights_changed``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import struct
import sys
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger("kvtier")

#: worker methods, as ``collective_rpc`` names them, known to change the weights in
#: place (a reload, a weight transfer's session, a config swap, zeroed or discarded
#: weights, a function run on the model, a process checkpoint's prepare and restore).
#: Followed like every other name not in :data:`READ_ONLY_RPCS`; listed so the tests
#: can tell vLLM's expected changes from a method they have not classified.
WEIGHT_CHANGING_RPCS = frozenset(
    {
        "reload_weights",
        "update_config",
        "load_model",
        "reset_weights",
        "discard",
        "checkpoint_prepare",
        "checkpoint_restore",
        "start_weight_update",
        "start_draft_weight_update",
        "update_weights",
        "finish_weight_update",
        "apply_model",
    }
)

#: worker methods that read the model or the device and change nothing the KV depends
#: on: those vLLM itself calls through the engine core while serving (0.32 to 0.34:
#: ``LLM.__repr__``'s ``get_model_inspection``, the weight checksums of the RL API,
#: 0.34's readiness check ``has_incomplete_weight_update``, a pooling model's
#: ``release_late_interaction_query_cache``, a checkpoint's ``synchronize_device``,
#: the benchmarks' ``get_encoder_timing_stats``), opening and closing a weight
#: transfer's connection (its weights arrive in ``update_weights``), saving the weights,
#: and plain getters
READ_ONLY_RPCS = frozenset(
    {
        "get_model_inspection",
        "compute_weight_checksums",
        "has_incomplete_weight_update",
        "release_late_interaction_query_cache",
        "synchronize_device",
        "get_encoder_timing_stats",
        "init_weight_transfer_engine",
        "shutdown_weight_transfer_engine",
        "save_sharded_state",
        "save_tensorized_model",
        "get_supported_tasks",
        "list_loras",
        "check_health",
        "get_kv_connector_handshake_metadata",
    }
)

#: the attribute :func:`read_only` sets on a callable
READ_ONLY_MARK = "_kvtier_read_only"

#: what the engine core's connector implements to be told (KVTierConnector; a
#: private name: it is no vLLM hook)
WEIGHTS_CHANGED_HOOK = "_kvtier_weights_changed"

F = TypeVar("F", bound=Callable[..., Any])


def read_only(fn: F) -> F:
    """Mark a function that only reads the model or the worker, so that passing it to
    ``collective_rpc`` or ``LLM.apply_model`` keeps kvtier's tiers (every other callable
    is taken for a weight change). The mark travels with the function to the engine
    core (cloudpickle keeps a function's attributes, and an imported one is marked at
    import)."""
    setattr(fn, READ_ONLY_MARK, True)
    return fn


def rpc_changes_weights(method: Any, args: Any = ()) -> str | None:
    """What to call this ``collective_rpc`` in the log when it may change the weights
    (``method``: a worker method's name or a callable; ``args``: the call's positional
    arguments, whose first is ``apply_model``'s function), None when it cannot."""
    if isinstance(method, str):
        if method in READ_ONLY_RPCS:
            return None
        if method == "apply_model":
            fn = args[0] if isinstance(args, tuple | list) and args else None
            if fn is not None and getattr(fn, READ_ONLY_MARK, False):
                return None
            return f"apply_model({_name(fn)})"
        return method
    if getattr(method, READ_ONLY_MARK, False):
        return None
    return f"collective_rpc({_name(method)})"


def _name(fn: Any) -> str:
    return str(
        getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    )


def _rpc_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``method`` and ``args`` of ``EngineCore.collective_rpc(method, timeout, args,
    kwargs)``, given by position (vLLM's clients) or by name."""
    method = args[0] if args else kwargs.get("method")
    rpc_args = args[2] if len(args) > 2 else kwargs.get("args", ())
    return method, rpc_args


def follow_weight_changes() -> bool:
    """Tell kvtier's scheduler side of every weight change vLLM makes while it runs.

    Wraps the engine core's ``collective_rpc``, once per process: after a call that
    may change the weights (:func:`rpc_changes_weights`) returns, or fails (a half-done
    update changed weights too), the engine core's connector is told before the next
    step is scheduled. Wraps its ``reset_prefix_cache`` too, which compares the
    weights' digest (:func:`check_written_weights`). Returns whether the hooks are in
    place (False: a vLLM without an engine core to wrap)."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:  # pragma: no cover - every vLLM kvtier supports has it
        return False
    if not getattr(EngineCore.collective_rpc, "_kvtier_follows_weights", False):
        EngineCore.collective_rpc = _following_rpc(  # type: ignore[method-assign]
            EngineCore.collective_rpc
        )
    if not getattr(EngineCore.reset_prefix_cache, "_kvtier_follows_weights", False):
        EngineCore.reset_prefix_cache = _checking_reset(  # type: ignore[method-assign]
            EngineCore.reset_prefix_cache
        )
    return True


def _following_rpc(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def collective_rpc(self: Any, *args: Any, **kwargs: Any) -> Any:
        method, rpc_args = _rpc_call(args, kwargs)
        why = rpc_changes_weights(method, rpc_args)
        try:
            return original(self, *args, **kwargs)
        finally:
            if why is not None:
                weights_changed(self, why)
                if DIGEST_ATTR in self.__dict__:  # taken again at the next reset
                    self.__dict__[DIGEST_ATTR] = STALE

    collective_rpc._kvtier_follows_weights = True  # type: ignore[attr-defined]
    return collective_rpc


def _checking_reset(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def reset_prefix_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        check_written_weights(self)
        return result

    reset_prefix_cache._kvtier_follows_weights = True  # type: ignore[attr-defined]
    return reset_prefix_cache


def weights_changed(engine_core: Any, why: str) -> int:
    """Tell the connectors of ``engine_core``'s scheduler (kvtier's, also inside a
    MultiConnector) that the weights changed; returns how many were told (0 while the
    engine core is still being built: vLLM calls the workers before it has a
    scheduler, and nothing is stored yet)."""
    scheduler = getattr(engine_core, "scheduler", None)
    todo = [getattr(scheduler, "connector", None)]
    told = 0
    while todo:
        connector = todo.pop()
        if connector is None:
            continue
        hook = getattr(connector, WEIGHTS_CHANGED_HOOK, None)
        if callable(hook):
            hook(why)
            told += 1
        todo.extend(getattr(connector, "sub_connectors", ()) or ())  # a MultiConnector's
    return told


# ---- weights written without a call ------------------------------------------------------
#: where an engine core keeps its workers' last weights digests (absent: not watched)
DIGEST_ATTR = "_kvtier_weights_digest"
#: a followed call changed the weights since the last digest: take it again, compare nothing
STALE = "stale"
#: words per row of a tensor's digest (:func:`_tensor_sums`)
DIGEST_ROW = 1024


@read_only
def weights_digest(worker: Any) -> str:
    """Run on each worker: a digest of every parameter and buffer of its model, all of
    their bytes, read where they are. Integer sums (:func:`_tensor_sums`: exact and
    order-free, so the same weights give the same digest on any device and run; a
    rewritten value, a moved row or a swapped pair changes it), no copy of a tensor."""
    import torch

    model = worker.get_model()
    h = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        # the buffers too: KV scales, rotary tables (computed, but a function may write)
        for name, param in (*model.named_parameters(), *model.named_buffers()):
            h.update(f"{name}:{param.dtype}:{tuple(param.shape)};".encode())
            try:
                h.update(_tensor_sums(param.detach()))
            except (RuntimeError, TypeError):  # a tensor subclass without a byte view
                h.update(b"unread")
    return h.hexdigest()


def _tensor_sums(t: Any) -> bytes:
    """A tensor's bytes as 64-bit words (narrower only when its size needs), laid out in
    rows of :data:`DIGEST_ROW` words: the sums of the rows and of the columns, each
    weighted by position. Two passes over the bytes in place, no copy."""
    import torch

    if t.numel() == 0 or t.device.type == "meta":
        return b""
    words = t.reshape(-1).view(torch.uint8)
    for wide in (torch.int64, torch.int32, torch.int16):
        if words.numel() % torch.empty((), dtype=wide).element_size() == 0:
            try:
                words = words.view(wide)
                break
            except RuntimeError:  # an offset the wider view cannot take
                continue
    rows, tail = divmod(words.numel(), DIGEST_ROW)
    head = words[: rows * DIGEST_ROW].view(rows, DIGEST_ROW)
    rest = words[rows * DIGEST_ROW :].to(torch.int64)

    def weighted(sums: Any) -> Any:
        where = torch.arange(1, sums.numel() + 1, dtype=torch.int64, device=sums.device)
        return (sums.to(torch.int64) * where).sum()

    by_row = head.sum(dim=1, dtype=torch.int64)
    by_col = head.sum(dim=0, dtype=torch.int64)
    out = [by_row.sum() + rest.sum(), weighted(by_row), weighted(by_col), weighted(rest)]
    return struct.pack("<4q", *(int(x) for x in out))


def engine_core_on_stack() -> Any:
    """The engine core being built, found on the call stack (vLLM builds the scheduler,
    and with it the scheduler's connector, inside ``EngineCore.__init__``), or None."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:  # pragma: no cover - every vLLM kvtier supports has it
        return None
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, EngineCore):
            return obj
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _digests(engine_core: Any) -> tuple[str, ...] | None:
    """Every worker's :func:`weights_digest` (through the executor: no call kvtier
    follows), or None when they cannot be taken (logged; the check is then off)."""
    try:
        return tuple(engine_core.model_executor.collective_rpc(weights_digest))
    except Exception as exc:  # a model or executor the digest cannot read
        logger.warning(
            "kvtier: the weights' digest cannot be taken (%s): weights written "
            "without a call are not followed",
            exc,
        )
        return None


def watch_written_weights(engine_core: Any) -> bool:
    """Take the weights' first digest, as the engine starts; returns whether they are
    watched."""
    if engine_core is None:
        return False
    digest = _digests(engine_core)
    if digest is None:
        return False
    engine_core.__dict__[DIGEST_ATTR] = digest
    return True


def check_written_weights(engine_core: Any) -> bool:
    """After ``reset_prefix_cache``: whether the weights changed since the last digest
    with no call kvtier follows (then the connector is told, as for a call)."""
    last = engine_core.__dict__.get(DIGEST_ATTR)
    if last is None or getattr(engine_core.model_executor, "is_sleeping", False):
        # asleep, the weights' memory may be unmapped (sleep mode): the next reset awake
        # compares with the digest from before the sleep
        return False
    digest = _digests(engine_core)
    if digest is None:
        engine_core.__dict__.pop(DIGEST_ATTR, None)
        return False
    engine_core.__dict__[DIGEST_ATTR] = digest
    if last == STALE or digest == last:
        return False
    weights_changed(engine_core, "weights written without a call (seen at reset_prefix_cache)")
    return True
