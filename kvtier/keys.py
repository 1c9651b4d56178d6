"""Chunk keys: the same prefix gives the same key in every process and replica.

A chunk covers ``chunk_size`` tokens. Its key is derived from vLLM's own block
hash of the chunk's *last* block — vLLM chains block hashes, so that one hash
already covers the whole prefix, the request's ``cache_salt``, LoRA and
multimodal inputs — mixed with a namespace digest of everything that makes KV
bytes incompatible: model identity (a fingerprint of the weights and config,
see :mod:`kvtier.fingerprint`), dtypes, kvtier's layout version, the TP size
and rank, the pipeline size and stage (stage 1 holds other layers than stage 0,
often with the same shapes), the worker's layers by name with each layer's KV dtype
and shape (:meth:`kvtier.host.layout.SlotLayout.identity`: two pipeline partitions, or two
lists of layers kept out of an fp8 KV cache, give other keys), and the operator's
``namespace``. Nothing here depends on ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

#: bump when the byte layout of a stored chunk changes
LAYOUT_VERSION = 3  # 2: chunk headers record the layer layout; 3: keys name each layer

#: the scheduler's index is shared by all workers; this stands in for rank and stage there
ANY_RANK = -1


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything besides the token prefix that decides whether KV bytes can be reused."""

    model: str
    revision: str | None
    dtype: str
    kv_cache_dtype: str
    block_size: int
    chunk_size: int
    tp_size: int
    namespace: str = ""
    layout_version: int = LAYOUT_VERSION
    pp_size: int = 1
    #: digest of the weights and everything that changes what they compute; "" = none
    fingerprint: str = ""
    #: every TP rank holds the same KV (MLA's one latent per token): the ranks share one
    #: object per chunk, rank 0's. Not in the digest: the model (in it) decides it.
    replicated_kv: bool = False
    #: digest of the layers this worker's KV holds: each layer's name, KV dtype and
    #: shape (:meth:`kvtier.host.layout.SlotLayout.identity`); "" until the worker registered
    #: its KV caches (the scheduler's namespace, which stands for all workers)
    layers: str = ""
    #: the model as the operator names it (vLLM's served model name), for the generation's
    #: manifest only: never in a digest (with an object tier ``model`` is "" and the
    #: fingerprint names the weights, wherever they were loaded from)
    label: str = ""
    #: for the manifest only, never in a digest: the generation this identity was derived
    #: from by a salt (:meth:`after_weight_change`: a weight change while the engine ran,
    #: or a canary mismatch's fork), and the fork id (the salt's first 8 bytes, hex)
    forked_from: str = ""
    fork_id: str = ""

    def digest(self, rank: int = ANY_RANK, stage: int = ANY_RANK) -> bytes:
        """16-byte digest of this namespace for one worker: its TP rank and pipeline stage
        (ANY_RANK for both in the scheduler's index, which stands for all workers)."""
        fields = [
            "kvtier",
            self.layout_version,
            self.model,
            self.revision or "",
            self.dtype,
            self.kv_cache_dtype,
            self.block_size,
            self.chunk_size,
            self.tp_size,
            rank,
            self.namespace,
            self.pp_size,
            stage,
            self.fingerprint,
            self.layers,
        ]
        return hashlib.blake2b(msgpack.packb(fields), digest_size=16).digest()

    def generation(self) -> str:
        """The generation this engine's chunks belong to (16 hex characters): the digest
        of the namespace without rank and stage, so every worker of one engine (and every
        replica of the same model and settings) shares it, and any change that makes old
        chunks useless (weights, dtypes, layout, ``namespace``) starts a new one. Every
        object key names it (:func:`generation_key`): ``kvtier store`` counts and deletes
        a generation by listing, and its manifest is claimed once (the canary's first
        writer). The worker's ``layers`` are in it too, as in every chunk key: engines
        whose keys never meet never share a claim (else one would check for good, every
        canary absent). TP ranks hold the same layers; pipeline stages do not, so with
        ``pp_size`` > 1 they are left out (the stages would split the generation) and the
        layout the manifest records (stage 0's) is compared instead
        (:func:`kvtier.objects.manifest.reclaim_generation`)."""
        fields = [
            "kvtier-generation",
            self.layout_version,
            self.model,
            self.revision or "",
            self.dtype,
            self.kv_cache_dtype,
            self.block_size,
            self.chunk_size,
            self.tp_size,
            self.namespace,
            self.pp_size,
            self.fingerprint,
        ]
        if self.layers and self.pp_size == 1:  # "": the scheduler's, until workers say
            fields.append(self.layers)
        return hashlib.blake2b(msgpack.packb(fields), digest_size=8).hexdigest()

    def after_weight_change(self, salt: bytes) -> Namespace:
        """This namespace once the weights changed while the engine ran (``salt``: drawn at
        the change, :func:`after_weight_change`). Every process that follows a change (each
        worker, and the scheduler's probe of their keys) derives the same new identity."""
        return dataclasses.replace(
            self,
            fingerprint=after_weight_change(self.fingerprint, salt),
            forked_from=self.generation(),
            fork_id=salt[:8].hex(),
        )


