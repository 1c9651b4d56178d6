"""``kvtier demo`` end to end: two real engines, host-tier hits, then restart hits."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def test_demo_shows_host_and_restart_hits(tmp_path: Path) -> None:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from kvtier.cli.main import main; raise SystemExit(main())",
            "demo",
            "--small",
            "--docs",
            "2",
            "--questions",
            "2",
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = proc.stdout
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+[12]\s+\d+\s+\d+\s", line)]
    assert len(rows) == 2 * 2 + 2  # engine 1: docs x questions, engine 2: one per doc
    # engine doc q prompt kvtier source vllm missed ttft
    engine1 = [r for r in rows if r[0] == "1"]
    engine2 = [r for r in rows if r[0] == "2"]
    assert all(r[4] == "0" and r[5] == "-" for r in engine1[:2]), "first questions are cold"
    assert all(r[7] == "absent:1536" for r in engine1[:2]), out  # the document: 6 chunks
    # a later question loads the whole document from the host tier, and nothing of it
    # comes from vLLM's own cache: reset_prefix_cache() said it flushed it
    assert all(r[4] == "1536" and r[5] == "host" and r[7] == "-" for r in engine1[2:]), out
    assert all(int(r[4]) >= 1024 and r[5] == "disk" for r in engine2), out
    assert all(r[6] == "0" for r in rows), out
    assert "could not be flushed" not in out
    served = int(re.search(r"tokens served by kvtier\s+(\d+)", out).group(1))
    assert served == sum(int(r[4]) for r in rows)
    assert "TTFT after restart (disk)" in out
    # engine 2 found engine 1's chunks: it checked 1024 tokens of them (canary_check_tokens:
    # the check document's first 4 chunks, at once) against vLLM's own KV before loading
    assert re.search(r"canary \(engine 2\)\s+4 match, 0 mismatch", out), out
    assert any((tmp_path / "object-tier").rglob("*")), "engine 1 wrote the directory tier"
