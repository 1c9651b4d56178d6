"""The chart's schema allows exactly the values kvtier's config accepts for its choice keys,
so a value the chart lets through never stops the engine at startup, and a new value is
never refused by the chart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import COMPRESSIONS, LOAD_POLICIES, WRITE_POLICIES, ConfigError, load_config

SCHEMA = Path(__file__).parents[2] / "deploy" / "helm" / "kvtier" / "values.schema.json"


def enums_named(node: Any, name: str) -> list[list[str]]:
    """Every ``enum`` of a property called ``name``, anywhere in the schema."""
    found: list[list[str]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == name and isinstance(value, dict) and "enum" in value:
                found.append(value["enum"])
            found += enums_named(value, name)
    elif isinstance(node, list):
        for value in node:
            found += enums_named(value, name)
    return found


def test_choice_keys_match_the_config() -> None:
    schema = json.loads(SCHEMA.read_text())
    assert enums_named(schema, "compression") == [list(COMPRESSIONS)]
    assert enums_named(schema, "writePolicy") == [list(WRITE_POLICIES)]
    assert enums_named(schema, "load_policy") == [list(LOAD_POLICIES)]
    for value in COMPRESSIONS:
        assert load_config({"compression": value}).compression == value


def test_a_value_outside_the_choices_names_them() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config({"compression": "gzip"})
    assert all(v in str(exc.value) for v in COMPRESSIONS)
