"""Governing the shared tier: what it holds per generation, deleting dead generations and
the least recently used chunks under a byte budget, and checking stored chunks.

Every object key kvtier writes names its generation (``gen-<id>/<chunk key>``, and the
generation's manifest ``gen-<id>/manifest``, :mod:`kvtier.objects.manifest`), so all of
this works by listing the backend, never by reading chunks (``verify`` alone reads):

- directory (``file://``): ``os.scandir`` of the fan-out directories; a chunk's bytes are
  its file's size, its last use its mtime (a hit refreshes it, at most once a minute);
- S3: ``ListObjectsV2`` pages; bytes are the listed ``Size``, last use the object's
  ``LastModified``: its last *write* (S3 records no reads; a chunk every engine hits but
  none rewrites looks old), deleted with ``DeleteObjects`` in batches of 1,000;
- Redis (one node, or every primary of a Redis Cluster): ``SCAN``; bytes are ``MEMORY
  USAGE`` (what the server spends on the key, ``STRLEN`` where MEMORY is not allowed),
  last use ``OBJECT IDLETIME`` (reads count; listing does not), deleted with ``UNLINK``.

Keys that are not kvtier's (another application's, in the same Redis or bucket) are never
listed or touched. Chunks of bare keys (written before generations) and of generations
whose manifest is missing or does not verify make one generation, ``unknown``; for them
``gc --dead-after`` goes by each chunk's own last use.

A chunk deleted while an engine reads it is that read's miss (a missing key, or a
truncated read that fails its check): every backend's delete is atomic per object, and
deleting a missing key is no error, so two gc runs at once only find less to delete.
"""

from __future__ import annotations

import os
import re
import stat
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import unquote

from kvtier.errors import CodecError, KVTierError, TierError, TierUnavailable
from kvtier.keys import GENERATION_PREFIX
from kvtier.objects import codec
from kvtier.objects.codec import head_length, parse_header
from kvtier.objects.manifest import MANIFEST, MAX_MANIFEST, RECLAIM, Manifest, read_manifest
from kvtier.objects.tiers.base import ObjectTier

__all__ = ["UNKNOWN", "GcPlan", "Generation", "StoreError", "StoredObject", "Usage",
           "gc", "holds_chunks", "lister_for", "parse_object_key", "usage",
           "verify"]  # fmt: skip

#: the generation of chunks without a readable manifest
UNKNOWN = "unknown"
_CHUNK_RE = re.compile(r"[0-9a-f]{40}", re.ASCII)
#: a re-claim's token (:func:`kvtier.objects.manifest.reclaim_key`): bookkeeping, as a manifest
_RECLAIM_RE = re.compile(re.escape(RECLAIM) + r"[0-9a-f]{16}", re.ASCII)
_GEN_RE = re.compile(re.escape(GENERATION_PREFIX) + r"([0-9a-f]{16})/(.+)", re.ASCII)
#: S3's most keys per DeleteObjects
S3_DELETE_BATCH = 1000
#: keys per Redis SCAN page and per pipeline (below the tier's reply bounds)
REDIS_BATCH = 256
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


@dataclass(frozen=True, slots=True)
class StoredObject:
    """One object as the backend lists it."""

    key: str
    #: bytes as stored (what the backend bills)
    size: int
    #: when it was last used as the backend records it (Unix seconds; see the module doc)
    used: float


class Lister(Protocol):
    """Listing and deleting on top of one backend's own client."""

    #: what "recently used" means on this backend, for ``--help`` and reports
    recency: str

    def objects(self) -> Iterator[StoredObject]: ...

    def delete(self, keys: Sequence[str]) -> None: ...


class FileLister:
    """A directory tier: ``root/<2 hex>/<quoted key>``; dot-names are its bookkeeping."""

    recency = "the file's mtime (a hit refreshes it, at most once a minute)"

    def __init__(self, tier: Any) -> None:
        self.tier = tier
        self.root: str = tier.root

    def objects(self) -> Iterator[StoredObject]:
        try:
            subs = [e for e in os.scandir(self.root)
                    if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]  # fmt: skip
        except OSError as exc:
            raise TierUnavailable(f"file tier {self.root}: {exc.strerror}") from None
        for sub in sorted(subs, key=lambda e: e.name):
            try:
                entries = list(os.scandir(sub.path))
            except OSError:
                continue  # removed meanwhile
            for e in entries:
                if e.name.startswith("."):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    yield StoredObject(unquote(e.name), st.st_size, st.st_mtime)

    def keys(self, under: str) -> Iterator[str]:
        """The keys starting with ``under``: names only, no stat."""
        try:
            subs = [e.path for e in os.scandir(self.root)
                    if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]  # fmt: skip
        except OSError as exc:
            raise TierUnavailable(f"file tier {self.root}: {exc.strerror}") from None
        for sub in subs:
            try:
                names = os.listdir(sub)
            except OSError:
                continue  # removed meanwhile
            for name in names:
                if not name.startswith("."):
                    key = unquote(name)
                    if key.startswith(under):
                        yield key

    def delete(self, keys: Sequence[str]) -> None:
        self.tier.delete(keys)  # through the tier's directory fds: never outside the root


