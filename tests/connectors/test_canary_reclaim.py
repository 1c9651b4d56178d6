"""A generation must not stay locked for good: when its manifest is there but no engine
that trusts it is alive and it holds no chunk (its writer died after claiming, or every
chunk expired or was deleted), a checking engine has nothing to check against, ever. One
checking engine claims it afresh; never while an engine that trusts it is alive, never
while it holds a chunk someone's KV could be compared with (the canary's guarantee).

Real scheduler and worker sides wired step by step over a real directory tier (fakes only
for vLLM's objects and KV caches); the race over a directory, a moto S3 server and a
redis-server."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier import canary
from kvtier.canary import Trust
from kvtier.config import load_config
from kvtier.connectors.scheduler import SchedulerSide
from kvtier.connectors.worker import WorkerSide
from kvtier.keys import Namespace
from kvtier.objects import manifest, store_admin
from kvtier.objects.tiers import FileTier
from tests.connectors.test_canary_claim import _tier
from tests.connectors.test_scheduler_side import BS, CHUNK, make_side, request, schedule_new

pytestmark = pytest.mark.integration

NUM_BLOCKS = 40


@pytest.fixture(autouse=True)
def canary_first_hit_off() -> None:
    """Overrides conftest's: these tests run with the canary's defaults (first hit on)."""


def _namespace() -> Namespace:
    """The namespace make_side's scheduler uses (the worker adds its layers' digest)."""
    return Namespace(model="m", revision=None, dtype="bfloat16", kv_cache_dtype="auto",
                     block_size=BS, chunk_size=CHUNK, tp_size=1)  # fmt: skip


def _worker(root: str, seed: int = 10) -> WorkerSide:
    """Rank 0 of an engine over the directory tier ``root``: 2 layers of 4 KiB per block
    (the slot make_side's scheduler plans), KV of ``seed``."""
    from copyfakes import make_caches

    from kvtier.objects.remote import RemoteIO

    cfg = load_config({"cpu_bytes": "4MiB", "chunk_size": CHUNK, "remote_url": f"file://{root}",
                       "write_policy": "write_through"}, environ={})  # fmt: skip

    def remote(c):  # type: ignore[no-untyped-def]
        return RemoteIO(FileTier(root), threads=1, queue_depth=8, timeout_s=5, signer=None)

    w = WorkerSide(cfg, _namespace(), NUM_BLOCKS, remote)
    w.register_kv_caches(make_caches((2, NUM_BLOCKS, BS, 2, 16), layers=2, seed=seed), rank=0)
    return w


class Engine:
    """One engine: its scheduler side and its rank-0 worker, stepped as vLLM steps them."""

    def __init__(self, root: str, seed: int = 10) -> None:
        self.worker = _worker(root, seed)
        self.side: SchedulerSide = make_side("4MiB", {"remote_url": f"file://{root}",
                                                      "write_policy": "write_through"})
        self.gen = self.worker.namespace.generation()
        self._n = 0
        self.settle()  # the workers' first report: whether the claim won (as the handshake)

    def prompt(self, prefix: int) -> tuple[int, Any]:
        """A new prompt of two full chunks computed in one step: its object-tier lookup
        (the tokens kvtier would load), and the step's metadata once the workers' report
        is in."""
        self._n += 1
        req = request(f"r{self._n}", prefix, 2 * CHUNK + 10)
        hit, _ = self.side.get_num_new_matched_tokens(req, 0)
        self.side.update_state_after_alloc(req, SimpleNamespace(), 0)
        meta = schedule_new(self.side, req, 0, 2 * CHUNK + 10, first_block=0)
        self.worker.start_load_kv(meta)
        self.worker.wait_for_save(meta)
        self.settle()
        return hit, meta

    def settle(self) -> None:
        """Hand the workers' reports to the scheduler until nothing it waits for is out."""
        deadline = time.monotonic() + 10
        while True:
            out = self.worker.build_worker_meta()
            self.side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=out))
            if self.side.pending_ops() == 0 or time.monotonic() > deadline:
                return
            time.sleep(0.01)

    def reclaim_done(self) -> None:
        """Wait for rank 0's re-claim in flight (a listing), then report."""
        thread = getattr(self.worker, "_reclaim", None)
        if thread is not None:
            thread.join(10)
        self.settle()

    def close(self) -> None:
        self.worker.shutdown()


