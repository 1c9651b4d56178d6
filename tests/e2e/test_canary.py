"""Hits checked against the model (kvtier.canary), end to end in real vLLM CPU engines.

Engine A (weights M1) fills a directory tier under ``model_fingerprint: "build-7"``.
Engine B runs other weights (M2) under the same pinned fingerprint: without the canary
it would load A's chunks and answer wrongly. With it, the chunks B computes for its first
prompt are compared with A's stored ones, differ, and B neither loads nor stores anything
under the shared name: it forks to a generation of its own, where its repeated prompts
hit its own KV; its outputs are M2's own, and an engine C on M1 still hits A's chunks
(never B's) and answers as vLLM alone does. C itself checks its first hits (they match)
before loading.

The check budget is ``canary_check_tokens``' default, 1024 tokens: every prompt here has
4 full chunks of 256 (PROMPT = 1044 tokens), all stored in the one step that prefills it,
so the first prompt an engine checks is checked whole, 4 chunks at once, and meets the
budget alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kit import chunk_files

from kvtier.canary import TOLERANCE
from kvtier.objects.manifest import read_manifest
from kvtier.objects.tiers import FileTier
from tests.e2e.conftest import run_engine

pytestmark = pytest.mark.e2e

ENV = {"KVTIER_TEST_SCENARIO_MODULES": "tests.e2e.canary_scenarios"}
PREFIX = 1024  # each prompt's full chunks: 4 of 256 tokens
CHUNKS = PREFIX // 256
SEEDS = [51, 52, 53]  # A and B see these; NEW only B, then C
NEW = 54


def run(**args: Any) -> dict[str, Any]:
    return run_engine("canary_prompts", env=ENV, **args)


def assert_as_vllm_computes(outs: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    """Each output equals vLLM's own of the same split, token and logprob: the prompt
    computed whole where kvtier served nothing, vLLM's own prefix hit of the prompt's full
    chunks where kvtier served them (a hit computes the last tokens apart from the
    prefix: a whole prefill is other bf16 arithmetic, and random weights have near ties)."""
    n = len(ref["outs"])
    for i, out in enumerate(outs):
        served = out.get("hit_remote", 0) + out.get("hit_host", 0)
        assert served in (0, PREFIX), out
        want = (ref["hits"] if served else ref["outs"])[i % n]
        assert not served or want["cached"] == PREFIX, want
        assert (out["tokens"], out["logprobs"]) == (want["tokens"], want["logprobs"]), (i, out)


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from kvtier.cli.tinymodel import build_tiny_llama

    root = tmp_path_factory.mktemp("weights")
    return {
        "m1": str(build_tiny_llama(root / "m1", seed=0)),
        "m2": str(build_tiny_llama(root / "m2", seed=1)),  # same shapes, other weights
    }


@pytest.mark.isa
def test_other_weights_under_a_pinned_fingerprint_are_refused(
    weights: dict[str, str], tmp_path: Path
) -> None:
    tier = tmp_path / "kv"
    extra = {
        "cpu_bytes": "64MiB",
        "remote_url": f"file://{tier}",
        "model_fingerprint": "build-7",
        "canary_first_hit": True,
    }

    # A: the generation's first writer, trusted at once, stores every prompt in one batch
    a = run(model=weights["m1"], extra=extra, seeds=SEEDS, batch=True)
    assert a["state"] == "trusted" and a["comparisons"] == [], a["totals"]
    assert len(chunk_files(tier)) == len(SEEDS) * CHUNKS

    # B: other weights, same name. Its first prompt's 4 chunks are checked at once and
    # differ from A's: B forks to a generation of its own at the first result in (the
    # other 3 are then of the refused generation, stale: compared, not counted). Then
    # every prompt again, its host tier emptied
    b = run(model=weights["m2"], extra=extra, seeds=[*SEEDS, NEW], then_single=True)
    ref_m2 = run(model=weights["m2"], extra=None, seeds=[*SEEDS, NEW])
    assert b["totals"]["canary_checks_mismatch"] == 1 and b["totals"]["canary_checks_match"] == 0
    [[fork_id, shared, forked]] = b["forks"]
    assert b["state"] == "trusted" and forked != shared, b["forks"]
    first, again = b["outs"][: len(SEEDS) + 1], b["outs"][len(SEEDS) + 1 :]
    assert [o["hit_remote"] for o in first] == [0] * (len(SEEDS) + 1), first
    # its own prompts, stored after the fork, are read back from its fork (the first was
    # being computed when the check settled: begun before the fork, it stored nothing
    # then, and is computed again here)
    assert [o["hit_remote"] for o in again][1:] == [PREFIX] * len(SEEDS), again
    assert b["totals"]["fetch_ok"] > 0 and b["totals"]["upload_ok"] > 0, b["totals"]
    assert len(b["outs"]) == 2 * len(ref_m2["outs"])
    assert_as_vllm_computes(b["outs"], ref_m2)

    def in_gen(gen: str) -> list[Path]:
        return [p for p in chunk_files(tier) if p.name.startswith(f"gen-{gen}")]

    assert len(in_gen(shared)) == len(SEEDS) * CHUNKS, "B stored nothing there"
    assert len(in_gen(forked)) == (len(SEEDS) + 1) * CHUNKS, "B's own prompts, in its fork"
    assert len(chunk_files(tier)) == (2 * len(SEEDS) + 1) * CHUNKS
    files = FileTier(str(tier), background_sweep=False)
    fork_manifest = read_manifest(files, forked, None)
    files.close()
    assert fork_manifest is not None, "B's fork has a manifest of its own"
    assert (fork_manifest.forked_from, fork_manifest.fork_id) == (shared, fork_id)
    mismatches = b["comparisons"]  # the first prompt's chunks, all checked in its step
    assert [m["result"] for m in mismatches] == ["mismatch"] * CHUNKS, mismatches
    for mismatch in mismatches:
        assert min(mismatch["errors"]) > 5 * TOLERANCE, mismatch  # every layer far off

    # C: M1 again. The 4 chunks it computes for its first prompt match A's (the budget:
    # 1024 tokens); then A's chunks are loaded
    c = run(model=weights["m1"], extra=extra, seeds=[*SEEDS, NEW])
    ref_m1 = run(model=weights["m1"], extra=None, seeds=[*SEEDS, NEW], hits_after=SEEDS)
    assert c["state"] == "trusted", c["totals"]
    assert c["totals"]["canary_checks_match"] == CHUNKS, c["totals"]
    assert c["totals"]["canary_checks_mismatch"] == 0
    hits = [o["hit_remote"] for o in c["outs"]]
    assert hits == [0, PREFIX, PREFIX, 0], hits  # the first checked; NEW only in B's fork
    assert len(c["outs"]) == len(ref_m1["outs"])
    assert_as_vllm_computes(c["outs"], ref_m1)
    matches = c["comparisons"]
    assert [m["result"] for m in matches] == ["match"] * CHUNKS, matches
    for match in matches:
        assert max(match["errors"]) < TOLERANCE / 5, match  # same weights, another batch
    m1, m2 = ref_m1["outs"][0], ref_m2["outs"][0]
    assert (m1["tokens"], m1["logprobs"]) != (m2["tokens"], m2["logprobs"]), (
        "the two weights compute differently (else this test proves nothing)"
    )


def test_sampled_hits_are_checked_and_first_hit_check_can_be_turned_off(
    weights: dict[str, str], tmp_path: Path
) -> None:
    """canary_rate 1: every later request is recomputed and checked (counted, all match,
    no hit served): the first prompt's 4 chunks (the generation untrusted: the budget),
    then one chunk of each later, sampled, prompt; canary_first_hit false: the first
    engine after the writer loads at once, checks nothing."""
    tier = tmp_path / "kv"
    extra = {"cpu_bytes": "64MiB", "remote_url": f"file://{tier}", "canary_first_hit": True}
    run(model=weights["m1"], extra=extra, seeds=SEEDS, batch=True)
    sampled = run(model=weights["m1"], extra={**extra, "canary_rate": 1.0}, seeds=SEEDS)
    want = CHUNKS + len(SEEDS) - 1  # the budget's 4 chunks, then one per sampled prompt
    assert sampled["totals"]["canary_checks_match"] == want, sampled["totals"]
    assert sampled["totals"]["canary_checks_mismatch"] == 0
    assert [o["hit_remote"] for o in sampled["outs"]] == [0] * len(SEEDS)
    off = run(model=weights["m1"], extra={**extra, "canary_first_hit": False}, seeds=SEEDS)
    assert [o["hit_remote"] for o in off["outs"]] == [PREFIX] * len(SEEDS), off["outs"]
    assert off["comparisons"] == [] and off["totals"]["canary_checks_match"] == 0


def test_no_false_alarm_at_tp2_with_chunked_prefill_and_other_requests_beside(
    tiny_model: str, tmp_path: Path
) -> None:
    """The same weights at TP=2 (each rank compares its own heads), the checked prompt
    prefilled in pieces of 128 tokens beside the other prompts of its batch: its chunks
    are checked as each is completed, until the budget's 4 matched (never more: no more
    checks are in flight than the budget still needs), and the prompts are then served
    from the tier."""
    tier = tmp_path / "kv"
    extra = {"cpu_bytes": "32MiB", "remote_url": f"file://{tier}", "canary_first_hit": True}
    env = {**ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    seeds = [61, 62, 63, 64]
    tp2 = {"tensor_parallel_size": 2}
    a = run_engine(
        "canary_prompts",
        env=env,
        model=tiny_model,
        extra=extra,
        seeds=seeds,
        batch=True,
        engine_kw=tp2,
    )
    assert a["state"] == "trusted" and a["totals"]["upload_ok"] == len(seeds) * CHUNKS
    b = run_engine(
        "canary_prompts",
        env=env,
        model=tiny_model,
        extra=extra,
        seeds=seeds,
        batch=True,
        then_single=True,
        engine_kw={**tp2, "max_num_batched_tokens": 128},
    )
    assert b["state"] == "trusted", b["totals"]
    assert b["totals"]["canary_checks_match"] == CHUNKS, b["totals"]
    assert b["totals"]["canary_checks_mismatch"] == 0
    batch, single = b["outs"][: len(seeds)], b["outs"][len(seeds) :]
    assert [o["hit_remote"] for o in single] == [PREFIX] * len(seeds), single
    for x, y in zip(batch, single, strict=True):
        assert x["tokens"] == y["tokens"]


@pytest.mark.isa
def test_a_generation_whose_writer_died_before_storing_is_claimed_afresh(
    weights: dict[str, str], tmp_path: Path
) -> None:
    """Engine A claims the generation and stops without storing a chunk (long ago: its
    manifest is aged). Engine B checks it, and every check finds the chunk absent: before,
    B stayed checking for as long as it ran, storing nothing and never getting a hit. Now
    after RECLAIM_AFTER prompts whose chunks were absent (all 4 of each checked; the
    streak counts each prompt once) B claims the generation afresh (it holds no chunk, no
    engine that trusts it is alive), stores its later prompts there and gets hits on them,
    answering as vLLM alone does."""
    import dataclasses
    import time

    from kvtier.canary import RECLAIM_AFTER
    from kvtier.objects.manifest import STALE_S, write_manifest
    from kvtier.objects.store_admin import usage

    tier = tmp_path / "kv"
    extra = {
        "cpu_bytes": "64MiB",
        "remote_url": f"file://{tier}",
        "model_fingerprint": "build-7",
        "canary_first_hit": True,
    }
    a = run(model=weights["m1"], extra=extra, seeds=[])
    assert a["state"] == "trusted" and chunk_files(tier) == []
    files = FileTier(str(tier), background_sweep=False)
    [g] = usage(files, None).generations  # A's claim: a manifest, no chunk
    assert g.chunks == [] and g.manifest is not None
    gen, m = g.id, g.manifest
    write_manifest(files, dataclasses.replace(m, last_seen=time.time() - 2 * STALE_S), None)
    files.close()

    seeds = [51, 52, 53, 54, 55, 56]
    b = run(model=weights["m1"], extra=extra, seeds=seeds, then_single=True)
    ref = run(model=weights["m1"], extra=None, seeds=seeds)
    assert b["state"] == "trusted", b["totals"]
    assert b["totals"]["canary_checks_absent"] >= RECLAIM_AFTER * CHUNKS, b["totals"]
    assert b["totals"]["canary_checks_mismatch"] == 0 and b["forks"] == []
    first, again = b["outs"][: len(seeds)], b["outs"][len(seeds) :]
    assert [o["hit_remote"] for o in first] == [0] * len(seeds)
    hits = [o["hit_remote"] for o in again]
    assert hits[:RECLAIM_AFTER] == [0] * RECLAIM_AFTER, "computed while checking: not stored"
    assert hits[-1] == PREFIX, hits  # stored once the generation was claimed afresh
    assert b["totals"]["upload_ok"] > 0
    assert len(b["outs"]) == 2 * len(ref["outs"])
    assert_as_vllm_computes(b["outs"], ref)
    files = FileTier(str(tier), background_sweep=False)
    after = read_manifest(files, gen, None)
    files.close()
    assert after is not None and time.time() - after.last_seen < STALE_S, "B refreshes it"


def test_a_sampled_mismatch_takes_what_kvtier_loaded_out_of_vllms_prefix_cache(
    weights: dict[str, str], tmp_path: Path
) -> None:
    """B (other weights, same pinned fingerprint, ``canary_first_hit`` off: trusted at
    once) loads A's KV for its first prompt: wrong for B, the risk the first-hit check
    exists for. A sampled check (``canary_rate``) of its next prompt mismatches; kvtier
    empties its host tier and forks, and the blocks it loaded leave vLLM's own prefix
    cache too: the first prompt again, vLLM's cache not emptied, is computed whole by B's
    own weights, not served the refused KV."""
    tier = tmp_path / "kv"
    extra = {
        "cpu_bytes": "64MiB",
        "remote_url": f"file://{tier}",
        "model_fingerprint": "build-7",
        "canary_first_hit": True,
    }
    run(model=weights["m1"], extra=extra, seeds=SEEDS, batch=True)  # A writes
    b = run_engine(
        "refused_after_loading",
        env=ENV,
        model=weights["m2"],
        extra={**extra, "canary_first_hit": False},
        seeds=SEEDS[:2],
    )
    ref = run(model=weights["m2"], extra=None, seeds=SEEDS[:1])
    assert b["loaded"] == PREFIX, b["totals"]  # A's chunks, unchecked
    first, want = b["first"], ref["outs"][0]
    assert (first["tokens"], first["logprobs"]) != (want["tokens"], want["logprobs"]), (
        "A's KV under B's weights answers otherwise (else this test proves nothing)"
    )
    assert b["totals"]["canary_checks_mismatch"] == 1, b["totals"]
    assert len(b["forks"]) == 1 and b["state"] == "trusted", b["forks"]  # in its own fork
    again = b["again"]
    assert again["cached"] == 0, "vLLM's prefix cache still served the refused KV"
    assert (again["tokens"], again["logprobs"]) == (want["tokens"], want["logprobs"])
