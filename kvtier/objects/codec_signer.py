"""The keys that protect object-tier chunks, as the codec takes them: :class:`Signer`.

HMAC-SHA256 signing with key rotation, and the optional AES-256-GCM
:class:`~kvtier.objects.seal.Sealer`, built from the config (the keys read from the
variables or files it names). Apart from :mod:`kvtier.objects.codec` (the frame and its
checks), which re-exports :class:`Signer`: which keys an engine holds is the config's
business, what a chunk must carry is the codec's.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError
from kvtier.objects.key_material import env_key, file_key
from kvtier.objects.seal import Sealer

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig

__all__ = ["HMAC_KEY_MIN_BYTES", "Signer"]


class Signer:
    """The keys that protect chunks in the object tier, as the codec and RemoteIO take them.

    HMAC-SHA256 signing: one key signs, several verify (key rotation). Without
    it anyone who can write the bucket can feed KV to every replica; with it,
    only holders of a key can. ``sealer`` adds AES-256-GCM sealing
    (:class:`kvtier.objects.seal.Sealer`): chunks are encrypted, and authenticated by
    the GCM tag, so a Signer may hold a sealer and no HMAC key at all.
    """

    __slots__ = ("_sign_key", "_verify_keys", "sealer")

    def __init__(
        self,
        sign_key: bytes | None = None,
        verify_keys: Sequence[bytes] = (),
        *,
        sealer: Sealer | None = None,
    ) -> None:
        keys = ([sign_key] if sign_key else []) + [k for k in verify_keys if k]
        if not keys and sealer is None:
            raise ValueError("Signer needs a signing key, a verify key or a sealer")
        self._sign_key = sign_key or None
        # the signing key verifies too, so a fresh rotation reads its own writes
        self._verify_keys = tuple(dict.fromkeys(keys))
        self.sealer = sealer

    def __repr__(self) -> str:  # never the keys themselves
        return (
            f"Signer(signs={self._sign_key is not None}, verify_keys={len(self._verify_keys)}, "
            f"sealer={self.sealer!r})"
        )

    @property
    def can_sign(self) -> bool:
        return self._sign_key is not None

    @property
    def hmac(self) -> bool:
        """True when chunks are signed and must carry a valid HMAC."""
        return bool(self._verify_keys)

    def sign(self, header: bytes, payload: memoryview) -> bytes:
        if self._sign_key is None:
            raise ValueError("this Signer only verifies; it has no signing key")
        mac = hmac.new(self._sign_key, header, hashlib.sha256)
        mac.update(payload)
        return mac.digest()

    def verify(self, header: bytes, payload: memoryview, sig: bytes) -> bool:
        ok = False
        for key in self._verify_keys:
            mac = hmac.new(key, header, hashlib.sha256)
            mac.update(payload)
            ok |= hmac.compare_digest(mac.digest(), sig)
        return ok

    @classmethod
    def from_config(
        cls, cfg: KVTierConfig, environ: Mapping[str, str] | None = None
    ) -> Signer | None:
        """Build the signer the config asks for; None when neither an HMAC key nor an
        encryption key is configured.

        A configured but missing or empty key (or an encryption key that is not
        256 bits) is a startup error (ConfigError naming the config key and the
        variable or file), never a silent switch to unsigned or plaintext
        chunks. The secret itself never appears in a message.
        """
        env = os.environ if environ is None else environ
        sealer = Sealer.from_config(cfg, env)
        sign_key: bytes | None = None
        if cfg.hmac_key_env:
            sign_key = env_key(env, "hmac_key_env", cfg.hmac_key_env)
            _long_enough("hmac_key_env", cfg.hmac_key_env, [sign_key])
        elif cfg.hmac_key_file:
            sign_key = file_key("hmac_key_file", cfg.hmac_key_file)
            _long_enough("hmac_key_file", cfg.hmac_key_file, [sign_key])
        verify: list[bytes] = []
        if cfg.hmac_verify_keys_env:
            raw = env_key(env, "hmac_verify_keys_env", cfg.hmac_verify_keys_env)
            extra = [k.strip() for k in raw.split(b",") if k.strip()]
            verify += _long_enough("hmac_verify_keys_env", cfg.hmac_verify_keys_env, extra)
        if cfg.hmac_verify_keys_file:
            raw = file_key("hmac_verify_keys_file", cfg.hmac_verify_keys_file)
            extra = [k.strip() for k in raw.splitlines() if k.strip()]
            verify += _long_enough("hmac_verify_keys_file", cfg.hmac_verify_keys_file, extra)
        if sign_key is None and not verify:
            return None if sealer is None else cls(sealer=sealer)
        if sign_key is None:
            key = "hmac_verify_keys_env" if cfg.hmac_verify_keys_env else "hmac_verify_keys_file"
            raise ConfigError(
                key,
                getattr(cfg, key),
                "extra verify keys need a signing key too (hmac_key_env or hmac_key_file)",
            )
        return cls(sign_key, verify, sealer=sealer)


#: the shortest HMAC key accepted: 32 bytes, SHA-256's output size (RFC 2104: a shorter key
#: weakens the MAC). ``openssl rand -hex 32`` gives 64.
HMAC_KEY_MIN_BYTES = 32


def _long_enough(cfg_key: str, where: str, keys: list[bytes]) -> list[bytes]:
    """``keys`` when each is at least :data:`HMAC_KEY_MIN_BYTES` long; a ConfigError naming
    the config key and the variable or file (never the key, nor its length) otherwise."""
    if any(len(k) < HMAC_KEY_MIN_BYTES for k in keys):
        raise ConfigError(
            cfg_key,
            where,
            f"a key of at least {HMAC_KEY_MIN_BYTES} bytes (e.g. openssl rand -hex 32); "
            "the one there is shorter",
        )
    return keys
