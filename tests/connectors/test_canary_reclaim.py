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
from kvtier.connectors.scheduler.side import SchedulerSide
from kvtier.connectors.worker.side import WorkerSide
from kvtier.keys import Namespace
from kvtier.objects import manifest, store_admin
from kvtier.objects.tiers import FileTier
from tests.connectors.scheduler.test_scheduler_side import (
    BS,
    CHUNK,
    make_side,
    request,
    schedule_new,
)
from tests.connectors.worker.test_canary_claim import _tier

pytestmark = pytest.mark.integration

NUM_BLOCKS = 40


@pytest.fixture(autouse=True)
def canary_first_hit_off() -> None:
    """Overrides conftest's: these tests run with the canary's defaults (first hit on)."""


def _namespace() -> Namespace:
    """The namespace make_side's scheduler uses (the worker adds its layers' digest)."""
    return Namespace(
        model="m",
        revision=None,
        dtype="bfloat16",
        kv_cache_dtype="auto",
        block_size=BS,
        chunk_size=CHUNK,
        tp_size=1,
    )


def _worker(root: str, seed: int = 10) -> WorkerSide:
    """Rank 0 of an engine over the directory tier ``root``: 2 layers of 4 KiB per block
    (the slot make_side's scheduler plans), KV of ``seed``."""
    from copyfakes import make_caches

    from kvtier.objects.remote import RemoteIO

    cfg = load_config(
        {
            "cpu_bytes": "4MiB",
            "chunk_size": CHUNK,
            "remote_url": f"file://{root}",
            "write_policy": "write_through",
        },
        environ={},
    )

    def remote(c):  # type: ignore[no-untyped-def]
        return RemoteIO(FileTier(root), threads=1, queue_depth=8, timeout_s=5, signer=None)

    w = WorkerSide(cfg, _namespace(), NUM_BLOCKS, remote)
    w.register_kv_caches(make_caches((2, NUM_BLOCKS, BS, 2, 16), layers=2, seed=seed), rank=0)
    return w


class Engine:
    """One engine: its scheduler side and its rank-0 worker, stepped as vLLM steps them.
    Its check budget is one prompt's two chunks (``canary_check_tokens``), as the e2e
    scenarios' prompts of four chunks meet the default's."""

    def __init__(self, root: str, seed: int = 10) -> None:
        self.worker = _worker(root, seed)
        self.side: SchedulerSide = make_side(
            "4MiB",
            {
                "remote_url": f"file://{root}",
                "write_policy": "write_through",
                "canary_check_tokens": 2 * CHUNK,
            },
        )
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
        return sum(
            1 for o in tier.list_objects() if store_admin.parse_object_key(o.key) == (gen, False)
        )


