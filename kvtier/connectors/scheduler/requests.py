"""What the scheduler side remembers about one request, its chunk keys, and whether its
chunks may be shared through the object tier.

vLLM's block hash names everything a chunk's KV depends on, but some of it only by
a name: a LoRA adapter by its name and path (not its weights), an image by the id
the client gave it (``multi_modal_uuids``) when it gave one. The host tier is one
engine's and follows vLLM's own prefix cache; the object tier outlives engines and
is shared by replicas, so it may only hold chunks whose whole identity is in their
key. :class:`RequestIdentity` decides that once per request:

- **LoRA**: the adapter's weights are fingerprinted (:func:`kvtier.fingerprint.
  weights_fingerprint` over ``lora_path``, on a background thread, cached per
  stat signature of the adapter's files) and mixed into every key of the request's
  chunks, host index and object tier alike. An adapter kvtier cannot read (no local
  directory, no weight files), one still being fingerprinted, and one whose files
  changed while this engine runs (vLLM may still compute with the version it loaded)
  keep their chunks in the host tier, keyed by the files' stat signature so that a
  rewrite never serves the old version's chunks.
- **Images and other multimodal inputs**: vLLM 0.32's request cannot tell a content
  hash from a client's id, so unless the operator says the ids are trusted
  (``trust_multimodal_ids``) or the request carries a ``cache_salt``, every chunk
  from the first multimodal placeholder on stays in the host tier.
- **Prompts mixing token ids and embeddings** (``prompt_is_token_ids``): vLLM hashes the
  token ids (0 where an embedding is used) and the embeddings tensor (zeros, or any
  filler, where a token id is used), but not the mask that says which of the two each
  position uses: token 0 with a zero row and a zero embedding row hash alike and
  compute differently. Such requests stay in the host tier.

Host-only chunks are neither looked up in nor written to the object tier.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import stat
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.fingerprint import FingerprintError, weights_fingerprint
from kvtier.host.index import Entry
from kvtier.keys import chunk_block_hashes

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("kvtier.scheduler")

#: why a request's chunks (all of them or those from a point on) stay in the host tier;
#: the scheduler side counts requests per reason (``host_only_<reason>``)
HOST_ONLY_REASONS = (
    "multimodal",
    "lora_unreadable",
    "lora_pending",
    "lora_changed",
    "mixed_embeds",
)
#: every chunk of the request may be shared
ALL_CHUNKS = sys.maxsize


@dataclass(slots=True)
class Lookup:
    """An object-tier lookup in flight for one request: its chunks from the first one
    the host tier lacked, in order (fetched for it, or already there or being fetched
    for another request)."""

    started: float
    first_chunk: int
    chunks: list[Entry] = field(default_factory=list)
    done: bool = False
    #: per what-if scale, the end of the chunks that object tier would have held
    #: (kvtier.whatif.objects: filled when their queue reaches the lookup); None once
    #: counted
    whatif_end: Sequence[int] | None = None
    #: seconds after ``started`` the request stops waiting for chunks still fetching and
    #: goes on with those that landed (load_policy: cost, kvtier.costs); None: only
    #: lookup_timeout_ms
    deadline_s: float | None = None
    #: the engine step at which the deadline was first seen passed: the lookup is cut at
    #: a later step, once that step's reports are in (a chunk that landed before the
    #: deadline is reported a step later); None: not passed yet
    late_step: int | None = None
    #: the wait the cost model predicted for the chunks asked for (None: unmeasured, or
    #: nothing asked for), observed beside the real one when the lookup ends
    predicted_s: float | None = None
    #: the ids of the fetches this lookup planned (its run), in order
    fetch_ops: list[int] = field(default_factory=list)
    #: the first chunk a priced lookup did not ask the tier for (None: none declined);
    #: its misses count as "declined", not "absent"
    declined_from: int | None = None


@dataclass(slots=True)
class RequestState:
    request: Request
    #: the last block hash of each full chunk so far (the chunks' host-index keys)
    chunk_hashes: list[bytes] = field(default_factory=list)
    #: chunks below this index are stored (or were skipped on purpose)
    next_store: int = 0
    #: (start, end) token range get_num_new_matched_tokens offered
    offer: tuple[int, int] | None = None
    #: a one-step lookup's chunks in that offer (:mod:`.one_step_lookups`): chunk -> the id of its
    #: fetch, which the workers read in the step that loads it; emptied with ``offer``
    fetching_now: dict[int, int] = field(default_factory=dict)
    #: the ids of the loads planned for this request in the step being planned: its stores
    #: of that step wait on them (``StoreOp.after_loads``); emptied as the step is handed on
    step_loads: list[int] = field(default_factory=list)
    #: tokens vLLM's own prefix cache had, as last passed to get_num_new_matched_tokens
    local_hit: int = 0
    lookup: Lookup | None = None
    hit_sources: dict[str, int] = field(default_factory=dict)
    outcome: str = "miss"
    prefill_done: bool = False
    #: mixed into every chunk key of the request (a LoRA adapter's version); b"": none
    key_tag: bytes = b""
    #: chunks below this index may be looked up in and written to the object tier; the
    #: rest stay in the host tier (:class:`RequestIdentity`)
    shared_chunks: int = ALL_CHUNKS
    #: why ``shared_chunks`` is not ALL_CHUNKS (one of HOST_ONLY_REASONS), else None
    host_only: str | None = None
    #: what the host tier's ghosts held of this prompt as its lookup began, and in which
    #: step (kvtier.whatif.host: GhostTiers.peek)
    ghost_peek: list[list[bool]] | None = None
    ghost_peek_step: int = -1
    #: who the request is (kv_transfer_params' kvtier.tenant, kvtier.host.tenants' id; 0:
    #: untagged) and how long it asks its chunks to stay pinned (0: no pin)
    tenant: int = 0
    pin_ttl_s: float = 0.0


def loadable_chunks(st: RequestState, cap: int, chunk_size: int) -> int:
    """How many of the request's chunks a load may touch: the full chunks vLLM has hashed
    that begin below ``cap`` (the last token vLLM must compute itself ends it; the last
    such chunk may load in part)."""
    return min(len(st.chunk_hashes), -(-cap // chunk_size))


class ChunkKeys:
    """Host-index keys of requests' chunks: vLLM's own hash of a chunk's last block,
    mixed with the request's ``key_tag`` when it has one (a LoRA adapter's version).

    The index belongs to one engine (one model, one namespace), and vLLM's block hash
    already chains the whole prefix, ``cache_salt``, LoRA and multimodal inputs, so it
    identifies the chunk there as it identifies vLLM's own cached blocks; mixing in the
    namespace (what object keys need, shared across engines: ``KeySpace``) would add
    nothing but a hash per chunk and a key string per entry. A lookup makes no hash.
    The same key names the chunk's objects (``KeySpace`` mixes the namespace into it),
    so an adapter's version is in both.
    """

    def __init__(self, blocks_per_chunk: int, identity: RequestIdentity | None = None) -> None:
        self.blocks_per_chunk = blocks_per_chunk
        #: decides each new request's key tag and what it may share (None: no LoRA or
        #: multimodal rules, every chunk keyed by vLLM's hash and shareable)
        self.identity = identity

    def new_state(self, request: Request) -> RequestState:
        """A request's state, with its key tag and what it may share decided."""
        st = RequestState(request=request)
        if self.identity is not None:
            self.identity.assign(st)
        return st

    def refresh(self, st: RequestState) -> None:
        """Take the last block hash of every full chunk vLLM has hashed so far (cheap)."""
        hashes = st.request.block_hashes
        have = len(st.chunk_hashes)
        if len(hashes) // self.blocks_per_chunk > have:
            new = chunk_block_hashes(hashes, self.blocks_per_chunk, have)
            if st.key_tag:
                new = [tagged_key(st.key_tag, h) for h in new]
            st.chunk_hashes.extend(new)

    @staticmethod
    def key(st: RequestState, c: int) -> bytes:
        """Host-index key of chunk ``c`` (one for all workers: the index is the engine's)."""
        return st.chunk_hashes[c]


