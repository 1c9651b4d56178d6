"""Generation manifests: which model and settings a generation of chunks belongs to.

Every object key names its generation (``gen-<id>/<chunk key>``,
:meth:`kvtier.keys.Namespace.generation`); the generation's manifest is one more object,
``gen-<id>/manifest``, framed and sealed like a chunk (:func:`kvtier.objects.codec.encode`:
checksummed, signed and encrypted as the engine's keys say). It names the model,
fingerprint, layout, namespace, kvtier version, writer host, and when the generation was
first and last seen in use. ``kvtier store`` lists the keys, reads the manifests, and
reports (or deletes) by generation: a generation whose ``last_seen`` is old is dead.

One writer per engine: rank 0 of stage 0 (:class:`ManifestWriter`, started beside its
object-tier I/O). Before it starts, the engine claims the generation
(:func:`claim_generation`: the manifest created only if absent, atomically): the one
engine whose claim wins is the generation's first writer (:mod:`kvtier.canary`). The
writer writes at start, every ``interval_s`` (60 s; ``kvtier store gc --dead-after``
must be much longer), when the engine's identity changes (a weight update starts a
generation), and once at shutdown. A write keeps the earliest ``first_seen`` the
stored manifest had, so several replicas of one model refresh one manifest.

Only an engine that trusts the generation writes its manifest (``active``): an engine
still checking its first hit does not, so ``last_seen`` says when an engine whose KV the
generation holds was last alive, for ``gc`` and for :func:`reclaim_generation`: a
generation whose manifest no trusted engine refreshed for :data:`STALE_S` and that holds
no chunk is claimed afresh by one checking engine (else it would stay locked for good,
every new engine checking with nothing left to check against).

Each manifest also holds its generation's hot list (:mod:`kvtier.hotset`): the chunk keys
the engines sharing it hit most, decayed hit counts, at most :data:`kvtier.hotset.LIMIT`.
Each refresh reads the stored manifest and adds the hits the engine's scheduler sent since
its last write (:meth:`ManifestWriter.add_heat`), so the list is the fleet's without a
server of its own; what concurrent writers may lose is in :mod:`kvtier.hotset`. The same
way it holds who uploaded which of its chunks (:mod:`kvtier.objects.tenant_keys`: per
tenant label, bounded), for ``kvtier store usage --by tenant`` and ``gc --tenant-quotas``,
and which chunks a host tier holds soft-pinned until when, which gc keeps until then.

A manifest can vanish under a live engine (deleted; evicted by a Redis under
``allkeys-lru``). Missing is not stale: the writer reads it back every :data:`CHECK_S`
(on Redis the GET keeps the key recently used, so LRU evicts it last) and writes it again
when it is gone, and a checking engine claims a generation whose manifest is missing only
once it was seen missing, the generation empty, for :data:`STALE_S` (:func:`missing_since`:
a record in the tier, so a restarted checker keeps its clock, and every live writer's
refresh ends it, so a manifest lost, written again and lost again starts it again).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from kvtier import __version__, hotset
from kvtier.errors import CodecError, TierError
from kvtier.keys import Namespace, generation_key
from kvtier.objects import codec
from kvtier.objects.tenant_keys import Pins, TenantKeys, merge_pins
from kvtier.objects.tenant_keys import merge as merge_tenants
from kvtier.objects.tiers.base import ObjectTier

__all__ = [
    "CHECK_S",
    "MANIFEST",
    "MANIFEST_DTYPE",
    "RECLAIM",
    "RECLAIM_TOKEN_VOID_S",
    "STALE_S",
    "Manifest",
    "ManifestWriter",
    "Reclaim",
    "claim_generation",
    "for_worker",
    "liveness_key",
    "manifest_key",
    "missing_since",
    "read_manifest",
    "reclaim_generation",
    "reclaim_key",
    "record",
    "write_manifest",
]

log = logging.getLogger("kvtier.manifest")

#: the name of a generation's manifest object under ``gen-<id>/``
MANIFEST = "manifest"
#: the dtype a manifest's frame records: never a chunk's, so neither loads as the other
MANIFEST_DTYPE = "kvtier-manifest"
#: the most bytes a manifest may have (a few hundred, plus its hot list: ~230 KB for
#: hotset.LIMIT keys of 32 bytes, 64-byte keys ~410 KB; plus its tenant lists, ~175 KB
#: at most, and pins, ~50 KB at most: kvtier.objects.tenant_keys. Older kvtier versions
#: read at most 512 KiB: with 32-byte hot keys a manifest stays within that)
MAX_MANIFEST = 1024 * 1024
#: how often a running engine refreshes ``last_seen``
REFRESH_S = 60.0
#: a manifest no trusted engine refreshed for this long: no engine whose KV the generation
#: holds is alive (ten refreshes missed; ``kvtier store gc --dead-after`` is longer still)
STALE_S = 10 * REFRESH_S
#: the name prefix of a re-claim's token under ``gen-<id>/`` (``reclaim-<16 hex>``)
RECLAIM = "reclaim-"
#: how often a running writer reads its manifest back (a GET: on Redis it keeps the key
#: recently used; a manifest found missing is written again at once, well within STALE_S)
CHECK_S = 10.0
#: a re-claim token whose manifest was not written this long after it (the engine died,
#: or the write failed, between the two) is void while the manifest is still the stale one
RECLAIM_TOKEN_VOID_S = 2 * REFRESH_S
#: a re-claim whose manifest write ends later than this after its token does not count:
#: well inside RECLAIM_TOKEN_VOID_S, so no other engine voids a token whose claim counts
#: (the margin is the clock skew between hosts it allows)
RECLAIM_WRITE_S = RECLAIM_TOKEN_VOID_S / 4
#: re-claims cut short in a row before a stale manifest is left for ``kvtier store gc``
MAX_RECLAIM_TOKENS = 16
#: the dtype a token's or liveness record's frame records (never a chunk's or manifest's)
RECORD_DTYPE = "kvtier-reclaim"
#: times a manifest or record may hold (Unix seconds; 2**33 is the year 2242)
_MAX_TIME = float(2**33)
#: the largest count a manifest may hold (sizes, ranks)
_MAX_INT = 2**31
#: hit deltas a writer keeps as sent before it folds them into one (ManifestWriter.add_heat)
_MAX_DELTAS = 8


def manifest_key(generation: str) -> str:
    return generation_key(generation, MANIFEST)


@dataclass(frozen=True, slots=True)
class Manifest:
    """What ``kvtier store usage`` shows about a generation (times: Unix seconds)."""

    id: str
    model: str
    revision: str
    fingerprint: str
    #: kvtier's chunk layout version and the digest of rank 0's layers (``Namespace.layers``)
    layout: str
    namespace: str
    dtype: str
    kv_cache_dtype: str
    tp_size: int
    pp_size: int
    chunk_size: int
    kvtier_version: str
    first_seen: float
    last_seen: float
    host: str
    #: the generation this one's identity was derived from by a salt (a weight change
    #: while the engine ran, or a canary mismatch's fork), and that fork's id; "": none
    forked_from: str = ""
    fork_id: str = ""
    #: the chunk keys the engines sharing the generation hit most (kvtier.hotset)
    hot: hotset.HotList = field(default_factory=hotset.HotList)
    #: who uploaded which chunks, per tenant label (kvtier.objects.tenant_keys)
    tenants: TenantKeys = field(default_factory=TenantKeys)
    #: chunks soft-pinned in a host tier, until when (gc keeps them: tenant_keys.Pins)
    pins: Pins = field(default_factory=Pins)

    @classmethod
    def of(
        cls,
        ns: Namespace,
        now: float,
        first_seen: float | None = None,
        hot: hotset.HotList | None = None,
        tenants: TenantKeys | None = None,
        pins: Pins | None = None,
    ) -> Manifest:
        return cls(
            id=ns.generation(),
            model=ns.model or ns.label,
            revision=ns.revision or "",
            fingerprint=ns.fingerprint,
            layout=_layout(ns),
            namespace=ns.namespace,
            dtype=ns.dtype,
            kv_cache_dtype=ns.kv_cache_dtype,
            tp_size=ns.tp_size,
            pp_size=ns.pp_size,
            chunk_size=ns.chunk_size,
            kvtier_version=__version__,
            first_seen=now if first_seen is None else first_seen,
            last_seen=now,
            host=socket.gethostname(),
            forked_from=ns.forked_from,
            fork_id=ns.fork_id,
            hot=hot if hot is not None else hotset.HotList(),
            tenants=tenants if tenants is not None else TenantKeys(),
            pins=pins if pins is not None else Pins(),
        )

    def to_bytes(self) -> bytes:
        # the plain fields as they are (asdict would deep-copy the lists, only to replace them)
        fields = {name: getattr(self, name) for name in (*_TYPES, *_OPTIONAL)} | {
            "hot": self.hot.to_json(),
            "hot_at": self.hot.at,
            "tenants": self.tenants.to_json(),
            "pins": self.pins.to_json(),
        }
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> Manifest:
        """Raises CodecError for anything but a manifest with every field of its type: a
        forged one (NaN, Infinity, absurd times or counts, deep nesting) is a bad manifest,
        never a crash of whoever reads it."""
        raw = _strict_json(data, "manifest")
        fields: dict[str, Any] = {}
        for name, kind in _TYPES.items():
            value = raw.get(name)
            if kind is float:
                if not _is_time(value):
                    raise CodecError(f"manifest field {name!r} is missing or not a time")
                value = float(value)
            elif kind is int:
                if not _is_count(value):
                    raise CodecError(f"manifest field {name!r} is missing or not a count")
            elif not isinstance(value, kind):
                raise CodecError(f"manifest field {name!r} is missing or not a {kind.__name__}")
            fields[name] = value
        for name in _OPTIONAL:  # absent from manifests written before these fields
            value = raw.get(name, "")
            if not isinstance(value, str):
                raise CodecError(f"manifest field {name!r} is not a str")
            fields[name] = value
        try:  # absent from manifests written before it: no hot list
            fields["hot"] = hotset.HotList.from_json(raw.get("hot", []), raw.get("hot_at", 0.0))
        except ValueError as exc:
            raise CodecError(f"manifest field 'hot': {exc}") from None
        try:  # absent from manifests written before it: no chunk attributed
            fields["tenants"] = TenantKeys.from_json(raw.get("tenants", {}))
        except ValueError as exc:
            raise CodecError(f"manifest field 'tenants': {exc}") from None
        try:  # absent from manifests written before it: no pin
            fields["pins"] = Pins.from_json(raw.get("pins", {}))
        except ValueError as exc:
            raise CodecError(f"manifest field 'pins': {exc}") from None
        return cls(**fields)


_TYPES: dict[str, type] = {
    "id": str,
    "model": str,
    "revision": str,
    "fingerprint": str,
    "layout": str,
    "namespace": str,
    "dtype": str,
    "kv_cache_dtype": str,
    "tp_size": int,
    "pp_size": int,
    "chunk_size": int,
    "kvtier_version": str,
    "first_seen": float,
    "last_seen": float,
    "host": str,
}
#: string fields a manifest may lack ("" then)
_OPTIONAL = ("forked_from", "fork_id")


def _layout(ns: Namespace) -> str:
    """What a manifest records of the layout: kvtier's version and rank 0's layers."""
    return f"v{ns.layout_version}:{ns.layers}"


def _strict_json(data: bytes | memoryview, what: str) -> dict[str, Any]:
    """``data`` as a JSON object; CodecError for anything else, NaN and Infinity (no JSON
    values, though Python's reader takes them) and nesting past the reader's recursion."""

    def no_constant(name: str) -> Any:
        raise CodecError(f"{what} holds {name}")

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise CodecError(f"{what} holds a number out of range")
        return value

    try:
        raw = json.loads(bytes(data), parse_constant=no_constant, parse_float=finite)
    except CodecError:
        raise
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise CodecError(f"{what} is not JSON") from None
    if not isinstance(raw, dict):
        raise CodecError(f"{what} is not a JSON object")
    return raw


def _is_time(value: object) -> TypeGuard[int | float]:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0.0 <= value < _MAX_TIME
    )


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_INT


def read_manifest(
    tier: ObjectTier, generation: str, signer: codec.Signer | None
) -> Manifest | None:
    """The stored manifest of ``generation``; None when there is none. Raises CodecError
    (a subclass: checksum, signature, sealed) for one that does not verify, or names
    another generation, and TierError when the tier fails."""
    key = manifest_key(generation)
    blob = tier.get(key, max_bytes=MAX_MANIFEST)
    if blob is None:
        return None
    payload = codec.decode(blob, key=key, dtype=MANIFEST_DTYPE, signer=signer)
    found = Manifest.from_bytes(payload)
    if found.id != generation:
        raise CodecError(f"manifest of generation {generation} names {found.id}")
    return found


def write_manifest(tier: ObjectTier, manifest: Manifest, signer: codec.Signer | None) -> None:
    """Store ``manifest`` framed and sealed like a chunk (raises TierError)."""
    key = manifest_key(manifest.id)
    data = manifest.to_bytes()
    tier.put(key, codec.encode(key, data, dtype=MANIFEST_DTYPE, shape=[len(data)], signer=signer))


def claim_generation(
    tier: ObjectTier,
    namespace: Namespace,
    signer: codec.Signer | None,
    *,
    now: float | None = None,
    holds_chunks: Callable[[], bool] | None = None,
) -> bool:
    """Whether this engine is the first writer of ``namespace``'s generation: its
    manifest, created only if none is stored (:meth:`ObjectTier.create_if_absent`, atomic
    on every tier). Of engines starting at once on an empty generation exactly one gets
    True; the others, and every engine after them, find the manifest and check their
    first hit (:mod:`kvtier.canary`). A missing manifest is no new generation when the
    generation was in use (its liveness record is stored: :func:`liveness_key`) or holds a
    chunk (``holds_chunks``, a listing, asked only when the manifest is missing): lost
    (deleted, evicted), its chunks someone's KV. A create retried after a lost reply
    answers False for the manifest its own first try stored: the stored bytes are read
    back, and this engine's own (its host, its time to the microsecond, a sealed
    manifest's nonce) win. Raises TierError when the tier fails (no answer: not the first
    writer)."""
    gen = namespace.generation()
    for key in (manifest_key(gen), liveness_key(gen)):  # exists() stops at a missing key
        if tier.exists([key])[0]:
            return False
    if holds_chunks is not None and holds_chunks():
        return False
    return _create_manifest(tier, namespace, signer, time.time() if now is None else now)


def _create_manifest(
    tier: ObjectTier, namespace: Namespace, signer: codec.Signer | None, now: float
) -> bool:
    """The claim itself: this engine's manifest created only if none is stored."""
    manifest = Manifest.of(namespace, now)
    key = manifest_key(manifest.id)
    data = manifest.to_bytes()
    # joined at once: a sealed manifest's parts live in this thread's scratch buffer
    blob = b"".join(codec.encode(key, data, dtype=MANIFEST_DTYPE, shape=[len(data)], signer=signer))
    return _created(tier, key, blob)


