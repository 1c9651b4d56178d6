"""A ``KVTIER_*`` variable that names no setting is warned about, with the nearest one
("The operator's first hour, round 2", item 2): ``KVTIER_CPU_BYTE=8GiB`` used to be ignored
without a word, and the engine ran with a host tier the operator never asked for.

Some ``KVTIER_*`` variables are not settings and are never warned about: the test hooks
(``KVTIER_TEST_*``) and a variable a ``*_env`` setting names (``hmac_key_env:
KVTIER_HMAC_KEY``, where the key itself is). kvtier.config keeps that list
(:data:`~kvtier.config.NON_KEY_ENV`); the last test checks that every ``KVTIER_*``
variable the repository sets or reads is a setting or on it.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from kvtier.config import ENV_PREFIX, KEYS, NON_KEY_ENV, load_config
from kvtier.config import settings as config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Each test a process that has warned of nothing yet."""
    monkeypatch.setattr(config, "_ENV_WARNED", set())
    caplog.set_level(logging.INFO, logger="kvtier")


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name.startswith("kvtier")
    ]


def test_a_misspelt_variable_is_named_with_the_nearest_setting(caplog) -> None:
    cfg = load_config({}, environ={"KVTIER_CPU_BYTE": "8GiB", "KVTIER_CHUNK_SIZE": "512"})
    assert cfg.cpu_bytes == "auto" and cfg.chunk_size == 512  # ignored, as before: but said
    (line,) = warnings(caplog)
    assert "KVTIER_CPU_BYTE" in line and "did you mean KVTIER_CPU_BYTES?" in line
    assert "8GiB" not in line  # a value under a misspelt name may be a secret


def test_a_variable_like_no_setting_is_named_without_a_guess(caplog) -> None:
    load_config({}, environ={"KVTIER_FROBNICATE": "1"})
    (line,) = warnings(caplog)
    assert "KVTIER_FROBNICATE" in line and "did you mean" not in line


def test_each_variable_is_warned_about_once_per_process(caplog) -> None:
    for _ in range(3):  # the config is loaded in several places of one process
        load_config({}, environ={"KVTIER_CPU_BYTE": "8GiB"})
    assert len(warnings(caplog)) == 1


@pytest.mark.parametrize(
    ("extra", "environ"),
    [
        ({}, {"KVTIER_TEST_CPU_ISA": "avx2", "KVTIER_TEST_SCENARIO_MODULES": "a.b"}),
        ({}, {"KVTIER_TEST_HMAC_KEY": "k" * 64}),  # any test hook
        ({"hmac_key_env": "KVTIER_HMAC_KEY"}, {"KVTIER_HMAC_KEY": "k" * 64}),
        ({}, {"KVTIER_ENCRYPTION_KEY_ENV": "KVTIER_ENC", "KVTIER_ENC": "ab" * 32}),
        ({"hmac_verify_keys_env": "KVTIER_OLD_KEYS"}, {"KVTIER_OLD_KEYS": "a,b"}),
        ({}, {"KVTIER_CPU_HEADROOM_BYTES": "512MiB", "OTHER_VAR": "x", "KVTIER": "x"}),
    ],
)
def test_variables_that_are_not_settings_but_belong_are_not_warned_about(
    caplog, extra: dict, environ: dict
) -> None:
    load_config(extra, environ=environ)
    assert warnings(caplog) == []


def test_a_key_variable_no_setting_names_is_warned_about(caplog) -> None:
    """The Helm chart's KVTIER_HMAC_KEY without hmac_key_env: kvtier signs nothing."""
    load_config({}, environ={"KVTIER_HMAC_KEY": "k" * 64})
    (line,) = warnings(caplog)
    assert "KVTIER_HMAC_KEY" in line and "k" * 64 not in line


def test_the_list_of_variables_that_are_not_settings_names_none() -> None:
    assert NON_KEY_ENV, "the list is kept in kvtier.config"
    for name in NON_KEY_ENV:
        assert name.startswith(ENV_PREFIX)
        assert name.removeprefix(ENV_PREFIX).lower().rstrip("*_") not in KEYS


#: where a KVTIER_* variable is set or read in the repository: os.environ / getenv /
#: env dicts in Python, NAME=value in the Makefile, shell and docs' command lines
_SET_OR_READ = re.compile(
    r"""(?:environ(?:\.get|\.setdefault|\.pop)?\(\s*|getenv\(\s*|\[\s*|\{\s*|,\s*)["'](KVTIER_[A-Z0-9_]+)["']"""
    r"""|\b(KVTIER_[A-Z0-9_]+)=""",
)


def _variables_in_repository() -> set[str]:
    names: set[str] = set()
    for path in [
        *ROOT.glob("kvtier/**/*.py"),
        *ROOT.glob("tests/**/*.py"),
        ROOT / "Makefile",
        *ROOT.glob("bench/**/*.sh"),
        *ROOT.glob("deploy/**/*.yaml"),
        *ROOT.glob("docs/*.md"),
        ROOT / "README.md",
    ]:
        if path == Path(__file__):
            continue
        for m in _SET_OR_READ.finditer(path.read_text(errors="replace")):
            names.add(m.group(1) or m.group(2))
    return names


def test_every_kvtier_variable_the_repository_uses_is_a_setting_or_listed() -> None:
    """A variable kvtier reads that is not a setting must be on NON_KEY_ENV, or every
    engine started with it would warn about it. Variables a ``*_env`` setting names are
    exempt wherever they are named (the tests' own key variables among them)."""
    settings = {ENV_PREFIX + k.upper() for k in KEYS}
    secrets = {
        "KVTIER_HMAC_KEY",
        "KVTIER_ENCRYPTION_KEY",
        "KVTIER_BENCH_KEY",
        "KVTIER_HMAC",
        "KVTIER_ENC",
        "KVTIER_K",
        "KVTIER_OLD_KEYS",
        "KVTIER_CPU_BYTE",
        "KVTIER_FROBNICATE",
    }  # named by *_env keys, or typos here
    found = _variables_in_repository()
    assert "KVTIER_TEST_CPU_ISA" in found and "KVTIER_REMOTE_URL" in found  # the scan works
    unknown = {n for n in found - settings - secrets if not config.is_known_non_key_env(n)}
    assert unknown == set(), "add them to kvtier.config.NON_KEY_ENV, with why"
