"""The worker drives every mover through one protocol (``kvtier.ops.Mover``: submit,
poll, close): each copier (CpuCopier, CudaCopier's bookkeeping on a fake stream
interface, a hybrid model's GroupsCopier) and RemoteIO over a file tier.

Each real mover is wrapped in a guard that records the protocol's calls and lets
through only what is not a transfer (the copier's layer-wise hooks, RemoteIO's health
and counters); a worker that moved bytes any other way (``begin_loads``,
``submit_put``, ...) fails here.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from copyfakes import FakeOps, blocks_of, make_caches
from faketier import FakeTier
from kit import before_reads

from kvtier import metrics
from kvtier.config import load_config
from kvtier.connectors.metadata import KVTierMetadata
from kvtier.connectors.worker import side as worker_mod
from kvtier.host import copiers
from kvtier.host.cuda_copier import CudaCopier
from kvtier.host.layout import FULL, SLIDING, KVGroup
from kvtier.host.transfer import CpuCopier
from kvtier.keys import Namespace
from kvtier.objects.remote import RemoteIO
from kvtier.objects.tiers import FileTier
from kvtier.ops import DROPPED, FetchOp, LoadOp, OpKind, OpResult, Put, StoreOp
from kvtier.stats import series_id

#: what a worker may read of a mover besides the protocol: no bytes move through these
COPIER_HOOKS = {"layerwise", "wait_layer", "save_layer"}
REMOTE_STATE = {
    "reads_down_s",
    "stuck_reads",
    "stuck_writes",
    "seals",
    "take_compression",
    "tier",
    "flush",
}


class Guard:
    """A mover seen only through the protocol: records ``submit`` / ``poll`` / ``close``
    and fails on any other attribute but ``allowed``."""

    def __init__(self, inner: Any, allowed: set[str]) -> None:
        self.inner, self.allowed = inner, allowed
        self.calls: list[tuple[str, ...]] = []
        self.bypassed: list[str] = []

    def submit(self, ops: list[Any]) -> list[OpResult]:
        self.calls.append(("submit", *sorted({type(op).__name__ for op in ops})))
        return list(self.inner.submit(ops))

    def poll(self) -> list[OpResult]:
        self.calls.append(("poll",))
        return list(self.inner.poll())

    def close(self) -> None:
        self.calls.append(("close",))
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        if name in self.__dict__.get("allowed", ()):
            return getattr(self.inner, name)
        self.__dict__.setdefault("bypassed", []).append(name)
        raise AssertionError(f"the worker bypassed the Mover protocol: {name}")


NB, BS, BPC = 40, 4, 4
ONE_GROUP = (2, NB, BS, 4, 16)  # FlashAttention style: [2, num_blocks, block_size, H, D]
#: a hybrid model: full layers a, c and sliding-window layers b, d over the same tensors
GROUPS = (KVGroup(FULL, ("a", "c"), BPC), KVGroup(SLIDING, ("b", "d"), 2, 8))


def hybrid_caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t0 = torch.randn(NB, 2, BS, 8, generator=g).to(torch.bfloat16)
    t1 = torch.randn(NB, 2, BS, 8, generator=g).to(torch.bfloat16)
    return {"a": t0, "c": t1, "b": t0, "d": t1}


def cpu(kv, layout, slab):  # type: ignore[no-untyped-def]
    return CpuCopier(kv, layout, slab)


def cuda_fake(kv, layout, slab):  # type: ignore[no-untyped-def]
    return CudaCopier(kv, layout, slab, FakeOps())


def build(tmp_path, monkeypatch, which: str, remote_factory=None):  # type: ignore[no-untyped-def]
    """A worker whose copier is ``which`` behind a Guard, and RemoteIO over a file tier
    behind another (or ``remote_factory``'s mover)."""
    guards: dict[str, Guard] = {}
    real = {"cpu": cpu, "cuda-fake": cuda_fake, "groups": copiers.make_copier}[which]

    def copier(kv, layout, slab):  # type: ignore[no-untyped-def]
        guards["copier"] = Guard(real(kv, layout, slab), COPIER_HOOKS)
        return guards["copier"]

    def remote(cfg):  # type: ignore[no-untyped-def]
        inner = (
            remote_factory(cfg)
            if remote_factory is not None
            else RemoteIO(
                FileTier(str(tmp_path / "kv")), threads=2, queue_depth=8, timeout_s=5, signer=None
            )
        )
        guards["remote"] = Guard(inner, REMOTE_STATE)
        return guards["remote"]

    monkeypatch.setattr(worker_mod, "make_copier", copier)
    cfg = load_config(
        {"cpu_bytes": "64MiB", "chunk_size": BPC * BS, "remote_url": f"file://{tmp_path / 'kv'}"},
        environ={},
    )
    ns = Namespace("m", None, "bfloat16", "auto", BS, BPC * BS, 1)
    groups = GROUPS if which == "groups" else ()
    w = worker_mod.WorkerSide(cfg, ns, NB, remote, groups=groups)
    caches = hybrid_caches(0) if groups else make_caches(ONE_GROUP, layers=2)
    w.register_kv_caches(caches, rank=0)
    return w, caches, guards


def step(w, n: int, **ops: Any) -> dict[int, list[bool]]:  # type: ignore[no-untyped-def]
    """One step as vLLM runs it: bind, loads, each layer's wait and save, wait_for_save."""
    meta = KVTierMetadata(step=n, host_bytes=w.layout.slot_bytes * 4, **ops)
    w.begin_step(meta)
    w.start_load_kv(meta)
    for name in w._layer_index:
        w.wait_for_layer_load(name)
        w.save_kv_layer(name)
    w.wait_for_save(meta)
    return w.build_worker_meta().results


def settle(w, got: dict[int, list[bool]], want: set[int]) -> dict[int, list[bool]]:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 10
    while not want <= got.keys() and time.monotonic() < deadline:
        time.sleep(0.01)
        got.update(w.build_worker_meta().results)
    return got


@pytest.mark.parametrize("which", ["cpu", "cuda-fake", "groups"])
def test_the_worker_moves_every_chunk_through_the_protocol(tmp_path, monkeypatch, which) -> None:
    """Store (with its upload), fetch back into another slot, load into other blocks: the
    bytes arrive, and each mover saw submit / poll / close and nothing else."""
    w, caches, guards = build(tmp_path, monkeypatch, which)
    more_store: Any = ([10, 11],) if which == "groups" else ()
    more_load: Any = ((1, [30]),) if which == "groups" else ()
    got = step(
        w, 1, stores=[StoreOp(1, 0, [5, 6, 7, 8], b"h" * 32, upload_op_id=2, more=more_store)]
    )
    assert settle(w, got, {1, 2}) == {1: [True], 2: [True]}
    got = settle(w, step(w, 2, fetches=[[FetchOp(3, 1, b"h" * 32)]]), {3})
    assert got == {3: [True]}
    assert bytes(w.slab.slot_memoryview(1)) == bytes(w.slab.slot_memoryview(0))
    assert step(w, 3, loads=[LoadOp(4, 1, 0, [20, 21, 22, 23], more=more_load)]) == {4: [True]}
    full = ["a", "c"] if which == "groups" else list(caches)
    for name in full:
        assert torch.equal(
            blocks_of(caches[name], [20, 21, 22, 23], NB), blocks_of(caches[name], [5, 6, 7, 8], NB)
        )
    if which == "groups":  # the sliding group's last stored block (11) -> 30
        for name in ("b", "d"):
            assert torch.equal(blocks_of(caches[name], [30], NB), blocks_of(caches[name], [11], NB))
    w.shutdown()

    copier, remote = guards["copier"], guards["remote"]
    kind = {"cpu": CpuCopier, "cuda-fake": CudaCopier, "groups": copiers.GroupsCopier}[which]
    assert type(copier.inner) is kind and type(remote.inner) is RemoteIO
    assert copier.bypassed == [] and remote.bypassed == []
    assert ("submit", "StoreOp") in copier.calls and ("submit", "LoadOp") in copier.calls
    assert copier.calls.count(("poll",)) == 3 and copier.calls[-1] == ("close",)
    assert ("submit", "Put") in remote.calls and ("submit", "GetRun") in remote.calls
    assert ("poll",) in remote.calls and remote.calls[-1] == ("close",)


@pytest.mark.parametrize("local", [True, False])
def test_a_local_directorys_run_is_read_in_its_own_step(tmp_path, monkeypatch, local) -> None:
    """On a local filesystem the worker reads a lookup's chunks while binding the step
    that carries it, so that step reports them; elsewhere (NFS, FUSE) the read threads
    do, and no read is made on the engine's thread."""
    monkeypatch.setattr("kvtier.objects.tiers.file.is_local", lambda path: local)
    w, _, guards = build(tmp_path, monkeypatch, "cpu")
    assert w.inline_read_s == (0.02 if local else 0.0)
    if local:  # the budget is wall-clock: a loaded CI machine may spend 20 ms elsewhere
        w.inline_read_s = 30.0
    got = settle(
        w, step(w, 1, stores=[StoreOp(1, 0, [5, 6, 7, 8], b"h" * 32, upload_op_id=2)]), {1, 2}
    )
    assert got == {1: [True], 2: [True]}
    readers: list[str] = []
    before_reads(
        monkeypatch, FileTier, lambda _key: readers.append(threading.current_thread().name)
    )
    got = step(w, 2, fetches=[[FetchOp(3, 1, b"h" * 32), FetchOp(4, 2, b"x" * 32)]])
    if local:
        assert got == {3: [True], 4: [False]}, "the step that carried the run reported it"
        # the hit on the engine's thread; the miss behind it there or on an I/O thread
        # (the run's rest is queued once a stat found the hit, and the two share it)
        assert readers[0] == threading.current_thread().name and len(readers) == 2, readers
    else:
        assert settle(w, got, {3, 4}) == {3: [True], 4: [False]}
        assert readers and all(r.startswith("kvtier-read") for r in readers), readers
    assert bytes(w.slab.slot_memoryview(1)) == bytes(w.slab.slot_memoryview(0))
    w.shutdown()
    assert guards["remote"].bypassed == []


class DroppingMover:
    """An object-tier mover whose write queue is always full."""

    reads_down_s = 0.0
    stuck_reads = stuck_writes = seals = 0
    tier = FakeTier()  # an in-memory tier: its reads are not local

    def submit(self, ops: list[Any]) -> list[OpResult]:
        return [
            OpResult(op.op_id, OpKind.UPLOAD, False, error_kind=DROPPED)
            for op in ops
            if isinstance(op, Put)
        ]

    def poll(self) -> list[OpResult]:
        return []

    def take_compression(self) -> dict[str, tuple[int, int, float]]:
        return {}

    def flush(self, timeout_s: float) -> int:
        return 0

    def close(self) -> None:
        pass


def test_an_upload_refused_at_submit_is_a_drop_not_an_error(tmp_path, monkeypatch) -> None:
    """A Put the mover answers DROPPED at submit (backpressure) fails its op, counts in
    kvtier:writes_dropped and in no error kind; the store itself succeeds."""
    w, _caches, guards = build(tmp_path, monkeypatch, "cpu", lambda cfg: DroppingMover())
    meta = KVTierMetadata(
        step=1,
        host_bytes=w.layout.slot_bytes * 4,
        stores=[StoreOp(1, 0, [5, 6, 7, 8], b"h" * 32, upload_op_id=2)],
    )
    w.begin_step(meta)
    w.start_load_kv(meta)
    w.wait_for_save(meta)
    out = w.build_worker_meta()
    assert out.results == {1: [True], 2: [False]} and out.errors == {}
    counters = w.get_stats()["counters"]
    assert counters.get(series_id(metrics.WRITES_DROPPED)) == 1, counters
    assert not [sid for sid in counters if sid.startswith(metrics.ERRORS.name)], counters
    assert guards["remote"].calls[0] == ("submit", "Put")


def test_the_guard_fails_a_worker_that_bypasses_the_protocol(tmp_path, monkeypatch) -> None:
    """What the guard is for: the movers' own calls (the ones the worker made before it
    had one protocol) are refused and recorded."""
    w, _caches, guards = build(tmp_path, monkeypatch, "cpu")
    w.begin_step(KVTierMetadata(step=1, host_bytes=w.layout.slot_bytes * 4))
    for guard, name in (
        (guards["copier"], "begin_loads"),
        (guards["copier"], "finish_saves"),
        (guards["remote"], "submit_put"),
        (guards["remote"], "submit_get_run"),
    ):
        with pytest.raises(AssertionError, match="bypassed the Mover protocol"):
            getattr(guard, name)
    assert guards["copier"].bypassed == ["begin_loads", "finish_saves"]
    w.shutdown()


def test_io_threads_auto_is_resolved_by_the_worker_for_its_share_of_the_cpus(
    tmp_path, monkeypatch
) -> None:
    """The worker opens its RemoteIO with a number of threads, never "auto": its CPUs (as
    vLLM bound them by register_kv_caches) over the engine's workers on the host."""
    import kvtier.config.settings as config_mod

    monkeypatch.setattr(config_mod, "usable_cpus", lambda: 64)
    opened: list[object] = []

    def remote(cfg):  # type: ignore[no-untyped-def]
        opened.append(cfg.io_threads)
        return RemoteIO.from_config(cfg)

    cfg = load_config(
        {"cpu_bytes": "64MiB", "chunk_size": BPC * BS, "remote_url": f"file://{tmp_path / 'kv'}"},
        environ={},
    )
    ns = Namespace("m", None, "bfloat16", "auto", BS, BPC * BS, 1)
    w = worker_mod.WorkerSide(cfg, ns, NB, remote, workers_on_node=8)
    try:
        w.register_kv_caches(make_caches(ONE_GROUP, layers=2), rank=0)
        assert opened == [8]
        assert w.remote is not None and len(w.remote.queue._threads) == 8
    finally:
        w.shutdown()
