"""The canary's first writer is claimed, not inferred: engines starting at once on an empty
generation (their manifest writes not landed yet) find exactly one first writer, which
trusts itself; every other engine checks its first hit. Real workers over real tiers
(a directory, a moto S3 server, a redis-server), fakes only for vLLM's KV caches."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import pytest

from kvtier.canary import GenerationTrust, Trust
from kvtier.config import load_config
from kvtier.keys import KeySpace, Namespace
from kvtier.objects import manifest
from kvtier.objects.tiers import FileTier, ObjectTier, open_tier
from kvtier.objects.tiers.base import Parts

pytestmark = pytest.mark.integration

BS, BPC = 32, 4
NS = Namespace("m", None, "bfloat16", "auto", BS, BS * BPC, 1, fingerprint="build-7")


def _tier(url: str) -> ObjectTier:
    return open_tier(load_config({"remote_url": url}, environ={}))


def _held_puts(tier: ObjectTier, until: threading.Event) -> ObjectTier:
    """``tier`` whose plain writes (the manifest writer's) wait for ``until``: both engines
    start before either's manifest lands, the window the old exists() check lost."""
    put = tier.put

    def held(key: str, parts: Parts) -> None:
        until.wait(30)
        put(key, parts)

    tier.put = held  # type: ignore[method-assign]
    return tier


def _worker(  # type: ignore[no-untyped-def]
    url: str,
    until: threading.Event,
    seed: int,
    tier: Callable[[], ObjectTier] | None = None,
):
    """A rank-0 worker with the canary's first-hit check on, over the tier ``url`` names
    (or ``tier()``)."""
    from copyfakes import make_caches

    from kvtier.connectors.worker.side import WorkerSide
    from kvtier.objects.remote import RemoteIO

    cfg = load_config(
        {"cpu_bytes": "16MiB", "chunk_size": BS * BPC, "remote_url": url, "canary_first_hit": True},
        environ={},
    )

    def remote(c):  # type: ignore[no-untyped-def]
        held = _held_puts(tier() if tier is not None else _tier(url), until)
        return RemoteIO(held, threads=1, queue_depth=8, timeout_s=5, signer=None)

    w = WorkerSide(cfg, NS, 40, remote)
    w.register_kv_caches(make_caches((2, 40, BS, 4, 16), layers=2, seed=seed), rank=0)
    return w


def _at_once(n: int, start: Callable[[int], Any]) -> list[Any]:
    """``start(i)`` for i < n in threads released together; their results in order."""
    out: list[Any] = [None] * n
    errors: list[BaseException] = []
    gate = threading.Barrier(n)

    def run(i: int) -> None:
        try:
            gate.wait(10)
            out[i] = start(i)
        except BaseException as exc:  # noqa: BLE001  raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def test_two_engines_starting_at_once_on_an_empty_generation_give_one_first_writer(
    url: str,
) -> None:
    """Engine A (the right weights) and engine B (other weights, the same name) start
    together on an empty tier, neither's manifest stored yet: exactly one is the
    generation's first writer and trusts itself; the other checks its first hit. (Before
    the claim both found no manifest and both trusted themselves, so B's wrong KV could
    be stored trusted.)"""
    landed = threading.Event()
    workers = _at_once(2, lambda i: _worker(url, landed, seed=10 + i))
    try:
        said = [w.fresh_generation for w in workers]
        assert sorted(said) == [False, True], said
        # what each engine's scheduler makes of its worker's answer (the handshake)
        trust = [GenerationTrust() for _ in workers]
        states = [t.first_writer(bool(fresh)) for t, fresh in zip(trust, said, strict=True)]
        assert sorted(s.value for s in states) == [Trust.CHECKING.value, Trust.TRUSTED.value]
        # the claim is the generation's manifest: the winner's, readable as any manifest
        gen = workers[0].namespace.generation()  # the workers' layers are in it
        assert gen == workers[1].namespace.generation()
        with _tier(url) as tier:
            stored = manifest.read_manifest(tier, gen, None)
            assert stored is not None and stored.id == gen
    finally:
        landed.set()
        for w in workers:
            w.shutdown()
    third = _worker(url, landed, seed=12)  # any engine after them checks too
    try:
        assert third.fresh_generation is False
    finally:
        third.shutdown()


def test_many_engines_claiming_at_once_give_one_first_writer(url: str) -> None:
    """The claim alone, eight engines at once, several generations: one winner each."""
    tiers = [_tier(url) for _ in range(8)]
    try:
        for fp in ("a", "b", "c"):
            ns = dataclasses.replace(NS, fingerprint=fp)
            won = _at_once(8, lambda i, ns=ns: manifest.claim_generation(tiers[i], ns, None))
            assert won.count(True) == 1, (fp, won)
    finally:
        for t in tiers:
            t.close()


class _LostReply(FileTier):
    """A directory whose create stores the object and then answers False, as a create
    retried after its first try's reply was lost answers."""

    def create_if_absent(self, key: str, parts: Parts) -> bool:
        super().create_if_absent(key, parts)
        return False


