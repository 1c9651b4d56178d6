"""Every exception kvtier raises on purpose.

    KVTierError
    ├── ConfigError        a config key or value is wrong; raised at engine start
    ├── CodecError         a stored chunk is malformed, corrupt, forged or not ours
    │   ├── ChecksumError      payload bytes do not match the header checksum
    │   ├── TruncatedError     fewer bytes than the header promises
    │   ├── SignatureError     HMAC missing or wrong
    │   └── KeyMismatchError   the object holds a different chunk key
    └── TierError          the object tier could not serve a request
        └── TierUnavailable    the backend is unreachable or timed out

Callers on the data path catch ``CodecError`` and ``TierError`` and turn them
into counted misses; nothing from kvtier may fail a user's request.
"""

from __future__ import annotations


class KVTierError(Exception):
    """Base class of every kvtier error."""


class ConfigError(KVTierError, ValueError):
    """A config key or value is wrong.

    The message always names the key, the value given and what is allowed.
    """

    def __init__(self, key: str, value: object, allowed: str) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        super().__init__(f"kvtier config {key!r}: got {value!r}; {allowed}")


class CodecError(KVTierError):
    """A stored chunk cannot be trusted; it is a miss and is never loaded."""

    kind = "malformed"


class ChecksumError(CodecError):
    kind = "checksum"


class TruncatedError(CodecError):
    kind = "truncated"


class SignatureError(CodecError):
    kind = "signature"


class KeyMismatchError(CodecError):
    kind = "wrong_key"


class TierError(KVTierError):
    """The object tier failed an operation."""

    kind = "tier"


class TierUnavailable(TierError):
    kind = "unreachable"
