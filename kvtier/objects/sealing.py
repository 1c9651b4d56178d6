"""The keys that protect object-tier chunks: HMAC signing (:class:`Signer`), AES-256-GCM
sealing (:class:`Sealer`), and reading their key material from the config.

Which keys an engine holds, how they are read (an environment variable or a file the
config names, never the config itself) and what they do to a chunk's bytes change
together; what a chunk must carry is :mod:`kvtier.objects.codec`'s business.

Key material: a name that leads nowhere (unset, empty, unreadable) stops startup with a
:class:`~kvtier.errors.ConfigError` naming the config key and the variable or file; the
key itself never enters a message.

Sealing (encryption at rest).

Signing stops forgery, not reading: KV plus the model's weights gives the
prompt back. With an encryption key every chunk written to the object tier is
sealed, so a reader of the bucket, the Redis or the directory learns its
chunk key, dtype, shape and length, and nothing about the tokens:

- AES-256-GCM (``cryptography``, OpenSSL underneath: AES-NI/VAES), a fresh
  random 96-bit nonce per object, the 128-bit tag in the chunk's header.
- The associated data is the chunk's format version, chunk key, dtype, shape
  and length (:func:`kvtier.objects.codec.encode` builds it): a sealed chunk copied to
  another chunk key's name, or with any header field changed, does not open.
- Every key has an id (the first 8 bytes of HMAC-SHA256(key, a fixed label)):
  it names which of an engine's keys opened a chunk without trying them all,
  and reveals nothing about the key. A chunk sealed with a key the engine does
  not hold is refused unread as :class:`~kvtier.errors.SealedError`.
- Rotation like the HMAC keys: one key seals, extra keys still open.
- The payload is encrypted into a per-thread scratch buffer (the host slot
  stays plaintext) and decrypted in place, in the host slot it was read into.

A key is 256 bits, written as 64 hex characters or as the base64 (standard or
URL-safe alphabet, padded or not) of 32 bytes; anything else stops startup.

With random nonces a key should seal fewer than 2**32 objects (NIST SP 800-38D;
16 PiB of 4 MiB chunks): rotate long before that.
"""

from __future__ import annotations

import binascii
import hashlib
import hmac
import os
import re
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kvtier.errors import ConfigError, SealedError, SignatureError

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig

__all__ = [
    "HMAC_KEY_MIN_BYTES",
    "KEY_BYTES",
    "KID_BYTES",
    "NONCE_BYTES",
    "TAG_BYTES",
    "Seal",
    "Sealer",
    "Signer",
    "env_key",
    "file_key",
    "parse_key",
]

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
#: a sealed chunk is decrypted in pieces of this size through a per-thread bounce buffer
OPEN_PIECE_BYTES = 1 << 20
KID_BYTES = 8
_KID_LABEL = b"kvtier seal key id v1"
#: prefixed to every chunk's associated data: a sealed chunk is never valid for another use
AAD_LABEL = b"kvtier chunk seal v1\x00"
_HEX_RE = re.compile(r"[0-9a-fA-F]{64}", re.ASCII)
_B64_RE = re.compile(r"[A-Za-z0-9+/_-]{42,44}={0,2}", re.ASCII)
KEY_HELP = "a 256-bit key: 64 hex characters, or the base64 of 32 bytes"


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


def parse_key(cfg_key: str, where: str, raw: bytes) -> bytes:
    """The 32 key bytes from their text (hex or base64); ConfigError naming ``cfg_key``
    and ``where`` (the variable or file) otherwise. The key never enters a message."""
    try:
        text = raw.strip().decode("ascii")
    except UnicodeDecodeError:
        raise ConfigError(cfg_key, where, KEY_HELP + " (it holds non-ASCII bytes)") from None
    if _HEX_RE.fullmatch(text):
        return bytes.fromhex(text)
    if _B64_RE.fullmatch(text):
        std = text.replace("-", "+").replace("_", "/").rstrip("=")
        try:
            key = binascii.a2b_base64(std + "=" * (-len(std) % 4), strict_mode=True)
        except binascii.Error:
            key = b""
        if len(key) == KEY_BYTES:
            return key
    raise ConfigError(cfg_key, where, KEY_HELP)


def key_id(key: bytes) -> bytes:
    """The id stored with every chunk ``key`` seals: says which key, not what it is."""
    return hmac.new(key, _KID_LABEL, hashlib.sha256).digest()[:KID_BYTES]


class Seal(NamedTuple):
    """What a sealed chunk's header records: key id, nonce and tag."""

    kid: bytes
    nonce: bytes
    tag: bytes


