"""The parsers of kvtier's config values that are not URLs: sizes, bounded numbers, text,
variable names, flags and choices.

Kept apart from :mod:`kvtier.config.settings` (which maps each key to one of these, holds the
frozen :class:`~kvtier.config.KVTierConfig` and loads it) so the rules of one value can
be read, and tested, without the loading around them. Each parser takes the key it reads
and raises :class:`~kvtier.errors.ConfigError` naming it, the value and what is allowed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Literal

from kvtier.errors import ConfigError

#: the largest size accepted (1 EiB): past it a typo, not a machine
MAX_SIZE_BYTES = 2**60

#: every unit a size string may carry (any case, right after its number or after spaces):
#: decimal kB..TB are 1000-based, IEC KiB..TiB and the bare K..T 1024-based. Kubernetes'
#: "Gi" is refused rather than guessed. docs/configuration.md ("Sizes") lists the same.
SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
# ASCII digits only: str.isdigit() and \d also take "５" and "²", which int() reads or rejects
_SIZE_RE = re.compile(r"([0-9]{1,30}(?:\.[0-9]{1,30})?)\s*([a-zA-Z]{0,3})", re.ASCII)
_INT_RE = re.compile(r"[+-]?[0-9]{1,30}", re.ASCII)
_FLOAT_RE = re.compile(
    r"[+-]?(?:[0-9]{1,30}(?:\.[0-9]{0,30})?|\.[0-9]{1,30})(?:[eE][+-]?[0-9]{1,3})?", re.ASCII
)
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}", re.ASCII)
#: ASCII control characters (urlparse drops tabs and newlines silently)
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
SIZE_HELP = (
    'a byte count or a size string such as "8GiB", "512MiB" (KiB, MiB, GiB, TiB: '
    '1024-based) or "1.5GB" (kB, MB, GB, TB: 1000-based)'
)


def parse_size(key: str, value: object) -> int:
    """Parse a byte count: an int, or a number with a unit (KiB/MiB/GiB/TiB, KB/MB/GB/TB).

    Exact (no float rounding), whole bytes, at most :data:`MAX_SIZE_BYTES`: a
    size past that, ``nan`` or ``inf`` is a typo that must not reach the planner.
    """
    bound = f"{SIZE_HELP}, at most {MAX_SIZE_BYTES} (1 EiB)"
    if isinstance(value, bool):
        raise ConfigError(key, value, SIZE_HELP)
    if isinstance(value, int):
        n = int(value)
    elif isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ConfigError(key, value, SIZE_HELP + " (a whole, finite number of bytes)")
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.fullmatch(value.strip())
        unit = m.group(2).lower() if m else ""
        if not m or unit not in SIZE_UNITS:
            raise ConfigError(key, value, SIZE_HELP)
        exact = Fraction(m.group(1)) * SIZE_UNITS[unit]
        if SIZE_UNITS[unit] == 1 and exact.denominator != 1:
            raise ConfigError(key, value, SIZE_HELP + " (a whole number of bytes)")
        n = int(exact)  # a fraction of a larger unit rounds down to whole bytes
    else:
        raise ConfigError(key, value, SIZE_HELP)
    if n < 0:
        raise ConfigError(key, value, SIZE_HELP + " (not negative)")
    if n > MAX_SIZE_BYTES:
        raise ConfigError(key, value, bound)
    return n


def describe_size(key: str, text: str, n: int) -> str | None:
    """How the size string ``text`` of ``key`` was read (``n`` bytes), for a log line, when
    it is a form one may misread: a decimal unit ("8 GB" is not 8 GiB), a bare K/M/G/T
    (1024-based, unlike GB) or a space before the unit. None for a byte count or an IEC
    unit against its number ("8GiB"), which say what they mean."""
    m = _SIZE_RE.fullmatch(text.strip())
    if not m:
        return None
    number, unit = m.group(1), m.group(2).lower()
    spaced = m.end(1) != m.start(2)
    head = f"{key} {text!r} = {n:,} bytes"
    if unit in ("kb", "mb", "gb", "tb"):
        other = int(Fraction(number) * SIZE_UNITS[unit[0] + "ib"])
        return f"{head} (decimal; {number} {unit[0].upper()}iB is {other:,})"
    if unit in ("k", "m", "g", "t"):
        letter = unit.upper()
        other = int(Fraction(number) * SIZE_UNITS[unit + "b"])
        decimal = "kB" if unit == "k" else f"{letter}B"
        return f"{head} (binary: {letter} is {letter}iB; {number} {decimal} is {other:,})"
    if spaced and unit:
        return head + (" (binary)" if unit.endswith("ib") else "")
    return None


def format_size(n: int) -> str:
    """Human-readable binary size, for messages and tables."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def parse_int(key: str, value: object, lo: int, hi: int) -> int:
    """An int, or its ASCII decimal text (an env override); bounded so no timeout overflows."""
    allowed = f"an integer >= {lo} and <= {hi}"
    if isinstance(value, str):
        m = _INT_RE.fullmatch(value.strip())
        if not m:
            raise ConfigError(key, value, allowed)
        value = int(m.group())
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(key, value, allowed)
    return int(value)


