"""``bench/tier_throughput.py``: its options parse, and a tiny file-tier run prints both
tables with real rows (no servers: only the file backend)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import tier_throughput  # noqa: E402


def test_defaults_cover_the_issue() -> None:
    args = tier_throughput.parse_args([])
    assert args.threads == [1, 2, 4, 8]
    assert args.concurrency == [4, 16]
    assert args.chunk_mib == 4.0
    assert args.only == ["file", "s3", "redis"]


def test_lists_and_backends_parse() -> None:
    args = tier_throughput.parse_args(
        ["--threads", "2,8", "--concurrency", "16", "--only", "file,redis"]
    )
    assert args.threads == [2, 8] and args.concurrency == [16]
    assert args.skip_s3 and not args.skip_redis and not args.skip_file


@pytest.mark.parametrize(
    "argv",
    [["--threads", "0"], ["--threads", "a,b"], ["--only", "ftp"], ["--concurrency", "32"]],
)
def test_bad_options_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        tier_throughput.parse_args(argv)


def test_tiny_file_run(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "tier_throughput.py"),
            "--only",
            "file",
            "--threads",
            "1,2",
            "--concurrency",
            "1,2",
            "--chunks",
            "2",
            "--chunk-mib",
            "0.25",
            "--rounds",
            "1",
            "--round-mib",
            "1",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Reads into host slots" in proc.stdout
    rows = json.loads(out.read_text())
    assert len(rows["putget"]) == 4
    into = rows["into"]
    assert {(r["io_threads"], r["concurrency"]) for r in into} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    for r in into:
        assert r["backend"] == "file"
        assert r["async_gbps_median"] > 0 and r["raw_gbps_median"] > 0


def test_cluster_flags_parse() -> None:
    assert tier_throughput.parse_args([]).cluster  # make bench-tiers includes it
    assert not tier_throughput.parse_args(["--only", "file"]).cluster
    assert not tier_throughput.parse_args(["--skip-cluster"]).cluster
    args = tier_throughput.parse_args(["--only-cluster"])
    assert args.cluster and args.skip_putget and args.skip_into and args.skip_encryption
    assert args.skip_compression and args.skip_s3 and args.skip_file and not args.skip_redis
    with pytest.raises(SystemExit):
        tier_throughput.parse_args(["--spread-keys", "0"])


def test_tiny_cluster_run(tmp_path: Path) -> None:
    """One redis-server and a 3-primary cluster on loopback (started by the bench): both
    targets' put/get rows against redis-py, and the key spread over the 3 primaries."""
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "tier_throughput.py"),
            "--only-cluster",
            "--chunks",
            "2",
            "--concurrency",
            "1",
            "--chunk-mib",
            "0.25",
            "--rounds",
            "1",
            "--putget-threads",
            "2",
            "--spread-keys",
            "300",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "3-primary cluster" in proc.stdout
    rows = json.loads(out.read_text())
    assert rows["putget"] == [] and rows["into"] == []
    cluster = rows["cluster"]
    assert [(r["backend"], r["op"]) for r in cluster] == [
        (t, op) for t in ("redis x1", "cluster x3") for op in ("put", "get", "put", "get")
    ]
    for r in cluster:
        assert r["kvtier_mbps_best"] > 0 and r["raw_mbps_best"] > 0 and r["ratio_median"] > 0
    spread = rows["cluster_key_spread"]
    assert spread["keys"] == 300 and len(spread["per_primary"]) == 3
    assert sum(spread["per_primary"].values()) == 300
    assert 0 < spread["min_share"] <= 1 / 3 <= spread["max_share"] < 1
