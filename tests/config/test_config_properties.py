"""Every config key, every kind of value: a KVTierConfig of the declared types, or a ConfigError.

Iterates ``KEYS`` so a key added later is covered without touching this file.
"""

from __future__ import annotations

import math
import types
from typing import Literal, Union, get_args, get_origin, get_type_hints

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.config import ENV_PREFIX, KEYS, MAX_SIZE_BYTES, KVTierConfig, load_config, parse_size
from kvtier.errors import ConfigError

HINTS = get_type_hints(KVTierConfig)

# text that int(), float() or urlparse() read differently from what a config means
NASTY_TEXT = [
    "nan",
    "NaN",
    "inf",
    "-inf",
    "Infinity",
    "nanGiB",
    "infGiB",
    "1e400",
    "1e3GiB",
    "-1GiB",
    "--5",
    "-5",
    "+5",
    "0x10",
    "0b1",
    "1_000",
    " 8 ",
    "\t8\n",
    "５",
    "²",
    "٣",
    "1.5",
    "1.5GiB",
    "9" * 400,
    "9" * 5000,
    "9" * 400 + "GiB",
    "0." + "9" * 400,
    "auto",
    " AUTO ",
    "",
    " ",
    "\x00",
    "a\x00b",
    "\udcff",
    "file://var/kv",
    "file:relative",
    "file:///var/kv?x=1",
    "file://localhost/var/kv",
    "file:///var/kv%00",
    "redis://[",
    "redis://h:99999",
    "redis://h/notadb",
    "redis://:pw@",
    "s3://",
    "s3://a:b@bucket",
    "http://h",
    "https://",
    "write_back",
    "none",
    "None",
    "true",
    "0",
    "1",
    "64",
    "65",
    "1e3",
    "1.0",
    "-0.0",
]
NASTY_VALUES: list[object] = [
    float("nan"),
    float("inf"),
    -float("inf"),
    1e300,
    -1e300,
    1.5,
    -0.0,
    0.0,
    2**60,
    2**60 + 1,
    2**63,
    10**400,
    -(10**400),
    10**5000,
    True,
    False,
    None,
    [],
    {},
    [1],
    {"a": 1},
    b"8",
]