@pytest.fixture
def root(tmp_path) -> str:  # type: ignore[no-untyped-def]
    return str(tmp_path / "kv")


@pytest.fixture
def engines(root: str) -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(seed: int = 10) -> Engine:
        made.append(Engine(root, seed))
        return made[-1]

    yield make
    for e in made:
        e.close()


def _age_manifest(root: str, gen: str, by_s: float) -> manifest.Manifest:
    """The engine that wrote ``gen``'s manifest last refreshed it ``by_s`` ago (it died)."""
    with FileTier(root) as tier:
        m = manifest.read_manifest(tier, gen, None)
        assert m is not None
        old = dataclasses.replace(m, last_seen=time.time() - by_s, host="dead-host")
        manifest.write_manifest(tier, old, None)
        return old


def _writer_died_after_claiming(root: str, engines: Callable[..., Engine]) -> str:
    """An engine claimed the generation, stored no chunk, and stopped long ago."""
    first = engines()
    assert first.worker.fresh_generation is True
    gen = first.gen
    first.close()
    _age_manifest(root, gen, 2 * manifest.STALE_S)
    return gen


def _chunks(root: str, gen: str) -> int:
    with FileTier(root) as tier:
        return sum(1 for o in store_admin.lister_for(tier).objects()
                   if store_admin.parse_object_key(o.key) == (gen, False))  # fmt: skip