class Sealer:
    """AES-256-GCM with one sealing key and extra opening keys (rotation); thread-safe.

    Never shows a key: ``repr`` counts them, and errors name only what failed.
    """

    __slots__ = ("_seal_key", "_seal_kid", "_keys", "_local", "_seals", "_seals_lock")

    def __init__(self, seal_key: bytes, open_keys: Sequence[bytes] = ()) -> None:
        for k in (seal_key, *open_keys):
            if not isinstance(k, bytes) or len(k) != KEY_BYTES:
                raise ValueError(f"a Sealer key is {KEY_BYTES} bytes")
        self._seal_key = seal_key
        self._seal_kid = key_id(seal_key)
        # the sealing key opens too, so a fresh rotation reads its own writes
        self._keys = {key_id(k): k for k in (*open_keys, seal_key)}
        self._local = threading.local()
        self._seals = 0
        self._seals_lock = threading.Lock()

    def __repr__(self) -> str:  # never the keys themselves
        return f"Sealer(open_keys={len(self._keys)})"

    @property
    def kid(self) -> bytes:
        """The id of the sealing key."""
        return self._seal_kid

    @property
    def seals(self) -> int:
        """How many times this sealer sealed (drew a random nonce for its one key)."""
        return self._seals

    def can_open(self, kid: bytes) -> bool:
        return kid in self._keys

    def scratch(self, nbytes: int) -> memoryview:
        """This thread's buffer for ciphertext, ``nbytes`` long (reused by the next seal)."""
        buf: bytearray | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = bytearray(nbytes)
            self._local.buf = buf
        return memoryview(buf)[:nbytes]

    def _decrypt_in_place(self, dec: Any, data: memoryview) -> None:
        """Decrypt ``data`` in place through this thread's bounce buffer, one piece at a
        time: cryptography >= 51 refuses ``update_into`` with overlapping input and output,
        and GCM, a stream mode, gives as many bytes out as in."""
        bounce: bytearray | None = getattr(self._local, "bounce", None)
        if bounce is None:
            # update_into wants room for one more block than it is given
            bounce = self._local.bounce = bytearray(OPEN_PIECE_BYTES + 16)
        out = memoryview(bounce)
        for at in range(0, data.nbytes, OPEN_PIECE_BYTES):
            piece = data[at : at + OPEN_PIECE_BYTES]
            n = dec.update_into(piece, out)
            assert n == piece.nbytes, "GCM is a stream mode: as many bytes out as in"
            piece[:] = out[:n]

    def seal(self, aad: bytes, plain: memoryview) -> tuple[Seal, memoryview]:
        """Encrypt ``plain`` with a fresh nonce; returns the seal and the ciphertext, which
        lives in this thread's scratch buffer until the thread seals again."""
        nonce = os.urandom(NONCE_BYTES)
        with self._seals_lock:
            self._seals += 1
        out = self.scratch(plain.nbytes)
        enc = Cipher(algorithms.AES(self._seal_key), modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(AAD_LABEL + aad)
        n = enc.update_into(plain, out) if plain.nbytes else 0
        enc.finalize()
        assert n == plain.nbytes, "GCM is a stream mode: as many bytes out as in"
        return Seal(self._seal_kid, nonce, enc.tag), out

    def open_into(self, seal: Seal, aad: bytes, data: memoryview) -> None:
        """Decrypt ``data`` in place and check the tag.

        Raises :class:`~kvtier.errors.SealedError` when no key here has the chunk's id
        (``data`` untouched) and :class:`~kvtier.errors.SignatureError` when the tag does
        not match (tampered, moved, or corrupt): then ``data`` holds garbage and must not
        be used.
        """
        key = self._keys.get(seal.kid)
        if key is None:
            raise SealedError("chunk is sealed with an encryption key this engine does not hold")
        if len(seal.nonce) != NONCE_BYTES or len(seal.tag) != TAG_BYTES:
            raise SignatureError("chunk seal has a nonce or tag of the wrong size")
        dec = Cipher(algorithms.AES(key), modes.GCM(seal.nonce, seal.tag)).decryptor()
        dec.authenticate_additional_data(AAD_LABEL + aad)
        if data.nbytes:
            self._decrypt_in_place(dec, data)
        try:
            dec.finalize()
        except InvalidTag:
            raise SignatureError(
                "sealed chunk does not open: its bytes or header were changed, or it was moved"
            ) from None

    @classmethod
    def from_config(
        cls, cfg: KVTierConfig, environ: Mapping[str, str] | None = None
    ) -> Sealer | None:
        """The sealer the config asks for; None without an encryption key.

        A configured key that is missing, empty or not 256 bits stops startup with
        a ConfigError naming the config key and the variable or file, never the key.
        """
        env = os.environ if environ is None else environ
        seal_key: bytes | None = None
        if cfg.encryption_key_env:
            raw = env_key(env, "encryption_key_env", cfg.encryption_key_env)
            seal_key = parse_key("encryption_key_env", cfg.encryption_key_env, raw)
        elif cfg.encryption_key_file:
            raw = file_key("encryption_key_file", cfg.encryption_key_file)
            seal_key = parse_key("encryption_key_file", cfg.encryption_key_file, raw)
        extra: list[bytes] = []
        if cfg.encryption_decrypt_keys_env:
            name = cfg.encryption_decrypt_keys_env
            raw = env_key(env, "encryption_decrypt_keys_env", name)
            extra += [
                parse_key("encryption_decrypt_keys_env", name, k)
                for k in raw.split(b",")
                if k.strip()
            ]
        if cfg.encryption_decrypt_keys_file:
            path = cfg.encryption_decrypt_keys_file
            raw = file_key("encryption_decrypt_keys_file", path)
            extra += [
                parse_key("encryption_decrypt_keys_file", path, k)
                for k in raw.splitlines()
                if k.strip()
            ]
        if seal_key is None:
            if not extra:
                return None
            key = (
                "encryption_decrypt_keys_env"
                if cfg.encryption_decrypt_keys_env
                else "encryption_decrypt_keys_file"
            )
            raise ConfigError(
                key,
                getattr(cfg, key),
                "extra decryption keys need a sealing key too "
                "(encryption_key_env or encryption_key_file)",
            )
        return cls(seal_key, extra)


class Signer:
    """The keys that protect chunks in the object tier, as the codec and RemoteIO take them.

    HMAC-SHA256 signing: one key signs, several verify (key rotation). Without
    it anyone who can write the bucket can feed KV to every replica; with it,
    only holders of a key can. ``sealer`` adds AES-256-GCM sealing
    (:class:`kvtier.objects.sealing.Sealer`): chunks are encrypted, and authenticated by
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
