"""``kvtier store usage | gc | verify`` as an operator runs it: real tiers (a directory,
moto's S3 server, redis-server) holding generations kvtier's object-tier code wrote."""

from __future__ import annotations

import json
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
        (b.generation, "org/tiny-b", 8), (a.generation, "org/tiny-a", 8)]  # fmt: skip
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
    out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "store", "gc", "--help"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    for flag in ("--max-bytes", "--dead-after", "--dry-run", "--json", "--config"):
        assert flag in out
    assert "IDLETIME" in out and "LastModified" in out and "mtime" in out
    top = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "--help"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "store" in top


def test_without_a_url_the_tier_is_the_engines_own(two_generations, capsys, tmp_path,
                                                    monkeypatch) -> None:  # fmt: skip
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
