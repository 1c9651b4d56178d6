"""Config never switches a security setting off without a word.

An empty ``KVTIER_HMAC_KEY_ENV`` (an unset template variable) used to override the
JSON and turn signing off; a 1-byte HMAC key was accepted; ``rediss://`` with
``ssl_cert_reqs=none`` quietly trusted any certificate. Each now stops startup with
a ConfigError naming the key, unless an explicit, logged opt-in allows it.
"""

from __future__ import annotations

import logging

import pytest

from kvtier.config import insecure_tls_args, load_config
from kvtier.errors import ConfigError
from kvtier.objects import codec
from kvtier.objects.sealing import Sealer
from kvtier.objects.tiers.redis import RedisTier

HEX_KEY = "ab" * 32
LONG = "k" * 32

# -- an empty value never turns signing, encryption or the namespace off ------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("hmac_key_env", "KVTIER_HMAC"),
        ("hmac_key_file", "/etc/kvtier/hmac.key"),
        ("encryption_key_env", "KVTIER_ENC"),
        ("encryption_key_file", "/etc/kvtier/enc.key"),
        ("namespace", "tenant-a"),
    ],
)
@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_env_override_cannot_blank_out_a_configured_security_key(
    key: str, value: str, empty: str
) -> None:
    env = {f"KVTIER_{key.upper()}": empty}
    with pytest.raises(ConfigError) as info:
        load_config({key: value}, environ=env)
    assert info.value.key == key
    assert f"KVTIER_{key.upper()}" in str(info.value)


