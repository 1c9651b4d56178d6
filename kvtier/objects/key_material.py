"""Reading key material the config points at: an environment variable or a file.

The HMAC keys (:class:`kvtier.objects.codec.Signer`) and the encryption keys
(:class:`kvtier.objects.seal.Sealer`) are both named in the config by a variable or a
path, never written there. A name that leads nowhere (unset, empty, unreadable)
stops startup with a :class:`~kvtier.errors.ConfigError` naming the config key and
the variable or file; the key itself never enters a message.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvtier.errors import ConfigError

__all__ = ["env_key", "file_key"]


def env_key(env: Mapping[str, str], cfg_key: str, var: str) -> bytes:
    """The stripped, non-empty value of the variable ``var`` (named by ``cfg_key``)."""
    value = env.get(var, "").strip()
    if not value:
        raise ConfigError(cfg_key, var, "the environment variable it names must be set, non-empty")
    return value.encode()


def file_key(cfg_key: str, path: str) -> bytes:
    """The stripped, non-empty contents of the file at ``path`` (named by ``cfg_key``)."""
    try:
        with open(path, "rb") as f:
            value = f.read().strip()
    except OSError as exc:
        raise ConfigError(cfg_key, path, f"a readable file ({exc.strerror})") from None
    if not value:
        raise ConfigError(cfg_key, path, "a file holding a non-empty key")
    return value