class S3Lister:
    """A bucket under the tier's prefix: ListObjectsV2 pages, DeleteObjects batches."""

    recency = "the object's LastModified: its last write (S3 records no reads)"

    def __init__(self, tier: Any) -> None:
        self.tier = tier
        self.client = tier._client
        self.bucket: str = tier.bucket
        self.prefix: str = tier.prefix

    def objects(self) -> Iterator[StoredObject]:
        pages = self.client.get_paginator("list_objects_v2")
        with self.tier._errors("list"):
            for page in pages.paginate(Bucket=self.bucket, Prefix=self.prefix):
                for obj in page.get("Contents", ()):
                    key = str(obj["Key"])[len(self.prefix):]
                    yield StoredObject(key, int(obj["Size"]), obj["LastModified"].timestamp())

    def keys(self, under: str) -> Iterator[str]:
        """The keys starting with ``under``: one listing of that prefix alone."""
        pages = self.client.get_paginator("list_objects_v2")
        with self.tier._errors("list"):
            for page in pages.paginate(Bucket=self.bucket, Prefix=self.prefix + under):
                for obj in page.get("Contents", ()):
                    yield str(obj["Key"])[len(self.prefix):]

    def delete(self, keys: Sequence[str]) -> None:
        for i in range(0, len(keys), S3_DELETE_BATCH):
            batch = [{"Key": self.prefix + k} for k in keys[i : i + S3_DELETE_BATCH]]
            with self.tier._errors("delete"):
                resp = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )
            errors = resp.get("Errors") or []
            if errors:
                first = errors[0]
                raise TierError(f"s3 delete: {len(errors)} objects not deleted "
                                f"({first.get('Code')}: {first.get('Message')})")  # fmt: skip


class RedisLister:
    """One Redis node, or every primary of a Redis Cluster: SCAN, then per page one
    pipeline of MEMORY USAGE and OBJECT IDLETIME; UNLINK one key per command (keys of
    one node are in many slots)."""

    recency = "OBJECT IDLETIME (reads and writes count)"

    def __init__(self, tier: Any) -> None:
        self.tier = tier

    def _nodes(self) -> list[Any]:
        cluster = getattr(self.tier, "_cluster_client", None)
        with self.tier._errors("list"):
            if cluster is None:
                return [self.tier._client]
            client = cluster()
            return [client.get_redis_connection(n) for n in client.get_primaries()]

    def objects(self) -> Iterator[StoredObject]:
        for node in self._nodes():
            cursor = 0
            while True:
                with self.tier._errors("list"):
                    cursor, keys = node.scan(cursor=cursor, count=REDIS_BATCH)
                    ours = [k for k in keys if parse_object_key(_text(k)) is not None]
                    sized = self._measure(node, ours)
                now = time.time()
                for key, size, idle in sized:
                    yield StoredObject(key, size, now - idle)
                if int(cursor) == 0:
                    break

    def keys(self, under: str) -> Iterator[str]:
        """The keys starting with ``under`` (no glob characters in kvtier's): SCAN MATCH,
        nothing measured."""
        for node in self._nodes():
            cursor = 0
            while True:
                with self.tier._errors("list"):
                    cursor, keys = node.scan(cursor=cursor, match=under + "*",
                                             count=REDIS_BATCH)  # fmt: skip
                yield from (_text(k) for k in keys)
                if int(cursor) == 0:
                    break

    @staticmethod
    def _measure(node: Any, keys: list[bytes]) -> list[tuple[str, int, float]]:
        if not keys:
            return []
        # neither command touches the key (an engine's read does): listing twice keeps
        # the order of last use
        pipe = node.pipeline(transaction=False)
        for k in keys:
            pipe.execute_command("OBJECT", "IDLETIME", k)
            pipe.execute_command("MEMORY", "USAGE", k, "SAMPLES", "0")
        replies = pipe.execute(raise_on_error=False)
        idles, sizes = replies[0::2], replies[1::2]
        refused = [i for i, m in enumerate(sizes) if isinstance(m, Exception)]
        if refused:  # MEMORY not allowed (an ACL): the value's length, which counts as a use
            pipe = node.pipeline(transaction=False)
            for i in refused:
                pipe.strlen(keys[i])
            for i, n in zip(refused, pipe.execute(raise_on_error=False), strict=True):
                sizes[i] = n
        out = []
        for k, idle, size in zip(keys, idles, sizes, strict=True):
            if not isinstance(size, int) or isinstance(size, bool) or idle is None:
                continue  # deleted meanwhile
            out.append((_text(k), size, float(idle) if isinstance(idle, int) else 0.0))
        return out

    def delete(self, keys: Sequence[str]) -> None:
        by_node: dict[int, tuple[Any, list[str]]] = {}
        cluster = getattr(self.tier, "_cluster_client", None)
        with self.tier._errors("delete"):
            if cluster is None:
                by_node[0] = (self.tier._client, list(keys))
            else:
                client = cluster()
                for k in keys:
                    node = client.get_redis_connection(client.get_node_from_key(k))
                    by_node.setdefault(id(node), (node, []))[1].append(k)
            for node, ks in by_node.values():
                for i in range(0, len(ks), REDIS_BATCH):
                    pipe = node.pipeline(transaction=False)
                    for k in ks[i : i + REDIS_BATCH]:
                        pipe.unlink(k)
                    pipe.execute()