def chunk_key(ns_digest: bytes, block_hash: bytes) -> str:
    """Key of the chunk whose last block has ``block_hash`` (hex, 40 chars)."""
    return hashlib.blake2b(block_hash, key=ns_digest, digest_size=20).hexdigest()


#: what every object key of a generation starts with: ``gen-<16 hex>/``
GENERATION_PREFIX = "gen-"


def generation_key(generation: str, name: str) -> str:
    """The object key of ``name`` (a chunk key, or ``manifest``) in ``generation``."""
    return f"{GENERATION_PREFIX}{generation}/{name}"


@dataclass(frozen=True, slots=True)
class KeySpace:
    """The keys of a worker's objects in the shared tier, and the digest they carry.

    Object keys are the only keys kvtier makes. Each worker's carry its own TP rank
    and pipeline stage: a worker writes and reads only its own heads' and layers'
    bytes, and a rank only ever finds what the same rank of a compatible engine
    wrote. Nobody asks about another rank's object: a lookup is each worker reading
    its own keys, and the scheduler learns the outcome from the workers' reports
    (all must have found their part). The exception is KV every rank holds whole
    (``Namespace.replicated_kv``: MLA): all ranks of a stage use rank 0's keys, only
    rank 0 writes (:meth:`writes`), and every rank reads the one copy. The scheduler's
    host-tier index, which is one engine's, is keyed by vLLM's block hash itself
    (:class:`kvtier.connectors.scheduler.requests.ChunkKeys`).
    """

    digest: bytes
    #: :meth:`Namespace.generation`, the prefix of every key ("": bare chunk keys)
    generation: str = ""

    @classmethod
    def worker(cls, ns: Namespace, rank: int, stage: int) -> KeySpace:
        return cls(ns.digest(0 if ns.replicated_kv else rank, stage), ns.generation())

    @staticmethod
    def writes(ns: Namespace, rank: int) -> bool:
        """Whether this rank uploads its chunks (replicated KV: rank 0 alone)."""
        return rank == 0 or not ns.replicated_kv

    def key(self, block_hash: bytes) -> str:
        key = chunk_key(self.digest, block_hash)
        return generation_key(self.generation, key) if self.generation else key


def after_weight_change(fingerprint: str, salt: bytes) -> str:
    """The model identity of an engine whose weights changed while it ran (a reload, a
    weight transfer): ``salt`` is fresh randomness drawn at the change, so the chunks
    written afterwards share keys with no other engine's (and no earlier epoch's); no
    process can know whether its new weights equal anyone else's."""
    h = hashlib.blake2b(salt, digest_size=16, person=b"kvtier-epoch")
    h.update(fingerprint.encode())
    return h.hexdigest()


def chunk_block_hashes(
    block_hashes: Sequence[bytes], blocks_per_chunk: int, first_chunk: int = 0
) -> list[bytes]:
    """The last block hash of every full chunk covered by ``block_hashes``, from chunk
    ``first_chunk`` on (a request's keys grow as vLLM hashes its blocks: only the new
    ones are taken). One strided slice: this runs on every lookup."""
    end = len(block_hashes) // blocks_per_chunk * blocks_per_chunk
    return list(block_hashes[(first_chunk + 1) * blocks_per_chunk - 1 : end : blocks_per_chunk])


def token_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[bytes]:
    """Chained hashes of every full block of ``token_ids``, shaped like vLLM's.

    The planner (``kvtier size --trace``) keys chunks with this instead of importing
    vLLM: each block's hash covers its parent's hash, its tokens and, on the first block
    only, ``cache_salt`` — the same chain vLLM builds, so two prompts share a block hash
    exactly when vLLM's would be shared (same whole prefix, same salt). The values differ
    from vLLM's (which are seeded per process); only equality matters to a hit rate.
    Feed the result to :func:`chunk_block_hashes`, as the connector feeds vLLM's.
    """
    out: list[bytes] = []
    parent = b"kvtier-block-chain"
    salt = (cache_salt or "").encode()
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        extra = salt if i == 0 else b""
        payload = msgpack.packb([parent, list(block), extra])
        parent = hashlib.blake2b(payload, digest_size=16).digest()
        out.append(parent)
    return out
