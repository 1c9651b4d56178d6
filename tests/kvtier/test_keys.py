"""Chunk keys: stable across processes, different whenever KV bytes would differ."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from kvtier.keys import (
    ANY_RANK,
    LAYOUT_VERSION,
    KeySpace,
    Namespace,
    after_weight_change,
    chunk_block_hashes,
    chunk_key,
)

NS = Namespace(
    model="/models/llama",
    revision=None,
    dtype="bfloat16",
    kv_cache_dtype="auto",
    block_size=32,
    chunk_size=256,
    tp_size=1,
)
HASHES = [bytes([i]) * 32 for i in range(24)]

_CHILD = """
import json, sys
from kvtier.keys import Namespace, chunk_block_hashes, chunk_key
ns = Namespace(model="/models/llama", revision=None, dtype="bfloat16", kv_cache_dtype="auto",
               block_size=32, chunk_size=256, tp_size=1)
hashes = [bytes([i]) * 32 for i in range(24)]
d = ns.digest()
print(json.dumps([chunk_key(d, h) for h in chunk_block_hashes(hashes, 8)]))
"""


def _keys_in_subprocess(seed: str) -> list[str]:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def test_same_prefix_same_key_in_every_process() -> None:
    here = [chunk_key(NS.digest(), h) for h in chunk_block_hashes(HASHES, 8)]
    assert _keys_in_subprocess("1") == here
    assert _keys_in_subprocess("12345") == here


def test_chunk_uses_its_last_block_hash() -> None:
    assert chunk_block_hashes(HASHES, 8) == [HASHES[7], HASHES[15], HASHES[23]]
    assert chunk_block_hashes(HASHES[:15], 8) == [HASHES[7]]  # partial chunk not keyed
    # from a chunk on: what a request's keys grow by as vLLM hashes more blocks
    assert chunk_block_hashes(HASHES, 8, 1) == [HASHES[15], HASHES[23]]
    assert chunk_block_hashes(HASHES[:23], 8, 2) == []
    for n in range(len(HASHES) + 1):
        for first in range(4):
            assert (
                chunk_block_hashes(HASHES[:n], 8, first)
                == [HASHES[(i + 1) * 8 - 1] for i in range(n // 8)][first:]
            )


def test_any_namespace_field_changes_the_key() -> None:
    base = chunk_key(NS.digest(), HASHES[7])
    changes = {
        "model": "/models/other",
        "revision": "abc",
        "dtype": "float16",
        "kv_cache_dtype": "fp8",
        "block_size": 16,
        "chunk_size": 512,
        "tp_size": 2,
        "namespace": "tenant-a",
        "layout_version": LAYOUT_VERSION + 1,
        "pp_size": 2,
        "fingerprint": "weights-b",
        "layers": "layers-11-22",
    }
    # a field added to Namespace but left out of its digest would let two layouts share
    # keys; replicated_kv is left out on purpose (it picks whose keys, see below), and
    # label (the name a generation's manifest shows: the same weights at two paths share),
    # forked_from and fork_id (the manifest's record of a salt the fingerprint carries)
    assert changes.keys() | {"replicated_kv", "label", "forked_from", "fork_id"} == {
        f.name for f in dataclasses.fields(Namespace)
    }
    seen = {base}
    for field, value in changes.items():
        key = chunk_key(dataclasses.replace(NS, **{field: value}).digest(), HASHES[7])
        assert key not in seen, field
        seen.add(key)


def test_rank_and_pipeline_stage_are_part_of_the_object_key() -> None:
    positions = [(r, s) for r in (ANY_RANK, 0, 1) for s in (ANY_RANK, 0, 1)]
    keys = {chunk_key(NS.digest(rank=r, stage=s), HASHES[7]) for r, s in positions}
    assert len(keys) == len(positions)
    pp2 = dataclasses.replace(NS, pp_size=2)
    assert chunk_key(pp2.digest(0, 0), HASHES[7]) != chunk_key(NS.digest(0, 0), HASHES[7])


def test_facade_reads_the_worker_position_from_vllm(monkeypatch) -> None:
    """TP rank and PP stage come from vLLM's process groups (stage 1 of PP=2 here)."""
    from types import SimpleNamespace

    from vllm.distributed import parallel_state

    from kvtier.connectors.vllm import worker_position

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: SimpleNamespace(rank_in_group=1))
    assert worker_position() == (1, 1)

    def unset():
        raise AssertionError("tensor model parallel group is not initialized")

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", unset)
    monkeypatch.setattr(parallel_state, "get_pp_group", unset)
    assert worker_position() == (0, 0)


def test_different_prefix_different_key() -> None:
    assert chunk_key(NS.digest(), HASHES[7]) != chunk_key(NS.digest(), HASHES[8])


def test_replicated_kv_ranks_share_rank_0s_keys_and_only_rank_0_writes() -> None:
    """MLA: every TP rank holds the same latent, so all ranks read rank 0's object;
    pipeline stages (other layers) keep their own keys."""
    mla = dataclasses.replace(NS, tp_size=2, replicated_kv=True)
    dense = dataclasses.replace(NS, tp_size=2)
    h = HASHES[7]
    assert KeySpace.worker(mla, 1, 0).key(h) == KeySpace.worker(mla, 0, 0).key(h)
    assert KeySpace.worker(mla, 0, 0).key(h) == KeySpace.worker(dense, 0, 0).key(h)
    assert KeySpace.worker(mla, 1, 1).key(h) != KeySpace.worker(mla, 1, 0).key(h)
    assert KeySpace.worker(dense, 1, 0).key(h) != KeySpace.worker(dense, 0, 0).key(h)
    assert [KeySpace.writes(mla, r) for r in (0, 1)] == [True, False]
    assert [KeySpace.writes(dense, r) for r in (0, 1)] == [True, True]


def test_a_weight_change_gives_an_identity_of_its_own() -> None:
    """Weights replaced in a running engine: the new identity is neither the old one nor
    any other change's (the salt is drawn per change), and it is one value for a salt."""
    fp = "weights-a"
    one, two = after_weight_change(fp, b"\x01" * 16), after_weight_change(fp, b"\x02" * 16)
    assert len({fp, one, two}) == 3
    assert after_weight_change(fp, b"\x01" * 16) == one
    assert after_weight_change("weights-b", b"\x01" * 16) != one
    keys = {
        KeySpace.worker(dataclasses.replace(NS, fingerprint=f), 0, 0).key(HASHES[7])
        for f in (fp, one, two)
    }
    assert len(keys) == 3