def test_a_generation_whose_writer_died_before_storing_is_claimed_afresh(
    root: str, engines: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    """The defect: a manifest and no chunk. Before, the new engine's checks all found the
    chunk absent and it stayed checking for as long as it ran, storing nothing and never
    getting a hit, silently. Now it says what it waits for, claims the generation after
    RECLAIM_AFTER absent chunks, stores, and gets hits from its own traffic."""
    gen = _writer_died_after_claiming(root, engines)
    caplog.set_level(logging.INFO, logger="kvtier")
    b = engines()
    assert b.worker.fresh_generation is False and b.gen == gen
    for p in range(1, canary.RECLAIM_AFTER):
        hit, meta = b.prompt(p)
        assert hit == 0 and meta.uploads == [] and not any(s.upload_op_id for s in meta.stores)
        assert b.side.canary.trust.state is Trust.CHECKING
    b.prompt(canary.RECLAIM_AFTER)
    b.reclaim_done()
    assert b.side.canary.trust.state is Trust.TRUSTED, "not locked for good"
    waiting = [r for r in caplog.records if "waits for a prompt whose chunk" in r.getMessage()]
    assert len(waiting) == 1 and gen in waiting[0].getMessage(), "never silent, said once"
    assert b.side.totals["canary_checks_absent"] == canary.RECLAIM_AFTER
    assert any("claimed afresh" in r.getMessage() for r in caplog.records)
    with FileTier(root) as tier:
        m = manifest.read_manifest(tier, gen, None)
        assert m is not None and m.host != "dead-host" and time.time() - m.last_seen < 60
    # it stores into the generation now, and its own traffic hits
    _, meta = b.prompt(50)
    assert [s.upload_op_id is not None for s in meta.stores] == [True, True]
    assert _chunks(root, gen) == 2
    c = engines()  # a later engine of the same weights: checks B's chunk and trusts it
    assert c.worker.fresh_generation is False
    c.prompt(50)
    assert c.side.canary.trust.state is Trust.TRUSTED
    assert c.side.totals["canary_checks_match"] == 1


def test_never_while_an_engine_that_trusts_the_generation_is_alive(
    root: str, engines: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    """The first writer is alive but has stored nothing yet (idle): its manifest is fresh.
    An engine checking it (perhaps other weights under the same name) finds every chunk
    absent and must not claim the generation: the first writer would then load its KV."""
    first = engines()
    assert first.worker.fresh_generation is True
    caplog.set_level(logging.INFO, logger="kvtier")
    wrong = engines(seed=11)
    wrong.worker.reclaim_every_s = 0.0  # try at every absent chunk
    for p in range(1, 2 * canary.RECLAIM_AFTER + 1):
        hit, meta = wrong.prompt(p)
        wrong.reclaim_done()
        assert hit == 0 and not any(s.upload_op_id for s in meta.stores)
    assert wrong.side.canary.trust.state is Trust.CHECKING
    assert _chunks(root, first.gen) == 0, "it stored nothing there"
    said = [r.getMessage() for r in caplog.records if "not claimed afresh" in r.getMessage()]
    assert said and "refreshed its manifest" in said[0], said


def test_never_while_the_generation_holds_a_chunk(
    root: str, engines: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    """Its writers are gone but one of their chunks is stored: a later engine with their
    weights could check against it. An engine whose prompts never meet that chunk keeps
    checking (and says why, and that gc removes it), and its lookups stay 0: it never
    loads KV it has not checked."""
    first = engines()
    first.prompt(99)  # stores two chunks
    gen = first.gen
    first.close()
    assert _chunks(root, gen) == 2
    _age_manifest(root, gen, 2 * manifest.STALE_S)
    caplog.set_level(logging.INFO, logger="kvtier")
    b = engines(seed=11)
    b.worker.reclaim_every_s = 0.0
    for p in range(1, 2 * canary.RECLAIM_AFTER + 1):
        hit, _ = b.prompt(p)
        b.reclaim_done()
        assert hit == 0
    assert b.side.canary.trust.state is Trust.CHECKING
    said = [r.getMessage() for r in caplog.records if "not claimed afresh" in r.getMessage()]
    assert said and "holds chunks" in said[0] and "kvtier store gc" in said[0], said
    req = request("stored", 99, 2 * CHUNK + 10)
    assert b.side.get_num_new_matched_tokens(req, 0) == (0, False), "unchecked: not loaded"
    # once gc removed the dead generation's chunks, the next absent run claims it
    with FileTier(root) as tier:
        store_admin.gc(tier, None, dead_after_s=manifest.STALE_S)
    assert _chunks(root, gen) == 0
    for p in range(10, 10 + canary.RECLAIM_AFTER):
        b.prompt(p)
        b.reclaim_done()
    assert b.side.canary.trust.state is Trust.TRUSTED


def test_a_checking_engine_does_not_keep_the_generation_alive(
    root: str, engines: Callable[..., Engine]
) -> None:
    """Only an engine that trusts the generation refreshes its manifest: engines that only
    check it leave it looking dead to ``kvtier store gc`` and to a re-claim."""
    gen = _writer_died_after_claiming(root, engines)
    with FileTier(root) as tier:
        before = manifest.read_manifest(tier, gen, None)
    b = engines()
    assert b.worker.manifests is not None
    assert b.worker.manifests.refresh() is None, "checking: nothing written"
    b.prompt(1)
    b.close()  # its shutdown's last refresh too
    with FileTier(root) as tier:
        assert manifest.read_manifest(tier, gen, None) == before
        plan = store_admin.plan_gc(store_admin.usage(tier, None),
                                   dead_after_s=manifest.STALE_S, max_bytes=None)  # fmt: skip
        assert [d.generation.id for d in plan.deleted] == [gen]


def test_engines_reclaiming_at_once_give_one_writer(url: str) -> None:
    """Eight checking engines judge the same stale, empty generation at once: exactly one
    re-claims it (its token is created only if absent); its manifest is the winner's, and
    ``kvtier store`` counts the token as the generation's bookkeeping, not a chunk."""
    ns = dataclasses.replace(_namespace(), fingerprint="build-7")
    gen = ns.generation()
    tiers = [_tier(url) for _ in range(8)]
    try:
        assert manifest.claim_generation(tiers[0], ns, None, now=time.time() - 3600)
        got: list[Any] = [None] * 8
        gate = threading.Barrier(8)

        def run(i: int) -> None:
            gate.wait(10)
            got[i] = manifest.reclaim_generation(
                tiers[i], ns, None, lambda i=i: store_admin.holds_chunks(tiers[i], gen))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [g.won for g in got].count(True) == 1, got
        lost = [g.reason for g in got if not g.won]
        assert all("another engine re-claimed it first" in r or "refreshed its manifest" in r
                   for r in lost), lost  # fmt: skip
        m = manifest.read_manifest(tiers[0], gen, None)
        assert m is not None and time.time() - m.last_seen < 60
        # the token is bookkeeping: not a chunk, listed with its generation, gc'd with it
        assert store_admin.holds_chunks(tiers[0], gen) is False
        [g] = [g for g in store_admin.usage(tiers[0], None).generations if g.id == gen]
        assert len(g.manifests) == 2 and g.chunks == [] and g.manifest is not None
        # a fresh manifest is not re-claimed again
        again = manifest.reclaim_generation(tiers[1], ns, None, lambda: False)
        assert not again.won and "refreshed its manifest" in again.reason
        store_admin.gc(tiers[0], None, dead_after_s=0.0, max_bytes=None)
        assert [g for g in store_admin.usage(tiers[0], None).generations if g.id == gen] == []
    finally:
        for t in tiers:
            t.close()


def test_holds_chunks_lists_one_generation_and_counts_only_chunks(url: str) -> None:
    """What a re-claim asks each backend: another generation's chunks, the manifest and a
    token are not this generation's chunks; one chunk is. A generation whose manifest is
    gone (deleted, evicted) but holds a chunk is not claimed: the chunk is someone's KV."""
    ns = dataclasses.replace(_namespace(), fingerprint="build-9")
    gen = ns.generation()
    other = dataclasses.replace(ns, fingerprint="other").generation()
    with _tier(url) as tier:
        assert manifest.claim_generation(tier, ns, None, now=time.time() - 3600)
        tier.put(f"gen-{other}/{'a' * 40}", [b"kv of another generation"])
        tier.put(f"gen-{gen}/{manifest.RECLAIM}{'0' * 16}", [b""])
        assert store_admin.holds_chunks(tier, gen) is False
        tier.put(f"gen-{gen}/{'b' * 40}", [b"kv"])
        assert store_admin.holds_chunks(tier, gen) is True
        holds = lambda: store_admin.holds_chunks(tier, gen)  # noqa: E731
        got = manifest.reclaim_generation(tier, ns, None, holds)
        assert not got.won and "holds chunks" in got.reason
        tier.delete([manifest.manifest_key(gen)])
        got = manifest.reclaim_generation(tier, ns, None, holds)
        assert not got.won and "gone but it holds chunks" in got.reason
        assert manifest.read_manifest(tier, gen, None) is None, "nothing claimed"
        tier.delete([f"gen-{gen}/{'b' * 40}"])
        assert manifest.reclaim_generation(tier, ns, None, holds).won


def test_a_late_fresh_answer_trusts_only_a_checking_generation() -> None:
    """A re-claim's win moves CHECKING to TRUSTED; it never undoes a refusal (a mismatch is
    for good), and the startup answer still decides UNKNOWN."""
    from kvtier.canary import MISMATCH, GenerationTrust

    t = GenerationTrust()
    assert t.first_writer(False) is Trust.CHECKING
    assert t.first_writer(False) is Trust.CHECKING
    assert t.first_writer(True) is Trust.TRUSTED
    refused = GenerationTrust()
    refused.first_writer(False)
    assert refused.checked(MISMATCH) is Trust.REFUSED
    assert refused.first_writer(True) is Trust.REFUSED


def test_a_win_for_a_generation_the_engine_left_is_not_reported(
    root: str, engines: Callable[..., Engine]
) -> None:
    """The worker reports a re-claim's win only for the generation its keys name now: after
    a fork or a weight change meanwhile, the old generation's win is dropped."""
    b = engines()
    b.worker._reclaimed.append("0" * 16)
    assert b.worker.build_worker_meta().fresh_generation is None
    b.worker._reclaimed.append(b.worker.namespace.generation())
    assert b.worker.build_worker_meta().fresh_generation is True


def test_an_engine_whose_startup_claim_failed_claims_the_empty_generation_later(
    root: str, engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same lock from another side: the tier failed the startup claim, so the engine
    checks a generation nobody wrote (no manifest, no chunk). Before, it checked for good
    (and wrote the manifest that kept it so); now its absent checks claim it."""
    from kvtier.errors import TierUnavailable

    real = FileTier.create_if_absent
    fails = [1]

    def flaky(self: FileTier, key: str, parts: Any) -> bool:
        if fails:
            fails.pop()
            raise TierUnavailable("file tier create: down")
        return real(self, key, parts)

    monkeypatch.setattr(FileTier, "create_if_absent", flaky)
    b = engines()
    assert b.worker.fresh_generation is False
    with FileTier(root) as tier:
        assert manifest.read_manifest(tier, b.gen, None) is None, "a checking engine writes none"
    for p in range(1, canary.RECLAIM_AFTER + 1):
        b.prompt(p)
    b.reclaim_done()
    assert b.side.canary.trust.state is Trust.TRUSTED
    with FileTier(root) as tier:
        assert manifest.read_manifest(tier, b.gen, None) is not None
