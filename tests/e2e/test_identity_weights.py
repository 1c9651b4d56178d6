"""A chunk's identity follows the weights, end to end in real vLLM engines.

- Weights replaced while the engine runs (``collective_rpc("reload_weights")``, the
  path RL weight syncs and operators take): nothing stored before is served after,
  from either tier, and the output is the new weights' own.
- Random weights (``--load-format dummy``) on the same model directory never find
  the real weights' chunks in a shared tier.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kit import chunk_files

from tests.e2e.conftest import run_engine
from tests.e2e.trust_scenarios import compare

pytestmark = pytest.mark.e2e

ENV = {"KVTIER_TEST_SCENARIO_MODULES": "tests.e2e.identity_scenarios"}
SEED = 41
PREFIX = 1024  # the prompt's full chunks (4 of 256 tokens)


def run(scenario: str, **args: Any) -> dict[str, Any]:
    return run_engine(scenario, env=ENV, **args)


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from kvtier.cli.tinymodel import build_tiny_llama

    root = tmp_path_factory.mktemp("weights")
    return {
        "a": str(build_tiny_llama(root / "a", seed=0)),
        "b": str(build_tiny_llama(root / "b", seed=1)),  # same shapes, other weights
    }


def test_weights_reloaded_in_a_running_engine_never_meet_old_chunks(
    weights: dict[str, str], tmp_path: Path
) -> None:
    tier = tmp_path / "kv"
    extra = {"cpu_bytes": "64MiB", "remote_url": f"file://{tier}"}
    r = run("reload_weights_run", model=weights["a"], other=weights["b"], extra=extra, seed=SEED)
    runs = r["runs"]
    assert runs["cold"]["cached"] == 0
    # before the change both tiers serve the prompt: the chunks are there to be found
    assert runs["from_tier"]["hit_remote"] == PREFIX, runs["from_tier"]
    assert runs["from_tier"]["tokens"] == runs["cold"]["tokens"]

    after = runs["after_reload"]
    assert after["cached"] == 0, after
    assert after["hit_host"] == 0 and after["hit_remote"] == 0 and after["fetch_ok"] == 0, after
    assert r["side"]["weights_epoch"] == 1 and r["side"]["totals"]["weights_changes"] == 1

    ref = run("one_prompt", model=weights["b"], extra=None, seed=SEED)["out"]
    assert after["tokens"] == ref["tokens"] and after["logprobs"] == ref["logprobs"]
    assert ref["tokens"] != runs["cold"]["tokens"] or ref["logprobs"] != runs["cold"]["logprobs"], (
        "the new weights compute differently (else this test proves nothing)"
    )

    # what is stored after the change is served again, by either tier, under new keys
    for name in ("again", "again_from_tier"):
        assert runs[name]["cached"] == PREFIX, (name, runs[name])
        assert compare(runs[name], ref) == "same", (name, runs[name], ref)
    assert runs["again"]["hit_host"] == PREFIX
    assert runs["again_from_tier"]["hit_remote"] == PREFIX
    assert len(chunk_files(tier)) == 2 * PREFIX // 256, "the new weights' chunks beside the old"


def test_dummy_weights_never_share_chunks_with_the_real_weights(
    weights: dict[str, str], tmp_path: Path
) -> None:
    tier = tmp_path / "kv"
    extra = {"cpu_bytes": "64MiB", "remote_url": f"file://{tier}"}
    real = run("one_prompt", model=weights["a"], extra=extra, seed=SEED)
    # (another real-weights engine finds them: tests/e2e/test_trust.py)
    assert real["out"]["cached"] == 0 and len(chunk_files(tier)) == PREFIX // 256

    dummy = run(
        "one_prompt", model=weights["a"], extra=extra, seed=SEED, engine_kw={"load_format": "dummy"}
    )
    out = dummy["out"]
    assert out["cached"] == 0 and out["hit_remote"] == 0 and out["fetch_ok"] == 0, out
    assert dummy["remote"]["ops_fetch"] >= 1, "the tier was asked, and had nothing for it"
    assert dummy["fingerprint"] != real["fingerprint"]
    assert len(chunk_files(tier)) == 2 * PREFIX // 256, "its own chunks, under other keys"