def _created(tier: ObjectTier, key: str, blob: bytes) -> bool:
    """Whether this call's create of ``key`` won: True, or a retried create's False for
    the bytes its own first try stored."""
    if tier.create_if_absent(key, [blob]):
        return True
    stored = tier.get(key, max_bytes=MAX_MANIFEST)
    return stored is not None and bytes(stored) == blob


def reclaim_key(generation: str, stale: bytes, attempt: int = 0) -> str:
    """The token a re-claim of ``generation`` creates: named by the stale manifest's bytes,
    so engines that judged the same manifest stale race for one key and one wins. A token
    void by age (:data:`RECLAIM_TOKEN_VOID_S`) gives way to the next ``attempt``'s."""
    h = hashlib.sha256(stale)
    if attempt:
        h.update(b"#%d" % attempt)
    return generation_key(generation, RECLAIM + h.hexdigest()[:16])


def liveness_key(generation: str) -> str:
    """The generation's liveness record (the token name of an empty manifest): since when
    a checking engine has seen the manifest missing (:func:`missing_since`), stored only
    until a live writer's refresh deletes it (or, where the tier refuses deletes,
    overwrites it with the time of that refresh). Bookkeeping, gc'd with the generation."""
    return reclaim_key(generation, b"")


def record(key: str, at: float, signer: codec.Signer | None, *, missing: bool = False) -> bytes:
    """The bytes of a token or liveness record stored at ``key``: a time (a token's
    creation; a writer's refresh; since when the manifest is missing, ``missing``),
    framed and sealed like a manifest, so no one without the keys can date one. A random
    ``by`` makes each engine's bytes its own (a retried create knows its own record)."""
    data = json.dumps({"at": at, "missing": missing, "by": os.urandom(8).hex()}).encode()
    return b"".join(codec.encode(key, data, dtype=RECORD_DTYPE, shape=[len(data)], signer=signer))