def _race(n: int, call: Callable[[int], Any]) -> list[Any]:
    """``call(i)`` on ``n`` threads released at once (engines re-claiming together): each
    one's answer, in thread order."""
    got: list[Any] = [None] * n
    gate = threading.Barrier(n)

    def run(i: int) -> None:
        gate.wait(10)
        got[i] = call(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


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
        assert len(meta.checks) == 2, "both chunks of the prompt checked"
        assert b.side.canary.trust.state is Trust.CHECKING
    # absent chunks count per request: 4 chunks absent, 2 requests, no re-claim tried yet
    assert b.side.totals["canary_checks_absent"] == 2 * (canary.RECLAIM_AFTER - 1)
    assert b.worker.absent_streak == canary.RECLAIM_AFTER - 1 and b.worker._reclaim is None
    b.prompt(canary.RECLAIM_AFTER)
    b.reclaim_done()
    assert b.side.canary.trust.state is Trust.TRUSTED, "not locked for good"
    waiting = [r for r in caplog.records if "waits for a prompt whose chunk" in r.getMessage()]
    assert len(waiting) == 1 and gen in waiting[0].getMessage(), "never silent, said once"
    assert b.side.totals["canary_checks_absent"] == 2 * canary.RECLAIM_AFTER
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
    assert c.side.totals["canary_checks_match"] == 2, "the budget: both of B's chunks"


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
    # its manifest went with them: claimed once seen missing for STALE_S (passed here)
    assert b.side.canary.trust.state is Trust.CHECKING
    with FileTier(root) as tier:
        assert manifest.missing_since(tier, gen, None) is not None
        key = manifest.liveness_key(gen)
        tier.put(
            key, [manifest.record(key, time.time() - manifest.STALE_S - 1, None, missing=True)]
        )
    b.prompt(20)
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
        plan = store_admin.plan_gc(
            store_admin.usage(tier, None), dead_after_s=manifest.STALE_S, max_bytes=None
        )
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
        got = _race(
            8,
            lambda i: manifest.reclaim_generation(
                tiers[i], ns, None, lambda: store_admin.holds_chunks(tiers[i], gen)
            ),
        )
        assert [g.won for g in got].count(True) == 1, got
        lost = [g.reason for g in got if not g.won]
        assert all(
            "another engine re-claimed it first" in r or "refreshed its manifest" in r for r in lost
        ), lost
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
        got = manifest.reclaim_generation(tier, ns, None, holds)
        assert not got.won and "missing" in got.reason, "missing is not stale at once"
        later = time.time() + manifest.STALE_S + 1
        assert manifest.reclaim_generation(tier, ns, None, holds, now=later).won


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
    (and wrote the manifest that kept it so); now its absent checks claim it, once its
    manifest was seen missing for STALE_S."""
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
    b.worker.reclaim_every_s = 0.0
    for p in range(1, canary.RECLAIM_AFTER + 1):
        b.prompt(p)
    b.reclaim_done()
    # it cannot tell a manifest never written from one lost: claimed once seen missing
    # for STALE_S (here that time has passed)
    assert b.side.canary.trust.state is Trust.CHECKING
    with FileTier(root) as tier:
        assert manifest.missing_since(tier, b.gen, None) is not None
        key = manifest.liveness_key(b.gen)
        tier.put(
            key, [manifest.record(key, time.time() - manifest.STALE_S - 1, None, missing=True)]
        )
    b.prompt(canary.RECLAIM_AFTER + 1)
    b.reclaim_done()
    assert b.side.canary.trust.state is Trust.TRUSTED
    with FileTier(root) as tier:
        assert manifest.read_manifest(tier, b.gen, None) is not None


# -- a missing manifest is not a free claim ------------------------------------------------


def test_a_live_writers_missing_manifest_is_not_claimed(
    root: str, engines: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    """The defect: engine A (the first writer, alive, its manifest refreshed a moment ago,
    no chunk stored yet) loses its manifest (deleted from the directory). Engine B, other
    weights under the same name, checking, found the generation empty and claimed it at
    once: both trusted, B's KV stored where A loads. Now the missing manifest counts as
    stale only once seen missing for STALE_S, and A writes it again within seconds."""
    a = engines()
    assert a.worker.fresh_generation is True and a.worker.manifests is not None
    b = engines(seed=11)
    assert b.worker.fresh_generation is False
    b.worker.reclaim_every_s = 0.0  # try at every absent chunk
    a.worker.manifests.check_s = 1e9  # A reads its manifest back below, by hand
    with FileTier(root) as tier:
        tier.delete([manifest.manifest_key(a.gen)])
        assert manifest.read_manifest(tier, a.gen, None) is None
    caplog.set_level(logging.INFO, logger="kvtier")
    for p in range(1, 2 * canary.RECLAIM_AFTER + 1):
        hit, meta = b.prompt(p)
        b.reclaim_done()
        assert hit == 0 and not any(s.upload_op_id for s in meta.stores)
        assert b.side.canary.trust.state is Trust.CHECKING, "a lost manifest claimed at once"
    said = [r.getMessage() for r in caplog.records if "not claimed afresh" in r.getMessage()]
    assert said and "missing" in said[0], said
    assert _chunks(root, a.gen) == 0, "B stored nothing there"
    # A's writer finds its manifest missing and writes it again at once
    assert a.worker.manifests.check() is True
    with FileTier(root) as tier:
        m = manifest.read_manifest(tier, a.gen, None)
        assert m is not None and time.time() - m.last_seen < 60
        assert manifest.missing_since(tier, a.gen, None) is None, "A's refresh ended B's clock"
    # an engine starting while the manifest is seen missing is not a first writer either
    with FileTier(root) as tier:
        tier.delete([manifest.manifest_key(a.gen)])
        got = manifest.reclaim_generation(tier, b.worker.namespace, None, lambda: False)
        assert not got.won and "missing" in got.reason
    c = engines(seed=12)
    assert c.worker.fresh_generation is False


def test_a_missing_manifest_is_stale_only_when_seen_missing_for_the_stale_time(
    url: str,
) -> None:
    """The rule, on every backend: a generation whose manifest is missing and that holds
    no chunk is claimed only once seen missing, continuously, for STALE_S: the first
    check records since when (in the tier: a restart of the checking engine keeps it),
    every live writer's refresh overwrites that record (so a manifest lost, written again
    and lost again starts the clock again), and the claim itself is created only if
    absent (one winner)."""
    from kvtier.objects.manifest import STALE_S, ManifestWriter, missing_since

    ns = dataclasses.replace(_namespace(), fingerprint="build-11")
    gen = ns.generation()
    t0 = time.time()
    now = [t0]
    with _tier(url) as tier:
        assert manifest.claim_generation(tier, ns, None, now=t0)
        # A, alive: refreshed by hand here, on the test's clock
        writer = ManifestWriter(tier, None, lambda: ns, clock=lambda: now[0])

        def lost() -> None:
            tier.delete([manifest.manifest_key(gen)])

        def reclaim(at: float, holds: bool = False) -> manifest.Reclaim:
            now[0] = at
            return manifest.reclaim_generation(tier, ns, None, lambda: holds, now=at)

        lost()
        got = reclaim(t0 + 1)
        assert not got.won and "missing" in got.reason, got
        assert missing_since(tier, gen, None) == t0 + 1
        assert not reclaim(t0 + STALE_S - 1).won
        assert not reclaim(t0 + 2 * STALE_S, holds=True).won, "holds a chunk"
        # the chunk went (gc): the clock started again when it was seen
        assert not reclaim(t0 + 2 * STALE_S + 1).won
        # A is alive: its refresh writes the manifest and ends the count of its absence
        assert writer.refresh() is not None
        assert missing_since(tier, gen, None) is None
        assert not reclaim(t0 + 2 * STALE_S + 2).won, "fresh manifest"
        lost()  # lost again: the time it was missing before does not count
        assert not reclaim(t0 + 3 * STALE_S).won
        assert not reclaim(t0 + 4 * STALE_S - 1).won
        # an engine starting meanwhile does not take the missing manifest for a new one
        assert manifest.claim_generation(tier, ns, None, now=t0 + 4 * STALE_S) is False
        # missing, and the generation empty, for STALE_S: no writer is alive
        got = reclaim(t0 + 4 * STALE_S + 1)
        assert got.won, got
        m = manifest.read_manifest(tier, gen, None)
        assert m is not None and m.last_seen == t0 + 4 * STALE_S + 1
        assert not reclaim(t0 + 4 * STALE_S + 2).won, "claimed once"


def test_an_engine_starting_on_a_generation_whose_manifest_is_gone_but_chunks_stay(
    root: str, engines: Callable[..., Engine]
) -> None:
    """The same rule at startup: the manifest is gone (deleted, evicted) but a chunk is
    stored: someone's KV, so the engine starting now checks its first hit instead of
    trusting itself as the generation's first writer (and loading that chunk unchecked)."""
    first = engines()
    first.prompt(99)
    gen = first.gen
    first.close()
    with FileTier(root) as tier:
        tier.delete([manifest.manifest_key(gen)])
    b = engines(seed=11)
    assert b.worker.fresh_generation is False
    req = request("stored", 99, 2 * CHUNK + 10)
    assert b.side.get_num_new_matched_tokens(req, 0) == (0, False), "unchecked: not loaded"


