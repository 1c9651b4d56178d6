"""``kvtier store usage --by tenant`` and ``kvtier store gc --tenant-quotas FILE`` as an
operator runs them (issue 60), on a directory tier whose chunks kvtier's object-tier code
uploaded and whose manifest attributes them as rank 0's writer does."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from kit import collect, payload
from store_kit import DT, NS, SHAPE, file_objects, hits

from kvtier.cli.main import main
from kvtier.config import load_config
from kvtier.keys import KeySpace
from kvtier.objects.manifest import ManifestWriter
from kvtier.objects.remote import RemoteIO
from kvtier.objects.tenant_keys import Pins, TenantKeys
from kvtier.objects.tiers import FileTier

pytestmark = pytest.mark.integration


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["store", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def tenants(tmp_path: Path) -> tuple[Path, dict[str, list[str]]]:
    """team-a: 4 chunks, team-b: 2, one chunk no one's; each older than the next."""
    root = tmp_path / "kv"
    root.mkdir()
    rio = RemoteIO.from_config(
        load_config({"remote_url": f"file://{root}"}, environ={}), environ={}
    )
    space = KeySpace.worker(NS, 0, 0)
    writer = ManifestWriter(rio.tier, None, lambda: NS)
    owned: dict[str, list[str]] = {"team-a": [], "team-b": [], "none": []}
    order = ["none", "team-a", "team-b", "team-a", "team-a", "team-b", "team-a"]
    for i, who in enumerate(order):
        key = space.key(os.urandom(16))
        assert rio.submit_put(i + 1, key, payload(i), dtype=DT, shape=SHAPE)
        owned[who].append(key)
    assert rio.flush(10.0) == 0 and all(r.ok for r in collect(rio, len(order)).values())
    now = time.time()
    seen: dict[str, int] = {}
    for i, who in enumerate(order):
        key = owned[who][seen.get(who, 0)]
        seen[who] = seen.get(who, 0) + 1
        t = now - 1000 + 100 * i
        os.utime(rio.tier.path(key), (t, t))  # type: ignore[attr-defined]
    writer.add_tenants(TenantKeys.of({t: owned[t] for t in ("team-a", "team-b")}))
    assert writer.refresh() is not None
    rio.close()
    return root, owned


def test_usage_by_tenant_table_and_json(tenants, capsys) -> None:
    root, owned = tenants
    rc, out, _ = run(capsys, "usage", f"file://{root}", "--by", "tenant", "--json")
    assert rc == 0
    doc = json.loads(out)
    held = file_objects(root)
    gen = NS.generation()
    assert [g["id"] for g in doc["generations"]] == [gen]
    by = doc["generations"][0]["tenants"]
    assert {t: n["chunks"] for t, n in by.items()} == {"team-a": 4, "team-b": 2, "unattributed": 1}
    assert by["team-a"]["bytes"] == sum(held[k] for k in owned["team-a"])
    assert doc["tenants"] == by
    rc, out, _ = run(capsys, "usage", f"file://{root}", "--by", "tenant")
    lines = out.splitlines()
    assert rc == 0 and lines[0].split() == ["GENERATION", "MODEL", "TENANT", "BYTES", "CHUNKS"]
    assert lines[1].split()[:3] == [gen, "org/tiny-a", "team-a"] and lines[1].endswith(" 4")
    assert [ln.split()[1] for ln in lines if ln.startswith("total")] == [
        "team-a",
        "team-b",
        "unattributed",
    ]
    rc, out, _ = run(capsys, "usage", f"file://{root}")
    assert rc == 0 and "TENANT" not in out and "team-a" not in out


@pytest.mark.parametrize("form", ["json", "yaml"])
def test_gc_tenant_quotas_dry_run_then_gc(tenants, capsys, tmp_path, form) -> None:
    root, owned = tenants
    size = max(file_objects(root)[k] for k in owned["team-a"])
    quotas = tmp_path / f"quotas.{form}"
    if form == "json":
        quotas.write_text(json.dumps({"team-a": str(2 * size), "*": "1GiB"}))
    else:
        quotas.write_text(f"team-a: {2 * size}\n'*': 1GiB\n")
    before = file_objects(root)
    rc, out, _ = run(capsys, "gc", f"file://{root}", "--tenant-quotas", str(quotas), "--dry-run")
    assert rc == 0 and file_objects(root) == before, out
    assert "would delete 2 chunks" in out and "of tenant team-a: over its quota" in out
    rc, out, _ = run(capsys, "gc", f"file://{root}", "--tenant-quotas", str(quotas), "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["deleted_by_tenant"] == {
        "team-a": {"bytes": sum(before[k] for k in owned["team-a"][:2]), "chunks": 2}
    }
    assert [(g["reason"], g["tenant"]) for g in doc["generations"]] == [("tenant_quota", "team-a")]
    left = set(file_objects(root))
    assert left == set(before) - set(owned["team-a"][:2]), "not team-a's two oldest"
    extra = {"remote_url": f"file://{root}"}
    assert hits(extra, owned["team-a"]) == [False, False, True, True]
    assert hits(extra, owned["team-b"] + owned["none"]) == [True] * 3


@pytest.mark.parametrize(
    "text, why",
    [
        ('{"team-a": "lots"}', "size"),
        ('{"bad name!": "1GiB"}', "tenant names"),
        ('{"team-a": 0}', "greater than zero"),
        ("[1, 2]", "not an object"),
        ("{: nope", "not JSON or YAML"),
    ],
)
def test_a_bad_quota_file_is_exit_2_and_deletes_nothing(
    tenants, capsys, tmp_path, text, why
) -> None:
    root, _ = tenants
    quotas = tmp_path / "quotas"
    quotas.write_text(text)
    before = file_objects(root)
    rc, _, err = run(capsys, "gc", f"file://{root}", "--tenant-quotas", str(quotas))
    assert rc == 2 and why in err and err.startswith("kvtier store gc: error:"), err
    assert file_objects(root) == before
    rc, _, err = run(capsys, "gc", f"file://{root}", "--tenant-quotas", str(tmp_path / "no"))
    assert rc == 2 and "--tenant-quotas" in err and file_objects(root) == before


def test_gc_keeps_a_pinned_chunk_and_says_so(tenants, capsys, tmp_path) -> None:
    root, owned = tenants
    tier = FileTier(str(root), background_sweep=False)
    writer = ManifestWriter(tier, None, lambda: NS)  # an engine that pinned team-a's oldest
    writer.add_pins(Pins.of({owned["team-a"][0]: time.time() + 3600}))
    assert writer.refresh() is not None
    tier.close()
    size = max(file_objects(root)[k] for k in owned["team-a"])
    quotas = tmp_path / "quotas.json"
    quotas.write_text(json.dumps({"team-a": 2 * size}))
    rc, out, _ = run(capsys, "gc", f"file://{root}", "--tenant-quotas", str(quotas))
    assert rc == 0 and "kept 1 chunks pinned in their manifest" in out, out
    left = set(file_objects(root))
    assert owned["team-a"][0] in left and not set(owned["team-a"][1:3]) & left
