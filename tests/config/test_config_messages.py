"""A config mistake is one clean line, from kvtier, before vLLM wraps it ("The operator's
first hour, round 2", item 1).

vLLM 0.32 builds its config inside a pydantic dataclass: the ConfigError kvtier raises there
comes out as a ``ValidationError`` under some 40 lines of traceback. So every ConfigError
that leaves kvtier at vLLM's boundary is first logged by kvtier itself (logger ``kvtier``,
ERROR), one line each: the key as written, the value unless it may be a secret, what is
allowed, and for an unknown key the nearest known one. (The live check, through vLLM's own
config build, is tests/connectors/test_startup_check.py.)
"""

from __future__ import annotations

import logging
import pickle

import pytest

from kvtier.config import load_config
from kvtier.errors import ConfigError, config_errors_logged
from kvtier.objects.codec import Signer


def refused(extra: dict, environ: dict | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        load_config(extra, environ={} if environ is None else environ)
    return err.value


@pytest.mark.parametrize(
    ("key", "near"),
    [
        ("cpu_byte", "cpu_bytes"),
        ("chunk_sise", "chunk_size"),
        ("remote_ulr", "remote_url"),
        ("Cpu_Bytes", "cpu_bytes"),
        ("hmac_key_enc", "hmac_key_env"),
    ],
)
def test_an_unknown_key_names_the_nearest_known_key(key: str, near: str) -> None:
    err = refused({key: "8GiB"})
    assert f"unknown key {key!r}: did you mean {near!r}?" in str(err)
    assert err.key == key and "8GiB" not in str(err)  # a misspelt key's value may be a secret


def test_an_unknown_key_like_no_known_key_lists_them_all() -> None:
    text = str(refused({"zzz": 1}))
    assert "unknown key 'zzz'" in text and "did you mean" not in text
    assert "cpu_bytes" in text and "chunk_size" in text


@pytest.mark.parametrize(
    "extra",
    [
        {"cpu_byte": "8GiB"},
        {"cpu_bytes": "lots"},
        {"chunk_size": 0},
        {"remote_url": "ftp://x"},
        {"write_policy": "sometimes"},
        {"hmac_key_env": "A", "hmac_key_file": "/k"},
        {"zzz": 1},
    ],
)
def test_every_config_error_is_one_line(extra: dict) -> None:
    text = str(refused(extra))
    assert "\n" not in text and text.startswith("kvtier config")
    assert len(text) < 300 or "known keys are" in text, text  # every key, when no guess


def test_a_message_with_line_breaks_is_still_one_line() -> None:
    err = ConfigError("cpu_bytes", 7, "the plan:\n  available 8 GiB\n  needed 9 GiB")
    assert "\n" not in str(err) and "the plan: available 8 GiB needed 9 GiB" in str(err)
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


@pytest.mark.parametrize("key", ["hmac_key_env", "encryption_key_env"])
def test_the_name_of_an_unset_variable_is_shown(key: str) -> None:
    """A variable's name is no secret, and the one thing the operator needs: which
    variable to set. (A key pasted there instead stays hidden: test_config_secrets.py.)"""
    cfg = load_config({key: "KVTIER_HMAC", "remote_url": "file:///kv"}, environ={})
    with pytest.raises(ConfigError) as err:
        Signer.from_config(cfg, environ={})
    assert err.value.key == key and "'KVTIER_HMAC'" in str(err.value)


@pytest.mark.parametrize(
    "value",
    [
        "f3f9a2b7c1d4e5f60718293a4b5c6d7e",  # a hex key pasted as the name
        "Zm9vYmFyYmF6cXV4",  # base64 of a key: a valid name, but random-looking
        "hunter2",
    ],  # not an upper-case variable name: could be a password
)
def test_what_is_not_a_variable_name_stays_hidden(value: str) -> None:
    cfg = load_config({"hmac_key_env": value, "remote_url": "file:///kv"}, environ={})
    with pytest.raises(ConfigError) as err:
        Signer.from_config(cfg, environ={})
    assert value not in str(err.value) and value not in repr(err.value.__reduce__())


def test_every_mistake_of_one_config_is_named_not_only_the_first() -> None:
    """Two typos are two lines at one start, not two restarts of a slow engine."""
    err = refused({"cpu_byte": "8GiB", "chunk_size": 0, "write_policy": "sometimes"})
    lines = [str(e) for e in (err, *err.more)]
    assert len(lines) == 3
    assert "unknown key 'cpu_byte'" in lines[0]
    assert any("'chunk_size'" in line for line in lines)
    assert any("'write_policy'" in line for line in lines)


def test_errors_at_vllms_boundary_are_logged_once_each(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvtier")
    with pytest.raises(ConfigError) as err:
        with config_errors_logged():
            with config_errors_logged():  # nested boundaries: still once
                load_config({"cpu_byte": "8GiB", "chunk_size": 0}, environ={})
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.name for r in errors] == ["kvtier", "kvtier"]
    assert [r.getMessage() for r in errors] == [str(e) for e in (err.value, *err.value.more)]
    assert errors[0].getMessage() == (
        "kvtier config: unknown key 'cpu_byte': did you mean 'cpu_bytes'?"
    )
    with pytest.raises(ValueError):  # anything else passes through, unlogged
        with config_errors_logged():
            raise ValueError("not ours")
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 2
