"""Governing the shared tier: what it holds per generation, deleting dead generations and
the least recently used chunks under a byte budget, and checking stored chunks.

Every object key kvtier writes names its generation (``gen-<id>/<chunk key>``, and the
generation's manifest ``gen-<id>/manifest``, :mod:`kvtier.objects.manifest`), so all of
this works by listing the backend, never by reading chunks (``verify`` alone reads),
through the tier's own :meth:`~kvtier.objects.tiers.base.ObjectTier.list_objects`,
:meth:`~kvtier.objects.tiers.base.ObjectTier.list_keys` and
:meth:`~kvtier.objects.tiers.base.ObjectTier.delete_many`; each backend says what its sizes
and last uses are:

- directory (``file://``): a chunk's bytes are its file's size, its last use its mtime (a
  hit refreshes it, at most once a minute);
- S3: bytes are the listed ``Size``, last use the object's ``LastModified``: its last
  *write* (S3 records no reads; a chunk every engine hits but none rewrites looks old);
- Redis (one node, or every primary of a Redis Cluster): bytes are ``MEMORY USAGE`` (what
  the server spends on the key, ``STRLEN`` where MEMORY is not allowed), last use ``OBJECT
  IDLETIME`` (reads count; listing does not).

Keys that are not kvtier's (another application's, in the same Redis or bucket) are never
listed or touched. Chunks of bare keys (written before generations) and of generations
whose manifest is missing or does not verify make one generation, ``unknown``; for them
``gc --dead-after`` goes by each chunk's own last use.

Per tenant (issue 60): a generation's manifest lists who uploaded which of its chunks
(:mod:`kvtier.objects.tenant_keys`); :meth:`Generation.by_tenant` joins those lists with
the listing (bytes and last use the backend's), and ``gc --tenant-quotas`` trims a tenant
over its quota (summed over every generation) by its own least recently used chunks,
never another tenant's, nor an unattributed chunk, nor the mix that is ``other``.

A chunk deleted while an engine reads it is that read's miss (a missing key, or a
truncated read that fails its check): every backend's delete is atomic per object, and
deleting a missing key is no error, so two gc runs at once only find less to delete.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import CodecError, KVTierError, TierError
from kvtier.keys import GENERATION_PREFIX
from kvtier.objects import codec
from kvtier.objects.codec import head_length, parse_header
from kvtier.objects.manifest import MANIFEST, MAX_MANIFEST, RECLAIM, Manifest, read_manifest
from kvtier.objects.tenant_keys import OTHER, UNATTRIBUTED, fingerprint
from kvtier.objects.tiers.base import ObjectTier, StoredObject

__all__ = [
    "UNKNOWN",
    "GcPlan",
    "Generation",
    "StoreError",
    "Usage",
    "gc",
    "holds_chunks",
    "parse_object_key",
    "usage",
    "verify",
]

#: the generation of chunks without a readable manifest
UNKNOWN = "unknown"
_CHUNK_RE = re.compile(r"[0-9a-f]{40}", re.ASCII)
#: a re-claim's token (:func:`kvtier.objects.manifest.reclaim_key`): bookkeeping, as a manifest
_RECLAIM_RE = re.compile(re.escape(RECLAIM) + r"[0-9a-f]{16}", re.ASCII)
_GEN_RE = re.compile(re.escape(GENERATION_PREFIX) + r"([0-9a-f]{16})/(.+)", re.ASCII)
#: error kinds of an object whose bytes, frame or name are damaged: all that ``verify
#: --delete-bad`` deletes. Every other kind is kept: a key reason (below), an object the
#: backend failed to serve this once (``unreachable``, ``object``, ``oversize``), one in
#: a form this version cannot read (``format``)
CORRUPT_KINDS = frozenset({"checksum", "truncated", "malformed", "wrong_key"})
#: the kinds a wrong or missing key gives every object it checks: no corruption
KEY_KINDS = frozenset({"signature", "sealed"})
#: more than this share of what was checked failing for a key reason means the keys
#: given are not the engines': ``verify --delete-bad`` and ``gc`` then delete nothing
KEY_FAILURE_SHARE = 0.5


class StoreError(KVTierError):
    """What ``kvtier store`` cannot do as asked (exit status 2, nothing deleted)."""


def parse_object_key(key: str) -> tuple[str | None, bool] | None:
    """(generation or None for a bare chunk key, is it a manifest) for a key kvtier wrote;
    None for anything else (another application's key). A re-claim's token counts as a
    manifest: bookkeeping of its generation, deleted with it, never a chunk."""
    m = _GEN_RE.fullmatch(key)
    if m is not None:
        name = m.group(2)
        if name == MANIFEST or _RECLAIM_RE.fullmatch(name):
            return m.group(1), True
        return (m.group(1), False) if _CHUNK_RE.fullmatch(name) else None
    return (None, False) if _CHUNK_RE.fullmatch(key) else None


def _listed(tier: ObjectTier) -> Iterator[StoredObject]:
    """kvtier's objects in ``tier`` (:meth:`ObjectTier.list_objects`; another application's
    keys are never measured); StoreError for a tier that cannot be listed."""
    try:
        return tier.list_objects(keep=_is_ours)
    except NotImplementedError:
        raise StoreError(f"kvtier store cannot list a {tier.name} tier") from None


def _is_ours(key: str) -> bool:
    return parse_object_key(key) is not None


def holds_chunks(tier: ObjectTier, generation: str) -> bool:
    """Whether ``generation`` holds any chunk (its manifest and tokens do not count): a
    listing of the generation's keys alone that stops at the first chunk found (a canary's
    re-claim, :func:`kvtier.objects.manifest.reclaim_generation`). Raises StoreError for a
    tier that cannot be listed and TierError when listing fails: neither is an answer of
    "none"."""
    try:
        keys = tier.list_keys(f"{GENERATION_PREFIX}{generation}/")
    except NotImplementedError:
        raise StoreError(f"kvtier store cannot list a {tier.name} tier") from None
    for key in keys:
        parsed = parse_object_key(key)
        if parsed is not None and parsed[0] == generation and not parsed[1]:
            return True
    return False


# -- usage -------------------------------------------------------------------------------


@dataclass(slots=True)
class Generation:
    """A generation's objects and what its manifest says (None: ``unknown``)."""

    id: str
    manifest: Manifest | None = None
    chunks: list[StoredObject] = field(default_factory=list)
    #: the manifest object itself (for ``unknown``: every unreadable manifest)
    manifests: list[StoredObject] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(o.size for o in self.chunks) + sum(o.size for o in self.manifests)

    def tenant_of(self) -> Callable[[StoredObject], str]:
        """Each chunk's tenant label as its manifest lists it, else :data:`UNATTRIBUTED`."""
        owners = self.manifest.tenants.owners() if self.manifest is not None else {}

        def of(obj: StoredObject) -> str:
            fp = fingerprint(obj.key)
            return owners.get(fp, UNATTRIBUTED) if fp is not None else UNATTRIBUTED

        return of

    def by_tenant(self) -> dict[str, dict[str, int]]:
        """Per tenant label its chunks' bytes and count (``unattributed``: in no list)."""
        out: dict[str, dict[str, int]] = {}
        of = self.tenant_of()
        for obj in self.chunks:
            row = out.setdefault(of(obj), {"bytes": 0, "chunks": 0})
            row["bytes"] += obj.size
            row["chunks"] += 1
        return dict(sorted(out.items()))

    def row(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "id": self.id,
            "model": m.model if m else None,
            "namespace": m.namespace if m else None,
            "bytes": self.bytes,
            "chunks": len(self.chunks),
            "first_seen": _iso(m.first_seen) if m else None,
            "last_seen": _iso(m.last_seen) if m else None,
            "hot_chunks": len(m.hot) if m else None,
        }


