"""The parsers of kvtier's URL settings: the object tier's ``remote_url`` in each of its
forms (file, S3, Redis, Redis Cluster seeds), the S3 endpoint, and the TLS checks a
``rediss://`` URL may turn off.

The object tier's URL is read here once, into a :class:`RemoteURL` that
:func:`~kvtier.config.load_config` keeps on the config (``cfg.remote``): the tiers, the
engine and the store command ask it what they need (its kind, directory, bucket, seeds,
TLS) and never read the string themselves (``tests/config/test_url_parsed_once.py``).
Kept apart from :mod:`kvtier.config` so the URL rules, half of what the config checks,
read on their own; :mod:`kvtier.config` exports every public name here. Each parser
raises :class:`~kvtier.errors.ConfigError` naming the key, the URL and what is allowed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, urlparse, urlunparse

from kvtier.config.values import CONTROL_RE, no_controls, parse_text
from kvtier.errors import ConfigError
from kvtier.redact import redact_url

REMOTE_SCHEMES = ("file", "s3", "redis", "rediss", "redis+cluster", "rediss+cluster")
#: Redis Cluster / Valkey cluster URLs: a seed list of host:port, the topology is discovered
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")

#: what a ``remote_url`` names: a directory, an S3 bucket, one Redis node, a Redis Cluster
RemoteKind = Literal["file", "s3", "redis", "redis-cluster"]
_KINDS: dict[str, RemoteKind] = {
    "file": "file",
    "s3": "s3",
    "redis": "redis",
    "rediss": "redis",
    "redis+cluster": "redis-cluster",
    "rediss+cluster": "redis-cluster",
}

_BUCKET_RE = re.compile(r"[A-Za-z0-9._-]{1,255}", re.ASCII)
#: rediss:// query arguments that turn certificate or host name checks off, and what
#: redis-py reads as "off" (the values of ``ssl_cert_reqs`` it accepts are none, optional,
#: required; ``ssl_check_hostname`` is off for an empty value or one of redis-py's false words)
_TLS_OFF_WORDS = frozenset({"", "0", "F", "FALSE", "N", "NO"})


@dataclass(frozen=True, slots=True, repr=False)
class RemoteURL:
    """The object tier's URL, read once by :func:`parse_remote`: its scheme, where it
    points (directory, bucket and prefix, the URL redis-py reads, a cluster's seeds) and
    its TLS options. ``text`` is the URL as configured and may hold a password: ``str()``
    and ``repr()`` show it redacted (:func:`kvtier.redact.redact_url`), as every message
    that names the tier does (:attr:`safe`)."""

    #: the URL as configured (stripped), credentials included: hand it only to a client
    text: str
    #: the scheme, lower case: one of :data:`REMOTE_SCHEMES`
    scheme: str
    #: ``file://``: the directory (percent-decoded)
    directory: str = ""
    #: ``s3://``: the bucket, and the key prefix ("" or ending in ``/``)
    bucket: str = ""
    prefix: str = ""
    #: a cluster's seed nodes, in order (port 6379 where left out)
    seeds: tuple[tuple[str, int], ...] = ()
    #: a cluster: the first seed as one node's URL with the cluster URL's user, password
    #: and query (what redis-py reads the connection options from), and the first seed's
    #: bare address (no credentials, no options)
    node_url: str = ""
    seed_url: str = ""
    #: ``rediss``: the query arguments that weaken TLS verification, as ``name=value``
    weak_tls: tuple[str, ...] = ()

    @property
    def kind(self) -> RemoteKind:
        return _KINDS[self.scheme]

    @property
    def is_local(self) -> bool:
        """A directory (``file://``): the engine may read it on its own thread."""
        return self.scheme == "file"

    @property
    def tls(self) -> bool:
        return self.scheme in ("rediss", "rediss+cluster")

    @property
    def safe(self) -> str:
        """The URL as an error or a log line may show it: no password."""
        return redact_url(self.text)

    def __str__(self) -> str:
        return self.safe

    def __repr__(self) -> str:
        return f"RemoteURL({self.safe!r})"

    @classmethod
    def parse(cls, url: RemoteURL | str) -> RemoteURL:
        """``url`` as a RemoteURL (a tier built from a string, as tests and benchmarks
        do): checked as ``remote_url`` is, ConfigError when it is not one."""
        if isinstance(url, RemoteURL):
            return url
        remote = parse_remote("remote_url", url)
        if remote is None:
            raise ConfigError("remote_url", url, "an object tier URL; this config has none")
        return remote


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


def _parse_cluster(key: str, value: object) -> RemoteURL | None:
    text = parse_text(key, value)
    if text is None or not text.strip():
        return None
    url = no_controls(key, text.strip(), "a URL")
    allowed = "redis+cluster://host1:6379,host2:6379/ (seed nodes, db 0 only)"
    try:
        parsed = urlparse(url)
        seeds = cluster_seeds(url)
    except ValueError as exc:
        raise ConfigError(key, url, f"{allowed}: {exc}") from None
    if not re.fullmatch(r"/?|/0", parsed.path, re.ASCII) or parsed.fragment:
        raise ConfigError(key, url, f"{allowed}; a cluster has database 0 only")
    node = "rediss" if parsed.scheme == "rediss+cluster" else "redis"
    # one node's URL with the cluster URL's user, password and query: what redis-py reads
    userinfo = parsed.netloc.rpartition("@")[0]
    host, port = seeds[0]
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    netloc = (userinfo + "@" if userinfo else "") + address
    return RemoteURL(
        url,
        parsed.scheme,
        seeds=tuple(seeds),
        node_url=urlunparse((node, netloc, "/0", "", parsed.query, "")),
        seed_url=urlunparse((node, address, "", "", "", "")),
        weak_tls=tuple(insecure_tls_args(url)),
    )


def parse_remote(key: str, value: object) -> RemoteURL | None:
    """``remote_url``: checked, and read once into a :class:`RemoteURL` (None: no tier)."""
    if isinstance(value, str) and value.strip().lower().startswith(
        tuple(s + "://" for s in CLUSTER_SCHEMES)
    ):
        return _parse_cluster(key, value)
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
        return RemoteURL(url, "file", directory=path)
    if parsed.scheme == "s3":
        if "@" in parsed.netloc:
            raise ConfigError(
                key, url, "s3:// takes no credentials; boto3 reads them from its own config"
            )
        if not _BUCKET_RE.fullmatch(parsed.netloc) or parsed.query or parsed.fragment:
            raise ConfigError(key, url, "s3:// needs a bucket name, e.g. s3://my-bucket/kv")
        prefix = parsed.path.strip("/")
        return RemoteURL(url, "s3", bucket=parsed.netloc, prefix=prefix + "/" if prefix else "")
    if parsed.scheme in CLUSTER_SCHEMES:  # "redis+cluster:h:1", without "//": no seeds
        return _parse_cluster(key, url)
    if not parsed.hostname:
        raise ConfigError(key, url, "redis:// needs a host, e.g. redis://host:6379/0")
    if not re.fullmatch(r"/?|/[0-9]{1,5}", parsed.path, re.ASCII):
        raise ConfigError(key, url, "redis:// takes a database number as its path, e.g. /0")
    return RemoteURL(url, parsed.scheme, weak_tls=tuple(insecure_tls_args(url)))


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
