"""Weights replaced while the engine runs: the scheduler side drops the host tier and the
workers key their objects under a new identity, so nothing stored before the change is
served after it, and nothing written after it carries the old identity.

The engine core tells the scheduler side (``weights.follow_weight_changes``, after
every ``collective_rpc`` not known to be read-only; tests/e2e/test_weight_routes.py and
tests/e2e/test_identity_weights.py run it through real engines); these drive the parts
the way vLLM does, with an object tier in a directory, and the engine core's wrapper with
a fake executor.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kit import chunk_files

from tests.connectors.test_parallel_sides import (
    BPC,
    CHUNK,
    PAGE,
    PipelineEngine,
    make_request,
)

H_CHUNKS = 3


def engine(tmp_path: Path) -> PipelineEngine:
    return PipelineEngine(
        [[0, 1]], cpu_bytes=16 * PAGE * 2 * BPC, extra={"remote_url": f"file://{tmp_path / 'kv'}"}
    )


def blocks(first: int) -> list[int]:
    return list(range(first, first + H_CHUNKS * BPC + 1))


def test_after_a_weight_change_neither_tier_serves_what_was_stored_before(
    tmp_path: Path,
) -> None:
    eng = engine(tmp_path)
    tokens = H_CHUNKS * CHUNK + 1
    assert eng.prefill(make_request(tokens), blocks(0)) == 0
    eng.settle()
    assert len(chunk_files(tmp_path / "kv")) == H_CHUNKS
    assert eng.prefill(make_request(tokens), blocks(20)) == H_CHUNKS * CHUNK  # host hit
    w = eng.workers[0]
    h = make_request(tokens).block_hashes[BPC - 1]
    old_key = w._object_key(h)

    eng.side.weights_changed("reload_weights")
    assert eng.side.index.used_slots == 0 and eng.side.totals["weights_changes"] == 1
    # host tier emptied; the object tier holds the chunks, but under the old identity
    assert eng.prefill(make_request(tokens), blocks(0)) == 0
    eng.settle()
    assert eng.side.totals["fetch_ok"] == 0
    assert w.weights_epoch == 1 and w._object_key(h) != old_key
    # what was computed after the change went in under the new identity, beside the old
    assert len(chunk_files(tmp_path / "kv")) == 2 * H_CHUNKS
    assert eng.prefill(make_request(tokens), blocks(20)) == H_CHUNKS * CHUNK
    eng.shutdown()


def test_stores_planned_before_a_change_and_settled_after_are_dropped(tmp_path: Path) -> None:
    """vLLM scheduled a step (its stores hold KV of the old weights), then ran the
    weight update before the step's results came back: those chunks never become hits."""
    eng = engine(tmp_path)
    build = eng.side.build_connector_meta

    def build_then_change(so):  # type: ignore[no-untyped-def]
        meta = build(so)
        if meta.stores:  # the prefill's step (not the lookup's idle steps before it)
            eng.side.weights_changed("update_weights")
        return meta

    eng.side.build_connector_meta = build_then_change  # type: ignore[method-assign]
    tokens = H_CHUNKS * CHUNK + 1
    assert eng.prefill(make_request(tokens), blocks(0)) == 0
    eng.side.build_connector_meta = build  # type: ignore[method-assign]
    eng.settle()
    assert eng.side.totals["store_ok"] == H_CHUNKS  # the workers did store them ...
    assert eng.side.index.used_slots == 0  # ... and the scheduler dropped them
    eng.side.index.check()
    # nor does the object tier give them back: they were uploaded under the old identity
    assert eng.prefill(make_request(tokens), blocks(20)) == 0
    eng.settle()
    assert eng.side.totals["fetch_ok"] == 0
    eng.shutdown()


