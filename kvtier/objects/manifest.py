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
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvtier import __version__
from kvtier.errors import CodecError, TierError
from kvtier.keys import Namespace, generation_key
from kvtier.objects import codec
from kvtier.objects.tiers.base import ObjectTier

__all__ = ["MANIFEST", "MANIFEST_DTYPE", "RECLAIM", "STALE_S", "Manifest", "ManifestWriter",
           "Reclaim", "claim_generation", "for_worker", "manifest_key", "read_manifest",
           "reclaim_generation", "reclaim_key", "write_manifest"]  # fmt: skip

log = logging.getLogger("kvtier.manifest")

#: the name of a generation's manifest object under ``gen-<id>/``
MANIFEST = "manifest"
#: the dtype a manifest's frame records: never a chunk's, so neither loads as the other
MANIFEST_DTYPE = "kvtier-manifest"
#: the most bytes a manifest may have (it holds a few hundred)
MAX_MANIFEST = 64 * 1024
#: how often a running engine refreshes ``last_seen``
REFRESH_S = 60.0
#: a manifest no trusted engine refreshed for this long: no engine whose KV the generation
#: holds is alive (ten refreshes missed; ``kvtier store gc --dead-after`` is longer still)
STALE_S = 10 * REFRESH_S
#: the name prefix of a re-claim's token under ``gen-<id>/`` (``reclaim-<16 hex>``)
RECLAIM = "reclaim-"


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

    @classmethod
    def of(cls, ns: Namespace, now: float, first_seen: float | None = None) -> Manifest:
        return cls(
            id=ns.generation(), model=ns.model or ns.label, revision=ns.revision or "",
            fingerprint=ns.fingerprint, layout=f"v{ns.layout_version}:{ns.layers}",
            namespace=ns.namespace, dtype=ns.dtype, kv_cache_dtype=ns.kv_cache_dtype,
            tp_size=ns.tp_size, pp_size=ns.pp_size, chunk_size=ns.chunk_size,
            kvtier_version=__version__, first_seen=now if first_seen is None else first_seen,
            last_seen=now, host=socket.gethostname(), forked_from=ns.forked_from,
            fork_id=ns.fork_id,
        )  # fmt: skip

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> Manifest:
        """Raises CodecError for anything but a manifest with every field of its type."""
        try:
            raw = json.loads(bytes(data))
        except (ValueError, UnicodeDecodeError):
            raise CodecError("manifest is not JSON") from None
        if not isinstance(raw, dict):
            raise CodecError("manifest is not a JSON object")
        fields: dict[str, Any] = {}
        for name, kind in _TYPES.items():
            value = raw.get(name)
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise CodecError(f"manifest field {name!r} is missing or not a {kind.__name__}")
            fields[name] = value
        for name in _OPTIONAL:  # absent from manifests written before these fields
            value = raw.get(name, "")
            if not isinstance(value, str):
                raise CodecError(f"manifest field {name!r} is not a str")
            fields[name] = value
        return cls(**fields)


_TYPES: dict[str, type] = {
    "id": str, "model": str, "revision": str, "fingerprint": str, "layout": str,
    "namespace": str, "dtype": str, "kv_cache_dtype": str, "tp_size": int, "pp_size": int,
    "chunk_size": int, "kvtier_version": str, "first_seen": float, "last_seen": float,
    "host": str,
}  # fmt: skip
#: string fields a manifest may lack ("" then)
_OPTIONAL = ("forked_from", "fork_id")


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
    tier.put(key, codec.encode(key, data, dtype=MANIFEST_DTYPE, shape=[len(data)],
                               signer=signer))  # fmt: skip


def claim_generation(
    tier: ObjectTier, namespace: Namespace, signer: codec.Signer | None,
    *, now: float | None = None,
) -> bool:
    """Whether this engine is the first writer of ``namespace``'s generation: its
    manifest, created only if none is stored (:meth:`ObjectTier.create_if_absent`, atomic
    on every tier). Of engines starting at once on an empty generation exactly one gets
    True; the others, and every engine after them, find the manifest and check their
    first hit (:mod:`kvtier.canary`). A create retried after a lost reply answers False
    for the manifest its own first try stored: the stored bytes are read back, and this
    engine's own (its host, its time to the microsecond, a sealed manifest's nonce) win.
    Raises TierError when the tier fails (no answer: not the first writer)."""
    manifest = Manifest.of(namespace, time.time() if now is None else now)
    key = manifest_key(manifest.id)
    data = manifest.to_bytes()
    # joined at once: a sealed manifest's parts live in this thread's scratch buffer
    blob = b"".join(codec.encode(key, data, dtype=MANIFEST_DTYPE, shape=[len(data)],
                                 signer=signer))  # fmt: skip
    if tier.create_if_absent(key, [blob]):
        return True
    stored = tier.get(key, max_bytes=MAX_MANIFEST)
    return stored is not None and bytes(stored) == blob


def reclaim_key(generation: str, stale: bytes) -> str:
    """The token a re-claim of ``generation`` creates: named by the stale manifest's bytes,
    so engines that judged the same manifest stale race for one key and one wins."""
    return generation_key(generation, RECLAIM + hashlib.sha256(stale).hexdigest()[:16])


@dataclass(frozen=True, slots=True)
class Reclaim:
    """What :func:`reclaim_generation` found: ``won`` (this engine is the generation's
    writer now), else why not, in words for the log."""

    won: bool
    reason: str


