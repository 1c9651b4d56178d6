"""``bench/tier_throughput.py --only-encryption``: a tiny file-tier run prints the
sealed ÷ plain table with real rows, and the machine's AES-GCM speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import tier_throughput  # noqa: E402


def test_the_encryption_table_is_on_by_default_and_can_run_alone() -> None:
    assert not tier_throughput.parse_args([]).skip_encryption
    args = tier_throughput.parse_args(["--only-encryption"])
    assert args.skip_putget and args.skip_into and not args.skip_encryption


def test_tiny_file_run(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "tier_throughput.py"),
            "--only",
            "file",
            "--only-encryption",
            "--concurrency",
            "2",
            "--chunks",
            "2",
            "--chunk-mib",
            "0.25",
            "--rounds",
            "1",
            "--putget-threads",
            "2",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Encryption: AES-256-GCM on one core" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["putget"] == [] and doc["into"] == []
    rows = doc["encryption"]
    assert [(r["mode"], r["op"]) for r in rows] == [
        ("sync, 1 thread", "put"),
        ("sync, 1 thread", "get"),
        ("RemoteIO, 1 threads", "put"),
        ("RemoteIO, 1 threads", "get"),
    ]
    for r in rows:
        assert r["backend"] == "file" and r["chunk_mib"] == 0.25
        assert r["plain_gbps_median"] > 0 and r["sealed_gbps_median"] > 0
        assert r["sealed_over_plain"] > 0
    assert doc["aes_gcm"]["seal_gbps"] > 0 and doc["aes_gcm"]["open_gbps"] > 0
    (hit,) = doc["restart_hit_fetch"]
    assert hit["backend"] == "file" and hit["chunks"] == 8 and hit["runs"] >= 15
    assert hit["plain_ms_median"] > 0 and hit["sealed_ms_median"] > 0
    assert "Restart-hit fetch" in proc.stdout