def test_a_claim_whose_reply_was_lost_is_still_this_engines(tmp_path) -> None:
    tier = _LostReply(str(tmp_path / "kv"))
    try:
        assert manifest.claim_generation(tier, NS, None, now=1000.0) is True
        # another engine's claim of the same generation: its bytes differ, it lost
        assert manifest.claim_generation(tier, NS, None, now=1000.5) is False
    finally:
        tier.close()


def test_a_tier_that_cannot_claim_makes_the_engine_check(tmp_path) -> None:
    """A claim that fails (the tier down, or a tier without an atomic create: the base
    class's raises) leaves the engine checking its first hit, never a first writer by
    default."""
    from kvtier.errors import TierUnavailable
    from kvtier.objects.tiers.base import ObjectTier as Base

    class Down(FileTier):
        def create_if_absent(self, key: str, parts: Parts) -> bool:
            raise TierUnavailable("file tier create: down")

    class NoCreate(FileTier):
        create_if_absent = Base.create_if_absent

    root = str(tmp_path / "kv")
    landed = threading.Event()
    landed.set()
    for cls in (Down, NoCreate):
        w = _worker(f"file://{root}", landed, seed=10, tier=lambda cls=cls: cls(root))
        try:
            assert w.fresh_generation is False, cls.__name__
        finally:
            w.shutdown()


# -- engines whose keys never meet never share a claim --------------------------------------


def _layout_worker(url: str, shape: tuple[int, ...]):  # type: ignore[no-untyped-def]
    """A rank-0 worker whose KV caches have ``shape`` (2 layers), first hit checked."""
    from copyfakes import make_caches

    from kvtier.connectors.worker.side import WorkerSide
    from kvtier.objects.remote import RemoteIO

    cfg = load_config(
        {"cpu_bytes": "16MiB", "chunk_size": BS * BPC, "remote_url": url, "canary_first_hit": True},
        environ={},
    )

    def remote(c):  # type: ignore[no-untyped-def]
        return RemoteIO(_tier(url), threads=1, queue_depth=8, timeout_s=5, signer=None)

    w = WorkerSide(cfg, NS, 40, remote)
    w.register_kv_caches(make_caches(shape, layers=2, seed=10), rank=0)
    return w


def test_engines_whose_layers_differ_never_share_a_claim(url: str) -> None:
    """Two engines under one model_fingerprint whose KV layouts differ (here another
    attention backend: blocks outermost instead of K/V outermost, the same bytes): every
    chunk key names the worker's layers, so their keys never meet. Before, the generation
    id left the layers out: the second engine found the first's manifest and checked for
    good (every canary absent). Now each layout is a generation of its own, claimed by
    its own first writer."""
    from kvtier.host.layout import SlotLayout

    kv_first, blocks_first = (2, 40, BS, 4, 16), (40, 2, BS, 4, 16)
    layouts = []
    for shape in (kv_first, blocks_first):
        from copyfakes import make_caches

        layouts.append(SlotLayout.from_kv_caches(make_caches(shape, layers=2), 40, BPC))
    assert layouts[0].slot_bytes == layouts[1].slot_bytes
    assert layouts[0].identity() != layouts[1].identity()
    ns = [dataclasses.replace(NS, layers=lay.identity()) for lay in layouts]
    assert ns[0].generation() != ns[1].generation()
    # the TP ranks of one engine hold the same layers: one generation per engine
    assert KeySpace.worker(ns[0], 0, 0).generation == KeySpace.worker(ns[0], 1, 0).generation
    workers = [_layout_worker(url, shape) for shape in (kv_first, blocks_first)]
    try:
        assert [w.fresh_generation for w in workers] == [True, True]
        gens = [w.namespace.generation() for w in workers]
        assert gens == [n.generation() for n in ns]
        with _tier(url) as tier:
            for w, gen in zip(workers, gens, strict=True):
                stored = manifest.read_manifest(tier, gen, None)
                assert stored is not None and stored.layout.endswith(w.namespace.layers)
        # an engine of the first layout still checks the first's generation
        third = _layout_worker(url, kv_first)
        try:
            assert third.fresh_generation is False
        finally:
            third.shutdown()
    finally:
        for w in workers:
            w.shutdown()


def test_a_pipeline_keeps_one_generation_across_its_stages_and_compares_layouts(  # type: ignore[no-untyped-def]
    tmp_path,
) -> None:
    """Pipeline stages hold other layers, so the layers cannot name a pipeline engine's
    generation (its stages would split): there the layout the manifest records (stage
    0's) is compared, and a checking engine of another layout says why it waits."""
    pp = dataclasses.replace(NS, pp_size=2)
    a, b = (dataclasses.replace(pp, layers=x) for x in ("stage-0-of-a", "stage-0-of-b"))
    assert a.generation() == dataclasses.replace(pp, layers="stage-1").generation()
    assert a.generation() == b.generation()
    with FileTier(str(tmp_path / "kv")) as tier:
        assert manifest.claim_generation(tier, a, None)
        got = manifest.reclaim_generation(tier, b, None, lambda: False)
        assert not got.won and "another KV layout" in got.reason, got
