"""``warmup``, ``warmup_bytes`` and ``warmup_timeout_s`` (issue 61) are read and checked like
every other key: a bad value is a ConfigError naming the key, and warm-up's byte budget
is ``warmup_bytes`` within the host tier, else half of it."""

from __future__ import annotations

import pytest

from kvtier.config import WARMUP_SHARE, load_config
from kvtier.errors import ConfigError

URL = {"remote_url": "file:///tmp/kv"}


def test_off_by_default_with_its_defaults() -> None:
    cfg = load_config({}, environ={})
    assert (cfg.warmup, cfg.warmup_bytes, cfg.warmup_timeout_s) == (False, None, 60.0)
    assert cfg.warmup_budget(2**30) == 0, "no warm-up: nothing fetched"


def test_set_it_is_read_from_the_dict_and_the_environment() -> None:
    cfg = load_config(
        {**URL, "warmup": True, "warmup_bytes": "1GiB", "warmup_timeout_s": "2.5"}, environ={}
    )
    assert (cfg.warmup, cfg.warmup_bytes, cfg.warmup_timeout_s) == (True, 2**30, 2.5)
    env = {"KVTIER_WARMUP": "true", "KVTIER_WARMUP_BYTES": "512MiB"}
    cfg = load_config(URL, environ=env)
    assert (cfg.warmup, cfg.warmup_bytes) == (True, 2**29)


def test_the_budget_is_warmup_bytes_within_the_host_tier_else_a_share() -> None:
    cfg = load_config({**URL, "warmup": True}, environ={})
    assert cfg.warmup_budget(8 * 2**30) == int(8 * 2**30 * WARMUP_SHARE) == 4 * 2**30
    cfg = load_config({**URL, "warmup": True, "warmup_bytes": "1GiB"}, environ={})
    assert cfg.warmup_budget(8 * 2**30) == 2**30
    assert cfg.warmup_budget(2**29) == 2**29, "never more than the host tier"


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"warmup": "sometimes"}, "warmup"),
        ({"warmup": 2}, "warmup"),
        ({"warmup_bytes": "lots"}, "warmup_bytes"),
        ({"warmup_bytes": -1}, "warmup_bytes"),
        ({"warmup_timeout_s": "nan"}, "warmup_timeout_s"),
        ({"warmup_timeout_s": "inf"}, "warmup_timeout_s"),
        ({"warmup_timeout_s": -1}, "warmup_timeout_s"),
        ({"warmup_timeout_s": 10**400}, "warmup_timeout_s"),
        ({"warmup_timeout_s": [1]}, "warmup_timeout_s"),
    ],
)
def test_a_bad_value_names_its_key(extra: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_config({**URL, **extra}, environ={})


def test_warmup_needs_an_object_tier_to_warm_from() -> None:
    with pytest.raises(ConfigError, match="warmup.*remote_url"):
        load_config({"warmup": True}, environ={})
    assert load_config({"warmup": False}, environ={}).warmup is False
