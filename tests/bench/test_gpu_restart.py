"""``bench/gpu_restart.py`` on the CPU (KV on the CPU, CpuCopier): a tiny run reads every
chunk back through kvtier bit-exact (the script checks it after every kvtier run) and
reports each side's time, with kvtier's own cost as kvtier minus raw."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_restart  # noqa: E402


@pytest.fixture(autouse=True)
def _process_settings_restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The bench sets process-wide values (the tier's hash pieces, Python's thread switch
    interval) as its own process would; run in the tests' process, each test gives them
    back, so a later test in it sees kvtier's own."""
    from kvtier.objects import codec

    monkeypatch.setattr(codec, "HASH_PIECE", codec.HASH_PIECE)
    monkeypatch.setattr(codec, "SMALL_HASH_PIECE", codec.SMALL_HASH_PIECE)
    switch = sys.getswitchinterval()
    yield
    sys.setswitchinterval(switch)


@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_a_tiny_cpu_run_reports_every_side(tmp_path, capsys, cache: str) -> None:
    out = tmp_path / "r.json"
    rc = gpu_restart.main(
        [
            "--tokens",
            "512",
            "1024",
            "--layers",
            "2",
            "--heads",
            "2",
            "--head-dim",
            "16",
            "--repeats",
            "2",
            "--file-cache",
            cache,
            "--dir",
            str(tmp_path),
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["device"] == "CPU (no CUDA)" and result["filesystem"]
    rows = result["rows"]
    assert [r["tokens"] for r in rows] == [512, 1024]
    assert [r["chunks"] for r in rows] == [2, 4]  # 256-token chunks
    for r in rows:
        assert r["file_cache"] == cache and r["read_threads"] == 2
        for side in ("raw", "kvtier_inline", "kvtier_threads"):
            assert 0 < r[f"{side}_read_ms"] <= r[f"{side}_ms"]
        for side in ("kvtier_inline", "kvtier_threads"):
            assert r[f"{side}_own_ms"] == pytest.approx(r[f"{side}_ms"] - r["raw_ms"])
        assert r["goal_ms"] == max(10.0, 0.2 * r["raw_ms"])
    printed = capsys.readouterr().out
    assert "  1024 tokens, 4 x" in printed and "RESULT " in printed
    assert not list(tmp_path.glob("kvtier-gpu-restart-*")), "the tier's directory is removed"


def test_the_hash_piece_is_the_one_asked_for_and_reads_stay_exact(tmp_path, monkeypatch) -> None:
    from kvtier.objects import codec

    out = tmp_path / "r.json"
    assert (
        gpu_restart.main(
            [
                "--tokens",
                "512",
                "--layers",
                "2",
                "--heads",
                "2",
                "--head-dim",
                "16",
                "--repeats",
                "1",
                "--hash-piece-kib",
                "8",
                "--dir",
                str(tmp_path),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert codec.HASH_PIECE == 8 << 10
    assert json.loads(out.read_text())["args"]["hash_piece_kib"] == 8
    with pytest.raises(SystemExit):
        gpu_restart.main(["--hash-piece-kib", "0"])


def test_split_times_each_part_of_the_read_on_the_same_threads(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    assert (
        gpu_restart.main(
            [
                "--tokens",
                "512",
                "--layers",
                "2",
                "--heads",
                "2",
                "--head-dim",
                "16",
                "--repeats",
                "1",
                "--split",
                "--dir",
                str(tmp_path),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    row = json.loads(out.read_text())["rows"][0]
    for side in ("tier_read", "tier_read_hashed", "hash_only"):
        assert row[f"{side}_ms"] > 0
    assert "split on 2 threads: preadv into the slots" in capsys.readouterr().out


def test_a_busy_engine_thread_with_the_short_interval_or_without_reads_the_same(
    tmp_path, capsys
) -> None:
    for us in ("50", "0"):
        out = tmp_path / f"r{us}.json"
        assert (
            gpu_restart.main(
                [
                    "--tokens",
                    "512",
                    "--layers",
                    "2",
                    "--heads",
                    "2",
                    "--head-dim",
                    "16",
                    "--repeats",
                    "1",
                    "--engine-thread",
                    "busy",
                    "--fetch-switch-us",
                    us,
                    "--dir",
                    str(tmp_path),
                    "--json",
                    str(out),
                ]
            )
            == 0
        )
        args = json.loads(out.read_text())["args"]
        assert args["engine_thread"] == "busy" and args["fetch_switch_us"] == int(us)
    assert "engine thread busy; fetch_switch_us 0" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gpu_restart.main(["--engine-thread", "spinning"])