@pytest.mark.parametrize(
    "key", ["hmac_key_env", "hmac_key_file", "encryption_key_env", "encryption_key_file"]
)
def test_an_empty_security_key_is_refused_wherever_it_comes_from(key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({key: ""}, environ={})
    assert info.value.key == key and "leave it out" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config({}, environ={f"KVTIER_{key.upper()}": ""})
    assert info.value.key == key


def test_non_empty_overrides_and_other_empty_overrides_still_work() -> None:
    cfg = load_config({"hmac_key_env": "A"}, environ={"KVTIER_HMAC_KEY_ENV": "B"})
    assert cfg.hmac_key_env == "B"
    cfg = load_config({}, environ={"KVTIER_NAMESPACE": ""})  # nothing configured to blank
    assert cfg.namespace == ""
    cfg = load_config({"remote_url": "file:///kv"}, environ={"KVTIER_REMOTE_URL": ""})
    assert cfg.remote_url is None  # switching the object tier off is allowed


# -- an HMAC key is at least 32 bytes --------------------------------------------------------


@pytest.mark.parametrize("n", [1, 16, 31])
def test_a_short_hmac_key_stops_startup(n: int, tmp_path) -> None:
    secret = ("Zq9" * 11)[:n]
    cfg = load_config({"hmac_key_env": "K"}, environ={})
    with pytest.raises(ConfigError) as info:
        codec.Signer.from_config(cfg, environ={"K": secret})
    assert info.value.key == "hmac_key_env" and "32 bytes" in str(info.value)
    assert secret not in str(info.value)
    path = tmp_path / "hmac.key"
    path.write_text(secret + "\n")
    cfg = load_config({"hmac_key_file": str(path)}, environ={})
    with pytest.raises(ConfigError) as info:
        codec.Signer.from_config(cfg, environ={})
    assert info.value.key == "hmac_key_file"


def test_short_verify_keys_stop_startup_too(tmp_path) -> None:
    cfg = load_config({"hmac_key_env": "K", "hmac_verify_keys_env": "OLD"}, environ={})
    with pytest.raises(ConfigError) as info:
        codec.Signer.from_config(cfg, environ={"K": LONG, "OLD": f"{LONG},x"})
    assert info.value.key == "hmac_verify_keys_env"
    path = tmp_path / "old.keys"
    path.write_text(f"{LONG}\nshort\n")
    cfg = load_config({"hmac_key_env": "K", "hmac_verify_keys_file": str(path)}, environ={})
    with pytest.raises(ConfigError) as info:
        codec.Signer.from_config(cfg, environ={"K": LONG})
    assert info.value.key == "hmac_verify_keys_file"


def test_a_32_byte_hmac_key_and_a_256_bit_encryption_key_are_accepted() -> None:
    cfg = load_config({"hmac_key_env": "K", "encryption_key_env": "E"}, environ={})
    signer = codec.Signer.from_config(cfg, environ={"K": LONG, "E": HEX_KEY})
    assert signer is not None and signer.can_sign and signer.sealer is not None


def test_a_missing_or_short_encryption_key_stops_startup() -> None:
    cfg = load_config({"encryption_key_env": "E"}, environ={})
    for env in ({}, {"E": ""}, {"E": "ab" * 16}):
        with pytest.raises(ConfigError) as info:
            Sealer.from_config(cfg, environ=env)
        assert info.value.key == "encryption_key_env"


# -- TLS verification is off only by an explicit, logged opt-in --------------------------------

BASE = "rediss://kv.internal:6380/0"


@pytest.mark.parametrize(
    "query",
    [
        "ssl_cert_reqs=none",
        "ssl_cert_reqs=optional",
        "ssl_cert_reqs=NONE",  # not a value redis-py accepts: refused here rather than later
        "ssl_check_hostname=false",
        "ssl_check_hostname=No",
        "ssl_check_hostname=0",
        "ssl_check_hostname=",
        "ssl_cert_reqs=%6Eone",  # percent-encoded
        "ssl_cert_reqs=%256Eone",  # encoded twice: redis-py < 6 decoded query values twice
        "ssl_cert_reqs=required&ssl_cert_reqs=none",  # every value counts, not the first
        "ssl_ca_certs=/ca.pem&ssl_cert_reqs=none",
    ],
)
def test_rediss_without_verification_needs_remote_tls_insecure(query: str) -> None:
    url = f"{BASE}?{query}"
    assert insecure_tls_args(url)
    with pytest.raises(ConfigError) as info:
        load_config({"remote_url": url}, environ={})
    assert info.value.key == "remote_url" and "remote_tls_insecure" in str(info.value)
    cfg = load_config({"remote_url": url, "remote_tls_insecure": True}, environ={})
    assert cfg.remote_tls_insecure is True
    cfg = load_config({"remote_url": url}, environ={"KVTIER_REMOTE_TLS_INSECURE": "true"})
    assert cfg.remote_tls_insecure is True


@pytest.mark.parametrize(
    "url",
    [
        BASE,
        f"{BASE}?ssl_ca_certs=/etc/ca.pem",
        f"{BASE}?ssl_cert_reqs=required&ssl_check_hostname=true",
        "redis://kv.internal:6379/0?ssl_cert_reqs=none",  # no TLS at all: nothing to verify
    ],
)
def test_verified_tls_needs_no_opt_in(url: str) -> None:
    assert insecure_tls_args(url) == []
    assert load_config({"remote_url": url}, environ={}).remote_url == url


@pytest.mark.parametrize("value", ["yes", 1, "1", None])
def test_remote_tls_insecure_is_a_boolean(value: object) -> None:
    with pytest.raises(ConfigError, match="true or false"):
        load_config({"remote_tls_insecure": value}, environ={})


def test_the_redis_tier_itself_refuses_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    url = f"{BASE}?ssl_cert_reqs=none"
    with pytest.raises(ConfigError, match="remote_tls_insecure"):
        RedisTier(url)
    caplog.set_level(logging.WARNING, logger="kvtier")
    tier = RedisTier(url, tls_insecure=True)  # connects lazily: nothing is sent yet
    assert "TLS verification is OFF" in caplog.text and "ssl_cert_reqs=none" in caplog.text
    tier.close()
