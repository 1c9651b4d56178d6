"""The worker's generation manifest: rank 0 of stage 0 writes it when its object-tier I/O
opens, follows a weight change to the new generation, and refreshes it at shutdown;
every other worker writes none. A real WorkerSide, RemoteIO and directory tier."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from copyfakes import make_caches

from kvtier.config import load_config
from kvtier.connectors.worker import side as worker_mod
from kvtier.keys import Namespace
from kvtier.objects.manifest import read_manifest
from kvtier.objects.remote import RemoteIO
from kvtier.objects.tiers import FileTier

NUM_BLOCKS, BS, BPC = 40, 32, 4
KV_FIRST = (2, NUM_BLOCKS, BS, 4, 16)


def worker(root: Path, rank: int, stage: int) -> worker_mod.WorkerSide:
    cfg = load_config(
        {"cpu_bytes": "64MiB", "chunk_size": BPC * BS, "remote_url": f"file://{root}"}, environ={}
    )
    ns = Namespace(
        "", None, "bfloat16", "auto", BS, BPC * BS, 2, fingerprint="f" * 32, label="org/served-name"
    )
    w = worker_mod.WorkerSide(cfg, ns, NUM_BLOCKS, lambda c: RemoteIO.from_config(c))
    w.register_kv_caches(make_caches(KV_FIRST, layers=2), rank=rank, stage=stage)
    return w


def manifests(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*%2Fmanifest"))


def test_rank_0_keeps_its_generations_manifest(tmp_path: Path) -> None:
    roots = [tmp_path / "rank1", tmp_path / "stage1"]
    others = [worker(roots[0], 1, 0), worker(roots[1], 0, 1)]  # each a tier of its own
    tmp_path = tmp_path / "rank0"
    w = worker(tmp_path, 0, 0)
    tier = FileTier(str(tmp_path), background_sweep=False)
    gen = w.namespace.generation()
    deadline = time.monotonic() + 5
    while (first := read_manifest(tier, gen, None)) is None:
        assert time.monotonic() < deadline, "no manifest after the worker opened its tier"
        time.sleep(0.05)
    assert first.model == "org/served-name" and first.tp_size == 2
    assert first.layout.endswith(w.namespace.layers) and w.namespace.layers
    assert (first.forked_from, first.fork_id) == ("", "")

    w._follow_weights(1, b"salt")  # the engine's weights changed: a new generation
    new_gen = w.namespace.generation()
    assert new_gen != gen
    deadline = time.monotonic() + 5
    while read_manifest(tier, new_gen, None) is None:
        assert time.monotonic() < deadline, "the new generation got no manifest"
        time.sleep(0.05)
    time.sleep(1.1)  # the times are seconds: shutdown's refresh comes later
    for o in others:
        o.shutdown()
    w.shutdown()
    last = read_manifest(tier, new_gen, None)
    assert last is not None and last.last_seen > first.last_seen
    assert (last.forked_from, last.fork_id) == (gen, b"salt".hex()), "the fork is recorded"
    assert manifests(tmp_path) == sorted(f"gen-{g}%2Fmanifest" for g in (gen, new_gen))
    assert [manifests(r) for r in roots] == [[], []], "only rank 0 of stage 0 writes one"
    tier.close()


def test_a_manifest_written_before_forks_were_recorded_still_reads() -> None:
    """Manifests of older kvtier versions lack forked_from and fork_id: read as ""."""
    import json

    from kvtier.errors import CodecError
    from kvtier.objects.manifest import Manifest

    ns = Namespace("m", None, "bfloat16", "auto", BS, BPC * BS, 1, fingerprint="f" * 32)
    forked = Manifest.of(ns.after_weight_change(b"\x01" * 16), 1.0)
    assert (forked.forked_from, forked.fork_id) == (ns.generation(), "01" * 8)
    raw = json.loads(forked.to_bytes())
    assert Manifest.from_bytes(forked.to_bytes()) == forked
    old = {k: v for k, v in raw.items() if k not in ("forked_from", "fork_id")}
    got = Manifest.from_bytes(json.dumps(old).encode())
    assert (got.forked_from, got.fork_id) == ("", "") and got.id == forked.id
    with pytest.raises(CodecError):
        Manifest.from_bytes(json.dumps({**raw, "fork_id": 7}).encode())