def tagged_key(tag: bytes, block_hash: bytes) -> bytes:
    """The key of a chunk whose last vLLM block hash is ``block_hash``, for a request
    whose key tag is ``tag`` (32 bytes, like vLLM's SHA-256 block hashes)."""
    return hashlib.blake2b(block_hash, key=tag, digest_size=32).digest()


def _tag(kind: bytes, value: bytes) -> bytes:
    return hashlib.blake2b(kind + b"\0" + value, digest_size=32, person=b"kvtier-reqtag").digest()


@dataclass(frozen=True, slots=True)
class AdapterVersion:
    """What kvtier knows of a LoRA adapter's files when a request names it."""

    #: mixed into the keys of the request's chunks (b"": vLLM's hash alone)
    tag: bytes
    #: the chunks may go through the object tier (the tag is the weights' fingerprint)
    shared: bool
    #: why not, when not shared: one of HOST_ONLY_REASONS
    reason: str | None = None


#: at most this many files (and directories) in an adapter directory are watched; a larger
#: one is not shared
MAX_ADAPTER_FILES = 256
#: adapter paths remembered (first version seen, fingerprint); the oldest is forgotten
MAX_ADAPTERS = 1024


class AdapterFingerprints:
    """LoRA adapters' weight fingerprints, cached per stat signature of their files.

    :meth:`version` runs on the scheduler's thread for each new LoRA request: it stats
    the adapter's files (a few µs on a local disk) and answers from the cache. A
    fingerprint not known yet is computed on a background thread (it reads every
    safetensors header and three samples per tensor: milliseconds, more on a cold
    network mount), and the request is not shared meanwhile: the scheduler never waits
    on it. A fingerprint is kept only if the files' signature was the same before and
    after it was read.

    Once an adapter's files change while the engine runs, its requests are never shared
    again by this engine: vLLM keeps the version it loaded until it evicts or reloads it
    (``load_inplace``), so kvtier cannot know which version a step computes with.
    """

    def __init__(
        self,
        *,
        remote: bool,
        fingerprint: Callable[[str], str] = weights_fingerprint,
        background: bool = True,
    ) -> None:
        #: without an object tier nothing is shared: the stat signature alone keeps
        #: versions apart in the host tier, no weights are read
        self.remote = remote
        self._fingerprint = fingerprint
        self._background = background
        self._lock = threading.Lock()
        #: path -> (stat signature, fingerprint or None when it could not be read)
        self._known: OrderedDict[str, tuple[bytes, str | None]] = OrderedDict()
        #: path -> the stat signature this engine first saw
        self._first: OrderedDict[str, bytes] = OrderedDict()
        self._changed: set[str] = set()
        self._pending: set[tuple[str, bytes]] = set()
        self._queue: queue.SimpleQueue[tuple[str, bytes]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition(self._lock)

    def version(self, path: str) -> AdapterVersion:
        local = os.path.expanduser(path) if path else ""
        sig = _signature(local) if local else None
        if sig is None:  # not a local directory kvtier can watch (a hub id, in memory...)
            return AdapterVersion(
                _tag(b"path", path.encode("utf-8", "replace")), False, "lora_unreadable"
            )
        local_tag = _tag(b"sig", local.encode("utf-8", "replace") + b"\0" + sig)
        first = self._first.setdefault(local, sig)
        self._first.move_to_end(local)
        if len(self._first) > MAX_ADAPTERS:
            self._first.popitem(last=False)
        if first != sig or local in self._changed:
            if local not in self._changed:
                self._changed.add(local)
                logger.warning(
                    "kvtier: the LoRA adapter at %s changed while this engine runs: its "
                    "chunks stay in the host tier until the engine restarts (write a new "
                    "adapter to a new path instead of over an old one)",
                    local,
                )
            return AdapterVersion(local_tag, False, "lora_changed")
        if not self.remote:
            return AdapterVersion(local_tag, False)
        with self._lock:
            known = self._known.get(local)
        if known is not None and known[0] == sig:
            fp = known[1]
            if fp is None:
                return AdapterVersion(local_tag, False, "lora_unreadable")
            return AdapterVersion(_tag(b"weights", fp.encode()), True)
        self._request(local, sig)
        with self._lock:  # a synchronous fingerprint (tests) is known now
            known = self._known.get(local)
        if known is not None and known[0] == sig and known[1] is not None:
            return AdapterVersion(_tag(b"weights", known[1].encode()), True)
        return AdapterVersion(local_tag, False, "lora_pending")

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no fingerprint is being computed (tests); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    # ---- internals --------------------------------------------------------------------
    def _request(self, path: str, sig: bytes) -> None:
        with self._lock:
            if (path, sig) in self._pending:
                return
            self._pending.add((path, sig))
        if not self._background:
            self._compute(path, sig)
            return
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="kvtier-adapter-fingerprint", daemon=True
            )
            self._thread.start()
        self._queue.put((path, sig))

    def _run(self) -> None:
        while True:
            path, sig = self._queue.get()
            self._compute(path, sig)

    def _compute(self, path: str, sig: bytes) -> None:
        fp: str | None
        try:
            fp = self._fingerprint(path)
        except (FingerprintError, OSError, ValueError) as exc:
            logger.warning(
                "kvtier: cannot fingerprint the LoRA adapter at %s (%s): its "
                "chunks stay in the host tier",
                path,
                exc,
            )
            fp = None
        except Exception:  # a background thread must not die
            logger.exception("kvtier: fingerprinting the LoRA adapter at %s failed", path)
            fp = None
        # read while the files stayed as signed: otherwise a later request retries
        unchanged = _signature(path) == sig
        with self._lock:
            self._pending.discard((path, sig))
            if unchanged:
                self._known[path] = (sig, fp)
                self._known.move_to_end(path)
                if len(self._known) > MAX_ADAPTERS:
                    self._known.popitem(last=False)
            self._idle.notify_all()