def _read_record(blob: bytes, key: str, signer: codec.Signer | None) -> tuple[float, bool]:
    """(time, missing) of a stored record; CodecError for one that does not verify (an
    older kvtier's empty token, a forgery)."""
    raw = _strict_json(
        codec.decode(blob, key=key, dtype=RECORD_DTYPE, signer=signer), "re-claim record"
    )
    at, missing = raw.get("at"), raw.get("missing")
    if not _is_time(at) or not isinstance(missing, bool):
        raise CodecError("re-claim record fields wrong")
    return float(at), missing


def missing_since(tier: ObjectTier, generation: str, signer: codec.Signer | None) -> float | None:
    """Since when a checking engine has seen ``generation``'s manifest missing, the
    generation empty; None when not (no record, a live writer's, or one that does not
    verify)."""
    key = liveness_key(generation)
    blob = tier.get(key, max_bytes=MAX_MANIFEST)
    if blob is None:
        return None
    try:
        at, missing = _read_record(bytes(blob), key, signer)
    except CodecError:
        return None
    return at if missing else None


@dataclass(frozen=True, slots=True)
class Reclaim:
    """What :func:`reclaim_generation` found: ``won`` (this engine is the generation's
    writer now), else why not, in words for the log."""

    won: bool
    reason: str


