"""Every exception kvtier raises on purpose.

    KVTierError
    ├── ConfigError        a config key or value is wrong; raised at engine start
    │   └── UnknownKeyError    a key kvtier does not read (a typo): names the nearest one
    ├── CodecError         a stored chunk is malformed, corrupt, forged or not ours
    │   ├── ChecksumError      payload bytes do not match the header checksum
    │   ├── TruncatedError     fewer bytes than the header promises
    │   ├── SignatureError     not authenticated: HMAC or AES-GCM tag missing or wrong
    │   ├── SealedError        sealed with an encryption key this engine does not hold
    │   └── KeyMismatchError   the object holds a different chunk key
    └── TierError          the object tier could not serve a request
        ├── TierUnavailable    the backend is unreachable or timed out (backs off)
        └── ObjectError        one object cannot be read or written; the backend works
            └── ObjectTooLarge     the object is bigger than the slot it would fill

Callers on the data path catch ``CodecError`` and ``TierError`` and turn them
into counted misses; nothing from kvtier may fail a user's request.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

# redaction lives in kvtier.redact; these two are also read from here
from kvtier.redact import Redacted, error_value, redact_key, redacted_placeholder
from kvtier.redact import is_secret_name as is_secret_name
from kvtier.redact import redact_text as redact_text


class KVTierError(Exception):
    """Base class of every kvtier error."""


class ConfigError(KVTierError, ValueError):
    """A config key or value is wrong.

    The message always names the key, the value given and what is allowed, but
    never a secret: config values end up in startup logs and crash reports, and
    a password or key is often put under the wrong key. Values of secret-named
    keys, URL credentials, ``password=`` arguments and long high-entropy tokens
    are redacted before they reach the message, ``args`` or ``value``.
    """

    #: the config's other mistakes, found in the same load: kvtier logs each as its own
    #: line (:func:`config_errors_logged`), so two typos cost one restart, not two
    more: tuple[ConfigError, ...] = ()
    #: already logged by :func:`config_errors_logged`, which must not log it twice
    logged = False

    def __init__(self, key: object, value: object, allowed: str) -> None:
        self.key = redact_key(key)
        self.value, shown = error_value(self.key, value)
        # one line, always: a log line of its own, and the line vLLM's traceback ends with
        self.allowed = _ONE_LINE.sub(" ", allowed).strip()
        super().__init__(f"kvtier config {self.key!r}: got {shown}; {self.allowed}")

    def __reduce__(self) -> tuple[type[ConfigError], tuple[object, object, str]]:
        # vLLM ships a worker's exception to the engine by pickle; args holds only the message
        return (type(self), (self.key, self.value, self.allowed))


class UnknownKeyError(ConfigError):
    """A key kvtier does not read, most often a typo: ``allowed`` names the nearest known
    key. Its value is never shown: a password under a misspelt key is still one."""

    def __init__(self, key: object, value: object, allowed: str) -> None:
        hidden = value if isinstance(value, Redacted) else redacted_placeholder(value)
        super().__init__(key, hidden, allowed)
        self.args = (f"kvtier config: unknown key {self.key!r}: {self.allowed}",)


_ONE_LINE = re.compile(r"\s*\n\s*")


@contextmanager
def config_errors_logged() -> Iterator[None]:
    """Log a ConfigError leaving this block, and each one it carries (``more``), as one
    ERROR line of logger ``kvtier``, once, then let it go on.

    For the places where vLLM calls kvtier at startup: vLLM 0.32 builds its config in a
    pydantic dataclass, which turns the error into a ``ValidationError`` under some 40
    lines of traceback; kvtier's own line comes first and says it plainly."""
    try:
        yield
    except ConfigError as exc:
        if not exc.logged:
            exc.logged = True
            log = logging.getLogger("kvtier")
            for err in (exc, *exc.more):
                log.error("%s", err)
        raise


class ModelConfigError(ValueError):
    """A model's config.json is missing, unreadable or lacks a field the planner needs
    (``kvtier size``; kvtier.sizing.model re-exports it)."""


class CodecError(KVTierError):
    """A stored chunk cannot be trusted; it is a miss and is never loaded."""

    kind = "malformed"


class ChecksumError(CodecError):
    kind = "checksum"


class TruncatedError(CodecError):
    kind = "truncated"


class SignatureError(CodecError):
    """The chunk is not authentic: unsigned or wrongly signed where an HMAC key is set,
    unsealed where an encryption key is set, or a sealed chunk whose AES-GCM tag does not
    match (tampered, corrupt, or moved to another chunk key)."""

    kind = "signature"


class SealedError(CodecError):
    """The chunk is sealed (encrypted) with a key this engine does not hold, or this engine
    has no encryption key: it cannot be opened, so it is a miss (replicas whose keys differ)."""

    kind = "sealed"


class KeyMismatchError(CodecError):
    kind = "wrong_key"


class TierError(KVTierError):
    """The object tier failed an operation."""

    kind = "tier"


class TierUnavailable(TierError):
    """The backend cannot be reached (refused, timed out, DNS, credentials): RemoteIO backs off."""

    kind = "unreachable"


class ObjectError(TierError):
    """One object failed (disk full on write, a Redis key of the wrong type, not a file).

    Only that object is a miss: the backend answered, so RemoteIO does not back off and
    other objects keep being served.
    """

    kind = "object"


class ObjectTooLarge(ObjectError):
    """The stored object is larger than the caller's bound; it is never read into memory."""

    kind = "oversize"
