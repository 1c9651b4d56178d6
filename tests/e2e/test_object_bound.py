"""A bounded directory object tier (``file_max_bytes``) in a real vLLM engine (CPU build,
tiny model): written several times its bound, the directory never holds more than the
bound, and the object tier's scale-1 ghost (kvtier.whatif.objects) counts the remote hits
the engine measured (exactly with one write thread, within 3 points with the default).

Before the bound was kept on the write path, the sweep thread (at most one sweep a
second) let this engine run an 8 MiB directory to 27 MB between sweeps, and the sweep
evicted the generation's manifest as the oldest object.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import run_engine

pytestmark = pytest.mark.e2e

ENV = {"KVTIER_TEST_SCENARIO_MODULES": "tests.e2e.object_bound_scenarios"}
SCALES = ("0.5", "1", "2", "4", "8")
#: one object: a chunk of 256 tokens x 4 layers x 2 x 2 kv heads x 64 x bf16 (512 KiB)
#: and its header (about 130 bytes)
CHUNK = 512 * 1024
MiB = 1 << 20


def _run(tiny_model: str, tmp_path: Path, max_bytes: int, **args: Any) -> dict[str, Any]:
    root = tmp_path / "kv"
    extra = {"cpu_bytes": "6MiB", "remote_url": f"file://{root}", "file_max_bytes": max_bytes}
    extra.update(args.pop("extra", {}))
    return run_engine(
        "bounded_zipf", model=tiny_model, extra=extra, root=str(root), env=ENV, **args
    )


def _check_bound(r: dict[str, Any], max_bytes: int) -> None:
    idx = r["index"]
    assert idx["invariants"] is True and idx["refs"] == 0, idx
    totals = idx["totals"]
    written = totals["upload_ok"] * CHUNK
    assert written > 3 * max_bytes, (written, max_bytes)  # well over the bound
    assert totals["upload_failed"] == 0, totals
    # on disk, writes in flight included: never past the bound, sampled every 10 ms
    assert r["samples"] > 50, r["samples"]
    assert r["peak"] <= max_bytes, (r["peak"], max_bytes)
    assert max(r["peaks"]) <= max_bytes, r["peaks"]
    assert r["after"]["bytes"] <= max_bytes, r["after"]
    assert r["after"]["bytes"] > 0.8 * max_bytes  # used up to its bound, not emptied
    assert r["manifests"] == 1  # the generation's claim is never evicted


def test_directory_stays_within_file_max_bytes(tiny_model: str, tmp_path: Path) -> None:
    """The engine's own write threads, back to back (no settling between requests): the
    rate that ran an 8 MiB directory to three times its bound."""
    r = _run(tiny_model, tmp_path, 8 * MiB, settle_between=False)
    _check_bound(r, 8 * MiB)


def test_object_ghost_at_scale_one_predicts_measured_remote_hits(
    tiny_model: str, tmp_path: Path
) -> None:
    """The ghosts of issue #52 against the real directory tier: Zipf over 32 documents
    (128 chunks, four times the bound), each request's uploads landed before the next
    looks up. Scale 1 counts the remote hits measured, larger ghosts never fewer.

    Exact with one write thread (``io_threads: 2``): the objects' mtimes, the tier's
    eviction order, then follow the order the uploads were planned in. With several
    write threads a request's chunks land in any order, and where an eviction splits a
    document the real tier may keep a later chunk instead of the first: the ghost, which
    models in-order landing, then counts more (0.3 to 1 point here alone, 3.4 and 3.9
    points on a loaded 2-core machine): not modelled yet (issue #52), so not asserted.
    The bound is away from a multiple of the chunk size at every
    scale and at low water: objects carry a header of about 130 bytes and the manifest a
    few hundred, which the ghost, sizing objects at the chunk's payload, does not count
    (at exactly 16 MiB the ghost would hold one chunk more than the directory).
    """
    max_bytes = 16 * MiB + 3 * CHUNK // 8  # 32.375 chunks: 32 objects in either count
    r = _run(tiny_model, tmp_path, max_bytes, n_docs=32, n_requests=96, extra={"io_threads": 2})
    _check_bound(r, max_bytes)
    assert r["ghost_capacity"] == [round(max_bytes * float(s)) for s in SCALES]
    totals = r["index"]["totals"]
    lookup, remote = totals["lookup_tokens"], totals["hit_tokens_remote"]
    got = {s: totals[f"whatif_hit_tokens_remote_{s}"] for s in SCALES}
    print(f"remote hit rate {remote / lookup:.3f}, ghosts {got}")
    assert 0.1 * lookup < remote < lookup, totals
    assert got["1"] == remote, (got, remote)
    assert list(got.values()) == sorted(got.values()), got
    assert got["0.5"] < got["1"] < got["2"] <= lookup, got
