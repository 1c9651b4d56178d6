"""Object tiers: the shared store behind the host tier, picked by ``remote_url``.

``file:///dir`` is always available; ``s3://`` needs boto3 and ``redis://`` /
``rediss://`` (one node) and ``redis+cluster://`` / ``rediss+cluster://`` (Redis Cluster,
Valkey cluster) need redis-py, imported only when chosen. The URL arrives read
(``cfg.remote``, a :class:`~kvtier.config.RemoteURL`) and is handed to the tier as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvtier.config import KVTierConfig, redact_url
from kvtier.errors import ConfigError
from kvtier.extras import MissingExtraError, needs
from kvtier.objects.tiers.base import ObjectTier, Parts
from kvtier.objects.tiers.file import FileTier

__all__ = ["FileTier", "ObjectTier", "Parts", "file_tier_root", "open_tier"]


def file_tier_root(cfg: KVTierConfig) -> str:
    """The directory a ``file://`` ``remote_url`` names."""
    return cfg.remote.directory if cfg.remote else ""


@contextmanager
def _extra(url: str, what: str) -> Iterator[None]:
    """A tier's client library missing: a ConfigError naming remote_url and the extra."""
    try:
        with needs(what):
            yield
    except MissingExtraError as exc:
        raise ConfigError("remote_url", redact_url(url), str(exc)) from exc


def open_tier(cfg: KVTierConfig) -> ObjectTier:
    """Build the object tier ``cfg.remote_url`` names (ConfigError when there is none)."""
    url = cfg.remote
    if not url:
        raise ConfigError("remote_url", cfg.remote_url, "an object tier URL; this config has none")
    if url.kind == "file":
        return FileTier(url.directory, max_bytes=cfg.file_max_bytes)
    if url.kind == "s3":
        with _extra(url.text, "an s3:// object tier"):
            from kvtier.objects.tiers.s3 import S3Tier

        return S3Tier(
            url,
            endpoint_url=cfg.s3_endpoint_url,
            io_threads=cfg.io_thread_count(),
            lookup_timeout_ms=cfg.lookup_timeout_ms,
        )
    if url.kind in ("redis", "redis-cluster"):
        with _extra(url.text, f"a {url.scheme}:// object tier"):
            from kvtier.objects.tiers.redis import RedisTier
            from kvtier.objects.tiers.redis_cluster import RedisClusterTier

        tier_cls = RedisClusterTier if url.kind == "redis-cluster" else RedisTier
        return tier_cls(
            url,
            io_threads=cfg.io_thread_count(),
            lookup_timeout_ms=cfg.lookup_timeout_ms,
            ttl_s=cfg.remote_ttl_s,
            tls_insecure=cfg.remote_tls_insecure,
        )
    raise ConfigError(  # a kind added to RemoteURL before a tier for it
        "remote_url",
        url.safe,
        "file://, s3://, redis://, rediss://, redis+cluster:// or rediss+cluster://",
    )