values = st.one_of(
    st.sampled_from(NASTY_TEXT + NASTY_VALUES),
    st.text(),
    st.integers(),
    st.floats(),  # nan and inf included
    st.booleans(),
    st.none(),
    st.lists(st.one_of(st.integers(), st.text(max_size=5)), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


def conforms(value: object, hint: object) -> bool:
    """Whether ``value`` is exactly of ``hint`` (no bool for int, no nan for float)."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(conforms(value, arg) for arg in get_args(hint))
    if origin is Literal:
        return any(type(value) is type(arg) and value == arg for arg in get_args(hint))
    if hint is type(None):
        return value is None
    if origin is tuple:  # tuple[X, ...] or tuple[X, Y]
        args = get_args(hint)
        if type(value) is not tuple:
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(conforms(v, args[0]) for v in value)
        return len(args) == len(value) and all(map(conforms, value, args))
    if hint is float:
        return type(value) is float and math.isfinite(value)
    return isinstance(hint, type) and type(value) is hint


def check(extra: dict, environ: dict, key: str) -> None:
    """The property: a config of the declared types, or a ConfigError naming the key."""
    try:
        cfg = load_config(extra, environ=environ)
    except ConfigError as exc:
        assert key in str(exc), str(exc)
        return
    for name in KEYS:
        assert conforms(getattr(cfg, name), HINTS[name]), (name, getattr(cfg, name))
    if isinstance(cfg.cpu_bytes, int):
        assert 0 < cfg.cpu_bytes <= MAX_SIZE_BYTES
    assert 0 <= cfg.cpu_headroom_bytes <= MAX_SIZE_BYTES


@pytest.mark.parametrize("key", KEYS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=values)
def test_every_key_every_value_is_a_config_or_a_config_error(key: str, value: object) -> None:
    check({key: value}, {}, key)


@pytest.mark.parametrize("key", KEYS)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(st.sampled_from(NASTY_TEXT), st.text()))
def test_every_environment_override_is_a_config_or_a_config_error(key: str, text: str) -> None:
    check({}, {ENV_PREFIX + key.upper(): text}, key)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize(
    "value",
    NASTY_TEXT + NASTY_VALUES,
    ids=lambda v: type(v).__name__,  # repr(10**5000) raises
)
def test_every_key_with_every_nasty_value(key: str, value: object) -> None:
    """The same property, deterministically, for the values that broke the old parser."""
    check({key: value}, {}, key)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("shutdown_flush_s", float("nan")),  # was accepted: the flush loop then never ends
        ("shutdown_flush_s", "nan"),
        ("shutdown_flush_s", "inf"),
        ("shutdown_flush_s", 10**400),  # float() of it raised OverflowError
        ("chunk_size", "--5"),  # lstrip("-") then int() raised ValueError
        ("io_threads", "５"),  # isdigit() and int() took a full-width digit
        ("io_threads", "²"),  # isdigit() took it, int() raised ValueError
        ("io_queue_depth", "9" * 5000),  # int() raised ValueError past 4300 digits
        ("cpu_bytes", "9" * 400),  # float() gave inf, int(inf) raised OverflowError
        ("cpu_bytes", 1e300),  # was accepted as a 1e300-byte tier
        ("cpu_bytes", 10**400),
        ("cpu_bytes", "1.5"),  # half a byte was rounded down silently
        ("cpu_headroom_bytes", "８GiB"),
        ("remote_url", "file://var/kv"),  # "var" was dropped as a host: the tier was /kv
        ("remote_url", "file:relative/dir"),
        ("remote_url", "redis://["),  # urlparse raised ValueError
        ("remote_url", "redis://host:99999/0"),
        ("remote_url", "redis://host/zero"),
        ("s3_endpoint_url", "minio:9000"),
        ("lookup_timeout_ms", 10**18),  # a socket timeout that overflows
        ("remote_ttl_s", 2**70),
        ("namespace", "\udcff"),  # msgpack could not encode it when hashing keys
        ("hmac_key_file", "/etc/kv\x00key"),  # open() raised ValueError
    ],
)
def test_values_the_old_parser_mishandled_are_config_errors(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({key: value}, environ={})
    assert err.value.key == key and repr(key) in str(err.value)


@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("1.1GiB", 1181116006),  # a fraction of a unit rounds down to whole bytes
        ("9007199254740993", 9007199254740993),  # exact: float() would give ...992
        (" 8 GiB ", 8 * 2**30),
        ("1e3", None),
        ("1e3GiB", None),
        ("1.5", None),
        (1.5, None),
        (-0.5, None),
        (float("nan"), None),
        ("nanGiB", None),
        ("infGiB", None),
        (2**60, 2**60),
        (2**60 + 1, None),
        ("1025PiB", None),
    ],
)
def test_parse_size_edges(text: object, n: int | None) -> None:
    if n is None:
        with pytest.raises(ConfigError):
            parse_size("cpu_bytes", text)
    else:
        assert parse_size("cpu_bytes", text) == n


def test_well_formed_values_still_parse() -> None:
    cfg = load_config(
        {
            "remote_url": "file://localhost/var/kv",
            "io_threads": " 8 ",
            "shutdown_flush_s": "2.5",
            "lookup_timeout_ms": "+1500",
            "s3_endpoint_url": "http://minio:9000",
        },
        environ={"KVTIER_REMOTE_TTL_S": "3600", "KVTIER_HMAC_KEY_ENV": "KVTIER_HMAC_KEY"},
    )
    assert (cfg.io_threads, cfg.shutdown_flush_s, cfg.lookup_timeout_ms) == (8, 2.5, 1500)
    assert cfg.remote_ttl_s == 3600 and cfg.hmac_key_env == "KVTIER_HMAC_KEY"
    assert load_config({"remote_url": " redis://h:6379/0 "}, environ={}).remote_url == (
        "redis://h:6379/0"
    )
    assert load_config({"remote_url": "s3://my-bucket/kv"}, environ={}).remote_url


def test_non_mapping_and_non_text_keys_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="kv_connector_extra_config"):
        load_config(["cpu_bytes"], environ={})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="known keys"):
        load_config({1: "a", "zz": 2, None: 3}, environ={})  # type: ignore[dict-item]


def test_file_max_bytes_is_a_size_and_only_for_a_file_tier() -> None:
    cfg = load_config({"remote_url": "file:///tmp/kv", "file_max_bytes": "2GiB"}, environ={})
    assert cfg.file_max_bytes == 2 * 2**30
    assert load_config({}, environ={}).file_max_bytes is None
    with pytest.raises(ConfigError, match="file_max_bytes.*file:// remote_url"):
        load_config({"remote_url": "redis://h:6379/0", "file_max_bytes": "1GiB"}, environ={})
    with pytest.raises(ConfigError, match="file_max_bytes"):
        load_config({"remote_url": "file:///tmp/kv", "file_max_bytes": "lots"}, environ={})
