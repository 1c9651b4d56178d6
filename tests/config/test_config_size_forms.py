"""Size strings: which forms are accepted, what each means, and a line that says how a
decimal or spaced form was read ("The operator's first hour, round 2", item 3).

"8 GB" is 8,000,000,000 bytes and "8GiB" 8,589,934,592: 7% apart, enough to tip a tight
host into the OOM killer. kvtier logs, once, how it read any form other than a bare byte
count or an IEC unit written against its number.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from kvtier.config import load_config, parse_size
from kvtier.config import settings as config
from kvtier.config.values import SIZE_UNITS, describe_size

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(config, "_SIZES_NOTED", set())
    caplog.set_level(logging.INFO, logger="kvtier")


def notes(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.INFO and r.name.startswith("kvtier")
    ]


@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("8GiB", 8 * 2**30),
        ("8 GiB", 8 * 2**30),
        ("8gib", 8 * 2**30),
        ("8G", 8 * 2**30),
        ("8 g", 8 * 2**30),
        ("8GB", 8 * 10**9),
        ("8 GB", 8 * 10**9),
        ("8gb", 8 * 10**9),
        ("512MiB", 512 * 2**20),
        ("512MB", 512 * 10**6),
        ("4KiB", 4096),
        ("4kB", 4000),
        ("4K", 4096),
        ("1TiB", 2**40),
        ("1TB", 10**12),
        ("1.5GiB", 3 * 2**29),
        ("1.5GB", 15 * 10**8),
        ("1024", 1024),
        ("1024B", 1024),
        ("1024 b", 1024),
    ],
)
def test_every_documented_form_parses_as_documented(text: str, n: int) -> None:
    assert parse_size("cpu_bytes", text) == n


@pytest.mark.parametrize("text", ["64Gi", "8 GiBs", "8,000MB", "1e9", "8 G B", "GiB", "-1GiB"])
def test_forms_that_are_refused(text: str) -> None:
    with pytest.raises(config.ConfigError):
        parse_size("cpu_bytes", text)


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("8 GB", "cpu_bytes '8 GB' = 8,000,000,000 bytes (decimal; 8 GiB is 8,589,934,592)"),
        ("8GB", "cpu_bytes '8GB' = 8,000,000,000 bytes (decimal; 8 GiB is 8,589,934,592)"),
        ("1.5GB", "cpu_bytes '1.5GB' = 1,500,000,000 bytes (decimal; 1.5 GiB is 1,610,612,736)"),
        ("8G", "cpu_bytes '8G' = 8,589,934,592 bytes (binary: G is GiB; 8 GB is 8,000,000,000)"),
        ("8 GiB", "cpu_bytes '8 GiB' = 8,589,934,592 bytes (binary)"),
        ("512 MiB", "cpu_bytes '512 MiB' = 536,870,912 bytes (binary)"),
    ],
)
def test_a_decimal_or_spaced_size_is_logged_as_read(caplog, text: str, line: str) -> None:
    assert describe_size("cpu_bytes", text, parse_size("cpu_bytes", text)) == line
    load_config({"cpu_bytes": text}, environ={})
    assert notes(caplog) == [f"kvtier: {line}"]


@pytest.mark.parametrize("value", ["8GiB", "512MiB", "1024", 4096, "auto"])
def test_a_plain_byte_count_or_iec_unit_is_not_remarked_on(caplog, value: object) -> None:
    load_config({"cpu_bytes": value}, environ={})
    assert notes(caplog) == []


def test_the_note_is_logged_once_and_covers_every_size_key(caplog) -> None:
    extra = {
        "cpu_bytes": "8 GB",
        "cpu_headroom_bytes": "2GB",
        "remote_url": "file:///kv",
        "file_max_bytes": "100 GB",
        "warmup_bytes": "4 GB",
    }
    for _ in range(3):
        load_config(extra, environ={})
    got = notes(caplog)
    assert len(got) == 4
    assert {line.split(" ")[1] for line in got} == {
        "cpu_bytes",
        "cpu_headroom_bytes",
        "file_max_bytes",
        "warmup_bytes",
    }


def test_an_environment_override_is_noted_too(caplog) -> None:
    load_config({}, environ={"KVTIER_CPU_BYTES": "8 GB"})
    assert notes(caplog) == [
        "kvtier: cpu_bytes '8 GB' = 8,000,000,000 bytes (decimal; 8 GiB is 8,589,934,592)"
    ]


def test_the_docs_list_exactly_the_units_the_parser_takes() -> None:
    """docs/configuration.md's table of size units is the parser's: each unit with its
    multiplier, none missing, none extra."""
    text = DOCS.read_text()
    section = text[text.index("### Sizes") :]
    section = section[: section.index("\n## ")] if "\n## " in section else section
    documented: dict[str, int] = {}
    for units, factor in re.findall(r"((?:`\w+`(?:, )?)+) = ([\d,]+)", section):
        for unit in re.findall(r"`(\w+)`", units):
            documented[unit.lower()] = int(factor.replace(",", ""))
    assert documented == {u: n for u, n in SIZE_UNITS.items() if u}, documented