def test_an_evicted_manifest_under_allkeys_lru_is_not_a_free_claim(services: Any) -> None:
    """The Helm chart's Redis evicts any key, least recently used first (maxmemory-policy
    allkeys-lru). A first writer's manifest evicted by other keys' traffic is no claim for
    a checking engine; the writer reads its manifest back every few seconds (a GET: the
    key's LRU clock is touched, so it is never the least recently used while it lives)
    and writes it again when it is gone."""
    from kvtier.objects.manifest import ManifestWriter

    server = services.redis()
    raw = server.client()
    raw.config_set("maxmemory", "2mb")
    raw.config_set("maxmemory-policy", "allkeys-lru")
    ns = dataclasses.replace(_namespace(), fingerprint="build-lru")
    gen = ns.generation()
    key = manifest.manifest_key(gen)
    a_tier, b_tier = _tier(server.url), _tier(server.url)
    writer: ManifestWriter | None = None
    try:
        assert manifest.claim_generation(a_tier, ns, None)
        filler = b"x" * 32 * 1024
        n = 0
        while raw.exists(key):  # other keys' traffic, the manifest untouched meanwhile
            raw.set(f"other:{n}", filler)
            n += 1
            assert n < 5000, "never evicted"

        def holds() -> bool:
            return store_admin.holds_chunks(b_tier, gen)

        got = manifest.reclaim_generation(b_tier, ns, None, holds)
        assert not got.won and "missing" in got.reason, got
        writer = ManifestWriter(a_tier, None, lambda: ns, interval_s=3600.0, check_s=0.1)
        assert writer.check() is True, "the live writer writes it again"
        assert raw.exists(key)
        assert not manifest.reclaim_generation(b_tier, ns, None, holds).won
        # running: the writer reads the manifest back every check_s, so under steady
        # traffic it stays among the most recently used keys
        writer.start()
        for i in range(60):
            raw.set(f"more:{i}", filler)
            time.sleep(0.05)
            assert not manifest.reclaim_generation(b_tier, ns, None, holds).won
        assert raw.object("idletime", key) <= 1
        deadline = time.monotonic() + 5
        while not raw.exists(key):
            assert time.monotonic() < deadline, "the writer did not write it again"
            time.sleep(0.05)
    finally:
        if writer is not None:
            writer.close()
        a_tier.close()
        b_tier.close()
        raw.close()


