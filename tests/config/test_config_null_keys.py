"""A key setting written as JSON ``null`` is refused, as ``""`` is (issue 47, item 9).

A templated config that renders an unset value as ``null`` (``"hmac_key_env": null``)
used to run unsigned without a word, while ``""`` was refused. Every setting that names
a key, the signing and encryption keys and the rotation keys accepted on read, now
stops startup with a ConfigError naming it; leaving the key out still runs without it.
"""

from __future__ import annotations

import json

import pytest

from kvtier.config import KEY_SETTINGS, KEYS, load_config
from kvtier.errors import ConfigError

EVERY_KEY_SETTING = (
    "hmac_key_env",
    "hmac_key_file",
    "hmac_verify_keys_env",
    "hmac_verify_keys_file",
    "encryption_key_env",
    "encryption_key_file",
    "encryption_decrypt_keys_env",
    "encryption_decrypt_keys_file",
)


def test_key_settings_are_every_key_and_secret_setting_of_the_config() -> None:
    """The list the refusal reads names every setting that holds a key's name or file:
    a new one added to the config without it would be switched off by null again."""
    keyish = {k for k in KEYS if "_key" in k}
    assert keyish == set(EVERY_KEY_SETTING) == set(KEY_SETTINGS)


@pytest.mark.parametrize("key", EVERY_KEY_SETTING)
@pytest.mark.parametrize("value", [None, "", "  "])
def test_a_null_or_empty_key_setting_is_refused_naming_it(key: str, value: object) -> None:
    extra = json.loads(json.dumps({key: value, "remote_url": "file:///kv"}))
    with pytest.raises(ConfigError) as info:
        load_config(extra, environ={})
    assert info.value.key == key
    assert key in str(info.value) and "leave it out" in str(info.value)
    if value is None:
        assert "null" in str(info.value)


@pytest.mark.parametrize("key", EVERY_KEY_SETTING)
def test_an_empty_override_cannot_blank_out_a_configured_key_setting(key: str) -> None:
    value = "/etc/kvtier/k" if key.endswith("_file") else "KVTIER_K"
    with pytest.raises(ConfigError) as info:
        load_config({key: value}, environ={f"KVTIER_{key.upper()}": ""})
    assert info.value.key == key and f"KVTIER_{key.upper()}" in str(info.value)


def test_left_out_it_is_off_and_set_it_is_read() -> None:
    cfg = load_config({}, environ={})
    assert all(getattr(cfg, k) is None for k in EVERY_KEY_SETTING)
    cfg = load_config({"hmac_key_env": "K", "hmac_verify_keys_env": "OLD"}, environ={})
    assert (cfg.hmac_key_env, cfg.hmac_verify_keys_env) == ("K", "OLD")


@pytest.mark.parametrize(
    "key",
    [
        "remote_url",
        "model_fingerprint",
        "s3_endpoint_url",
        "remote_ttl_s",
        "file_max_bytes",
        "namespace",
        "warmup_bytes",
    ],
)
def test_null_elsewhere_is_the_default_as_documented(key: str) -> None:
    """Settings whose null is their documented default (no object tier, kvtier's own
    fingerprint, no expiry, unbounded, no namespace) and never weakens a check: null
    stays accepted there, as leaving them out is."""
    assert load_config({key: None}, environ={}) == load_config({}, environ={})