def parse_float(key: str, value: object, lo: float, hi: float) -> float:
    """A finite number in range: nan compares false with every bound and would pass them."""
    allowed = f"a number >= {lo:g} and <= {hi:g}"
    if isinstance(value, str):
        m = _FLOAT_RE.fullmatch(value.strip())
        if not m:
            raise ConfigError(key, value, allowed)
        value = float(m.group())
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(key, value, allowed)
    # compare before float(): float() of a 400-digit int raises OverflowError
    if not (lo <= value <= hi):  # also false for nan
        raise ConfigError(key, value, allowed)
    return float(value)


def parse_text(key: str, value: object) -> str | None:
    """A string that can be hashed, logged and opened: valid UTF-8, no NUL."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(key, value, "a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: undecodable bytes in an env var
        raise ConfigError(key, value, "valid UTF-8 text") from None
    if "\x00" in value:
        raise ConfigError(key, value, "text without NUL characters")
    return value


def no_controls(key: str, value: str, what: str) -> str:
    if CONTROL_RE.search(value):
        raise ConfigError(key, value, f"{what} without control characters")
    return value


def parse_env_name(key: str, value: object) -> str | None:
    """The name of an environment variable; a pasted key (hex, base64) is refused."""
    name = parse_text(key, value)
    if name is not None and not _ENV_NAME_RE.fullmatch(name):
        raise ConfigError(
            key, name, "the name of an environment variable ([A-Za-z_][A-Za-z0-9_]*), not a key"
        )
    return name


def parse_path(key: str, value: object) -> str | None:
    path = parse_text(key, value)
    return None if path is None else no_controls(key, path, "a file path")


def parse_cpu_bytes(key: str, value: object) -> int | Literal["auto"]:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    n = parse_size(key, value)
    if n <= 0:
        raise ConfigError(key, value, '"auto" or ' + SIZE_HELP + " greater than zero")
    return n


def parse_int_or_auto(low: int, high: int) -> Callable[[str, object], int | Literal["auto"]]:
    """The parser of a count that is ``"auto"`` or an integer in ``[low, high]``."""

    def parse(key: str, value: object) -> int | Literal["auto"]:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            return parse_int(key, value, low, high)
        except ConfigError as exc:
            raise ConfigError(key, value, f'"auto" or an integer {low}..{high}') from exc

    return parse


def parse_bool(key: str, value: object) -> bool:
    """true/false (a JSON boolean, or its text in an environment override)."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if not isinstance(value, bool):
        raise ConfigError(key, value, "true or false")
    return value


def one_of(choices: tuple[str, ...]) -> Callable[[str, object], str]:
    """The parser of a value that is one of ``choices``, exactly."""

    def parse(key: str, value: object) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(key, value, "one of " + ", ".join(choices))
        return value

    return parse
