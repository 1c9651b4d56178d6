"""Generations written by real vLLM engines, seen and collected by ``kvtier store``.

Two engines with different weights write into one directory tier, one after the other:
each writes its generation's manifest (rank 0, refreshed at shutdown); ``kvtier store
usage`` shows two generations whose chunks and bytes are the files'; ``kvtier store gc
--dead-after`` right after the second engine stopped deletes the first generation only,
and a new engine of each model then misses, or hits, accordingly.
"""

from __future__ import annotations

import calendar
import json
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote

import pytest

from kvtier.cli.tinymodel import build_tiny_llama
from tests.e2e.conftest import run_engine

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


def store(*argv: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "store", *argv, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def by_generation(root: Path) -> dict[str, list[int]]:
    """generation -> sizes of its chunk files (its manifest's size last)."""
    gens: dict[str, list[int]] = {}
    for path in root.rglob("gen-*"):
        gen, name = unquote(path.name).removeprefix("gen-").split("/")
        sizes = gens.setdefault(gen, [])
        sizes.insert(len(sizes) if name == "manifest" else 0, path.stat().st_size)
    return gens


def seen(text: str) -> float:
    return float(calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ")))


def test_usage_and_gc_of_two_engines_generations(
    tiny_model: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    other = str(build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny4-other", seed=1))
    root = tmp_path / "kv"
    url = f"file://{root}"
    extra = {"cpu_bytes": "64MiB", "remote_url": url}
    run_engine("remote_writer", model=tiny_model, extra=extra)
    run_engine("remote_writer", model=other, extra=extra)

    usage = store("usage", url)
    files = by_generation(root)
    rows = {g["model"]: g for g in usage["generations"]}
    assert set(rows) == {tiny_model, other}, usage
    for model, row in rows.items():
        sizes = files[row["id"]]
        assert row["chunks"] == len(sizes) - 1 > 0, (model, row, sizes)
        assert row["bytes"] == sum(sizes)
    assert usage["total_bytes"] == sum(map(sum, files.values()))
    first, second = rows[tiny_model], rows[other]
    now = time.time()
    age_first, age_second = now - seen(first["last_seen"]), now - seen(second["last_seen"])
    assert age_first - age_second > 4, (first, second)  # the second engine ran meanwhile

    dead_after = f"{int((age_first + age_second) / 2) + 1}s"
    gc = store("gc", url, "--dead-after", dead_after)
    assert [g["id"] for g in gc["generations"]] == [first["id"]], gc
    assert gc["deleted_chunks"] == first["chunks"]
    assert set(by_generation(root)) == {second["id"]}

    gone = run_engine("remote_reader", model=tiny_model, extra=extra)
    assert gone["index"]["totals"]["hit_tokens_remote"] == 0, gone["index"]["totals"]
    kept = run_engine("remote_reader", model=other, extra=extra)
    assert kept["index"]["totals"]["hit_tokens_remote"] >= 1024, kept["index"]["totals"]
