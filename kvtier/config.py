"""kvtier's one config: read once from ``kv_connector_extra_config`` plus
``KVTIER_<KEY>`` environment overrides, validated once, then frozen.

Every mistake raises :class:`~kvtier.errors.ConfigError` naming the key, the
value and what is allowed, so a wrong ``--kv-transfer-config`` stops the engine
at startup instead of misbehaving later.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, urlparse

from kvtier.errors import ConfigError
from kvtier.redact import redact_setting, redacted_placeholder
from kvtier.redact import redact_url as redact_url  # the tiers and the facade read it here

ENV_PREFIX = "KVTIER_"
WRITE_POLICIES = ("write_through", "write_back", "none")
REMOTE_SCHEMES = ("file", "s3", "redis", "rediss", "redis+cluster", "rediss+cluster")
#: Redis Cluster / Valkey cluster URLs: a seed list of host:port, the topology is discovered
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
#: the largest size accepted (1 EiB): past it a typo, not a machine
MAX_SIZE_BYTES = 2**60

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
# ASCII digits only: str.isdigit() and \d also take "５" and "²", which int() reads or rejects
_SIZE_RE = re.compile(r"([0-9]{1,30}(?:\.[0-9]{1,30})?)\s*([a-zA-Z]{0,3})", re.ASCII)
_INT_RE = re.compile(r"[+-]?[0-9]{1,30}", re.ASCII)
_FLOAT_RE = re.compile(
    r"[+-]?(?:[0-9]{1,30}(?:\.[0-9]{0,30})?|\.[0-9]{1,30})(?:[eE][+-]?[0-9]{1,3})?", re.ASCII
)
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}", re.ASCII)
_BUCKET_RE = re.compile(r"[A-Za-z0-9._-]{1,255}", re.ASCII)
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
SIZE_HELP = 'a byte count or a size string such as "512MiB", "8GiB" or "1.5GB"'


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
        if not m or unit not in _UNITS:
            raise ConfigError(key, value, SIZE_HELP)
        exact = Fraction(m.group(1)) * _UNITS[unit]
        if _UNITS[unit] == 1 and exact.denominator != 1:
            raise ConfigError(key, value, SIZE_HELP + " (a whole number of bytes)")
        n = int(exact)  # a fraction of a larger unit rounds down to whole bytes
    else:
        raise ConfigError(key, value, SIZE_HELP)
    if n < 0:
        raise ConfigError(key, value, SIZE_HELP + " (not negative)")
    if n > MAX_SIZE_BYTES:
        raise ConfigError(key, value, bound)
    return n


def format_size(n: int) -> str:
    """Human-readable binary size, for messages and tables."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _int(key: str, value: object, lo: int, hi: int) -> int:
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


def _float(key: str, value: object, lo: float, hi: float) -> float:
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


def _text(key: str, value: object) -> str | None:
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


def _no_controls(key: str, value: str, what: str) -> str:
    if _CONTROL_RE.search(value):
        raise ConfigError(key, value, f"{what} without control characters")
    return value


def _env_name(key: str, value: object) -> str | None:
    """The name of an environment variable; a pasted key (hex, base64) is refused."""
    name = _text(key, value)
    if name is not None and not _ENV_NAME_RE.fullmatch(name):
        raise ConfigError(
            key, name, "the name of an environment variable ([A-Za-z_][A-Za-z0-9_]*), not a key"
        )
    return name


def _path(key: str, value: object) -> str | None:
    path = _text(key, value)
    return None if path is None else _no_controls(key, path, "a file path")


def _cpu_bytes(key: str, value: object) -> int | Literal["auto"]:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    n = parse_size(key, value)
    if n <= 0:
        raise ConfigError(key, value, '"auto" or ' + SIZE_HELP + " greater than zero")
    return n


def _url(key: str, value: object) -> tuple[str, Any] | None:
    """Parse a URL setting: stripped, no control characters (urlparse drops tabs silently)."""
    text = _text(key, value)
    if text is None or not text.strip():
        return None
    url = _no_controls(key, text.strip(), "a URL")
    try:
        parsed = urlparse(url)
        parsed.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError:
        raise ConfigError(key, url, "a well-formed URL") from None
    return url, parsed


def cluster_seeds(url: str) -> list[tuple[str, int]]:
    """The seed nodes of a ``redis+cluster://[user:password@]h1:p1,h2:p2/`` URL, in order
    (port 6379 when left out; ``[v6]:port`` for IPv6). ValueError names what is wrong."""
    netloc = urlparse(url).netloc
    hosts = netloc.rpartition("@")[2]
    seeds = []
    for part in hosts.split(","):
        m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::([0-9]{1,5}))?", part, re.ASCII)
        port = int(m.group(2)) if m and m.group(2) else 6379
        if not m or not 0 < port < 65536:
            raise ValueError(f"seed {part!r} is not host:port")
        seeds.append((m.group(1).strip("[]"), port))
    return seeds