def _text(key: bytes | str) -> str:
    return key.decode("utf-8", "replace") if isinstance(key, bytes) else key


def lister_for(tier: ObjectTier) -> Lister:
    """The lister of ``tier``'s backend."""
    if tier.name == "file":
        return FileLister(tier)
    if tier.name == "s3":
        return S3Lister(tier)
    if tier.name == "redis":
        return RedisLister(tier)
    raise StoreError(f"kvtier store cannot list a {tier.name} tier")


def holds_chunks(tier: ObjectTier, generation: str, *, lister: Lister | None = None) -> bool:
    """Whether ``generation`` holds any chunk (its manifest and tokens do not count): a
    listing that stops at the first chunk found (a canary's re-claim,
    :func:`kvtier.objects.manifest.reclaim_generation`). Raises StoreError for a tier that
    cannot be listed and TierError when listing fails: neither is an answer of "none"."""
    lister = lister if lister is not None else lister_for(tier)
    under = f"{GENERATION_PREFIX}{generation}/"
    only = getattr(lister, "keys", None)  # a listing of the generation's keys alone
    keys = only(under) if only is not None else (o.key for o in lister.objects())
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

    def row(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "id": self.id, "model": m.model if m else None,
            "namespace": m.namespace if m else None, "bytes": self.bytes,
            "chunks": len(self.chunks), "first_seen": _iso(m.first_seen) if m else None,
            "last_seen": _iso(m.last_seen) if m else None,
            "hot_chunks": len(m.hot) if m else None,
        }  # fmt: skip


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

    def to_json(self) -> dict[str, Any]:
        return {"total_bytes": self.total_bytes, "total_chunks": self.total_chunks,
                "generations": [g.row() for g in self.generations]}  # fmt: skip


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def usage(
    tier: ObjectTier,
    signer: codec.Signer | None,
    *,
    lister: Lister | None = None,
    progress: Callable[[int], None] | None = None,
) -> Usage:
    """List ``tier`` and read each generation's manifest.

    A manifest that does not verify (corrupt, forged, sealed with another key) leaves its
    generation ``unknown``. One that is signed or sealed while ``signer`` holds no key
    raises StoreError: its claims cannot be checked, and ``gc`` must not act on them."""
    lister = lister if lister is not None else lister_for(tier)
    gens: dict[str, Generation] = {}
    unknown = Generation(UNKNOWN)
    for n, obj in enumerate(lister.objects(), 1):
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
    #: "dead": not seen for --dead-after; "lru": under --max-bytes
    reason: str
    objects: list[StoredObject] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        m = self.generation.manifest
        return {
            "id": self.generation.id, "model": m.model if m else None,
            "namespace": m.namespace if m else None, "reason": self.reason,
            "bytes": sum(o.size for o in self.objects),
            "chunks": sum(1 for o in self.objects if not o.key.endswith("/" + MANIFEST)),
        }  # fmt: skip