def reclaim_generation(
    tier: ObjectTier,
    namespace: Namespace,
    signer: codec.Signer | None,
    holds_chunks: Callable[[], bool],
    *,
    now: float | None = None,
    stale_after_s: float | None = None,
) -> Reclaim:
    """Claim a generation afresh when nobody's KV in it can be poisoned: its manifest was
    last refreshed by a trusted engine more than ``stale_after_s`` ago (only trusted
    engines refresh it: none whose KV it holds is alive) and it holds no chunk
    (``holds_chunks``, a listing). Of engines re-claiming at once exactly one wins: the
    token :func:`reclaim_key` names is created only if absent; a token whose manifest was
    not written within :data:`RECLAIM_TOKEN_VOID_S` is void and the next one decides. The
    winner writes the manifest as its own. No chunk can appear meanwhile: only a trusted
    engine uploads, and none is alive. A manifest that is missing is stale only once seen
    missing, the generation empty, for ``stale_after_s`` (:func:`missing_since`); one
    that does not verify is never re-claimed (its claims cannot be judged). ``now``: the
    clock (tests). Raises TierError."""
    clock: Callable[[], float] = time.time if now is None else (lambda: now)
    stale_after_s = STALE_S if stale_after_s is None else stale_after_s
    gen = namespace.generation()
    key = manifest_key(gen)
    blob = tier.get(key, max_bytes=MAX_MANIFEST)
    if blob is None:  # deleted or evicted: perhaps under a live writer
        return _reclaim_missing(tier, namespace, signer, holds_chunks, clock, stale_after_s)
    stale = bytes(blob)
    try:
        found = Manifest.from_bytes(
            codec.decode(stale, key=key, dtype=MANIFEST_DTYPE, signer=signer)
        )
    except CodecError as exc:
        return Reclaim(False, f"its manifest does not verify ({exc.kind})")
    if found.id != gen:
        return Reclaim(False, f"its manifest names generation {found.id}")
    age = clock() - found.last_seen
    if age < stale_after_s:
        why = (
            f"an engine that trusts it refreshed its manifest {age:.0f} s ago "
            f"(re-claimed only after {stale_after_s:.0f} s)"
        )
        mine = _layout(namespace)
        if found.layout != mine:  # a pipeline's generation names no stage's layers
            why += (
                f"; its manifest records another KV layout ({found.layout}, this "
                f"engine's {mine}): this engine's chunk keys never meet its chunks, "
                "so its canaries find nothing; give these engines a namespace of "
                "their own"
            )
        return Reclaim(False, why)
    if holds_chunks():
        return Reclaim(
            False,
            "it holds chunks of engines no longer alive (delete them with "
            "`kvtier store gc`, or wait for a prompt whose chunk it holds)",
        )
    return _take_over(tier, namespace, signer, stale, found, clock)