def _cluster_url(key: str, value: object) -> str | None:
    text = _text(key, value)
    if text is None or not text.strip():
        return None
    url = _no_controls(key, text.strip(), "a URL")
    allowed = "redis+cluster://host1:6379,host2:6379/ (seed nodes, db 0 only)"
    try:
        parsed = urlparse(url)
        cluster_seeds(url)
    except ValueError as exc:
        raise ConfigError(key, url, f"{allowed}: {exc}") from None
    if not re.fullmatch(r"/?|/0", parsed.path, re.ASCII) or parsed.fragment:
        raise ConfigError(key, url, f"{allowed}; a cluster has database 0 only")
    return url


def _remote_url(key: str, value: object) -> str | None:
    if isinstance(value, str) and value.strip().lower().startswith(
        tuple(s + "://" for s in CLUSTER_SCHEMES)
    ):
        return _cluster_url(key, value)
    got = _url(key, value)
    if got is None:
        return None
    url, parsed = got
    allowed = (
        "file:///dir, s3://bucket[/prefix], redis://host:port[/db], rediss://..., "
        "redis+cluster://host1:port,host2:port/ or rediss+cluster://..."
    )
    if parsed.scheme not in REMOTE_SCHEMES:
        raise ConfigError(key, url, allowed)
    if parsed.scheme == "file":
        path = unquote(parsed.path)
        if parsed.netloc.lower() not in ("", "localhost") or not path.startswith("/"):
            raise ConfigError(
                key, url, "file:// needs an absolute directory and no host, e.g. file:///var/kv"
            )
        if parsed.params or parsed.query or parsed.fragment or _CONTROL_RE.search(path):
            raise ConfigError(key, url, "file:///dir with no ;params, ?query or #fragment")
    if parsed.scheme == "s3":
        if "@" in parsed.netloc:
            raise ConfigError(
                key, url, "s3:// takes no credentials; boto3 reads them from its own config"
            )
        if not _BUCKET_RE.fullmatch(parsed.netloc) or parsed.query or parsed.fragment:
            raise ConfigError(key, url, "s3:// needs a bucket name, e.g. s3://my-bucket/kv")
    if parsed.scheme in ("redis", "rediss"):
        if not parsed.hostname:
            raise ConfigError(key, url, "redis:// needs a host, e.g. redis://host:6379/0")
        if not re.fullmatch(r"/?|/[0-9]{1,5}", parsed.path, re.ASCII):
            raise ConfigError(key, url, "redis:// takes a database number as its path, e.g. /0")
    return url


#: settings that turn authentication or encryption on: an empty value is a mistake (an
#: unset template variable, ``KVTIER_HMAC_KEY_ENV=""``), never a quiet way to switch it off
SECURITY_KEYS = ("hmac_key_env", "hmac_key_file", "encryption_key_env", "encryption_key_file")
#: settings an empty ``KVTIER_<KEY>`` must not blank out when the JSON sets them
_NO_EMPTY_OVERRIDE = (*SECURITY_KEYS, "namespace")
#: rediss:// query arguments that turn certificate or host name checks off, and what
#: redis-py reads as "off" (the values of ``ssl_cert_reqs`` it accepts are none, optional,
#: required; ``ssl_check_hostname`` is off for an empty value or one of redis-py's false words)
_TLS_OFF_WORDS = frozenset({"", "0", "F", "FALSE", "N", "NO"})


def insecure_tls_args(url: str) -> list[str]:
    """The query arguments of a ``rediss://`` URL that weaken TLS verification, as
    ``name=value`` (empty when it has none). Every value is looked at, decoded once and
    twice (redis-py before 6 decoded query values twice), so no spelling slips past."""
    try:
        parsed = urlparse(url)
        pairs = parse_qsl(parsed.query, keep_blank_values=True)
    except ValueError:
        return []
    if parsed.scheme not in ("rediss", "rediss+cluster"):
        return []
    weak = []
    for name, value in pairs:
        for v in dict.fromkeys((value, unquote(value))):
            if name == "ssl_cert_reqs" and v != "required":
                weak.append(f"{name}={v}")
            elif name == "ssl_check_hostname" and v.strip().upper() in _TLS_OFF_WORDS:
                weak.append(f"{name}={v}")
            elif name == "ssl_exclude_verify_flags" and v.strip():
                weak.append(f"{name}={v}")
    return list(dict.fromkeys(weak))


