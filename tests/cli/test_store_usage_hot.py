"""``kvtier store usage`` shows each generation's hot-set size: the keys of the hot list
its engines keep in its manifest (kvtier.hotset), "-" for a generation without one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvtier.cli.main import main
from kvtier.hotset import HotList
from kvtier.keys import Namespace
from kvtier.objects.manifest import ManifestWriter
from kvtier.objects.tiers import FileTier

NS = Namespace(
    model="org/tiny-a",
    revision=None,
    dtype="bfloat16",
    kv_cache_dtype="auto",
    block_size=16,
    chunk_size=64,
    tp_size=1,
    fingerprint="a" * 32,
    layers="L0",
)
NS_B = dataclasses.replace(NS, model="org/tiny-b", fingerprint="b" * 32)
T0 = 1_800_000_000.0


def _write(tier: FileTier, ns: Namespace, hot_keys: int, at: float) -> None:
    w = ManifestWriter(tier, None, lambda: ns, clock=lambda: at)
    if hot_keys:
        w.add_heat(HotList(at, tuple((i.to_bytes(32, "big"), 1.0) for i in range(hot_keys))))
    assert w.refresh() is not None


def test_usage_shows_each_generations_hot_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FileTier(str(tmp_path)) as tier:
        _write(tier, NS, 5, T0)
        _write(tier, NS_B, 0, T0 + 60)
    assert main(["store", "usage", f"file://{tmp_path}", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {g["id"]: g["hot_chunks"] for g in doc["generations"]} == {
        NS.generation(): 5,
        NS_B.generation(): 0,
    }
    assert main(["store", "usage", f"file://{tmp_path}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = lines[0].split()
    assert head[:6] == ["GENERATION", "MODEL", "NAMESPACE", "BYTES", "CHUNKS", "HOT"], lines[0]
    at = lines[0].index("HOT") + len("HOT")  # right-aligned under its header
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert rows[NS.generation()][:at].endswith(" 5")
    assert rows[NS_B.generation()][:at].endswith(" 0")


def test_a_generation_without_a_manifest_shows_no_hot_set() -> None:
    from kvtier.cli.store import usage_table

    doc = {
        "total_bytes": 10,
        "total_chunks": 1,
        "generations": [
            {
                "id": "unknown",
                "model": None,
                "namespace": None,
                "bytes": 10,
                "chunks": 1,
                "first_seen": None,
                "last_seen": None,
                "hot_chunks": None,
            }
        ],
    }
    head, row = usage_table(doc).splitlines()[:2]
    at = head.index("HOT") + len("HOT")
    assert row[:at].endswith(" -") and row[: at - 3].rstrip().endswith(" 1"), row
