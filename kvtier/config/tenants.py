"""The tenant settings' parsers (issue 60): tenant names, ``tenant_quotas``, ``pin_tenants``.

A tenant name is what a request names in ``kv_transfer_params`` and what the
``tenant`` label of kvtier's metrics shows, so it is short and plain: 1 to 63 of
``A-Z a-z 0-9 . _ -``, starting with a letter or digit, and not one of the label values
kvtier itself uses ("untagged", "other").
"""

from __future__ import annotations

import json
import re

from kvtier.config.values import SIZE_HELP, parse_size
from kvtier.errors import ConfigError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
#: label values of kvtier's own (kvtier.host.tenants): never a tenant's name
RESERVED_NAMES = ("untagged", "other")
TENANT_NAME_HELP = (
    "1 to 63 of A-Z a-z 0-9 . _ - starting with a letter or digit, not "
    + " or ".join(repr(n) for n in RESERVED_NAMES)
)
#: the longest pin a request may ask for, seconds (30 days)
MAX_PIN_TTL_S = 30 * 86_400


def tenant_name_problem(name: object) -> str | None:
    """Why ``name`` is no tenant name, or None when it is one."""
    if not isinstance(name, str):
        return f"a string ({TENANT_NAME_HELP})"
    if not _NAME.fullmatch(name) or name in RESERVED_NAMES:
        return TENANT_NAME_HELP
    return None


def parse_tenant(key: str, value: object) -> str | None:
    """``default_tenant``: a tenant name, or None."""
    if value is None or value == "":
        return None
    if (problem := tenant_name_problem(value)) is not None:
        raise ConfigError(key, value, problem)
    assert isinstance(value, str)
    return value


def _json(key: str, value: object, allowed: str) -> object:
    """An environment override is text: JSON for a list or an object."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        raise ConfigError(key, value, allowed) from None


def parse_tenant_list(key: str, value: object) -> tuple[str, ...]:
    """``pin_tenants``: a list of tenant names, ``"*"`` for every tenant; as text a JSON
    list or names separated by commas."""
    allowed = f'a list of tenant names ({TENANT_NAME_HELP}) or "*"'
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        text = value.strip()
        value = _json(key, text, allowed) if text.startswith("[") else text.split(",")
    if not isinstance(value, list | tuple):
        raise ConfigError(key, value, allowed)
    names: list[str] = []
    for item in value:
        name = item.strip() if isinstance(item, str) else item
        if name != "*" and tenant_name_problem(name) is not None:
            raise ConfigError(key, item, allowed)
        if name not in names:
            names.append(name)
    return tuple(names)


def parse_tenant_quotas(key: str, value: object) -> tuple[tuple[str, int], ...]:
    """``tenant_quotas``: tenant name (``"*"``: every tenant not named) -> a size of the host
    tier per worker (``cpu_bytes``' forms), greater than zero; as text a JSON object."""
    allowed = f'an object of tenant name or "*" -> size ({SIZE_HELP}, greater than zero)'
    if value is None or value == "":
        return ()
    value = _json(key, value, allowed)
    if not isinstance(value, dict):
        raise ConfigError(key, value, allowed)
    out: list[tuple[str, int]] = []
    for name, size in value.items():
        if name != "*" and (problem := tenant_name_problem(name)) is not None:
            raise ConfigError(key, {name: size}, f'tenant names ({problem}) or "*" -> sizes')
        try:
            n = parse_size(key, size)
        except ConfigError:
            n = 0
        if n <= 0:
            raise ConfigError(key, {name: size}, f"{name}'s size as {SIZE_HELP}, greater than zero")
        out.append((name, n))
    return tuple(sorted(out))