def test_requests_begun_before_a_change_store_nothing_after_it(tmp_path: Path) -> None:
    """A prompt prefilled in pieces across the change: its first chunks' KV is the old
    weights', so the chunks it completes afterwards (built on them) are not stored."""
    eng = engine(tmp_path)
    req = make_request(H_CHUNKS * CHUNK + 1, seed=3)
    n, _ = eng.side.get_num_new_matched_tokens(req, 0)
    while n is None:  # the object-tier lookup (a miss) runs first
        eng.idle_step()
        n, _ = eng.side.get_num_new_matched_tokens(req, 0)
    eng.side.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]
    eng.step(req, 0, CHUNK, blocks(0))  # chunk 0 computed with the old weights
    eng.settle()
    assert eng.side.totals["store_ok"] == 1
    eng.side.weights_changed("reload_weights")
    eng.step(req, CHUNK, req.num_tokens - CHUNK, blocks(0))  # the rest, with the new ones
    eng.settle()
    assert eng.side.totals["store_ok"] == 1 and eng.side.index.used_slots == 0
    eng.side.request_finished(req, [])
    eng.shutdown()


def test_after_a_change_what_vllms_own_cache_served_is_not_stored(tmp_path: Path) -> None:
    """vLLM keeps its prefix cache across a weight change: blocks it serves may hold the
    old weights' KV, so kvtier stores only the chunks the request computed itself."""
    eng = engine(tmp_path)
    eng.side.weights_changed("reload_weights")
    req = make_request(H_CHUNKS * CHUNK + 1, seed=4)
    local = 2 * CHUNK  # vLLM's own cache served the first two chunks
    n, _ = eng.side.get_num_new_matched_tokens(req, local)
    while n is None:
        eng.idle_step()
        n, _ = eng.side.get_num_new_matched_tokens(req, local)
    assert n == 0
    eng.side.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]
    eng.step(req, local, req.num_tokens - local, blocks(0))
    eng.settle()
    assert eng.side.totals["store_ok"] == H_CHUNKS - 2  # the third chunk only
    eng.shutdown()


# ---- the engine core's collective_rpc: which calls are followed ---------------------------
class _Told:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def _kvtier_weights_changed(self, why: str) -> None:
        self.calls.append(why)


