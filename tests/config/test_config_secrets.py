"""A secret never reaches an exception or a log line, whatever key it is under.

Secrets end up under the wrong key (a key pasted into ``hmac_key_env``, a password
in a misspelt key), in URLs that fail validation, or in ``password=`` arguments;
each position is tried with arbitrary secrets. ``kvtier doctor`` is checked in
tests/sizing/test_doctor.py.
"""

from __future__ import annotations

import base64
import json
import logging
import pickle
import random
import traceback
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvtier import config, errors, redact
from kvtier.config import ENV_PREFIX, KEYS, load_config
from kvtier.errors import ConfigError
from kvtier.objects.codec import Signer
from kvtier.redact import redact_setting, redact_text, redact_url, shows_variable_name

log = logging.getLogger("kvtier.test_secrets")

URL_SAFE = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~!$'()*+,"
url_secrets = st.text(alphabet=URL_SAFE, min_size=10, max_size=40)
# a pasted key can be any text at all
any_secrets = st.text(min_size=10, max_size=40)

Extra = tuple[dict[str, object], dict[str, str]]

# where a secret lands: (extra config, environment) for a secret s
POSITIONS: dict[str, Callable[[str], Extra]] = {
    "redis url, bad scheme": lambda s: ({"remote_url": f"redis+bad://:{s}@kv.invalid:6379/0"}, {}),
    "ftp url": lambda s: ({"remote_url": f"ftp://user:{s}@kv.invalid/"}, {}),
    "redis url, no host": lambda s: ({"remote_url": f"redis://:{s}@"}, {}),
    "redis url, bad port": lambda s: ({"remote_url": f"redis://:{s}@kv.invalid:99999/0"}, {}),
    "redis url, bad ipv6": lambda s: ({"remote_url": f"redis://:{s}@[kv.invalid"}, {}),
    "redis url, bad db": lambda s: ({"remote_url": f"redis://:{s}@kv.invalid:6379/x"}, {}),
    "redis url, valid": lambda s: ({"remote_url": f"rediss://default:{s}@kv.invalid:6380/0"}, {}),
    "redis url via env": lambda s: ({}, {"KVTIER_REMOTE_URL": f"redis://:{s}@kv.invalid/0?x"}),
    "redis url, user only": lambda s: ({"remote_url": f"redis://{s}@kv.invalid:6379/0"}, {}),
    "s3 url with keys": lambda s: ({"remote_url": f"s3://AKIAEXAMPLE:{s}@bucket/kv"}, {}),
    "file url with keys": lambda s: ({"remote_url": f"file://me:{s}@kv.invalid/var/kv"}, {}),
    "password= valid": lambda s: ({"remote_url": f"redis://kv.invalid:6379/0?password={s}"}, {}),
    "password= invalid": lambda s: ({"remote_url": f"ftp://kv.invalid/?password={s}&db=1"}, {}),
    "password= bad port": lambda s: ({"remote_url": f"redis://kv.invalid:0/0?password={s}"}, {}),
    "s3 endpoint with keys": lambda s: ({"s3_endpoint_url": f"https://AK:{s}@minio.invalid"}, {}),
    "s3 endpoint, token=": lambda s: ({"s3_endpoint_url": f"http://minio.invalid?token={s}"}, {}),
    "s3 endpoint, bad": lambda s: ({"s3_endpoint_url": f"minio://AK:{s}@minio.invalid"}, {}),
    "key in hmac_key_env": lambda s: ({"hmac_key_env": s, "remote_url": "file:///kv"}, {}),
    "key in hmac_key_env via env": lambda s: ({}, {"KVTIER_HMAC_KEY_ENV": s}),
    "key in hmac_verify_keys_env": lambda s: ({"hmac_verify_keys_env": s}, {}),
    "key in hmac_key_file": lambda s: ({"hmac_key_file": s}, {}),
    "key in hmac_verify_keys_file": lambda s: ({"hmac_verify_keys_file": s}, {}),
    "both hmac keys": lambda s: ({"hmac_key_env": "K", "hmac_key_file": s}, {}),
    "password under unknown key": lambda s: ({"redis_password": s}, {}),
    "password under misspelt key": lambda s: ({"remote_ulr": f"redis://:{s}@kv.invalid"}, {}),
    "secret under any unknown key": lambda s: ({"foo": s, "chunk_size": 256}, {}),
    "secret in a list": lambda s: ({"remote_url": [f"redis://:{s}@kv.invalid"]}, {}),
    "secret in a dict": lambda s: ({"hmac_key_env": {"key": s}}, {}),
}
# positions where only an arbitrary text secret makes sense (not inside a URL)
TEXT_POSITIONS = [
    "key in hmac_key_env",
    "key in hmac_key_env via env",
    "key in hmac_verify_keys_env",
    "key in hmac_key_file",
    "key in hmac_verify_keys_file",
    "both hmac keys",
    "password under unknown key",
    "secret under any unknown key",
    "secret in a dict",
]