def reclaim_generation(
    tier: ObjectTier, namespace: Namespace, signer: codec.Signer | None,
    holds_chunks: Callable[[], bool], *, now: float | None = None,
    stale_after_s: float | None = None,
) -> Reclaim:
    """Claim a generation afresh when nobody's KV in it can be poisoned: its manifest was
    last refreshed by a trusted engine more than ``stale_after_s`` ago (only trusted
    engines refresh it: none whose KV it holds is alive) and it holds no chunk
    (``holds_chunks``, a listing). Of engines re-claiming at once exactly one wins: the
    token :func:`reclaim_key` names is created only if absent. The winner writes the
    manifest as its own. No chunk can appear meanwhile: only a trusted engine uploads, and
    none is alive. A manifest that is gone is claimed as at startup; one that does not
    verify is never re-claimed (its claims cannot be judged). Raises TierError."""
    now = time.time() if now is None else now
    stale_after_s = STALE_S if stale_after_s is None else stale_after_s
    gen = namespace.generation()
    key = manifest_key(gen)
    blob = tier.get(key, max_bytes=MAX_MANIFEST)
    if blob is None:  # deleted or evicted: chunks without it are still someone's KV
        if holds_chunks():
            return Reclaim(False, "its manifest is gone but it holds chunks (delete them "
                                  "with `kvtier store gc`)")
        won = claim_generation(tier, namespace, signer, now=now)
        return Reclaim(won, "its manifest is gone and it holds no chunk: claimed afresh"
                       if won else "another engine re-claimed it first")
    stale = bytes(blob)
    try:
        found = Manifest.from_bytes(codec.decode(stale, key=key, dtype=MANIFEST_DTYPE,
                                                 signer=signer))  # fmt: skip
    except CodecError as exc:
        return Reclaim(False, f"its manifest does not verify ({exc.kind})")
    if found.id != gen:
        return Reclaim(False, f"its manifest names generation {found.id}")
    age = now - found.last_seen
    if age < stale_after_s:
        return Reclaim(False, f"an engine that trusts it refreshed its manifest {age:.0f} s "
                              f"ago (re-claimed only after {stale_after_s:.0f} s)")
    if holds_chunks():
        return Reclaim(False, "it holds chunks of engines no longer alive (delete them with "
                              "`kvtier store gc`, or wait for a prompt whose chunk it holds)")
    if not tier.create_if_absent(reclaim_key(gen, stale), [b""]):
        return Reclaim(False, "another engine re-claimed it first")
    write_manifest(tier, Manifest.of(namespace, now, first_seen=found.first_seen), signer)
    return Reclaim(True, f"no trusted engine refreshed it for {age:.0f} s and it holds no "
                         "chunk: claimed afresh")


class ManifestWriter:
    """Keeps this engine's generation manifest fresh from a daemon thread.

    ``namespace`` is read at every refresh: after a weight update the engine's keys name
    a new generation, whose manifest is written then (the old one keeps the last time it
    was refreshed). Failures are logged, never raised: a manifest is bookkeeping, and
    the next refresh tries again. ``active``: whether the engine trusts its generation now;
    while it does not (it checks its first hit) nothing is written, so a generation kept
    only by checking engines looks dead (:func:`reclaim_generation`, ``gc``).
    """

    def __init__(
        self,
        tier: ObjectTier,
        signer: codec.Signer | None,
        namespace: Callable[[], Namespace],
        *,
        interval_s: float = REFRESH_S,
        clock: Callable[[], float] = time.time,
        active: Callable[[], bool] = lambda: True,
    ) -> None:
        self.tier = tier
        self.active = active
        self.signer = signer
        self.namespace = namespace
        self.interval_s = interval_s
        self.clock = clock
        #: first_seen of each generation this writer wrote
        self._first: dict[str, float] = {}
        self.writes = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvtier-manifest", daemon=True)

    def start(self) -> ManifestWriter:
        self._thread.start()
        return self

    def refresh(self) -> Manifest | None:
        """Write the current generation's manifest now; None when it failed (logged) or
        the engine does not trust its generation (not ``active``)."""
        with self._lock:
            if not self.active():
                return None
            ns = self.namespace()
            gen = ns.generation()
            try:
                first = self._first.get(gen)
                if first is None:
                    first = self._stored_first_seen(gen)
                now = self.clock()
                manifest = Manifest.of(ns, now, first_seen=min(first or now, now))
                write_manifest(self.tier, manifest, self.signer)
            except TierError as exc:
                log.warning("kvtier: manifest of generation %s not written: %s", gen, exc)
                return None
            self._first[gen] = manifest.first_seen
            self.writes += 1
            return manifest

    def _stored_first_seen(self, gen: str) -> float | None:
        """The first_seen of the manifest another engine (or an earlier run) stored."""
        try:
            stored = read_manifest(self.tier, gen, self.signer)
        except (TierError, CodecError):
            return None  # unreadable or forged: written over with this engine's
        return stored.first_seen if stored is not None else None

    def _loop(self) -> None:
        """Refresh every ``interval_s``, and at once when the generation changed or the
        engine came to trust it (checked every second: a digest of a few fields)."""
        self.refresh()
        last, gen, was = time.monotonic(), self.namespace().generation(), self.active()
        while not self._stop.wait(min(1.0, self.interval_s)):
            now_gen, active = self.namespace().generation(), self.active()
            if (now_gen != gen or (active and not was)
                    or time.monotonic() - last >= self.interval_s):
                self.refresh()
                last, gen, was = time.monotonic(), now_gen, active

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
    remote: object, namespace: Callable[[], Namespace], rank: int, stage: int,
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