def _bool_flag(key: str, value: object) -> bool:
    """true/false (a JSON boolean, or its text in an environment override)."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if not isinstance(value, bool):
        raise ConfigError(key, value, "true or false")
    return value


def _endpoint_url(key: str, value: object) -> str | None:
    got = _url(key, value)
    if got is None:
        return None
    url, parsed = got
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(key, url, "an http:// or https:// endpoint, e.g. http://minio:9000")
    if "@" in parsed.netloc:
        raise ConfigError(key, url, "an endpoint without credentials; boto3 reads those itself")
    return url


def redact_value(key: object, value: object) -> object:
    """A config value as a log line or report may show it (:func:`kvtier.redact.redact_setting`
    over the keys this config reads)."""
    return redact_setting(key, value, _PARSERS)


def _choice(choices: tuple[str, ...]) -> Callable[[str, object], str]:
    def parse(key: str, value: object) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(key, value, "one of " + ", ".join(choices))
        return value

    return parse


# Upper bounds keep every value usable: a timeout past threading.TIMEOUT_MAX raises
# OverflowError, a Redis expiry past int64 milliseconds is refused by the server.
_PARSERS: dict[str, Callable[[str, object], Any]] = {
    "chunk_size": lambda k, v: _int(k, v, 1, 2**20),
    "cpu_bytes": _cpu_bytes,
    "cpu_headroom_bytes": parse_size,
    "namespace": lambda k, v: _text(k, v) or "",
    "model_fingerprint": _text,
    "remote_url": _remote_url,
    "s3_endpoint_url": _endpoint_url,
    "remote_ttl_s": lambda k, v: None if v is None else _int(k, v, 1, 2**31 - 1),
    "remote_tls_insecure": _bool_flag,
    "file_max_bytes": lambda k, v: None if v is None else parse_size(k, v),
    "write_policy": _choice(WRITE_POLICIES),
    "lookup_timeout_ms": lambda k, v: _int(k, v, 1, 3_600_000),
    "shutdown_flush_s": lambda k, v: _float(k, v, 0.0, 86_400.0),
    "io_threads": lambda k, v: _int(k, v, 1, 64),
    "io_queue_depth": lambda k, v: _int(k, v, 1, 2**20),
    "hmac_key_env": _env_name,
    "hmac_key_file": _path,
    "hmac_verify_keys_env": _env_name,
    "hmac_verify_keys_file": _path,
    "encryption_key_env": _env_name,
    "encryption_key_file": _path,
    "encryption_decrypt_keys_env": _env_name,
    "encryption_decrypt_keys_file": _path,
    "trust_multimodal_ids": _bool_flag,
}
#: how chunks are stored in the object tier: raw, compressed losslessly, losslessly only where
#: that makes reads faster (kvtier.objects.zpolicy), or as fp8 (kvtier.objects.compress)
COMPRESSIONS = ("none", "lossless", "auto", "fp8")
_PARSERS["compression"] = _choice(COMPRESSIONS)


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
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
    #: names the exact weights (a build id, a checksum) in object-tier keys instead of
    #: kvtier's own fingerprint of the model directory; for weights kvtier cannot read
    model_fingerprint: str | None = None
    #: object tier: file:///dir, s3://bucket/prefix, redis://host:port/db; None = host only
    remote_url: str | None = None
    #: explicit S3 endpoint (MinIO, Ceph RGW); otherwise boto3's own discovery
    s3_endpoint_url: str | None = None
    #: expiry of chunks written to Redis, seconds; None = no expiry
    remote_ttl_s: int | None = None
    #: allow a rediss:// remote_url to turn off TLS verification (ssl_cert_reqs=none or
    #: optional, ssl_check_hostname=false); logged as a warning at startup
    remote_tls_insecure: bool = False
    #: size bound of a file:// tier: past it the least recently used chunks go (down to
    #: 90%); None = unbounded (the directory's own quota applies)
    file_max_bytes: int | None = None
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
    #: name of the environment variable holding the AES-256-GCM key that seals (encrypts)
    #: every chunk written to the object tier: 64 hex characters or base64 of 32 bytes
    encryption_key_env: str | None = None
    #: file holding the encryption key
    encryption_key_file: str | None = None
    #: environment variable with extra comma-separated keys that still decrypt (rotation)
    encryption_decrypt_keys_env: str | None = None
    #: file with extra keys that still decrypt, one per line (rotation)
    encryption_decrypt_keys_file: str | None = None
    #: share chunks of multimodal requests without a cache_salt through the object tier:
    #: only when no client can name an input (multi_modal_uuids) another client sent
    trust_multimodal_ids: bool = False
    #: object-tier chunks: "none" (raw), "lossless" (python-blosc2: byte shuffle + zstd) or
    #: "fp8" (lossy, opt-in: bf16/fp16 KV as fp8 e4m3 with per-block scales); every engine
    #: reads every form, whatever its own setting
    compression: str = "none"

    def check_block_size(self, block_size: int) -> None:
        """Fail startup when chunks would not line up with vLLM's blocks."""
        if self.chunk_size % block_size != 0:
            raise ConfigError(
                "chunk_size",
                self.chunk_size,
                f"a multiple of the engine's block size ({block_size})",
            )

    def redacted(self) -> dict[str, Any]:
        """The config as a dict that is safe to log: no passwords, no key, not even its name.

        A key pasted into ``hmac_key_env`` is a valid variable name, so those
        values are hidden too; :func:`redact_value` says what is shown.
        """
        return {f.name: redact_value(f.name, getattr(self, f.name)) for f in fields(self)}

    def __repr__(self) -> str:  # a config in a traceback or an f-string is logged too
        return f"KVTierConfig({', '.join(f'{k}={v!r}' for k, v in self.redacted().items())})"