def exception_texts(exc: BaseException) -> list[str]:
    """Every way an exception is printed or shipped."""
    texts = [str(exc), repr(exc), repr(exc.args), "".join(traceback.format_exception(exc))]
    if isinstance(exc, ConfigError):
        texts += [repr(exc.value), str(exc.value), repr(exc.key), exc.allowed]
        texts.append(repr(pickle.loads(pickle.dumps(exc)).args))
    return texts


def all_texts(extra: dict[str, object], environ: dict[str, str]) -> list[str]:
    """What loading (and signing with) this config prints, raises and logs, as kvtier does."""
    texts: list[str] = []
    try:
        cfg = load_config(extra, environ=environ)
    except ConfigError as exc:
        log.error("kvtier refused its config: %s", exc)
        log.exception("with traceback")
        return texts + exception_texts(exc)
    config_line = json.dumps(cfg.redacted(), ensure_ascii=False)
    log.info("kvtier config: %s", config_line)  # what the connector logs at startup
    log.info("config object %r", cfg)
    texts += [config_line, json.dumps(cfg.redacted()), repr(cfg), str(cfg)]
    texts += [redact_url(cfg.remote_url or ""), redact_url(cfg.s3_endpoint_url or "")]
    try:
        texts.append(repr(Signer.from_config(cfg, environ={})))
    except ConfigError as exc:
        log.error("kvtier: %s", exc)
        texts += exception_texts(exc)
    return texts


def assert_hidden(secret: str, texts: list[str], caplog: pytest.LogCaptureFixture) -> None:
    for text in [*texts, caplog.text]:
        assert secret not in text, (secret, text)


def _baseline() -> str:
    """All the text kvtier prints around a secret (with a stand-in for it)."""
    out = [", ".join(KEYS)]
    for position in [*POSITIONS.values(), *RANDOM_KEY_POSITIONS.values()]:
        for stand_in in ("ZZZZZZZZZZ", "0123456789abcdef0123"):
            out += all_texts(*position(stand_in))
    return "\n".join(out)


def usable(secret: str) -> bool:
    """A secret that cannot occur in the surrounding text by chance ("write_thro" does)."""
    return len(set(secret)) >= 4 and secret not in BASELINE


#: positions where the secret is the value of a ``*_env`` key: an upper-case variable name
#: there is shown on purpose, since naming the variable to set is the point of the error
#: (tests/config/test_config_messages.py); anything else there stays hidden
ENV_NAME_POSITIONS = {
    "key in hmac_key_env",
    "key in hmac_key_env via env",
    "key in hmac_verify_keys_env",
}


def usable_at(position: str, secret: str) -> bool:
    named = position in ENV_NAME_POSITIONS and shows_variable_name("hmac_key_env", secret)
    return usable(secret) and not named


@pytest.mark.parametrize("position", sorted(POSITIONS))
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(secret=url_secrets)
def test_a_secret_in_a_url_or_under_the_wrong_key_never_shows(
    position: str, secret: str, caplog: pytest.LogCaptureFixture
) -> None:
    assume(usable_at(position, secret))
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        texts = all_texts(*POSITIONS[position](secret))
    assert_hidden(secret, texts, caplog)


@pytest.mark.parametrize("position", TEXT_POSITIONS)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(secret=any_secrets)
def test_any_text_pasted_as_a_key_never_shows(
    position: str, secret: str, caplog: pytest.LogCaptureFixture
) -> None:
    assume(usable_at(position, secret))
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        texts = all_texts(*POSITIONS[position](secret))
    assert_hidden(secret, texts, caplog)


# a random key put where a plain value belongs: shown nowhere, though the key is not secret-named
RANDOM_KEY_POSITIONS: dict[str, Callable[[str], Extra]] = {
    "namespace": lambda s: ({"namespace": s}, {}),
    "write_policy": lambda s: ({"write_policy": s}, {}),
    "io_threads": lambda s: ({"io_threads": s}, {}),
    "cpu_bytes": lambda s: ({"cpu_bytes": s}, {}),
    "file path": lambda s: ({"remote_url": f"file:///keys/{s}?v=1"}, {}),
    "s3 prefix": lambda s: ({"remote_url": f"s3://bucket/{s}#x"}, {}),
    "env override": lambda s: ({}, {ENV_PREFIX + "WRITE_POLICY": s}),
}


@pytest.mark.parametrize("position", sorted(RANDOM_KEY_POSITIONS))
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**32), size=st.integers(8, 48))
def test_a_random_hex_key_under_a_plain_key_never_shows(
    position: str, seed: int, size: int, caplog: pytest.LogCaptureFixture
) -> None:
    secret = random.Random(seed).randbytes(size).hex()  # >= 16 hex digits
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        texts = all_texts(*RANDOM_KEY_POSITIONS[position](secret))
    assert_hidden(secret, texts, caplog)


