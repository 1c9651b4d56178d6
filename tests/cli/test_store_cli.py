"""``kvtier store usage | gc | verify`` as an operator runs it: real tiers (a directory,
moto's S3 server, redis-server) holding generations kvtier's object-tier code wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from store_kit import NS, NS_B, file_objects, hits, write_engine

from kvtier.cli.main import main
from kvtier.objects.manifest import manifest_key
from kvtier.objects.tiers import FileTier

pytestmark = pytest.mark.integration

DAY = 86400.0


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["store", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def two_generations(tmp_path: Path):
    root = tmp_path / "kv"
    root.mkdir()
    extra = {"remote_url": f"file://{root}"}
    dead = time.time() - 10 * DAY
    a = write_engine(extra, NS, seed=1, clock=lambda: dead)
    b = write_engine(extra, NS_B, seed=2)
    return root, extra, a, b


def test_usage_json_and_table(two_generations, capsys) -> None:
    root, _, a, b = two_generations
    rc, out, _ = run(capsys, "usage", f"file://{root}", "--json")
    assert rc == 0
    doc = json.loads(out)
    held = file_objects(root)
    assert doc["total_bytes"] == sum(held.values()) and doc["total_chunks"] == 16
    assert [(g["id"], g["model"], g["chunks"]) for g in doc["generations"]] == [
        (b.generation, "org/tiny-b", 8),
        (a.generation, "org/tiny-a", 8),
    ]
    rc, out, _ = run(capsys, "usage", f"file://{root}")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["GENERATION", "MODEL", "NAMESPACE", "BYTES", "CHUNKS"]
    assert lines[1].startswith(b.generation) and "org/tiny-b" in lines[1]
    assert lines[-1].startswith("total") and lines[-1].split()[-1] == "16"


def test_gc_dry_run_then_gc(two_generations, capsys) -> None:
    root, extra, a, b = two_generations
    before = file_objects(root)
    rc, out, _ = run(capsys, "gc", f"file://{root}", "--dry-run")
    assert rc == 0 and file_objects(root) == before, "--dry-run deleted"
    assert "would delete 8 chunks" in out and a.generation in out and "dead" in out
    rc, out, _ = run(capsys, "gc", f"file://{root}", "--dead-after", "7d", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["dry_run"] is False and doc["deleted_chunks"] == 8
    assert [g["id"] for g in doc["generations"]] == [a.generation]
    assert set(file_objects(root)) == {*b.keys, manifest_key(b.generation)}
    assert hits(extra, a.keys) == [False] * 8 and hits(extra, b.keys) == [True] * 8
    # a budget: the least recently used chunks go until the total fits
    total = sum(file_objects(root).values())
    rc, out, _ = run(capsys, "gc", f"file://{root}", "--max-bytes", str(total // 2))
    assert rc == 0 and "least recently used" in out
    assert sum(file_objects(root).values()) <= total // 2


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["gc", "{url}", "--max-bytes", "lots"], "--max-bytes"),
        (["gc", "{url}", "--max-bytes", "-5GiB"], "--max-bytes"),
        (["gc", "{url}", "--dead-after", "soon"], "--dead-after"),
        (["gc", "{url}", "--dead-after", "7 fortnights"], "--dead-after"),
        (["verify", "{url}", "--sample", "0"], "--sample"),
        (["gc", "ftp://host/kv"], "remote_url"),
        (["gc", "{url}/nowhere"], "no such directory"),
        (["gc", "{url}", "--config", "{tmp}/missing.json"], "--config"),
    ],
)
def test_bad_input_is_exit_2_naming_the_cause_and_deletes_nothing(
    two_generations, capsys, tmp_path, argv, says
) -> None:
    root = two_generations[0]
    before = file_objects(root)
    argv = [a.format(url=f"file://{root}", tmp=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as exit_:  # argparse's own refusals
        code = main(["store", *argv])
        raise SystemExit(code)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2, (out, err)
    assert says in err, err
    assert file_objects(root) == before


def test_a_signed_tier_without_its_key_is_refused(tmp_path, capsys, monkeypatch) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    extra = {"remote_url": f"file://{root}", "hmac_key_env": "KVT_CLI_HMAC"}
    env = {"KVT_CLI_HMAC": "s" * 64}
    eng = write_engine(extra, NS, seed=3, clock=lambda: time.time() - 10 * DAY, environ=env)
    before = file_objects(root)
    rc, _, err = run(capsys, "gc", f"file://{root}")
    assert rc == 2 and "signed" in err and "--config" in err
    assert file_objects(root) == before
    # with the engines' config and key it verifies, and gc goes ahead
    config = tmp_path / "extra.json"
    config.write_text(json.dumps({"kv_connector_extra_config": extra}))
    rc, _, err = run(capsys, "gc", f"file://{root}", "--config", str(config))
    assert rc == 2 and "'hmac_key_env'" in err, "the key's variable is not set: named"
    monkeypatch.setenv("KVT_CLI_HMAC", env["KVT_CLI_HMAC"])
    rc, out, _ = run(capsys, "gc", f"file://{root}", "--config", str(config))
    assert rc == 0 and file_objects(root) == {}
    assert eng.generation in out


def test_wrong_redis_password_and_missing_bucket_are_exit_2(services, s3_env, capsys) -> None:
    server = services.redis(password="right-password")
    rc, _, err = run(capsys, "usage", f"redis://:wrong@{server.host}:{server.port}/0")
    assert rc == 2 and "right-password" not in err and "wrong" not in err.split("error:")[0]
    assert "redis" in err
    rc, _, err = run(capsys, "gc", "s3://no-such-bucket-kvtier/kv", "--json")
    assert rc == 2 and "NoSuchBucket" in err


def test_verify_reports_bad_chunks_and_deletes_them_when_asked(tmp_path, capsys) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    eng = write_engine({"remote_url": f"file://{root}"}, NS, seed=4)
    rc, out, _ = run(capsys, "verify", f"file://{root}")
    assert rc == 0 and "checked 9 objects: 0 bad" in out
    tier = FileTier(str(root), background_sweep=False)
    path = Path(tier.path(eng.keys[0]))
    path.write_bytes(path.read_bytes()[:-10])
    rc, out, _ = run(capsys, "verify", f"file://{root}", "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["bad"] == 1 and doc["by_kind"] == {"truncated": 1}, doc
    assert path.exists()
    rc, out, _ = run(capsys, "verify", f"file://{root}", "--delete-bad")
    assert rc == 1 and "1 deleted" in out and not path.exists()
    tier.close()


def test_store_help_explains_every_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "store", "gc", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in ("--max-bytes", "--dead-after", "--dry-run", "--json", "--config"):
        assert flag in out
    assert "IDLETIME" in out and "LastModified" in out and "mtime" in out
    top = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "store" in top


def test_without_a_url_the_tier_is_the_engines_own(
    two_generations, capsys, tmp_path, monkeypatch
) -> None:
    root, extra, a, b = two_generations
    rc, _, err = run(capsys, "usage")
    assert rc == 2 and "no tier" in err
    config = tmp_path / "extra.json"
    config.write_text(json.dumps({**extra, "file_max_bytes": "1GiB"}))
    rc, out, _ = run(capsys, "usage", "--config", str(config), "--json")
    assert rc == 0 and json.loads(out)["total_chunks"] == 16
    # the engines' override wins over the config's remote_url, as in an engine
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setenv("KVTIER_REMOTE_URL", f"file://{other}")
    rc, out, _ = run(capsys, "usage", "--config", str(config), "--json")
    assert rc == 0 and json.loads(out)["total_chunks"] == 0
    rc, out, _ = run(capsys, "usage", f"file://{root}", "--json")  # a URL given wins
    assert rc == 0 and json.loads(out)["total_chunks"] == 16


def _ledger_sum(root: Path) -> int:
    """The engines' shared count of a bounded directory (``.kvtier-usage``)."""
    from kvtier.objects.tiers import file_ledger

    data = (root / file_ledger.LEDGER_NAME).read_bytes()
    return sum(file_ledger._LEDGER_SLOTS.unpack_from(data, file_ledger._LEDGER_HEAD.size))


