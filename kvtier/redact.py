"""Secrets never shown: what errors, logs, reprs and reports print instead of them.

One home for redaction. :class:`~kvtier.errors.ConfigError` hides the value of a
secret-named key and anything that looks like a credential (:func:`error_value`), but
shows the name of a variable a ``*_env`` key names (:func:`shows_variable_name`);
the config's ``redacted()`` and ``kvtier doctor`` show settings through
:func:`redact_setting`; the tiers name their URL through :func:`redact_url`.
Nothing here raises, whatever it is given.
"""

from __future__ import annotations

import re
from collections.abc import Container, Sequence
from itertools import groupby


class Redacted(str):
    """A placeholder that stands where a secret was; it prints without quotes."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


#: a key whose value is a credential or names one: its value is never shown (a count of
#: tokens, ``canary_check_tokens``, is a number of the model's tokens, not a credential)
_SECRET_NAME = re.compile(
    r"pass|pwd|secret|token(?!s(?:$|_))|hmac|cred|auth|private|signature|key", re.I
)
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


#: what an environment variable is conventionally named (POSIX: upper case, digits, _)
_VARIABLE_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,254}", re.ASCII)


def shows_variable_name(key: object, value: object) -> bool:
    """Whether an error about ``key`` shows ``value`` although the key is secret-named: a
    ``*_env`` setting (``hmac_key_env``) holds the *name* of the variable with the key,
    and that name is what the operator must see to set it ("hmac_key_env names
    KVTIER_HMAC, which is not set"). Only an upper-case variable name that does not look
    generated is shown; a key pasted there (hex, base64, a password) stays hidden."""
    return (
        isinstance(key, str)
        and not isinstance(key, Redacted)
        and key.endswith("_env")
        and isinstance(value, str)
        and not isinstance(value, Redacted)
        and bool(_VARIABLE_NAME.fullmatch(value))
        and redact_text(value) == value
    )


def error_value(key: object, value: object) -> tuple[object, str]:
    """The value an error keeps and the text its message shows, both free of secrets."""
    if isinstance(value, Redacted):
        return value, str(value)
    if value is None or isinstance(value, bool):
        return value, repr(value)
    if shows_variable_name(key, value):
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


def redact_url(url: str) -> str:
    """Hide a password in a URL so it never lands in an error or a log line.

    Covers ``user:password@`` and a ``password=`` query argument (redis-py
    accepts both), and never raises, even on a malformed URL.
    """
    return redact_credentials(url)


def redact_setting(key: object, value: object, known: Container[object]) -> object:
    """A setting's value as a log line or report may show it (``known``: the keys
    the config reads).

    Unknown and secret-named keys (``hmac_key_env``: a key pasted there is a
    key) show only a placeholder; text loses URL credentials and random-looking
    tokens; containers, which may hold anything, show only their size.
    """
    if value is None or value == "" or isinstance(value, bool | int | float):
        return value
    if key not in known or is_secret_name(key):
        return redacted_placeholder(value)
    if isinstance(value, str):
        return redact_text(value)
    size = f" of {len(value)} items" if isinstance(value, list | tuple | dict | set) else ""
    return Redacted(f"<{type(value).__name__}{size}>")
