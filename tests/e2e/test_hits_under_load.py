"""A chunk a finished request stored is a hit for the next request, on a loaded machine.

``make demo`` on a loaded 2-core machine served a document's second question 768 of
its 1,536 tokens: the first question's lookup had ended while fetches of the
document's later chunks were still unreported (the run's first miss reported in one
step, the misses behind it in the next, or a read past ``lookup_timeout_ms``), and the
store planner put those chunks off to a later step that a request with one output token
never has. Here the object tier's reads are slower than ``lookup_timeout_ms`` (the
lookup times out with its first read still going, every time) and a CPU burner runs
beside the engine: the second question must load the whole document from the host tier.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtier import metrics
from kvtier.stats import total_name

from .conftest import run_engine

pytestmark = pytest.mark.e2e

DOC = 4 * 256  # four chunks

#: a CPU burner that stops by itself (the test also kills it)
BURNER = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass\n"


def test_a_chunk_stored_by_a_finished_request_is_a_hit_for_the_next(
    tiny_model: str, tmp_path: Path
) -> None:
    burner = subprocess.Popen([sys.executable, "-c", BURNER.format(seconds=300)])
    try:
        res = run_engine(
            "stored_then_hit",
            env={"KVTIER_TEST_SCENARIO_MODULES": "tests.e2e.load_scenarios"},
            timeout=400,
            model=tiny_model,
            extra={
                "cpu_bytes": "64MiB",
                "remote_url": f"file://{tmp_path / 'tier'}",
                # a slow mount (its reads outlast the lookup): not a local
                # filesystem, so its reads stay on the I/O threads
                "lookup_timeout_ms": 1000,
                "inline_read_ms": 0,
            },
            read_delay_s=4.0,
            doc_tokens=DOC,
        )
    finally:
        burner.kill()
        burner.wait()
    assert res["resets"] == [True, True], "vLLM's own prefix cache was not flushed"
    first, second = res["rows"]
    timeouts = first["delta"].get(total_name(metrics.MISS_TOKENS, ("fetching",)), 0)
    assert timeouts == DOC, f"the first lookup did not time out on a read: {first}"
    host = total_name(metrics.HIT_TOKENS, ("host",))
    assert second["delta"].get(host) == DOC and second["cached"] == DOC, second
    assert second["delta"].get(total_name(metrics.LOOKUP_TOKENS)) == DOC + 32
    idx = res["index"]
    assert idx["invariants"] is True and idx["superseded"] == 0
    assert idx["pending_ops"] == 0 and idx["refs"] == 0