def _reclaim_missing(
    tier: ObjectTier,
    namespace: Namespace,
    signer: codec.Signer | None,
    holds_chunks: Callable[[], bool],
    clock: Callable[[], float],
    stale_after_s: float,
) -> Reclaim:
    """A missing manifest: stale once seen missing, the generation empty, for
    ``stale_after_s``. The first check records since when (created only if absent); a
    live writer's refresh ends that record, which starts the clock again."""
    gen = namespace.generation()
    key = liveness_key(gen)
    wait = (
        f"claimed only once missing for {stale_after_s:.0f} s with no chunk; a live "
        f"writer writes it again within {CHECK_S:.0f} s"
    )
    if holds_chunks():  # the clock starts when it is empty
        tier.put(key, [record(key, clock(), signer, missing=True)])
        return Reclaim(
            False, "its manifest is gone but it holds chunks (delete them with `kvtier store gc`)"
        )
    mark = record(key, clock(), signer, missing=True)
    if _created(tier, key, mark):
        return Reclaim(False, f"its manifest is missing, seen so from now on ({wait})")
    blob = tier.get(key, max_bytes=MAX_MANIFEST)
    try:
        at, missing = _read_record(bytes(blob or b""), key, signer)
    except CodecError:
        at, missing = 0.0, False
    if not missing:  # a live writer's refresh, or unreadable: the clock starts now
        tier.put(key, [mark])
        return Reclaim(False, f"its manifest is missing, seen so from now on ({wait})")
    gone = clock() - at
    if gone < stale_after_s:
        return Reclaim(False, f"its manifest has been missing for {gone:.0f} s ({wait})")
    won = _create_manifest(tier, namespace, signer, clock())
    return Reclaim(
        won,
        f"its manifest was missing for {gone:.0f} s and it holds no chunk: claimed afresh"
        if won
        else "another engine re-claimed it first",
    )


