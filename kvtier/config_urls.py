"""The parsers of kvtier's URL settings: the object tier's ``remote_url`` in each of its
forms (file, S3, Redis, Redis Cluster seeds), the S3 endpoint, and the TLS checks a
``rediss://`` URL may turn off.

Kept apart from :mod:`kvtier.config` so the URL rules, half of what the config checks,
read on their own; :mod:`kvtier.config` exports every public name here (the backends
import a cluster's seeds and the weak TLS arguments from there). Each parser raises
:class:`~kvtier.errors.ConfigError` naming the key, the URL and what is allowed.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, unquote, urlparse

from kvtier.config_values import CONTROL_RE, no_controls, parse_text
from kvtier.errors import ConfigError

REMOTE_SCHEMES = ("file", "s3", "redis", "rediss", "redis+cluster", "rediss+cluster")
#: Redis Cluster / Valkey cluster URLs: a seed list of host:port, the topology is discovered
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")

_BUCKET_RE = re.compile(r"[A-Za-z0-9._-]{1,255}", re.ASCII)
#: rediss:// query arguments that turn certificate or host name checks off, and what
#: redis-py reads as "off" (the values of ``ssl_cert_reqs`` it accepts are none, optional,
#: required; ``ssl_check_hostname`` is off for an empty value or one of redis-py's false words)
_TLS_OFF_WORDS = frozenset({"", "0", "F", "FALSE", "N", "NO"})


def parse_url(key: str, value: object) -> tuple[str, Any] | None:
    """Parse a URL setting: stripped, no control characters (urlparse drops tabs silently)."""
    text = parse_text(key, value)
    if text is None or not text.strip():
        return None
    url = no_controls(key, text.strip(), "a URL")
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


def parse_cluster_url(key: str, value: object) -> str | None:
    text = parse_text(key, value)
    if text is None or not text.strip():
        return None
    url = no_controls(key, text.strip(), "a URL")
    allowed = "redis+cluster://host1:6379,host2:6379/ (seed nodes, db 0 only)"
    try:
        parsed = urlparse(url)
        cluster_seeds(url)
    except ValueError as exc:
        raise ConfigError(key, url, f"{allowed}: {exc}") from None
    if not re.fullmatch(r"/?|/0", parsed.path, re.ASCII) or parsed.fragment:
        raise ConfigError(key, url, f"{allowed}; a cluster has database 0 only")
    return url


def parse_remote_url(key: str, value: object) -> str | None:
    if isinstance(value, str) and value.strip().lower().startswith(
        tuple(s + "://" for s in CLUSTER_SCHEMES)
    ):
        return parse_cluster_url(key, value)
    got = parse_url(key, value)
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
        if parsed.params or parsed.query or parsed.fragment or CONTROL_RE.search(path):
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


def parse_endpoint_url(key: str, value: object) -> str | None:
    got = parse_url(key, value)
    if got is None:
        return None
    url, parsed = got
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(key, url, "an http:// or https:// endpoint, e.g. http://minio:9000")
    if "@" in parsed.netloc:
        raise ConfigError(key, url, "an endpoint without credentials; boto3 reads those itself")
    return url