# -- a re-claim cut short does not lock the generation --------------------------------------


def test_a_reclaim_cut_between_its_token_and_its_manifest_does_not_lock_for_good(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The defect: the re-claim's token was created, then the manifest write failed (or
    the engine died between the two): every later re-claim named the same token and
    lost, for good. Now a token whose manifest was not written within
    RECLAIM_TOKEN_VOID_S is void while the manifest is still the stale one, and the next
    token (created only if absent) decides; one winner among engines racing for it."""
    from kvtier.errors import TierUnavailable

    ns = dataclasses.replace(_namespace(), fingerprint="build-12")
    gen = ns.generation()
    tiers = [_tier(url) for _ in range(8)]
    try:
        assert manifest.claim_generation(tiers[0], ns, None, now=time.time() - 3600)
        t = time.time()
        real = manifest.write_manifest

        def dies(*args: Any, **kw: Any) -> None:
            raise TierUnavailable("the engine died here")

        monkeypatch.setattr(manifest, "write_manifest", dies)
        with pytest.raises(TierUnavailable):
            manifest.reclaim_generation(tiers[0], ns, None, lambda: False, now=t)
        monkeypatch.setattr(manifest, "write_manifest", real)
        got = manifest.reclaim_generation(tiers[1], ns, None, lambda: False, now=t + 1)
        assert not got.won and "re-claimed it first" in got.reason, "young: its writer may live"
        late = t + manifest.RECLAIM_TOKEN_VOID_S + 1
        won = _race(
            8, lambda i: manifest.reclaim_generation(tiers[i], ns, None, lambda: False, now=late)
        )
        assert [g.won for g in won].count(True) == 1, won
        m = manifest.read_manifest(tiers[0], gen, None)
        assert m is not None and m.last_seen == late
        # the winner's manifest is not stale: its token is not void, whatever its age
        again = manifest.reclaim_generation(
            tiers[2], ns, None, lambda: False, now=late + manifest.RECLAIM_TOKEN_VOID_S + 1
        )
        assert not again.won and "refreshed its manifest" in again.reason
        # tokens are bookkeeping: no chunk, gc'd with the generation
        assert store_admin.holds_chunks(tiers[0], gen) is False
    finally:
        for tier in tiers:
            tier.close()


def test_a_token_void_by_age_is_kept_when_its_manifest_was_written(url: str) -> None:
    """A token older than the bound whose re-claim did write the manifest (the winner is
    trusted now, the manifest no longer the stale one) is never voided by an engine that
    judged the old manifest stale long before (its listing was slow)."""
    ns = dataclasses.replace(_namespace(), fingerprint="build-13")
    gen = ns.generation()
    with _tier(url) as tier:
        assert manifest.claim_generation(tier, ns, None, now=time.time() - 3600)
        t = time.time()
        late = t + manifest.RECLAIM_TOKEN_VOID_S + 1
        first: list[manifest.Reclaim] = []

        def slow_listing() -> bool:  # meanwhile another engine re-claims it
            first.append(manifest.reclaim_generation(tier, ns, None, lambda: False, now=t))
            return False

        got = manifest.reclaim_generation(tier, ns, None, slow_listing, now=late)
        assert first[0].won and not got.won, (first, got)
        m = manifest.read_manifest(tier, gen, None)
        assert m is not None and m.last_seen == t
