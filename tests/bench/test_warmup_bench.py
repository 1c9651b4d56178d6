"""``bench/warmup.py`` (issue 61): its options parse, the bench model's chunk is 4 MiB, a
tiny directory-tier run warms every chunk and prints its table and JSON, and a warm-up
that leaves a chunk out fails the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import warmup as warmup_bench  # noqa: E402


def test_defaults_and_the_bench_models_chunk(tmp_path: Path) -> None:
    args = warmup_bench.parse_args([])
    assert args.only == ["file", "redis", "s3"] and args.chunks == 64 and args.io_threads == 4
    cfg, layout, ns = warmup_bench.engine_parts(args, {"remote_url": f"file://{tmp_path}"})
    # 8 layers x K and V x 256 tokens x 8 KV heads x 64 wide x 2 bytes (bf16)
    assert layout.slot_bytes == 8 * 2 * 256 * 8 * 64 * 2 == 4 * 2**20
    assert cfg.warmup and cfg.warmup_budget(64 * layout.slot_bytes) == 64 * layout.slot_bytes
    assert ns.layers == layout.identity()


@pytest.mark.parametrize(
    "argv",
    [
        ["--only", "ftp"],
        ["--chunks", "0"],
        ["--rounds", "x"],
        ["--heads", "3"],
        ["--chunk-tokens", "100"],
        ["--split-rounds", "-1"],
    ],
)
def test_bad_options_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        warmup_bench.parse_args(argv)


def test_tiny_file_run(tmp_path: Path) -> None:
    out = tmp_path / "warmup.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "warmup.py"),
            "--only",
            "file",
            "--chunks",
            "4",
            "--rounds",
            "1",
            "--split-rounds",
            "1",
            "--out",
            str(out),
        ],
        cwd=ROOT / "bench",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| 4 of 4 | 16 |" in proc.stdout, proc.stdout
    assert "where a warm-up's time goes" in proc.stdout
    assert "file: storing 4 chunks" in proc.stderr and "timed rounds" in proc.stderr
    result = json.loads(out.read_text())
    assert result["unavailable"] == {} and result["config"]["chunk_bytes"] == 4 * 2**20
    (row,) = result["tiers"]
    assert row["tier"] == "file" and row["outcome"] == "done"
    assert row["planned"] == row["warmed"] == row["chunks"] == 4 and row["not_warmed"] == []
    assert row["warmup_bytes"] >= 4 * 4 * 2**20 and row["raw_bytes"] == row["warmup_bytes"]
    assert row["warmup_mbps"] > 0 and row["raw_mbps"] > 0 and row["ratio"] > 0
    assert row["met"] == (row["ratio"] >= 0.8) and row["read_threads"] == 2
    split = row["split"]
    assert split["reads"] == 4 and split["verifies"] >= 4 and split["tier_reads_s"] > 0
    assert 0 < split["crc_s"] <= split["tier_reads_s"]


def test_a_chunk_left_out_fails_the_run(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    """The check is real: a warm-up that plans one chunk fewer reports 3 of 4 and exits 1."""
    from kvtier.connectors.worker import warmup

    plan = warmup.plan_warmup
    monkeypatch.setattr(warmup, "plan_warmup", lambda hot, **kw: plan(hot, **kw)[:-1])
    monkeypatch.setattr(sys, "setswitchinterval", lambda _s: None)  # the test process's own
    out = tmp_path / "warmup.json"
    rc = warmup_bench.main(
        [
            "--only",
            "file",
            "--chunks",
            "4",
            "--rounds",
            "1",
            "--split-rounds",
            "0",
            "--out",
            str(out),
        ]
    )
    assert rc == 1
    (row,) = json.loads(out.read_text())["tiers"]
    assert row["warmed"] == 3 and row["not_warmed"] == [3] and row["split"] == {}
    assert "| 3 of 4 |" in capsys.readouterr().out