def _signature(path: str) -> bytes | None:
    """Names, sizes, inodes and change times of the regular files under ``path`` (hidden
    entries skipped, as the fingerprint skips them); None when it is not a directory
    kvtier can watch. A rewrite changes the ctime whatever the writer does."""
    parts: list[bytes] = []
    try:
        if not stat.S_ISDIR(os.stat(path).st_mode):
            return None
        stack = [("", path)]
        visited = 0
        while stack:
            visited += 1
            if visited > MAX_ADAPTER_FILES:  # a deep tree or a link loop: not watched
                return None
            rel, directory = stack.pop()
            with os.scandir(directory) as it:
                entries = sorted(it, key=lambda e: e.name)
            for e in entries:
                if e.name.startswith("."):
                    continue
                s = e.stat()  # follows links, as the fingerprint does
                if stat.S_ISDIR(s.st_mode):
                    stack.append((f"{rel}{e.name}/", e.path))
                    continue
                if not stat.S_ISREG(s.st_mode):
                    continue
                if len(parts) >= MAX_ADAPTER_FILES:
                    return None
                parts.append(
                    f"{rel}{e.name}\0{s.st_size}\0{s.st_ino}\0{s.st_dev}\0{s.st_mtime_ns}\0"
                    f"{s.st_ctime_ns}".encode("utf-8", "replace")
                )
    except OSError:
        return None
    if not parts:
        return None
    return hashlib.blake2b(b"\n".join(parts), digest_size=16).digest()


class RequestIdentity:
    """Decides, once per request, its key tag and which of its chunks may be shared."""

    def __init__(
        self,
        *,
        chunk_size: int,
        trust_multimodal_ids: bool,
        adapters: AdapterFingerprints,
    ) -> None:
        self.chunk_size = chunk_size
        self.trust_multimodal_ids = trust_multimodal_ids
        self.adapters = adapters

    def assign(self, st: RequestState) -> None:
        request: Any = st.request
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            version = self.adapters.version(str(getattr(lora, "lora_path", "") or ""))
            st.key_tag = version.tag
            if not version.shared:
                st.shared_chunks = 0
                st.host_only = version.reason
        features = getattr(request, "mm_features", None)
        if features and not self.trust_multimodal_ids and not getattr(request, "cache_salt", None):
            # a client may have named the input (multi_modal_uuids): vLLM's hash then
            # holds its id, not its content. Chunks before the first placeholder do not
            # depend on it.
            first = min(f.mm_position.offset for f in features) // self.chunk_size
            if first < st.shared_chunks:
                st.shared_chunks = first
                st.host_only = "multimodal"
        if getattr(request, "prompt_is_token_ids", None) is not None:
            st.shared_chunks = 0
            st.host_only = "mixed_embeds"
