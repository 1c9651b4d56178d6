"""Config: one frozen object; every mistake names the key, the value and what is allowed."""

from __future__ import annotations

import os

import pytest

from kvtier.config import KEYS, format_size, load_config, parse_size
from kvtier.errors import ConfigError


def test_defaults() -> None:
    cfg = load_config({}, environ={})
    assert cfg.chunk_size == 256 and cfg.cpu_bytes == "auto" and cfg.namespace == ""
    assert cfg.write_policy == "write_through" and cfg.remote_url is None


@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("512MiB", 512 * 2**20),
        ("8GiB", 8 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("1024", 1024),
        (4096, 4096),
        ("2 gib", 2 * 2**30),
    ],
)
def test_sizes(text: object, n: int) -> None:
    assert parse_size("cpu_bytes", text) == n
    assert load_config({"cpu_bytes": text}, environ={}).cpu_bytes == n


@pytest.mark.parametrize(
    ("extra", "key", "hint"),
    [
        ({"chunk_sise": 256}, "chunk_sise", "did you mean 'chunk_size'?"),
        ({"cpu_bytes": "lots"}, "cpu_bytes", "size string"),
        ({"cpu_bytes": -1}, "cpu_bytes", "not negative"),
        ({"chunk_size": 0}, "chunk_size", "integer >= 1"),
        ({"chunk_size": True}, "chunk_size", "integer"),
        ({"write_policy": "sometimes"}, "write_policy", "write_through"),
        ({"remote_url": "ftp://x"}, "remote_url", "s3://"),
        ({"remote_url": "s3://"}, "remote_url", "bucket"),
        ({"io_threads": 1000}, "io_threads", '"auto" or an integer 1..64'),
        ({"io_threads": "many"}, "io_threads", '"auto" or an integer 1..64'),
        ({"shutdown_flush_s": "soon"}, "shutdown_flush_s", "number"),
        ({"hmac_key_env": "A", "hmac_key_file": "/k"}, "hmac_key_file", "not both"),
    ],
)
def test_errors_name_key_value_and_allowed(extra: dict, key: str, hint: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(extra, environ={})
    assert err.value.key == key
    assert repr(key) in str(err.value) and hint in str(err.value)


def test_environment_overrides_the_dict() -> None:
    cfg = load_config({"chunk_size": 256}, environ={"KVTIER_CHUNK_SIZE": "512"})
    assert cfg.chunk_size == 512
    with pytest.raises(ConfigError, match="chunk_size"):
        load_config({}, environ={"KVTIER_CHUNK_SIZE": "many"})


def test_block_size_check() -> None:
    cfg = load_config({"chunk_size": 96}, environ={})
    cfg.check_block_size(32)
    with pytest.raises(ConfigError, match="multiple of the engine's block size"):
        cfg.check_block_size(64)


def test_config_is_frozen_and_redacts_passwords() -> None:
    cfg = load_config({"remote_url": "redis://:s3cret@host:6379/0"}, environ={})
    with pytest.raises(AttributeError):
        cfg.chunk_size = 1  # type: ignore[misc]
    assert "s3cret" not in str(cfg.redacted())
    with pytest.raises(ConfigError) as err:
        load_config({"remote_url": "http://:s3cret@host/"}, environ={})
    assert "s3cret" not in str(err.value)


def test_every_key_is_documented_and_sizes_print_readably() -> None:
    from pathlib import Path

    reference = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    assert [k for k in KEYS if f"`{k}`" not in reference] == [], (
        "a config key docs/configuration.md omits"
    )
    assert format_size(3 * 2**30) == "3.00 GiB"


def test_io_threads_auto_is_the_default_and_resolves_per_process(monkeypatch) -> None:
    """\"auto" (any case) stays "auto" in the config and resolves where the threads start,
    from the CPUs that process may run on; a number is kept as given."""
    import kvtier.config.settings as config_mod

    assert load_config({}, environ={}).io_threads == "auto"
    cfg = load_config({"io_threads": " AUTO "}, environ={})
    assert cfg.io_threads == "auto"
    monkeypatch.setattr(config_mod, "usable_cpus", lambda: 16)
    assert cfg.io_thread_count() == 16
    assert cfg.io_thread_count(workers_on_node=8) == 4
    monkeypatch.setattr(config_mod, "usable_cpus", lambda: 2)
    assert cfg.io_thread_count() == 4
    assert load_config({"io_threads": 3}, environ={}).io_thread_count(8) == 3
    assert load_config({}, environ={"KVTIER_IO_THREADS": "6"}).io_threads == 6


@pytest.mark.parametrize(
    ("cpus", "workers", "threads"),
    [
        (1, 1, 4),
        (2, 1, 4),
        (8, 1, 8),
        (16, 1, 16),
        (224, 1, 16),
        (64, 8, 8),
        (16, 8, 4),
        (12, 0, 12),
    ],
)
def test_auto_io_threads_is_a_share_of_the_cpus_within_bounds(cpus, workers, threads) -> None:
    from kvtier.config import auto_io_threads, usable_cpus

    assert auto_io_threads(cpus, workers) == threads
    assert 1 <= usable_cpus() <= (os.cpu_count() or 1)