def test_gc_and_delete_bad_on_a_bounded_directory_keep_the_engines_shared_count(
    tmp_path, capsys
) -> None:
    """gc's and verify --delete-bad's deletions change the engines' ledger as the
    engines' own deletes do: after them its count is what the disk holds. Before, they
    deleted behind its back: the engines counted bytes long gone until their next scan."""
    root = tmp_path / "kv"
    root.mkdir()
    extra = {"remote_url": f"file://{root}", "file_max_bytes": "1GiB"}
    a = write_engine(extra, NS, seed=1, clock=lambda: time.time() - 10 * DAY)
    b = write_engine(extra, NS_B, seed=2)
    assert _ledger_sum(root) == sum(file_objects(root).values())
    rc, _, _ = run(capsys, "gc", f"file://{root}", "--dead-after", "7d")
    assert rc == 0 and not any(k.startswith(f"gen-{a.generation}/") for k in file_objects(root))
    assert _ledger_sum(root) == sum(file_objects(root).values())
    rc, _, _ = run(
        capsys, "gc", f"file://{root}", "--max-bytes", str(sum(file_objects(root).values()) // 2)
    )
    assert rc == 0 and _ledger_sum(root) == sum(file_objects(root).values())
    tier = FileTier(str(root), background_sweep=False)
    left = [k for k in b.keys if k in file_objects(root)]
    path = Path(tier.path(left[0]))
    path.write_bytes(path.read_bytes()[:-10])  # a torn chunk: its bytes change on disk
    tier.close()
    rc, out, _ = run(capsys, "verify", f"file://{root}", "--delete-bad")
    assert rc == 1 and "1 deleted" in out and not path.exists()
    # the hand-made cut is no change the engines counted: off by those 10 bytes only
    assert _ledger_sum(root) == sum(file_objects(root).values()) + 10


def _sealed_tier(tmp_path: Path, **keys: str) -> tuple[Path, dict, dict]:
    root = tmp_path / "kv"
    root.mkdir()
    extra = {"remote_url": f"file://{root}", **keys}
    env = {"KVT_CLI_HMAC": "s" * 64, "KVT_CLI_SEAL": "ab" * 32}
    write_engine(extra, NS, seed=7, environ=env)
    write_engine(extra, NS_B, seed=8, environ=env)
    return root, extra, env


@pytest.mark.parametrize(
    ("keys", "given", "says"),
    [
        ({"encryption_key_env": "KVT_CLI_SEAL"}, {}, "encryption_key_env"),
        ({"hmac_key_env": "KVT_CLI_HMAC"}, {}, "hmac_key_env"),
        (
            {"hmac_key_env": "KVT_CLI_HMAC", "encryption_key_env": "KVT_CLI_SEAL"},
            {"hmac_key_env": "KVT_CLI_HMAC"},
            "encryption_key_env",
        ),
        (
            {"hmac_key_env": "KVT_CLI_HMAC", "encryption_key_env": "KVT_CLI_SEAL"},
            {"encryption_key_env": "KVT_CLI_SEAL"},
            "hmac_key_env",
        ),
    ],
)
def test_verify_refuses_a_sealed_or_signed_tier_without_its_keys(
    tmp_path, capsys, monkeypatch, keys, given, says
) -> None:
    """Without the keys the engines sign or seal with, every object "fails" (sealed,
    or its signature goes unchecked): verify says which setting is missing, exits 2 and
    deletes nothing. Before, --delete-bad deleted every chunk and manifest of a sealed
    tier (18 objects -> 0) and passed a signed one unchecked."""
    root, _, env = _sealed_tier(tmp_path, **keys)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    config = tmp_path / "extra.json"
    config.write_text(json.dumps({"remote_url": f"file://{root}", **given}))
    before = file_objects(root)
    assert len(before) == 18
    for argv in ([], ["--config", str(config)]) if given else ([],):
        rc, out, err = run(capsys, "verify", f"file://{root}", "--delete-bad", *argv)
        assert rc == 2, (out, err)
        assert says in err and "nothing was deleted" in err, err
        assert file_objects(root) == before
    full = tmp_path / "full.json"
    full.write_text(json.dumps({"remote_url": f"file://{root}", **keys}))
    rc, out, _ = run(capsys, "verify", f"file://{root}", "--config", str(full))
    assert rc == 0 and "checked 18 objects: 0 bad" in out


def test_verify_delete_bad_deletes_nothing_when_the_key_is_wrong(
    tmp_path, capsys, monkeypatch
) -> None:
    """A key that is not the engines' (a rotated-out one, another cluster's) fails every
    object as "signature": no corruption, so --delete-bad refuses, says why and exits 2;
    the report still lists what failed."""
    root, _, env = _sealed_tier(tmp_path, hmac_key_env="KVT_CLI_HMAC")
    monkeypatch.setenv("KVT_CLI_HMAC", "w" * 64)  # the wrong key
    config = tmp_path / "extra.json"
    config.write_text(json.dumps({"remote_url": f"file://{root}", "hmac_key_env": "KVT_CLI_HMAC"}))
    before = file_objects(root)
    rc, out, err = run(capsys, "verify", f"file://{root}", "--config", str(config), "--delete-bad")
    assert rc == 2 and file_objects(root) == before
    assert "checked 18 objects: 18 bad (18 signature)" in out
    assert "signature" in err and "key" in err and "nothing was deleted" in err, err


def test_verify_delete_bad_keeps_manifests_and_deletes_only_corruption(
    tmp_path, capsys, monkeypatch
) -> None:
    """A manifest that does not verify is reported, never deleted (gc handles its
    generation as unknown); a chunk that fails for a key reason (signed by a stranger)
    is reported and kept (an engine never loads it); a corrupt chunk is deleted."""
    root, extra, env = _sealed_tier(tmp_path, hmac_key_env="KVT_CLI_HMAC")
    monkeypatch.setenv("KVT_CLI_HMAC", env["KVT_CLI_HMAC"])
    config = tmp_path / "extra.json"
    config.write_text(json.dumps(extra))
    gen = NS.generation()
    keys = sorted(
        k for k in file_objects(root) if k.startswith(f"gen-{gen}/") and not k.endswith("/manifest")
    )
    tier = FileTier(str(root), background_sweep=False)
    man = Path(tier.path(manifest_key(gen)))
    man.write_bytes(man.read_bytes()[:-5])
    torn = Path(tier.path(keys[0]))
    torn.write_bytes(torn.read_bytes()[:-10])
    from kvtier.objects import codec

    forged = keys[1]
    tier.put(
        forged,
        codec.encode(
            forged, bytes(2048), dtype="bfloat16", shape=[2, 8, 64], signer=codec.Signer(b"z" * 32)
        ),
    )
    tier.close()
    before = file_objects(root)
    rc, out, _ = run(
        capsys, "verify", f"file://{root}", "--config", str(config), "--delete-bad", "--json"
    )
    doc = json.loads(out)
    assert rc == 1 and doc["by_kind"] == {"truncated": 2, "signature": 1}, doc
    assert doc["deleted"] == 1, doc
    assert set(before) - set(file_objects(root)) == {keys[0]}
    assert man.exists() and Path(tier.path(forged)).exists()


def test_gc_refuses_when_the_key_is_wrong(tmp_path, capsys, monkeypatch) -> None:
    """A wrong key makes every manifest fail ("signature") and every generation unknown,
    whose chunks gc ages one by one: a live generation's chunks unused for --dead-after
    went. gc now refuses when most manifests fail for a key reason, or one needs a key it
    lacks (a sealed tier opened with only the HMAC key)."""
    root, extra, env = _sealed_tier(
        tmp_path, hmac_key_env="KVT_CLI_HMAC", encryption_key_env="KVT_CLI_SEAL"
    )
    tier = FileTier(str(root), background_sweep=False)
    old = time.time() - 10 * DAY
    for key in file_objects(root):
        if not key.endswith("/manifest"):
            os.utime(tier.path(key), (old, old))  # live generations, chunks unused for days
    tier.close()
    before = file_objects(root)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"remote_url": f"file://{root}", **extra}))
    monkeypatch.setenv("KVT_CLI_HMAC", "w" * 64)
    monkeypatch.setenv("KVT_CLI_SEAL", "cd" * 32)
    rc, out, err = run(capsys, "gc", f"file://{root}", "--config", str(wrong))
    assert rc == 2 and "nothing was deleted" in err and file_objects(root) == before, (out, err)
    monkeypatch.setenv("KVT_CLI_HMAC", env["KVT_CLI_HMAC"])
    monkeypatch.setenv("KVT_CLI_SEAL", env["KVT_CLI_SEAL"])
    hmac_only = tmp_path / "hmac.json"
    hmac_only.write_text(
        json.dumps({"remote_url": f"file://{root}", "hmac_key_env": "KVT_CLI_HMAC"})
    )
    rc, out, err = run(capsys, "gc", f"file://{root}", "--config", str(hmac_only))
    assert rc == 2 and "encryption_key_env" in err and file_objects(root) == before, (out, err)
    rc, out, _ = run(capsys, "gc", f"file://{root}", "--config", str(wrong))
    assert rc == 0 and file_objects(root) == before, "live generations: nothing to delete"


