"""Every exception kvtier raises on purpose.

    KVTierError
    ├── ConfigError        a config key or value is wrong; raised at engine start
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

import re
from collections.abc import Sequence
from itertools import groupby


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

    def __init__(self, key: object, value: object, allowed: str) -> None:
        self.key = redact_key(key)
        self.value, shown = _redact_value(self.key, value)
        self.allowed = allowed
        super().__init__(f"kvtier config {self.key!r}: got {shown}; {allowed}")

    def __reduce__(self) -> tuple[type[ConfigError], tuple[object, object, str]]:
        # vLLM ships a worker's exception to the engine by pickle; args holds only the message
        return (type(self), (self.key, self.value, self.allowed))


class Redacted(str):
    """A placeholder that stands where a secret was; it prints without quotes."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


#: a key whose value is a credential or names one: its value is never shown
_SECRET_NAME = re.compile(r"pass|pwd|secret|token|hmac|cred|auth|private|signature|key", re.I)
_MAX_SHOWN = 200  # characters of a (safe) value shown in a message
_MAX_SCANNED = 4096  # characters redaction looks into; a longer value is hidden whole


def is_secret_name(key: object) -> bool:
    """True for a key whose value is, or names, a secret (``hmac_key_env``, ``password``)."""
    return isinstance(key, str) and bool(_SECRET_NAME.search(key))


def redacted_placeholder(value: object) -> Redacted:
    """What a message shows instead of ``value``: its kind and size, never its content."""
    if isinstance(value, str):
        return Redacted(f"<redacted {len(value)} chars>")
    return Redacted(f"<redacted {type(value).__name__}>")


_SECRET_ARG = re.compile(
    r"(?i)(?:^|[?&;#\s,])[^=&;?#\s,]*(?:pass|pwd|secret|token|key|auth|sig|cred)[^=&;?#\s]*="
)
_TOKEN = re.compile(r"[A-Za-z0-9+/=_.~-]{16,}")
_HEX = re.compile(r"[0-9a-fA-F]{16,}")
_WORD_SEP = re.compile(r"[+/=_.~-]")


def _looks_random(token: str) -> bool:
    """Long hex (a UUID too), or text that jumbles case and digits like base64 or an API key.

    Paths and model names (``/models/Llama-3-8B-Instruct``) are mostly words, so they stay
    readable; what is caught is what a generated key looks like.
    """
    for run in _HEX.findall(token.replace("-", "")):
        # a hex key may be digits only (one in 2,000 of 16 digits are): no message
        # figure is 16 digits long, so such a run is hidden too
        if any(c.isdigit() for c in run) and (any(c.isalpha() for c in run) or run.isdigit()):
            return True
    for word in _WORD_SEP.split(token):
        n = _switches(word)
        if len(word) >= 10 and n >= 4 and n >= 0.3 * len(word):
            return True
    alnum = [c for c in token if c.isascii() and c.isalnum()]
    if {_kind(c) for c in alnum} != {0, 1, 2} or _switches(alnum) < 4:
        return False
    runs = [len(list(g)) for k, g in groupby(alnum, _kind) if k]
    return sum(n for n in runs if n >= 4) < 0.4 * sum(runs)  # few word-like letter runs


def _kind(c: str) -> int:
    return 0 if c.isdigit() else 1 if c.islower() else 2 if c.isupper() else 3


def _switches(chars: Sequence[str]) -> int:
    """How often text switches between lower case, upper case and digits."""
    return sum(_kind(a) != _kind(b) for a, b in zip(chars, chars[1:], strict=False))


def redact_credentials(text: str) -> str:
    """``text`` with URL credentials and the values of secret arguments hidden.

    Works on any string, a well-formed URL or not: the password in a URL that
    fails validation is as secret as one in a URL that passes. The value of
    ``password=`` (``token=``, ``secret=`` ...) is hidden up to the end of the
    text, since an unescaped ``&`` may be part of it; ``user:password@``
    becomes ``user:***@`` (all of the userinfo when the user part looks odd).
    Text longer than 4096 characters is hidden whole: no setting is that long, and
    the search must stay fast on anything.
    """
    if len(text) > _MAX_SCANNED:
        return redacted_placeholder(text)
    m = _SECRET_ARG.search(text)
    if m:
        text = text[: m.end()] + "***"
    at = text.rfind("@")
    if at >= 0:
        scheme = text.find("://")
        start = scheme + 3 if 0 <= scheme < at else 0
        user, colon, _ = text[start:at].partition(":")
        if colon and re.fullmatch(r"[\w.-]*", user, re.ASCII) and not _looks_random(user):
            text = f"{text[:start]}{user}:***{text[at:]}"
        else:
            text = f"{text[:start]}***{text[at:]}"
    return text


def redact_text(text: str) -> str:
    """:func:`redact_credentials`, and every long random-looking token (a pasted key) hidden."""
    if len(text) > _MAX_SCANNED:
        return redacted_placeholder(text)
    return _TOKEN.sub(
        lambda t: f"<redacted {len(t.group())} chars>" if _looks_random(t.group()) else t.group(),
        redact_credentials(text),
    )


def redact_key(key: object) -> object:
    """A key as a message may show it: one that looks like a secret, or is not text, is hidden."""
    if isinstance(key, str):
        return key if redact_text(key) == key else redacted_placeholder(key)
    if key is None or (isinstance(key, int) and key.bit_length() <= 64):
        return key
    return Redacted(f"<a {type(key).__name__} key>")


def _redact_value(key: object, value: object) -> tuple[object, str]:
    """The value an error keeps and the text its message shows, both free of secrets."""
    if isinstance(value, Redacted):
        return value, str(value)
    if value is None or isinstance(value, bool):
        return value, repr(value)
    if is_secret_name(key) or not isinstance(key, str) or isinstance(key, Redacted):
        hidden = redacted_placeholder(value)
        return hidden, str(hidden)
    if isinstance(value, float):
        return value, repr(value)
    if isinstance(value, int):
        if value.bit_length() > 128:  # repr of an int over 4300 digits raises ValueError
            return value, f"<an integer of {value.bit_length()} bits>"
        return value, repr(value)
    if isinstance(value, str):
        safe = redact_text(value)
        kept = value if safe == value else Redacted(safe)
        if len(safe) > _MAX_SHOWN:
            return kept, repr(safe[:_MAX_SHOWN]) + f"... ({len(safe)} chars)"
        return kept, repr(safe)
    # a list, dict or object may hold anything, and its repr may be huge or raise
    size = f" of {len(value)} items" if isinstance(value, list | tuple | dict | set) else ""
    hidden = Redacted(f"<{type(value).__name__}{size}>")
    return hidden, str(hidden)


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