def _engine_core(
    monkeypatch: pytest.MonkeyPatch, result: Any = None, error: Exception | None = None
) -> tuple[Any, _Told]:
    """vLLM's EngineCore with its collective_rpc wrapped by kvtier, a fake executor and a
    scheduler whose connector records what it is told."""
    from vllm.v1.engine.core import EngineCore

    from kvtier.connectors.scheduler.weights import follow_weight_changes

    # the wrappers go on the class: put the originals back after the test
    monkeypatch.setattr(EngineCore, "collective_rpc", EngineCore.collective_rpc)
    monkeypatch.setattr(EngineCore, "reset_prefix_cache", EngineCore.reset_prefix_cache)
    assert follow_weight_changes() and follow_weight_changes()  # idempotent

    def rpc(method, timeout=None, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if error is not None:
            raise error
        return [result]

    core = object.__new__(EngineCore)
    told = _Told()
    core.model_executor = SimpleNamespace(collective_rpc=rpc)
    core.scheduler = SimpleNamespace(connector=told)
    return core, told


def test_every_weight_changing_rpc_reaches_the_connector(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.connectors.scheduler.weights import WEIGHT_CHANGING_RPCS

    core, told = _engine_core(monkeypatch, result="ok")
    assert core.collective_rpc("reload_weights", kwargs={"weights_path": "/m"}) == ["ok"]
    assert told.calls == ["reload_weights"]
    for method in sorted(WEIGHT_CHANGING_RPCS - {"apply_model"}):
        core.collective_rpc(method=method)
    assert told.calls[1:] == sorted(WEIGHT_CHANGING_RPCS - {"apply_model"})


def weight_writer(worker: Any) -> None:
    """Stands for a function that writes the weights (what it does is not looked at)."""


def test_methods_and_functions_kvtier_does_not_know_are_followed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 47: a worker extension's methods (vLLM's RLHF example, TRL), ``apply_model``
    and a callable changed weights without a re-key. Given as vLLM's clients give them:
    ``collective_rpc(method, timeout, args, kwargs)`` by position."""
    core, told = _engine_core(monkeypatch)
    core.collective_rpc("update_weight", None, ("w", "bf16", (4, 4)), {})
    core.collective_rpc("update_weights_from_ipc_handles", None, ({},), None)
    core.collective_rpc("update_named_param", kwargs={"name": "w"})
    core.collective_rpc("apply_model", None, (weight_writer,), None)  # LLM.apply_model
    core.collective_rpc(weight_writer)
    core.collective_rpc(lambda worker: None)
    assert told.calls == [
        "update_weight",
        "update_weights_from_ipc_handles",
        "update_named_param",
        "apply_model(weight_writer)",
        "collective_rpc(weight_writer)",
        "collective_rpc(test_methods_and_functions_kvtier_does_not_know_are_followed."
        "<locals>.<lambda>)",
    ]


def test_read_only_calls_keep_the_tiers(monkeypatch: pytest.MonkeyPatch) -> None:
    """What vLLM itself calls while serving (``repr(llm)``, readiness, checksums) and
    functions marked read-only change nothing: following them would cost every hit."""
    from kvtier.connectors.scheduler.weights import READ_ONLY_RPCS, read_only

    core, told = _engine_core(monkeypatch)
    for method in sorted(READ_ONLY_RPCS):
        core.collective_rpc(method)

    @read_only
    def inspect(worker: Any) -> int:
        return 1

    core.collective_rpc(inspect)
    core.collective_rpc("apply_model", None, (inspect,), None)
    core.collective_rpc(method="apply_model", args=(inspect,))
    assert told.calls == []


def test_a_failed_weight_update_still_counts_as_a_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reload that fails half-way has replaced some weights already."""
    core, told = _engine_core(monkeypatch, error=RuntimeError("trainer went away"))
    with pytest.raises(RuntimeError, match="trainer went away"):
        core.collective_rpc("update_weights", kwargs={"update_info": {}})
    with pytest.raises(RuntimeError, match="trainer went away"):
        core.collective_rpc(weight_writer)
    assert told.calls == ["update_weights", "collective_rpc(weight_writer)"]


def test_a_connector_inside_a_multi_connector_is_told() -> None:
    from kvtier.connectors.scheduler.weights import weights_changed

    inner = _Told()
    multi = SimpleNamespace(sub_connectors=[SimpleNamespace(), inner])
    assert weights_changed(SimpleNamespace(scheduler=SimpleNamespace(connector=multi)), "x") == 1
    assert inner.calls == ["x"]
    # vLLM calls its workers while the engine core is built, before it has a scheduler
    assert weights_changed(SimpleNamespace(), "x") == 0


#: read-only methods newer than the installed vLLM (0.34's readiness check)
NEWER_READ_ONLY = {"has_incomplete_weight_update"}


def test_the_named_rpcs_are_vllm_worker_methods() -> None:
    """A known change vLLM renames would still be followed (every unknown name is), but a
    read-only name misspelt or renamed would cost hits in silence: each must exist on
    vLLM's worker (the class every platform's worker derives from)."""
    from vllm.v1.worker.gpu_worker import Worker

    from kvtier.connectors.scheduler.weights import READ_ONLY_RPCS, WEIGHT_CHANGING_RPCS

    assert not READ_ONLY_RPCS & WEIGHT_CHANGING_RPCS
    names = (READ_ONLY_RPCS - NEWER_READ_ONLY) | WEIGHT_CHANGING_RPCS
    missing = sorted(m for m in names if not callable(getattr(Worker, m, None)))
    assert not missing, missing


#: what vLLM calls through the engine core and kvtier follows though it changes no
#: weight: both run while the engine core is built, before it has a scheduler to tell
#: (``update_max_model_len``, and the callable ``measure_encoder_output_widths`` runs)
FOLLOWED_AT_STARTUP = {"update_max_model_len"}


def _vllm_root() -> Path:
    import vllm

    return Path(vllm.__file__).parent


def engine_core_rpc_names(root: Path) -> set[str]:
    """The worker methods vLLM's own code calls through the engine core's collective_rpc
    (the engine core itself, the LLM and AsyncLLM clients, the API servers): not the
    executor's calls to its workers, which do not pass the engine core."""
    call = re.compile(
        r"(?<![\w.])(?:self|self\.llm_engine|self\.engine_core|engine|client|"
        r"llm_engine|engine_client\([^)]*\)|self\.engine_client)"
        r"\.collective_rpc(?:_async)?\(\s*(?:method=)?\"(\w+)\""
    )
    files = [
        root / "v1/engine/core.py",
        root / "v1/engine/llm_engine.py",
        root / "v1/engine/async_llm.py",
        root / "snapshot/server.py",
        root / "benchmarks/mm_processor.py",
        *sorted((root / "entrypoints").rglob("*.py")),
    ]
    names: set[str] = set()
    for f in files:
        if f.is_file():
            names.update(call.findall(f.read_text()))
    return names


def test_every_rpc_vllm_calls_itself_is_classified() -> None:
    """vLLM calls some worker methods through the engine core while it serves (0.32:
    ``LLM.__repr__``'s ``get_model_inspection``; 0.34 adds a readiness check on every
    ``/health``-like probe). A new one vLLM adds would be taken for a weight change and
    empty the host tier each time: this names it on the next upgrade."""
    from kvtier.connectors.scheduler.weights import READ_ONLY_RPCS, WEIGHT_CHANGING_RPCS

    names = engine_core_rpc_names(_vllm_root())
    assert {"get_model_inspection", "apply_model", "reload_weights"} <= names, names
    unknown = names - READ_ONLY_RPCS - WEIGHT_CHANGING_RPCS - FOLLOWED_AT_STARTUP
    assert not unknown, (
        f"classify these in kvtier/connectors/scheduler/weights.py: {sorted(unknown)}"
    )


def test_calls_with_no_step_between_them_are_one_change() -> None:
    """A trainer's sync sends one tensor per call (TRL's ``update_named_param``): one
    change (one new identity, one log line) until vLLM schedules a step; the next call
    after a step is a change of its own."""
    from kvtier.connectors.vllm import KVTierConnector

    told: list[str] = []
    conn = KVTierConnector.__new__(KVTierConnector)
    conn._scheduler = SimpleNamespace(  # type: ignore[assignment]
        weights_changed=told.append, build_connector_meta=lambda so: "meta"
    )
    conn._weights_change_open = False
    for name in ("embed", "norm", "lm_head"):
        conn._kvtier_weights_changed(f"update_named_param {name}")
    assert told == ["update_named_param embed"]
    assert conn.build_connector_meta(None) == "meta"  # type: ignore[arg-type]
    conn._kvtier_weights_changed("update_named_param embed")
    assert told == ["update_named_param embed"] * 2


# ---- weights written without a call: seen at reset_prefix_cache ----------------------------
def _worker(*tensors: Any) -> Any:
    import torch

    model = torch.nn.Module()
    for i, t in enumerate(tensors):
        model.register_parameter(f"p{i}", torch.nn.Parameter(t, requires_grad=False))
    return SimpleNamespace(get_model=lambda: model), model


def test_the_weights_digest_sees_every_rewritten_value() -> None:
    """Any one value, a swap of two, a value in a tensor read in several steps, bytes
    of every dtype: each changes the digest; the same weights give the same one."""
    import torch

    from kvtier.connectors.scheduler import weights as w

    torch.manual_seed(0)
    tensors = [
        torch.randn(64, 33).to(torch.bfloat16),
        torch.randn(7).to(torch.float32),
        torch.randint(0, 255, (5,), dtype=torch.uint8),
        torch.zeros(0),
    ]
    worker, model = _worker(*tensors)
    first = w.weights_digest(worker)
    assert w.weights_digest(worker) == first
    p0, p1, p2 = model.p0, model.p1, model.p2
    with torch.no_grad():
        value = p0.data[3, 5].clone()
        p0.data[3, 5] = value + 1
        changed = w.weights_digest(worker)
        assert changed != first
        p0.data[3, 5] = value
        assert w.weights_digest(worker) == first  # written back: the same weights
        row = p0.data[1].clone()
        p0.data[1] = p0.data[2]
        p0.data[2] = row  # two rows swapped: the plain sum alone would not see it
        assert w.weights_digest(worker) not in (first, changed)
        p0.data[2], p0.data[1] = p0.data[1].clone(), row
        assert w.weights_digest(worker) == first
        p1.data[6] = 0.5
        assert w.weights_digest(worker) != first
        p1.data.copy_(tensors[1])
        p2.data[4] ^= 1  # an odd number of bytes: read byte by byte
        assert w.weights_digest(worker) != first


def test_the_digest_sees_a_value_in_the_rows_and_in_the_tail(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from kvtier.connectors.scheduler import weights as w

    monkeypatch.setattr(w, "DIGEST_ROW", 7)  # 14 rows and a tail of 2 words
    worker, model = _worker(torch.arange(100, dtype=torch.int64))
    whole = w.weights_digest(worker)
    seen = {whole}
    with torch.no_grad():
        for i, j in ((0, 1), (0, 7), (3, 52), (97, 99), (50, 98)):  # swaps
            p = model.p0.data
            p[i], p[j] = p[j].clone(), p[i].clone()
            seen.add(w.weights_digest(worker))
            p[i], p[j] = p[j].clone(), p[i].clone()
        assert w.weights_digest(worker) == whole
        model.p0.data[99] += 1
        seen.add(w.weights_digest(worker))
    assert len(seen) == 7


def test_weights_written_with_no_call_are_seen_at_reset_prefix_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TRL's colocate mode writes an in-process engine's model directly, then resets
    vLLM's prefix cache (vLLM requires it after a weight change): the reset compares the
    digest taken at startup. A reset with unchanged weights keeps the tiers; after a
    followed call the next reset takes the digest again and tells nobody."""
    import torch

    from kvtier.connectors.scheduler import weights as w

    core, told = _engine_core(monkeypatch)
    worker, model = _worker(torch.ones(16))
    core.model_executor = SimpleNamespace(
        collective_rpc=lambda fn, *a, **k: [fn(worker)] if callable(fn) else [None]
    )
    core.scheduler = SimpleNamespace(connector=told, reset_prefix_cache=lambda *a, **k: True)

    assert w.engine_core_on_stack() is None
    assert _inside(core) is core  # as vLLM builds the connector in EngineCore.__init__
    assert w.watch_written_weights(_inside(core))
    assert core.reset_prefix_cache() is True and told.calls == []
    with torch.no_grad():
        model.p0.data[3] = 2.0
    assert core.reset_prefix_cache() is True
    assert told.calls == ["weights written without a call (seen at reset_prefix_cache)"]
    assert core.reset_prefix_cache() and len(told.calls) == 1  # that digest is the new one

    core.collective_rpc(weight_writer)  # followed: the next reset only takes the digest
    with torch.no_grad():
        model.p0.data[4] = 3.0
    assert core.reset_prefix_cache() and told.calls[1:] == ["collective_rpc(weight_writer)"]
    with torch.no_grad():
        model.p0.data[5] = 3.0
    core.model_executor.is_sleeping = True  # sleep mode: the weights are not read
    assert core.reset_prefix_cache() and len(told.calls) == 2
    core.model_executor.is_sleeping = False  # awake: compared with the digest before
    assert core.reset_prefix_cache() and len(told.calls) == 3


def _inside(self: Any) -> Any:
    """``engine_core_on_stack`` called below a frame whose ``self`` is the engine core."""
    from kvtier.connectors.scheduler import weights as w

    return w.engine_core_on_stack()


def test_an_engine_whose_digest_cannot_be_taken_is_not_watched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvtier.connectors.scheduler import weights as w

    def broken(fn, *a, **k):  # type: ignore[no-untyped-def]
        raise RuntimeError("no model here")

    core = SimpleNamespace(model_executor=SimpleNamespace(collective_rpc=broken))
    assert not w.watch_written_weights(core) and not w.watch_written_weights(None)
    assert not w.check_written_weights(core)