@dataclass(slots=True)
class Usage:
    """Everything kvtier stored in one tier, by generation (``unknown`` last)."""

    generations: list[Generation]
    #: why manifests were set aside as unknown: generation -> error kind
    bad_manifests: dict[str, str] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(g.bytes for g in self.generations)

    @property
    def total_chunks(self) -> int:
        return sum(len(g.chunks) for g in self.generations)

    def to_json(self, by_tenant: bool = False) -> dict[str, Any]:
        """``by_tenant``: each generation's row holds ``tenants`` (:meth:`Generation.by_tenant`)
        and the document their sum over generations."""
        rows = [
            g.row() | ({"tenants": g.by_tenant()} if by_tenant else {}) for g in self.generations
        ]
        doc = {
            "total_bytes": self.total_bytes,
            "total_chunks": self.total_chunks,
            "generations": rows,
        }
        if by_tenant:
            total: dict[str, dict[str, int]] = {}
            for row in rows:
                for label, n in row["tenants"].items():
                    t = total.setdefault(label, {"bytes": 0, "chunks": 0})
                    t["bytes"] += n["bytes"]
                    t["chunks"] += n["chunks"]
            doc["tenants"] = dict(sorted(total.items()))
        return doc


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def usage(
    tier: ObjectTier,
    signer: codec.Signer | None,
    *,
    progress: Callable[[int], None] | None = None,
) -> Usage:
    """List ``tier`` and read each generation's manifest.

    A manifest that does not verify (corrupt, forged, sealed with another key) leaves its
    generation ``unknown``. One that is signed or sealed while ``signer`` holds no key
    raises StoreError: its claims cannot be checked, and ``gc`` must not act on them."""
    gens: dict[str, Generation] = {}
    unknown = Generation(UNKNOWN)
    for n, obj in enumerate(_listed(tier), 1):
        if progress is not None and n % 1000 == 0:
            progress(n)
        parsed = parse_object_key(obj.key)
        if parsed is None:
            continue
        gen_id, is_manifest = parsed
        if gen_id is None:
            unknown.chunks.append(obj)
            continue
        gen = gens.setdefault(gen_id, Generation(gen_id))
        (gen.manifests if is_manifest else gen.chunks).append(obj)
    bad: dict[str, str] = {}
    for gen in gens.values():
        if gen.manifests:
            try:
                size = max(o.size for o in gen.manifests)  # the manifest, or a token's 0
                gen.manifest = _checked_manifest(tier, gen.id, signer, size)
            except CodecError as exc:
                bad[gen.id] = exc.kind
    known = [g for g in gens.values() if g.manifest is not None]
    for g in gens.values():
        if g.manifest is None:
            unknown.chunks += g.chunks
            unknown.manifests += g.manifests
    known.sort(key=lambda g: (-g.manifest.last_seen if g.manifest else 0.0, g.id))
    out = known + ([unknown] if unknown.chunks or unknown.manifests else [])
    return Usage(out, bad)


