"""kvtier's one config: read once from ``kv_connector_extra_config`` plus
``KVTIER_<KEY>`` environment overrides, validated once, then frozen.

Every mistake raises :class:`~kvtier.errors.ConfigError` naming the key, the
value and what is allowed, so a wrong ``--kv-transfer-config`` stops the engine
at startup instead of misbehaving later.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal
from urllib.parse import urlparse

from kvtier.errors import ConfigError

ENV_PREFIX = "KVTIER_"
WRITE_POLICIES = ("write_through", "write_back", "none")
REMOTE_SCHEMES = ("file", "s3", "redis", "rediss")

_UNITS = {
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
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
SIZE_HELP = 'a byte count or a size string such as "512MiB", "8GiB" or "1.5GB"'


def parse_size(key: str, value: object) -> int:
    """Parse a byte count: an int, or a number with a unit (KiB/MiB/GiB/TiB, KB/MB/GB/TB)."""
    if isinstance(value, bool):
        raise ConfigError(key, value, SIZE_HELP)
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(key, value, SIZE_HELP + " (not negative)")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ConfigError(key, value, SIZE_HELP)


def format_size(n: int) -> str:
    """Human-readable binary size, for messages and tables."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _int(key: str, value: object, lo: int, hi: int | None = None) -> int:
    allowed = f"an integer >= {lo}" + (f" and <= {hi}" if hi is not None else "")
    if isinstance(value, bool):
        raise ConfigError(key, value, allowed)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        raise ConfigError(key, value, allowed)
    return value


def _float(key: str, value: object, lo: float) -> float:
    allowed = f"a number >= {lo}"
    if isinstance(value, bool):
        raise ConfigError(key, value, allowed)
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(key, value, allowed) from None
    if not isinstance(value, int | float) or value < lo:
        raise ConfigError(key, value, allowed)
    return float(value)


def _opt_str(key: str, value: object) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(key, value, "a string")
    return value


def _cpu_bytes(key: str, value: object) -> int | Literal["auto"]:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    n = parse_size(key, value)
    if n <= 0:
        raise ConfigError(key, value, '"auto" or ' + SIZE_HELP + " greater than zero")
    return n


def _remote_url(key: str, value: object) -> str | None:
    url = _opt_str(key, value)
    if url is None:
        return None
    parsed = urlparse(url)
    allowed = "file:///dir, s3://bucket[/prefix], redis://host:port[/db] or rediss://..."
    if parsed.scheme not in REMOTE_SCHEMES:
        raise ConfigError(key, redact_url(url), allowed)
    if parsed.scheme == "file" and not parsed.path:
        raise ConfigError(key, url, "file:// needs an absolute directory, e.g. file:///var/kv")
    if parsed.scheme == "s3" and not parsed.netloc:
        raise ConfigError(key, url, "s3:// needs a bucket name, e.g. s3://my-bucket/kv")
    if parsed.scheme in ("redis", "rediss") and not parsed.hostname:
        raise ConfigError(key, redact_url(url), "redis:// needs a host, e.g. redis://host:6379/0")
    return url


def redact_url(url: str) -> str:
    """Hide a password in a URL so it never lands in an error or a log line.

    Covers ``user:password@`` and a ``password=`` query argument (redis-py
    accepts both).
    """
    parsed = urlparse(url)
    if parsed.password:
        netloc = parsed.netloc.replace(f":{parsed.password}@", ":***@")
        parsed = parsed._replace(netloc=netloc)
    if "password=" in parsed.query:
        query = re.sub(r"(^|&)password=[^&]*", r"\1password=***", parsed.query)
        parsed = parsed._replace(query=query)
    return parsed.geturl()


_redact_url = redact_url  # the old private name, for callers not yet updated


def _choice(choices: tuple[str, ...]) -> Callable[[str, object], str]:
    def parse(key: str, value: object) -> str:
        if value not in choices:
            raise ConfigError(key, value, "one of " + ", ".join(choices))
        return str(value)

    return parse