KEYS = tuple(f.name for f in fields(KVTierConfig))
assert set(KEYS) == set(_PARSERS), "every config field needs a parser"


def secret_in_config(extra: Mapping[str, Any] | None) -> str | None:
    """What to warn about a secret written into ``kv_connector_extra_config`` itself, which
    vLLM logs verbatim (a password in ``remote_url``), or None. Overrides from the
    environment (``KVTIER_REMOTE_URL``) are not logged and not warned about."""
    url = extra.get("remote_url") if isinstance(extra, Mapping) else None
    if isinstance(url, str) and redact_url(url) != url:
        return (
            "remote_url in --kv-transfer-config holds a password, and vLLM logs that "
            "config verbatim; pass the URL through KVTIER_REMOTE_URL instead"
        )
    return None


def load_config(
    extra: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> KVTierConfig:
    """Validate ``kv_connector_extra_config`` and apply ``KVTIER_<KEY>`` overrides.

    Environment variables win over the dict, so an operator can change one
    setting of a packaged deployment without editing its JSON.
    """
    if extra is not None and not isinstance(extra, Mapping):
        raise ConfigError("kv_connector_extra_config", extra, "a JSON object of kvtier settings")
    raw = dict(extra or {})
    env = os.environ if environ is None else environ
    # text keys first, in order; any other key (a number from YAML) after them
    unknown = sorted(
        (k for k in raw if k not in _PARSERS),
        key=lambda k: (k, "") if isinstance(k, str) else ("\uffff", type(k).__name__),
    )
    if unknown:  # its value is not shown: a password under a misspelt key is still one
        first = unknown[0]
        raise ConfigError(
            first, redacted_placeholder(raw[first]), "known keys are " + ", ".join(KEYS)
        )
    for key in KEYS:
        env_value = env.get(ENV_PREFIX + key.upper())
        if env_value is None:
            continue
        if key in _NO_EMPTY_OVERRIDE and not env_value.strip() and raw.get(key):
            raise ConfigError(
                key,
                f"{ENV_PREFIX}{key.upper()}=",
                "an empty environment override would switch this setting off without a word; "
                f"unset {ENV_PREFIX}{key.upper()}, or remove {key} from the config",
            )
        raw[key] = env_value
    for key in SECURITY_KEYS:
        if key in raw and isinstance(raw[key], str) and not raw[key].strip():
            raise ConfigError(
                key,
                raw[key],
                "a name (empty would turn it off silently); to run without it, leave it out",
            )
    values = {key: _PARSERS[key](key, value) for key, value in raw.items()}
    weak = insecure_tls_args(values.get("remote_url") or "")
    if weak and not values.get("remote_tls_insecure"):
        raise ConfigError(
            "remote_url",
            values["remote_url"],
            f"{', '.join(weak)} turns off TLS verification of the server; remove it (give "
            "the server's CA with ssl_ca_certs=/path/ca.pem), or set remote_tls_insecure "
            "to true to allow it",
        )
    for kind in ("hmac", "encryption"):
        env_key, file_key = f"{kind}_key_env", f"{kind}_key_file"
        if values.get(env_key) and values.get(file_key):
            raise ConfigError(file_key, values[file_key], f"set {env_key} or {file_key}, not both")
    if values.get("file_max_bytes") is not None and not str(
        values.get("remote_url") or ""
    ).startswith("file://"):
        raise ConfigError(
            "file_max_bytes",
            values["file_max_bytes"],
            "only with a file:// remote_url (S3 and Redis have their own expiry and limits)",
        )
    return KVTierConfig(**values)