def _take_over(
    tier: ObjectTier,
    namespace: Namespace,
    signer: codec.Signer | None,
    stale: bytes,
    found: Manifest,
    clock: Callable[[], float],
) -> Reclaim:
    """One winner among the engines that judged the manifest ``stale``: the first to
    create the token; a token older than RECLAIM_TOKEN_VOID_S while the manifest is still
    ``stale`` (its claim was cut short) gives way to the next name, never reused."""
    gen = found.id
    for attempt in range(MAX_RECLAIM_TOKENS):
        key = reclaim_key(gen, stale, attempt)
        began = time.monotonic()
        if _created(tier, key, record(key, clock(), signer)):
            return _write_claim(tier, namespace, signer, stale, found, clock, began)
        why = _token_holds(tier, key, signer, gen, stale, clock)
        if why is not None:
            return Reclaim(False, why)
        log.warning(
            "kvtier: generation %s: re-claim token %s is older than %.0f s and its "
            "manifest was never written (its engine died or failed between the "
            "two): void",
            gen,
            key,
            RECLAIM_TOKEN_VOID_S,
        )
    return Reclaim(
        False,
        f"{MAX_RECLAIM_TOKENS} re-claims of it were cut short (delete it with `kvtier store gc`)",
    )


def _token_holds(
    tier: ObjectTier,
    key: str,
    signer: codec.Signer | None,
    gen: str,
    stale: bytes,
    clock: Callable[[], float],
) -> str | None:
    """Why the token at ``key`` still decides (another engine's re-claim stands or may
    still land), or None when it is void: older than RECLAIM_TOKEN_VOID_S and the
    manifest still the stale one."""
    blob = tier.get(key, max_bytes=MAX_MANIFEST)
    if blob is None:  # gone meanwhile (gc, eviction): the next try creates it
        return "another engine re-claimed it first"
    try:
        at, _ = _read_record(bytes(blob), key, signer)
    except CodecError as exc:
        return (
            f"its re-claim token cannot be dated ({exc.kind}: an older kvtier's, or "
            "forged); `kvtier store gc` deletes it with the generation"
        )
    if clock() - at < RECLAIM_TOKEN_VOID_S:
        return "another engine re-claimed it first"
    current = tier.get(manifest_key(gen), max_bytes=MAX_MANIFEST)
    if current is None or bytes(current) != stale:
        return "another engine re-claimed it first"
    return None


def _write_claim(
    tier: ObjectTier,
    namespace: Namespace,
    signer: codec.Signer | None,
    stale: bytes,
    found: Manifest,
    clock: Callable[[], float],
    began: float,
) -> Reclaim:
    """The token is this engine's: write the manifest, unless it changed meanwhile (a
    token lost to eviction) or the write ended too late to count (the token may be void
    to others by then)."""
    current = tier.get(manifest_key(found.id), max_bytes=MAX_MANIFEST)
    if current is None or bytes(current) != stale:
        return Reclaim(False, "another engine re-claimed it first")
    now = clock()
    write_manifest(tier, Manifest.of(namespace, now, first_seen=found.first_seen), signer)
    took = time.monotonic() - began
    if took > RECLAIM_WRITE_S:
        return Reclaim(
            False,
            f"its manifest was written {took:.0f} s after its token, too "
            "late to count: re-claimed again once stale",
        )
    return Reclaim(
        True,
        f"no trusted engine refreshed it for {now - found.last_seen:.0f} s "
        "and it holds no chunk: claimed afresh",
    )