_PARSERS: dict[str, Callable[[str, object], Any]] = {
    "chunk_size": lambda k, v: _int(k, v, 1),
    "cpu_bytes": _cpu_bytes,
    "cpu_headroom_bytes": parse_size,
    "namespace": lambda k, v: _opt_str(k, v) or "",
    "remote_url": _remote_url,
    "s3_endpoint_url": _opt_str,
    "remote_ttl_s": lambda k, v: None if v is None else _int(k, v, 1),
    "write_policy": _choice(WRITE_POLICIES),
    "lookup_timeout_ms": lambda k, v: _int(k, v, 1),
    "shutdown_flush_s": lambda k, v: _float(k, v, 0.0),
    "io_threads": lambda k, v: _int(k, v, 1, 64),
    "io_queue_depth": lambda k, v: _int(k, v, 1),
    "hmac_key_env": _opt_str,
    "hmac_key_file": _opt_str,
    "hmac_verify_keys_env": _opt_str,
    "hmac_verify_keys_file": _opt_str,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class KVTierConfig:
    """Validated connector settings. Build it with :func:`load_config`."""

    #: tokens per chunk; a multiple of vLLM's block size
    chunk_size: int = 256
    #: host tier size in bytes, or "auto" to let the planner size it
    cpu_bytes: int | Literal["auto"] = "auto"
    #: memory left to the OS and everything else when cpu_bytes is "auto"
    cpu_headroom_bytes: int = 4 * 2**30
    #: optional string mixed into every chunk key (tenant / deployment isolation)
    namespace: str = ""
    #: object tier: file:///dir, s3://bucket/prefix, redis://host:port/db; None = host only
    remote_url: str | None = None
    #: explicit S3 endpoint (MinIO, Ceph RGW); otherwise boto3's own discovery
    s3_endpoint_url: str | None = None
    #: expiry of chunks written to Redis, seconds; None = no expiry
    remote_ttl_s: int | None = None
    #: when chunks reach the object tier
    write_policy: str = "write_through"
    #: an object-tier lookup slower than this is a miss
    lookup_timeout_ms: int = 2000
    #: at shutdown, how long queued writes may still flush
    shutdown_flush_s: float = 10.0
    #: object-tier I/O threads (and the size of the connection pool)
    io_threads: int = 4
    #: queued object-tier writes before new ones are dropped (and counted)
    io_queue_depth: int = 256
    #: name of the environment variable holding the HMAC signing key
    hmac_key_env: str | None = None
    #: file holding the HMAC signing key
    hmac_key_file: str | None = None
    #: environment variable with extra comma-separated keys accepted on read (rotation)
    hmac_verify_keys_env: str | None = None
    #: file with extra keys accepted on read, one per line (rotation)
    hmac_verify_keys_file: str | None = None

    def check_block_size(self, block_size: int) -> None:
        """Fail startup when chunks would not line up with vLLM's blocks."""
        if self.chunk_size % block_size != 0:
            raise ConfigError(
                "chunk_size",
                self.chunk_size,
                f"a multiple of the engine's block size ({block_size})",
            )

    def redacted(self) -> dict[str, Any]:
        """The config as a dict that is safe to log: no passwords."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.remote_url:
            out["remote_url"] = redact_url(self.remote_url)
        return out


KEYS = tuple(f.name for f in fields(KVTierConfig))
assert set(KEYS) == set(_PARSERS), "every config field needs a parser"


def load_config(
    extra: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> KVTierConfig:
    """Validate ``kv_connector_extra_config`` and apply ``KVTIER_<KEY>`` overrides.

    Environment variables win over the dict, so an operator can change one
    setting of a packaged deployment without editing its JSON.
    """
    raw = dict(extra or {})
    env = os.environ if environ is None else environ
    unknown = sorted(k for k in raw if k not in _PARSERS)
    if unknown:
        raise ConfigError(unknown[0], raw[unknown[0]], "known keys are " + ", ".join(KEYS))
    for key in KEYS:
        env_value = env.get(ENV_PREFIX + key.upper())
        if env_value is not None:
            raw[key] = env_value
    values = {key: _PARSERS[key](key, value) for key, value in raw.items()}
    if values.get("hmac_key_env") and values.get("hmac_key_file"):
        raise ConfigError(
            "hmac_key_file", values["hmac_key_file"], "set hmac_key_env or hmac_key_file, not both"
        )
    return KVTierConfig(**values)
