"""The tenant settings (issue 60): default_tenant, pin_tenants, tenant_quotas,
pin_max_fraction, tenant_metrics_max; each mistake named by its key."""

from __future__ import annotations

import pytest

from kvtier.config import KEYS, load_config
from kvtier.config.tenants import tenant_name_problem
from kvtier.errors import ConfigError

TENANT_KEYS = (
    "default_tenant",
    "pin_tenants",
    "tenant_quotas",
    "pin_max_fraction",
    "tenant_metrics_max",
)


def test_defaults_leave_tenants_off() -> None:
    cfg = load_config({}, environ={})
    assert set(TENANT_KEYS) <= set(KEYS)
    assert (cfg.default_tenant, cfg.pin_tenants, cfg.tenant_quotas) == (None, (), ())
    assert (cfg.pin_max_fraction, cfg.tenant_metrics_max) == (0.5, 20)
    assert not cfg.tenants


def test_values_as_json_and_as_environment_overrides() -> None:
    cfg = load_config(
        {
            "tenant_quotas": {"team-a": "8GiB", "*": 2 * 2**30},
            "pin_tenants": ["team-a", "*"],
            "default_tenant": "web",
            "pin_max_fraction": 0.25,
            "tenant_metrics_max": 5,
        },
        environ={},
    )
    assert cfg.tenant_quotas == (("*", 2 * 2**30), ("team-a", 8 * 2**30))
    assert cfg.pin_tenants == ("team-a", "*") and cfg.default_tenant == "web" and cfg.tenants
    env = {
        "KVTIER_TENANT_QUOTAS": '{"b": "1GiB"}',
        "KVTIER_PIN_TENANTS": "a, b",
        "KVTIER_PIN_MAX_FRACTION": "0",
        "KVTIER_TENANT_METRICS_MAX": "3",
    }
    cfg = load_config({}, environ=env)
    assert cfg.tenant_quotas == (("b", 2**30),) and cfg.pin_tenants == ("a", "b")
    assert cfg.pin_max_fraction == 0.0 and cfg.tenant_metrics_max == 3
    assert load_config({}, environ={"KVTIER_PIN_TENANTS": '["x"]'}).pin_tenants == ("x",)


@pytest.mark.parametrize(
    ("extra", "key", "says"),
    [
        ({"default_tenant": "team a"}, "default_tenant", "1 to 63 of"),
        ({"default_tenant": "untagged"}, "default_tenant", "not 'untagged'"),
        ({"default_tenant": 3}, "default_tenant", "a string"),
        ({"pin_tenants": "x" * 64}, "pin_tenants", "a list of tenant names"),
        ({"pin_tenants": {"a": 1}}, "pin_tenants", "a list of tenant names"),
        ({"tenant_quotas": ["a"]}, "tenant_quotas", "an object of tenant name"),
        ({"tenant_quotas": "{not json"}, "tenant_quotas", "an object of tenant name"),
        ({"tenant_quotas": {"-a": "1GiB"}}, "tenant_quotas", "tenant names"),
        ({"tenant_quotas": {"a": "0"}}, "tenant_quotas", "greater than zero"),
        ({"tenant_quotas": {"a": "8Gi"}}, "tenant_quotas", "a's size"),
        ({"pin_max_fraction": 1.5}, "pin_max_fraction", "<= 1"),
        ({"tenant_metrics_max": 0}, "tenant_metrics_max", ">= 1"),
        ({"tenant_metrics_max": 5000}, "tenant_metrics_max", "<= 1000"),
    ],
)
def test_each_mistake_names_its_key_and_what_is_allowed(extra, key, says) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(extra, environ={})
    assert err.value.key == key
    assert says in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("team-a", True),
        ("A.b_c-9", True),
        ("x" * 63, True),
        ("x" * 64, False),
        ("", False),
        ("-a", False),
        ("a b", False),
        ("ä", False),
        ("other", False),
        ("a/b", False),
        (None, False),
    ],
)
def test_tenant_names(name, ok) -> None:
    assert (tenant_name_problem(name) is None) is ok
