"""The e2e run (``make test``) sends a module's tests that share engines to one worker with
``--dist loadgroup`` and ``xdist_group`` marks. A pytest and pytest-xdist pair where the
marks group nothing still passes every test, only slower (each worker starts the shared
engines again: pytest 9.2 with xdist 3.8 did this, unseen, for minutes of CI): this checks
the installed pair on a module of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MODULE = """
import os
import pytest

pytestmark = pytest.mark.xdist_group("shared")


def test_one(): print("RAN one", os.environ["PYTEST_XDIST_WORKER"])
def test_two(): print("RAN two", os.environ["PYTEST_XDIST_WORKER"])
def test_three(): print("RAN three", os.environ["PYTEST_XDIST_WORKER"])
"""
OTHER = """
import os


def test_a(): print("RAN a", os.environ["PYTEST_XDIST_WORKER"])
def test_b(): print("RAN b", os.environ["PYTEST_XDIST_WORKER"])
def test_c(): print("RAN c", os.environ["PYTEST_XDIST_WORKER"])
"""


def test_loadgroup_runs_a_group_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(MODULE)
    (tmp_path / "test_other.py").write_text(OTHER)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-rP",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = dict(line.split()[1:3] for line in proc.stdout.splitlines() if line.startswith("RAN "))
    assert set(ran) == {"one", "two", "three", "a", "b", "c"}, proc.stdout[-3000:]
    workers = {ran[t] for t in ("one", "two", "three")}
    assert len(workers) == 1, f"the group ran on {sorted(workers)}: xdist_group has no effect"