def _checked_manifest(
    tier: ObjectTier, gen: str, signer: codec.Signer | None, size: int
) -> Manifest | None:
    """The manifest, verified with ``signer``; StoreError when it is signed or sealed and
    no key was configured to check it."""
    if size > MAX_MANIFEST:
        raise CodecError(f"manifest of {size} bytes")
    blob = tier.get(f"{GENERATION_PREFIX}{gen}/{MANIFEST}", max_bytes=MAX_MANIFEST)
    if blob is None:
        return None
    if signer is None:
        header = _header_of(blob)
        if "sig" in header or "nonce" in header:
            raise StoreError(
                "the tier's manifests are signed or sealed and no key was given: pass the "
                "engines' config with --config (hmac_key_env / encryption_key_env ...) and "
                "their key variables"
            )
    return read_manifest(_Once(tier, blob), gen, signer)


def _header_of(blob: bytes) -> dict[str, Any]:
    view = memoryview(blob)
    body_at = head_length(view[:8])
    if len(blob) < body_at:
        raise CodecError("manifest ends inside its header")
    header: dict[str, Any] = parse_header(bytes(view[8:body_at]))
    return header


class _Once(ObjectTier):
    """A tier that answers one object already read (the manifest is read once)."""

    name = "once"

    def __init__(self, tier: ObjectTier, blob: bytes) -> None:
        self._blob = blob

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [True] * len(keys)

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        return self._blob

    def put(self, key: str, parts: Any) -> None:
        raise NotImplementedError

    def delete(self, keys: Sequence[str]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


# -- gc ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Deleted:
    """What gc deletes of one generation."""

    generation: Generation
    #: "dead": not seen for --dead-after; "tenant_quota": a tenant over its quota of
    #: --tenant-quotas; "lru": under --max-bytes
    reason: str
    objects: list[StoredObject] = field(default_factory=list)
    #: whose chunks ("tenant_quota" only)
    tenant: str | None = None

    def row(self) -> dict[str, Any]:
        m = self.generation.manifest
        return {
            "id": self.generation.id,
            "model": m.model if m else None,
            "namespace": m.namespace if m else None,
            "reason": self.reason,
            "tenant": self.tenant,
            "bytes": sum(o.size for o in self.objects),
            "chunks": sum(1 for o in self.objects if not o.key.endswith("/" + MANIFEST)),
        }


@dataclass(slots=True)
class GcPlan:
    """What gc deletes (or, dry, would) and what is left."""

    before: Usage
    deleted: list[Deleted]
    dry_run: bool
    max_bytes: int | None
    dead_after_s: float
    #: --tenant-quotas: tenant name ("*": every other tenant) -> bytes
    tenant_quotas: dict[str, int] | None = None
    #: chunks kept because their manifest holds them pinned (tenant_keys.Pins)
    kept_pinned: int = 0

    def by_tenant(self) -> dict[str, dict[str, int]]:
        """What the tenant quotas deleted, per tenant: bytes and chunks."""
        out: dict[str, dict[str, int]] = {}
        for d in self.deleted:
            if d.reason == "tenant_quota" and d.tenant is not None:
                row = out.setdefault(d.tenant, {"bytes": 0, "chunks": 0})
                row["bytes"] += sum(o.size for o in d.objects)
                row["chunks"] += len(d.objects)
        return dict(sorted(out.items()))

    @property
    def deleted_bytes(self) -> int:
        return sum(o.size for d in self.deleted for o in d.objects)

    @property
    def deleted_chunks(self) -> int:
        return sum(d.row()["chunks"] for d in self.deleted)

    def to_json(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "dead_after_s": self.dead_after_s,
            "max_bytes": self.max_bytes,
            "total_bytes_before": self.before.total_bytes,
            "total_bytes_after": self.before.total_bytes - self.deleted_bytes,
            "deleted_bytes": self.deleted_bytes,
            "deleted_chunks": self.deleted_chunks,
            "tenant_quotas": self.tenant_quotas,
            "deleted_by_tenant": self.by_tenant(),
            "kept_pinned_chunks": self.kept_pinned,
            "generations": [d.row() for d in self.deleted],
        }


def plan_gc(
    found: Usage,
    *,
    dead_after_s: float,
    max_bytes: int | None,
    now: float | None = None,
    dry_run: bool = False,
    tenant_quotas: dict[str, int] | None = None,
) -> GcPlan:
    """Which objects gc deletes: first every object of the generations whose manifest was
    last refreshed more than ``dead_after_s`` ago (``unknown``: each chunk by its own last
    use); then, with ``tenant_quotas`` (tenant name, ``"*"`` for every tenant not named,
    ``untagged`` included -> bytes), each tenant's own least recently used chunks while
    its chunks left in every generation hold more than its quota (:func:`_over_quota`);
    then, with ``max_bytes``, the least recently used chunks of the rest until the total
    is at most ``max_bytes`` (manifests of live generations are kept).

    A chunk its manifest holds pinned past ``now`` (:class:`~kvtier.objects.tenant_keys.Pins`)
    is never deleted, nor, while it is, its generation's manifest; it counts to its
    tenant's quota and to the total."""
    now = time.time() if now is None else now
    cutoff = now - dead_after_s
    deleted: list[Deleted] = []
    left: list[tuple[StoredObject, Generation]] = []
    pinned: list[tuple[StoredObject, Generation]] = []
    total = found.total_bytes
    for gen in found.generations:
        m = gen.manifest
        live = m.pins.live(now) if m is not None else frozenset()
        held = [o for o in gen.chunks if live and fingerprint(o.key) in live]
        pinned += [(o, gen) for o in held]
        ids = {id(o) for o in held}
        chunks = [o for o in gen.chunks if id(o) not in ids] if held else gen.chunks
        if m is not None and m.last_seen < cutoff:
            d = Deleted(gen, "dead", [*chunks, *(() if held else gen.manifests)])
        elif m is None:
            d = Deleted(gen, "dead", [o for o in (*gen.chunks, *gen.manifests) if o.used < cutoff])
            left += [(o, gen) for o in gen.chunks if o.used >= cutoff]
        else:
            left += [(o, gen) for o in chunks]
            continue
        if d.objects:
            deleted.append(d)
            total -= sum(o.size for o in d.objects)
    if tenant_quotas:
        trimmed = _over_quota(left, tenant_quotas, pinned)
        gone = {id(o) for d in trimmed for o in d.objects}
        left = [og for og in left if id(og[0]) not in gone]
        total -= sum(o.size for d in trimmed for o in d.objects)
        deleted += trimmed
    if max_bytes is not None and total > max_bytes:
        lru: dict[str, Deleted] = {}
        for obj, gen in sorted(left, key=lambda og: (og[0].used, og[0].key)):
            if total <= max_bytes:
                break
            lru.setdefault(gen.id, Deleted(gen, "lru")).objects.append(obj)
            total -= obj.size
        deleted += lru.values()
    return GcPlan(
        found, deleted, dry_run, max_bytes, dead_after_s, tenant_quotas, kept_pinned=len(pinned)
    )


def _over_quota(
    left: list[tuple[StoredObject, Generation]],
    quotas: dict[str, int],
    pinned: Sequence[tuple[StoredObject, Generation]] = (),
) -> list[Deleted]:
    """The chunks each tenant over its quota loses: its own, least recently used first
    (the backend's last use, as ``--max-bytes``), until what it holds in every generation
    (its ``pinned`` chunks too, which never go) is within its quota. A chunk is a tenant's
    when its generation's manifest lists it so; unattributed chunks and ``other``'s (a mix
    of tenants) are no tenant's to trim."""
    star = quotas.get("*")
    mine: dict[str, list[tuple[StoredObject, Generation]]] = {}
    kept: dict[str, int] = {}
    labels: dict[str, Callable[[StoredObject], str]] = {}

    def label_of(obj: StoredObject, gen: Generation) -> str:
        of = labels.get(gen.id)
        if of is None:
            of = labels[gen.id] = gen.tenant_of()
        return of(obj)

    for obj, gen in left:
        label = label_of(obj, gen)
        if label not in (UNATTRIBUTED, OTHER):
            mine.setdefault(label, []).append((obj, gen))
    for obj, gen in pinned:
        label = label_of(obj, gen)
        kept[label] = kept.get(label, 0) + obj.size
    out: list[Deleted] = []
    for label, chunks in sorted(mine.items()):
        quota = quotas.get(label, star)
        held = sum(o.size for o, _ in chunks) + kept.get(label, 0)
        if quota is None or held <= quota:
            continue
        by_gen: dict[str, Deleted] = {}
        for obj, gen in sorted(chunks, key=lambda og: (og[0].used, og[0].key)):
            if held <= quota:
                break
            by_gen.setdefault(gen.id, Deleted(gen, "tenant_quota", tenant=label)).objects.append(
                obj
            )
            held -= obj.size
        out += by_gen.values()
    return out


def gc(
    tier: ObjectTier,
    signer: codec.Signer | None,
    *,
    dead_after_s: float,
    max_bytes: int | None = None,
    dry_run: bool = False,
    now: float | None = None,
    progress: Callable[[int], None] | None = None,
    tenant_quotas: dict[str, int] | None = None,
) -> GcPlan:
    """List, plan (:func:`plan_gc`), and delete unless ``dry_run``: dead generations'
    chunks before their manifest, so a run cut short leaves them still listed as such."""
    found = usage(tier, signer, progress=progress)
    _refuse_wrong_keys(found, signer)
    plan = plan_gc(
        found,
        dead_after_s=dead_after_s,
        max_bytes=max_bytes,
        now=now,
        dry_run=dry_run,
        tenant_quotas=tenant_quotas,
    )
    if not dry_run:
        for d in plan.deleted:
            chunks = [o.key for o in d.objects if not o.key.endswith("/" + MANIFEST)]
            tier.delete_many(chunks)
            tier.delete_many([o.key for o in d.objects if o.key.endswith("/" + MANIFEST)])
    return plan


def _refuse_wrong_keys(found: Usage, signer: codec.Signer | None) -> None:
    """StoreError when the manifests say the keys given are not the engines': a sealed
    manifest and no encryption key, or most manifests failing for a key reason. Each
    such generation would be ``unknown`` and its chunks aged one by one, live or not."""
    if signer is not None and signer.sealer is None and "sealed" in found.bad_manifests.values():
        raise StoreError(
            "the tier's manifests are sealed (encrypted) and no encryption key was given: "
            "pass the engines' config with --config (encryption_key_env or "
            "encryption_key_file) and its key variable; nothing was deleted"
        )
    checked = sum(1 for g in found.generations if g.manifest is not None)
    checked += len(found.bad_manifests)
    failed = sum(1 for kind in found.bad_manifests.values() if kind in KEY_KINDS)
    if failed and failed > KEY_FAILURE_SHARE * checked:
        raise StoreError(
            f"{failed} of {checked} manifests fail for a key reason (signature/sealed): the "
            "keys given are most likely not the engines' (check --config's hmac_key_env / "
            "encryption_key_env and their variables); a wrong key is not a dead generation, "
            "so nothing was deleted"
        )


# -- verify ------------------------------------------------------------------------------


@dataclass(slots=True)
class VerifyReport:
    """What ``verify`` read and found."""

    checked: int = 0
    #: key -> error kind (checksum, signature, sealed, truncated, wrong_key, malformed ...)
    bad: dict[str, str] = field(default_factory=dict)
    deleted: int = 0
    #: why ``delete_bad`` deleted nothing (None: it deleted the corrupt chunks)
    refused: str | None = None
    #: what ``delete_bad`` deletes (or, ``dry_run``, would): the corrupt chunks
    to_delete: list[str] = field(default_factory=list)
    dry_run: bool = False

    def to_json(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for kind in self.bad.values():
            kinds[kind] = kinds.get(kind, 0) + 1
        return {
            "checked": self.checked,
            "bad": len(self.bad),
            "by_kind": kinds,
            "bad_keys": dict(sorted(self.bad.items())),
            "deleted": self.deleted,
            "to_delete": self.to_delete,
            "dry_run": self.dry_run,
            "delete_refused": self.refused,
        }


def verify(
    tier: ObjectTier,
    signer: codec.Signer | None,
    *,
    sample: int | None = None,
    delete_bad: bool = False,
    dry_run: bool = False,
    seed: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Read ``sample`` chunks (all when None; a random sample otherwise) and check each
    as an engine would (frame, checksum, signature, decryption, its own key, its layout's
    slot size when compressed).

    ``delete_bad`` deletes the chunks that are corrupt (:data:`CORRUPT_KINDS`), never a
    manifest (gc decides on its generation) nor an object failing for a key reason or
    for the backend's sake; and nothing at all when more than :data:`KEY_FAILURE_SHARE`
    of those checked fail for a key reason (``refused`` says so): a wrong key is not
    corruption. ``dry_run``: what it would delete (``to_delete``), nothing deleted.
    Raises StoreError, before deleting anything, on a signed or sealed object when
    ``signer`` lacks that key: it cannot be checked."""
    import random

    objs = []
    for n, o in enumerate(_listed(tier), 1):
        if progress is not None and n % 1000 == 0:
            progress(n)
        objs.append(o)
    if sample is not None and sample < len(objs):
        objs = random.Random(seed).sample(objs, sample)
    report = VerifyReport(dry_run=dry_run)
    for obj in objs:
        kind = _check(tier, obj, signer)
        report.checked += 1
        if kind is not None:
            report.bad[obj.key] = kind
    if delete_bad and report.bad:
        by_key = sum(1 for kind in report.bad.values() if kind in KEY_KINDS)
        if by_key > KEY_FAILURE_SHARE * report.checked:
            report.refused = (
                f"{by_key} of {report.checked} objects checked fail for a key reason "
                "(signature/sealed): the keys given are most likely not the engines' (check "
                "--config's hmac_key_env / encryption_key_env and their variables); a wrong "
                "key is not corruption, so nothing was deleted"
            )
            return report
        report.to_delete = sorted(
            k for k, kind in report.bad.items() if kind in CORRUPT_KINDS and not _is_bookkeeping(k)
        )
        if not dry_run:
            tier.delete_many(report.to_delete)
            report.deleted = len(report.to_delete)
    return report


def _is_bookkeeping(key: str) -> bool:
    """A manifest or a re-claim's token: never deleted by verify."""
    parsed = parse_object_key(key)
    return parsed is None or parsed[1]


def _missing_key(header: dict[str, Any], signer: codec.Signer | None) -> str | None:
    """Why an object with this header cannot be checked with ``signer`` (None: it can),
    naming the settings of every key it needs that ``signer`` lacks."""
    missing = []
    if "nonce" in header and (signer is None or signer.sealer is None):
        missing.append(("sealed (encrypted)", "encryption_key_env or encryption_key_file"))
    if "sig" in header and (signer is None or not signer.hmac):
        missing.append(("signed", "hmac_key_env or hmac_key_file"))
    if not missing:
        return None
    return (
        f"the tier's objects are {' and '.join(m[0] for m in missing)}, and the key to "
        f"check that was not given ({'; '.join(m[1] for m in missing)}): pass the "
        "engines' config with --config and its key variables; nothing was deleted"
    )


def _check(tier: ObjectTier, obj: StoredObject, signer: codec.Signer | None) -> str | None:
    """The error kind of one stored object, None when it verifies (or vanished)."""
    from kvtier.objects.manifest import MANIFEST_DTYPE

    try:
        blob = tier.get(obj.key, max_bytes=max(obj.size, 1 << 20) + codec.MAX_HEADER + 8)
        if blob is None:
            return None  # deleted meanwhile
        header = _header_of(blob)
        missing = _missing_key(header, signer)
        if missing is not None:
            raise StoreError(missing)
        out = None
        if "z" in header:
            shape = header.get("shape")
            if not isinstance(shape, list) or len(shape) < 3 or not isinstance(shape[2], int):
                raise CodecError("compressed chunk without a slot size in its shape")
            out = memoryview(bytearray(shape[2]))
        dtype = MANIFEST_DTYPE if obj.key.endswith("/" + MANIFEST) else None
        if dtype is None and header.get("dtype") == MANIFEST_DTYPE:
            raise CodecError("a manifest stored under a chunk's key")
        codec.decode(bytearray(blob), key=obj.key, dtype=dtype, signer=signer, out=out, lossy=True)
    except CodecError as exc:
        return exc.kind
    except TierError as exc:
        return exc.kind
    return None


def progress_printer(stream: Any = None) -> Callable[[int], None] | None:
    """A counter of listed objects on a terminal's stderr (None elsewhere); called with 0
    when the listing is over, it clears its line."""
    out = sys.stderr if stream is None else stream
    if not out.isatty():
        return None

    def show(n: int) -> None:
        out.write(f"\rlisted {n:,} objects" if n else "\r\x1b[K")  # 0: clear the line
        out.flush()

    return show
