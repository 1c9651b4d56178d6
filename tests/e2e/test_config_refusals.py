"""An engine whose config would switch security off without a word does not start."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import run_engine

pytestmark = pytest.mark.e2e


def test_an_empty_key_variable_stops_the_engine(tiny_model: str, tmp_path: Path) -> None:
    """``KVTIER_HMAC_KEY_ENV=""`` (an unset template variable) over a JSON that asks for
    signing used to start the engine unsigned; it stops startup, naming the key."""
    extra = {
        "cpu_bytes": "256MiB",
        "remote_url": f"file://{tmp_path}/kv",
        "hmac_key_env": "KVTIER_TEST_HMAC_KEY",
    }
    env = {"KVTIER_HMAC_KEY_ENV": "", "KVTIER_TEST_HMAC_KEY": "k" * 64}
    r = run_engine("start_only", model=tiny_model, extra=extra, env=env)
    assert r["started"] is False, "the engine started without the HMAC key it was asked for"
    # refused as vLLM builds its config, before any engine process: pydantic reports the
    # ConfigError as a "Value error" of VllmConfig
    assert "kvtier config 'hmac_key_env'" in r["error"], r["error"]
    assert "KVTIER_HMAC_KEY_ENV" in r["error"], r["error"]
    assert not list((tmp_path / "kv").rglob("*-*")), "chunks were written unsigned"


def test_symlinked_fanout_dirs_take_no_chunk_outside_the_tier(
    tiny_model: str, tmp_path: Path
) -> None:
    """All 256 fan-out names of a shared directory are symlinks to another directory (one
    that could be /dev/shm): the engine serves every request, and not one byte lands
    outside the tier's directory; the failed uploads are counted, the tier stays up."""
    root, outside = tmp_path / "kv", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    for i in range(256):
        (root / f"{i:02x}").symlink_to(outside)
    extra = {"cpu_bytes": "64MiB", "remote_url": f"file://{root}"}
    w = run_engine("remote_writer", model=tiny_model, extra=extra)
    assert w["b_ref"]["cached"] == 1024  # the engine itself runs as always
    assert [p for p in outside.rglob("*")] == [], "chunks were written outside the tier"
    assert w["index"]["refs"] == 0 and w["index"]["invariants"] is True
