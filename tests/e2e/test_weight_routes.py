"""Every route that changes a running engine's weights is followed, end to end in real
vLLM engines with a host and an object tier (issue 47): ``LLM.apply_model(fn)``, a
``worker_extension_cls`` method (vLLM's RLHF route, TRL's ``update_named_param``), a
function given to ``collective_rpc``, and the model written with no call at all (TRL's
colocate mode), seen when vLLM's prefix cache is reset. After each, the engine serves
none of the old weights' KV (its outputs are a fresh engine's on the new weights) and
stores nothing under the identity the old weights' engines share (one of those finds
none of it). Calls that only read (vLLM's own, a marked function) keep every hit.

``reload_weights`` and the other named reloads: tests/e2e/test_identity_weights.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import run_engine
from tests.e2e.trust_scenarios import compare

pytestmark = pytest.mark.e2e

ENV = {"KVTIER_TEST_SCENARIO_MODULES": "tests.e2e.weight_route_scenarios"}
PREFIX = 1024  # the prompts' full chunks (4 of 256 tokens)


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


class References:
    """Both prompts on fresh engines without kvtier: on the old weights, and on the old
    weights with the tensors a route wrote taken from the new ones."""

    def __init__(self, weights: dict[str, str], root: Path) -> None:
        self.weights, self.root = weights, root
        self.old = run("reference", model=weights["a"])
        self._mixed: dict[tuple[str, ...], dict[str, Any]] = {}

    def after_change(self, written: list[str]) -> dict[str, Any]:
        from tests.e2e.weight_route_scenarios import mixed_checkpoint

        key = tuple(sorted(written))
        if key not in self._mixed:
            path = mixed_checkpoint(
                self.weights["a"],
                self.weights["b"],
                list(key),
                str(self.root / f"mixed{len(self._mixed)}"),
            )
            ref = run("reference", model=path)
            for prompt in ("before", "after"):
                assert compare(ref[prompt], self.old[prompt]) != "same", (
                    "the new weights compute differently (else this test proves nothing)"
                )
            self._mixed[key] = ref
        return self._mixed[key]


@pytest.fixture(scope="module")
def reference(weights: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> References:
    return References(weights, tmp_path_factory.mktemp("references"))


def tier(tmp_path: Path) -> dict[str, Any]:
    return {"cpu_bytes": "64MiB", "remote_url": f"file://{tmp_path / 'kv'}"}


@pytest.mark.parametrize("route", ["apply_model", "extension", "callable", "direct"])
def test_a_weight_change_by_any_route_meets_no_old_chunk_and_leaves_none(
    route: str, weights: dict[str, str], reference: References, tmp_path: Path
) -> None:
    extra = tier(tmp_path)
    r = run("weight_route", model=weights["a"], other=weights["b"], extra=extra, route=route)
    runs = r["runs"]
    assert "model.embed_tokens.weight" in r["written"], r["written"]
    new_ref = reference.after_change(r["written"])
    assert runs["cold"]["cached"] == 0 and runs["cold"]["stored"] == PREFIX // 256
    assert compare(runs["cold"], reference.old["before"]) == "same"
    # before the change the tier serves the prompt: the chunks are there to be found
    assert runs["from_tier"]["hit_remote"] == PREFIX, runs["from_tier"]

    after = runs["after"]
    assert after["cached"] == 0, after
    assert after["hit_host"] == 0 and after["hit_remote"] == 0, after
    assert compare(after, new_ref["before"]) == "same", (after, new_ref)
    assert r["side"]["weights_epoch"] == 1, r["side"]
    assert r["side"]["host_slots"][0] > 0 and r["side"]["host_slots"][1] == 0, r["side"]
    assert r["side"]["totals"]["weights_changes"] == 1, "one change, however many calls"

    new = runs["new_prompt"]
    assert new["cached"] == 0 and new["stored"] == PREFIX // 256, new
    assert compare(new, new_ref["after"]) == "same", (new, new_ref)

    # an engine on the old weights shares the tier: it finds the chunks stored before the
    # change and none of those stored after it (they hold the new weights' KV)
    reader = run("old_weights_reader", model=weights["a"], extra=extra)["runs"]
    assert reader["new_prompt"]["hit_remote"] == 0 and reader["new_prompt"]["cached"] == 0
    assert compare(reader["new_prompt"], reference.old["after"]) == "same"
    assert reader["old_prompt"]["hit_remote"] == PREFIX, reader["old_prompt"]
    assert compare(reader["old_prompt"], reference.old["before"]) == "same"


def test_calls_that_only_read_keep_every_hit(
    weights: dict[str, str], reference: References, tmp_path: Path
) -> None:
    """``repr(llm)`` (vLLM's ``get_model_inspection``), the weight checksums and functions
    marked read-only, by ``apply_model`` and by ``collective_rpc``: the host tier keeps
    its chunks, kvtier still serves the prompt, and the engine still shares the tier with
    the old weights' ones."""
    extra = tier(tmp_path)
    r = run("weight_route", model=weights["a"], other=weights["b"], extra=extra, route="read_only")
    runs = r["runs"]
    assert runs["from_tier"]["hit_remote"] == PREFIX, runs["from_tier"]
    assert r["side"]["host_slots"][0] > 0, r["side"]
    assert r["side"]["host_slots"][1] == r["side"]["host_slots"][0], "the host tier is kept"
    after = runs["after"]
    assert after["cached"] == PREFIX == after["hit_host"] + after["hit_remote"], after
    assert compare(runs["after"], reference.old["before"]) == "same"
    assert r["side"]["weights_epoch"] == 0 and r["side"]["totals"]["weights_changes"] == 0
    reader = run("old_weights_reader", model=weights["a"], extra=extra)["runs"]
    assert reader["new_prompt"]["hit_remote"] == PREFIX, reader["new_prompt"]