@dataclass(slots=True)
class GcPlan:
    """What gc deletes (or, dry, would) and what is left."""

    before: Usage
    deleted: list[Deleted]
    dry_run: bool
    max_bytes: int | None
    dead_after_s: float

    @property
    def deleted_bytes(self) -> int:
        return sum(o.size for d in self.deleted for o in d.objects)

    @property
    def deleted_chunks(self) -> int:
        return sum(d.row()["chunks"] for d in self.deleted)

    def to_json(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run, "dead_after_s": self.dead_after_s,
            "max_bytes": self.max_bytes, "total_bytes_before": self.before.total_bytes,
            "total_bytes_after": self.before.total_bytes - self.deleted_bytes,
            "deleted_bytes": self.deleted_bytes, "deleted_chunks": self.deleted_chunks,
            "generations": [d.row() for d in self.deleted],
        }  # fmt: skip


def plan_gc(
    found: Usage, *, dead_after_s: float, max_bytes: int | None, now: float | None = None,
    dry_run: bool = False,
) -> GcPlan:
    """Which objects gc deletes: first every object of the generations whose manifest was
    last refreshed more than ``dead_after_s`` ago (``unknown``: each chunk by its own last
    use); then, with ``max_bytes``, the least recently used chunks of the rest until the
    total is at most ``max_bytes`` (manifests of live generations are kept)."""
    now = time.time() if now is None else now
    cutoff = now - dead_after_s
    deleted: list[Deleted] = []
    left: list[tuple[StoredObject, Generation]] = []
    total = found.total_bytes
    for gen in found.generations:
        m = gen.manifest
        if m is not None and m.last_seen < cutoff:
            d = Deleted(gen, "dead", [*gen.chunks, *gen.manifests])
        elif m is None:
            d = Deleted(gen, "dead", [o for o in (*gen.chunks, *gen.manifests) if o.used < cutoff])
            left += [(o, gen) for o in gen.chunks if o.used >= cutoff]
        else:
            left += [(o, gen) for o in gen.chunks]
            continue
        if d.objects:
            deleted.append(d)
            total -= sum(o.size for o in d.objects)
    if max_bytes is not None and total > max_bytes:
        lru: dict[str, Deleted] = {}
        for obj, gen in sorted(left, key=lambda og: (og[0].used, og[0].key)):
            if total <= max_bytes:
                break
            lru.setdefault(gen.id, Deleted(gen, "lru")).objects.append(obj)
            total -= obj.size
        deleted += lru.values()
    return GcPlan(found, deleted, dry_run, max_bytes, dead_after_s)


def gc(
    tier: ObjectTier,
    signer: codec.Signer | None,
    *,
    dead_after_s: float,
    max_bytes: int | None = None,
    dry_run: bool = False,
    lister: Lister | None = None,
    now: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> GcPlan:
    """List, plan (:func:`plan_gc`), and delete unless ``dry_run``: dead generations'
    chunks before their manifest, so a run cut short leaves them still listed as such."""
    lister = lister if lister is not None else lister_for(tier)
    found = usage(tier, signer, lister=lister, progress=progress)
    _refuse_wrong_keys(found, signer)
    plan = plan_gc(found, dead_after_s=dead_after_s,
                   max_bytes=max_bytes, now=now, dry_run=dry_run)  # fmt: skip
    if not dry_run:
        for d in plan.deleted:
            chunks = [o.key for o in d.objects if not o.key.endswith("/" + MANIFEST)]
            lister.delete(chunks)
            lister.delete([o.key for o in d.objects if o.key.endswith("/" + MANIFEST)])
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
        return {"checked": self.checked, "bad": len(self.bad), "by_kind": kinds,
                "bad_keys": dict(sorted(self.bad.items())), "deleted": self.deleted,
                "to_delete": self.to_delete, "dry_run": self.dry_run,
                "delete_refused": self.refused}  # fmt: skip


def verify(
    tier: ObjectTier,
    signer: codec.Signer | None,
    *,
    sample: int | None = None,
    delete_bad: bool = False,
    dry_run: bool = False,
    lister: Lister | None = None,
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

    lister = lister if lister is not None else lister_for(tier)
    objs = []
    for n, o in enumerate(lister.objects(), 1):
        if progress is not None and n % 1000 == 0:
            progress(n)
        if parse_object_key(o.key) is not None:
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
        report.to_delete = sorted(k for k, kind in report.bad.items()
                                  if kind in CORRUPT_KINDS and not _is_bookkeeping(k))  # fmt: skip
        if not dry_run:
            lister.delete(report.to_delete)
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
    return (f"the tier's objects are {' and '.join(m[0] for m in missing)}, and the key to "
            f"check that was not given ({'; '.join(m[1] for m in missing)}): pass the "
            "engines' config with --config and its key variables; nothing was deleted")


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
        codec.decode(bytearray(blob), key=obj.key, dtype=dtype, signer=signer, out=out,
                     lossy=True)  # fmt: skip
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