class ManifestWriter:
    """Keeps this engine's generation manifest fresh from a daemon thread.

    ``namespace`` is read at every refresh: after a weight update the engine's keys name
    a new generation, whose manifest is written then (the old one keeps the last time it
    was refreshed). Every refresh also ends any checking engine's count of the manifest
    missing (its record, :func:`liveness_key`, deleted or overwritten).
    Every ``check_s`` the manifest is read back (on Redis the GET keeps it recently used,
    so ``allkeys-lru`` evicts it last) and written again at once when it is gone.
    Failures are logged, never raised, and nothing ends the thread: a manifest is
    bookkeeping, and the next refresh tries again. ``active``: whether the engine trusts
    its generation now; while it does not (it checks its first hit) nothing is written, so
    a generation kept only by checking engines looks dead (:func:`reclaim_generation`,
    ``gc``).
    """

    def __init__(
        self,
        tier: ObjectTier,
        signer: codec.Signer | None,
        namespace: Callable[[], Namespace],
        *,
        interval_s: float = REFRESH_S,
        check_s: float = CHECK_S,
        clock: Callable[[], float] = time.time,
        active: Callable[[], bool] = lambda: True,
    ) -> None:
        self.tier = tier
        self.active = active
        self.signer = signer
        self.namespace = namespace
        self.interval_s = interval_s
        self.check_s = check_s
        self.clock = clock
        #: first_seen of each generation this writer wrote
        self._first: dict[str, float] = {}
        self.writes = 0
        #: failures already logged in full (each kind once: the thread never stops)
        self._said: set[str] = set()
        #: hits the scheduler sent since the last write that landed (add_heat), kept under
        #: a lock of their own: the worker's thread adds while a refresh waits on the tier
        self._heat: list[hotset.HotList] = []
        #: the chunks uploaded per tenant since the last write that landed (add_tenants),
        #: under the same lock
        self._tenants: list[TenantKeys] = []
        #: pins sent since the last write that landed (add_pins), folded into one
        self._pins = Pins()
        self._heat_lock = threading.Lock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvtier-manifest", daemon=True)

    def start(self) -> ManifestWriter:
        self._thread.start()
        return self

    def add_heat(self, delta: hotset.HotList) -> None:
        """Hits the scheduler counted (:class:`kvtier.hotset.HitCounter`), added to the
        manifest's hot list at the next refresh. Kept as sent (the worker's thread calls
        it: the refresh's thread merges them), folded into one only past
        :data:`_MAX_DELTAS` (refreshes not writing: the engine does not trust its
        generation yet, or the tier is down); never waits on the tier."""
        with self._heat_lock:
            self._heat.append(delta)
            if len(self._heat) > _MAX_DELTAS:
                self._heat = [hotset.merge(*self._heat, now=max(h.at for h in self._heat))]

    def add_tenants(self, delta: TenantKeys) -> None:
        """Chunks uploaded per tenant (:mod:`kvtier.objects.tenant_keys`), added to the
        manifest's tenant lists at the next refresh; like :meth:`add_heat`, kept as sent
        and folded into one past :data:`_MAX_DELTAS` (bounded by the lists' own limit)."""
        if not delta:
            return
        with self._heat_lock:
            self._tenants.append(delta)
            if len(self._tenants) > _MAX_DELTAS:
                self._tenants = [merge_tenants(*self._tenants)]

    def add_pins(self, delta: Pins) -> None:
        """Chunks pinned in the host tier and until when, added to the manifest's pins at
        the next refresh (folded into one at once: at most PINS_LIMIT)."""
        if delta:
            with self._heat_lock:
                self._pins = merge_pins(self._pins, delta)

    def _take_pins(self) -> Pins:
        with self._heat_lock:
            pins, self._pins = self._pins, Pins()
        return pins

    def _keep_pins(self, pins: Pins) -> None:
        self.add_pins(pins)

    def _take_tenants(self) -> list[TenantKeys]:
        with self._heat_lock:
            deltas, self._tenants = self._tenants, []
        return deltas

    def _keep_tenants(self, deltas: list[TenantKeys]) -> None:
        """A write that did not land: its uploads go back for the next, ahead of those
        sent since (they are older)."""
        if deltas:
            with self._heat_lock:
                self._tenants = [merge_tenants(*deltas, *self._tenants)]

    def _take_heat(self) -> hotset.HotList:
        with self._heat_lock:
            deltas, self._heat = self._heat, []
        return hotset.merge(*deltas, now=max((h.at for h in deltas), default=0.0))

    def refresh(self) -> Manifest | None:
        """Write the current generation's manifest now, its hot list the stored one plus
        the hits sent since the last write, and stamp its liveness record; None when it
        failed (logged: the hits wait for the next) or the engine does not trust its
        generation (not ``active``)."""
        with self._lock:
            gen = "?"
            heat: hotset.HotList | None = None
            uploads: list[TenantKeys] = []
            pins = Pins()
            try:
                if not self.active():
                    return None
                ns = self.namespace()
                gen = ns.generation()
                stored = self._stored(gen)
                first = self._first.get(gen)
                if first is None and stored is not None:
                    first = stored.first_seen
                now = self.clock()
                heat = self._take_heat()
                hot = hotset.merge(
                    stored.hot if stored is not None else hotset.HotList(), heat, now=now
                )
                uploads = self._take_tenants()
                tenants = merge_tenants(
                    stored.tenants if stored is not None else TenantKeys(), *uploads
                )
                pins = self._take_pins()
                kept = merge_pins(stored.pins if stored is not None else Pins(), pins, now=now)
                manifest = Manifest.of(
                    ns, now, first_seen=min(first or now, now), hot=hot, tenants=tenants, pins=kept
                )
                write_manifest(self.tier, manifest, self.signer)
            except TierError as exc:
                self._keep_heat(heat)
                self._keep_tenants(uploads)
                self._keep_pins(pins)
                log.warning("kvtier: manifest of generation %s not written: %s", gen, exc)
                return None
            except Exception as exc:  # noqa: BLE001  a bug or a forgery: never the thread's end
                self._keep_heat(heat)
                self._keep_tenants(uploads)
                self._keep_pins(pins)
                self._failed(exc)
                return None
            self._first[gen] = manifest.first_seen
            self.writes += 1
            self._end_missing(gen, now)
            return manifest

    def _end_missing(self, gen: str, now: float) -> None:
        """End a checking engine's count of this manifest missing, if one began: its
        record deleted, or overwritten with this live writer's where the tier refuses
        deletes (S3 engines are granted no DeleteObject). One ``exists`` per refresh."""
        key = liveness_key(gen)
        try:
            if not self.tier.exists([key])[0]:
                return
            try:
                self.tier.delete([key])
            except TierError:
                pass
            if self.tier.exists([key])[0]:  # refused (S3 answers a denied delete quietly)
                self.tier.put(key, [record(key, now, self.signer)])
        except Exception as exc:  # noqa: BLE001  the manifest is written; next time
            self._failed(exc)

    def check(self) -> bool:
        """Read the manifest back and write it again when it is gone (deleted, evicted);
        whether it was. Nothing while the engine does not trust its generation."""
        if not self.active():
            return False
        gen = self.namespace().generation()
        try:
            if self.tier.get(manifest_key(gen), max_bytes=MAX_MANIFEST) is not None:
                return False
        except TierError:
            return False  # the tier's trouble, not a missing manifest: the refresh retries
        said = f"missing:{gen}"
        if said not in self._said:
            self._said.add(said)
            log.warning(
                "kvtier: manifest of generation %s was missing (deleted, or evicted "
                "by the tier): written again; a checking engine claims a generation "
                "only once its manifest was missing for %.0f s",
                gen,
                STALE_S,
            )
        self.refresh()
        return True

    def _failed(self, exc: BaseException) -> None:
        """Log a failure in full the first time its kind and text are seen, then briefly."""
        said = f"{type(exc).__name__}: {exc}"[:200]
        if said in self._said or len(self._said) > 64:
            log.debug("kvtier: manifest writer: %s", said)
            return
        self._said.add(said)
        log.error(
            "kvtier: manifest writer: %s (it keeps refreshing; said once)", said, exc_info=exc
        )

    def _guarded(self, step: Callable[[], Any]) -> Any:
        """``step()``, or None when it raised (logged): the loop outlives anything."""
        try:
            return step()
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)
            return None

    def _state(self) -> tuple[str, bool]:
        return self.namespace().generation(), self.active()

    def _keep_heat(self, heat: hotset.HotList | None) -> None:
        """A write that did not land: its hits go back for the next."""
        if heat:
            self.add_heat(heat)

    def _stored(self, gen: str) -> Manifest | None:
        """The manifest another engine (or an earlier run, or this writer) stored; None
        when there is none or it does not verify (written over with this engine's).
        Raises TierError: a refresh that cannot read the fleet's hot list does not write
        over it."""
        try:
            return read_manifest(self.tier, gen, self.signer)
        except CodecError:
            return None

    def _loop(self) -> None:
        """Refresh every ``interval_s``, and at once when the generation changed or the
        engine came to trust it (checked every second: a digest of a few fields); read the
        manifest back every ``check_s`` between refreshes."""
        self._guarded(self.refresh)
        last = checked = time.monotonic()
        gen, was = self._guarded(self._state) or (None, False)
        while not self._stop.wait(min(1.0, self.interval_s, self.check_s)):
            state = self._guarded(self._state)
            if state is None:
                continue
            now_gen, active = state
            now = time.monotonic()
            if now_gen != gen or (active and not was) or now - last >= self.interval_s:
                self._guarded(self.refresh)
                last = checked = time.monotonic()
                gen, was = now_gen, active
            elif now - checked >= self.check_s:
                self._guarded(self.check)
                checked = time.monotonic()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop refreshing and write ``last_seen`` once more, within ``timeout_s`` (a tier
        that hangs must not hold the engine's shutdown)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        done = threading.Thread(target=self.refresh, name="kvtier-manifest-last", daemon=True)
        done.start()
        done.join(timeout_s)


def for_worker(
    remote: object,
    namespace: Callable[[], Namespace],
    rank: int,
    stage: int,
    active: Callable[[], bool] = lambda: True,
) -> ManifestWriter | None:
    """The manifest writer of a worker's object-tier I/O: rank 0 of stage 0 writes for the
    whole engine (every rank's keys name the same generation), while ``active`` (the
    engine trusts its generation); None for the other workers and for an I/O that is not
    kvtier's :class:`~kvtier.objects.remote.RemoteIO`."""
    from kvtier.objects.remote import RemoteIO

    if rank != 0 or stage != 0 or not isinstance(remote, RemoteIO):
        return None
    return ManifestWriter(remote.tier, remote.signer, namespace, active=active).start()