BASELINE = _baseline()

# base64 keys of 32 bytes, from a fixed seed: deterministic, so the test never flakes
BASE64_KEYS = [
    enc(random.Random(i).randbytes(32)).decode().rstrip("=")
    for i in range(100)
    for enc in (base64.b64encode, base64.urlsafe_b64encode)
]


@pytest.mark.parametrize("position", sorted(RANDOM_KEY_POSITIONS))
def test_base64_keys_under_a_plain_key_never_show(
    position: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        for secret in BASE64_KEYS:
            assert_hidden(secret, all_texts(*RANDOM_KEY_POSITIONS[position](secret)), caplog)


def test_a_hex_key_of_digits_only_never_shows() -> None:
    """About one 16-digit hex key in 2,000 has no letter (found by the fuzzer above)."""
    text = redact_text("got 'file:///keys/8489915708617705?v=1'; file:///dir")
    assert "8489915708617705" not in text and "file://" in text


def test_redaction_keeps_what_helps_and_hides_what_does_not() -> None:
    assert redact_text("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert redact_text("redis://u:pw@host/0?password=x&db=2") == "redis://u:***@host/0?password=***"
    assert redact_text("/models/Llama-3-8B-Instruct") == "/models/Llama-3-8B-Instruct"
    assert redact_text("KVTIER_HMAC_KEY") == "KVTIER_HMAC_KEY"
    assert redact_text("key " + "3f9a2b7c1d4e5f60" * 2) == "key <redacted 32 chars>"
    # a URL urlparse cannot read is redacted all the same (redact_url used to raise)
    assert redact_url("redis://:pw@[::1") == "redis://:***@[::1"


@pytest.mark.parametrize(
    ("extra", "secret"),
    [
        ({"remote_url": "redis+x://hunter2@h/"}, "hunter2"),  # only user:password@ was hidden
        ({"remote_url": "redis://:hunter2@[::1"}, "hunter2"),  # ValueError from urlparse
        ({"remote_url": "file://:hunter2@h/kv"}, "hunter2"),
        ({"s3_endpoint_url": "https://AK:hunter2@minio"}, "hunter2"),  # accepted and logged
        ({"remote_url": "s3://AK:hunter2@bucket/kv"}, "hunter2"),  # became the bucket name
        ({"hmac_key_env": "3f9a2b7c1d4e5f60718293a4b5c6d7e8"}, "3f9a2b7c1d4e5f60718293a4b5c6d7e8"),
        ({"redis_password": "hunter2"}, "hunter2"),
        ({"namespace": "x", "pasword": "hunter2"}, "hunter2"),
    ],
)
def test_secrets_the_old_code_showed(extra: dict, secret: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(extra, environ={})
    for text in exception_texts(err.value):
        assert secret not in text, text


def test_a_key_pasted_into_hmac_key_env_is_hidden_by_the_signer_and_the_log() -> None:
    pasted = "Zm9vYmFyYmF6cXV4"  # a valid variable name, so the config accepts it
    cfg = load_config({"hmac_key_env": pasted}, environ={})
    assert pasted not in json.dumps(cfg.redacted()) and pasted not in repr(cfg)
    with pytest.raises(ConfigError) as err:
        Signer.from_config(cfg, environ={})
    assert err.value.key == "hmac_key_env"
    assert all(pasted not in text for text in exception_texts(err.value))


def test_redaction_has_one_home() -> None:
    """kvtier.redact holds the rules; the config and the errors read them from there (the
    names they still offer are the same functions), and settings are shown by one rule."""
    assert config.redact_url is redact.redact_url
    assert errors.redact_text is redact.redact_text
    assert errors.is_secret_name is redact.is_secret_name
    known = {"remote_url", "hmac_key_env"}
    url = "redis://:hunter2@h:6379/0"
    assert redact_setting("remote_url", url, known) == "redis://:***@h:6379/0"
    assert config.redact_value("remote_url", url) == "redis://:***@h:6379/0"
    # a secret-named key and a key the config does not read show only a placeholder
    for key, keys in (("hmac_key_env", known), ("remote_url", set())):
        assert redact_setting(key, "KV_KEY", keys) == "<redacted 6 chars>"
    assert config.redact_value("remote_urll", "x" * 9) == "<redacted 9 chars>"
    assert redact_setting("remote_url", ["a", "b"], known) == "<list of 2 items>"
    assert redact_setting("remote_url", 7, set()) == 7  # numbers are never secrets


def test_config_error_survives_pickle_and_huge_values() -> None:
    exc = ConfigError("cpu_bytes", 10**5000, "a size")  # repr() of it raised ValueError
    again = pickle.loads(pickle.dumps(exc))  # vLLM ships worker errors by pickle
    assert isinstance(again, ConfigError) and again.args == exc.args and again.key == "cpu_bytes"
    assert "cpu_bytes" in str(exc)
