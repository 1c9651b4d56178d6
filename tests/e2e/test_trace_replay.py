"""The trace planner against the real engine (issue 18, "Check it against the real engine").

``bench/trace_replay.py --quick`` writes a generated trace (multi-turn sessions, shared
system prompts, Zipf-popular documents, a salted tenant), predicts the host tier's hit
rate with ``kvtier size --trace`` and the planner's simulation, and replays the trace
through a real vLLM engine with kvtier at three host-tier sizes, vLLM's prefix cache
reset before every request. The measured hit rate (kvtier's own counters) must be
within 5 points of the prediction at each size, and rise with the size.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# one worker runs the module: its replay (three engines, minutes) is made once, not once
# per worker that a test of it lands on (make test: --dist loadgroup)
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("trace_replay")]

ROOT = Path(__file__).resolve().parents[2]


# session, not module: xdist runs other modules' tests between this module's, and a module
# fixture was made again after them (the three engines twice, ~260 s each)
@pytest.fixture(scope="session")
def replay(tmp_path_factory: pytest.TempPathFactory, tiny_model: str) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("trace_replay")
    out = work / "result.json"
    # three engines side by side: the hit rates do not depend on timing, start-ups overlap
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "trace_replay.py"),
            "--quick",
            "--parallel",
            "3",
            "--workdir",
            str(work),
            "--model-dir",
            tiny_model,
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_measured_hit_rate_within_5_points_of_the_curve(replay: dict[str, Any]) -> None:
    points = replay["points"]
    assert len(points) == 3
    for p in points:
        assert abs(p["measured_hit_rate"] - p["predicted_hit_rate"]) <= 0.05, p
    measured = [p["measured_hit_rate"] for p in points]
    assert measured[0] > 0 and measured == sorted(measured) and len(set(measured)) == 3, measured
    # the three sizes are meant to be told apart by the curve itself
    predicted = [p["predicted_hit_rate"] for p in points]
    assert all(b - a >= 0.05 for a, b in zip(predicted, predicted[1:], strict=False)), predicted


def test_replay_is_what_the_planner_modelled(replay: dict[str, Any]) -> None:
    t = replay["trace"]
    assert t["bad_lines"] == 0 and t["requests"] == t["generated_requests"] > 50
    for p in replay["points"]:
        # the planner's slot size is the connector's: the tiers hold the same chunk counts
        assert p["slot_bytes"] == replay["planner_slot_bytes"]
        assert p["num_slots"] == p["slots"] == p["cpu_bytes"] // p["slot_bytes"]
        assert p["slots"] >= t["max_request_chunks"]
        assert p["requests"] == t["requests"]
        assert p["prompt_tokens"] == t["prompt_tokens"]
        # vLLM's own cache was empty for every request: everything cached came from kvtier
        assert p["resets_failed"] == 0
        assert p["cached_tokens_vllm"] == p["hit_tokens_host"] == sum(p["per_request_hits"])
        assert p["store_failed"] == 0 and p["load_failed"] == 0
        assert p["evictions"] > 0, "every size should be smaller than the trace"


def test_hash_id_trace_within_5_points_of_the_curve(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: str
) -> None:
    """The same check for a hash-id (Mooncake-format) trace: the planner reads the ids
    without expanding them (`--trace-block-size 32`), the engine gets each id's tokens
    (as `kvtier bench --trace` sends them)."""
    work = tmp_path_factory.mktemp("trace_replay_hash")
    out = work / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "trace_replay.py"),
            "--quick",
            "--hash-ids",
            "--parallel",
            "3",
            "--workdir",
            str(work),
            "--model-dir",
            tiny_model,
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    check_hash_replay(json.loads(out.read_text()))


def check_hash_replay(res: dict[str, Any]) -> None:
    t = res["trace"]
    assert res["format"] == "mooncake" and t["format"] == "mooncake" and t["block_size"] == 32
    assert res["planned_from_ids_as_from_tokens"]
    assert t["bad_lines"] == 0 and t["requests"] == t["generated_requests"] == 60
    points = res["points"]
    assert len(points) == 3
    for p in points:
        assert abs(p["measured_hit_rate"] - p["predicted_hit_rate"]) <= 0.05, p
        assert (
            p["slot_bytes"] == res["planner_slot_bytes"] and p["slots"] >= t["max_request_chunks"]
        )
        assert p["prompt_tokens"] == t["prompt_tokens"] and p["resets_failed"] == 0
        assert p["cached_tokens_vllm"] == p["hit_tokens_host"]
        assert p["store_failed"] == 0 and p["load_failed"] == 0
    measured = [p["measured_hit_rate"] for p in points]
    assert measured[0] > 0 and measured == sorted(measured) and len(set(measured)) == 3