def test_verify_delete_bad_dry_run_says_what_it_would_delete(tmp_path, capsys) -> None:
    """``--delete-bad --dry-run``: the run the docs show first. It names what
    --delete-bad would delete (the corrupt chunks; not manifests) and deletes nothing."""
    root = tmp_path / "kv"
    root.mkdir()
    eng = write_engine({"remote_url": f"file://{root}"}, NS, seed=10)
    tier = FileTier(str(root), background_sweep=False)
    for key in (eng.keys[0], manifest_key(eng.generation)):
        path = Path(tier.path(key))
        path.write_bytes(path.read_bytes()[:-10])
    tier.close()
    before = file_objects(root)
    rc, out, _ = run(capsys, "verify", f"file://{root}", "--delete-bad", "--dry-run")
    assert rc == 1 and file_objects(root) == before
    assert "would delete 1" in out and f"would delete: {eng.keys[0]}" in out, out
    rc, out, _ = run(capsys, "verify", f"file://{root}", "--delete-bad", "--dry-run", "--json")
    doc = json.loads(out)
    assert doc["dry_run"] is True and doc["deleted"] == 0 and doc["to_delete"] == [eng.keys[0]]
    rc, out, _ = run(capsys, "verify", f"file://{root}", "--delete-bad")
    assert rc == 1 and set(before) - set(file_objects(root)) == {eng.keys[0]}
