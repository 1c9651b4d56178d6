"""The transfer contract: the ops the scheduler side plans, the one result type
every mover (host copies, object-tier I/O) answers with, and the one interface the
worker drives every mover through (:class:`Mover`).

Four kinds of op move a chunk's bytes, each its own type, each carrying its
kind:

- :class:`LoadOp` host slot -> paged KV (the copier),
- :class:`StoreOp` paged KV -> host slot (the copier),
- :class:`FetchOp` object tier -> host slot (:class:`kvtier.objects.remote.RemoteIO`),
- :class:`UploadOp` host slot -> object tier (:class:`kvtier.objects.remote.RemoteIO`).

Every op the worker accepts yields exactly one :class:`OpResult`. Plain
dataclasses of ints and bytes: vLLM pickles the ops from the scheduler process to
the workers. The worker turns a fetch or an upload into what RemoteIO moves
(:class:`GetRun`, :class:`Put`: object keys and host memory, never pickled).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import ClassVar, Protocol, TypeVar


class OpKind(StrEnum):
    LOAD = "load"
    STORE = "store"
    FETCH = "fetch"
    UPLOAD = "upload"


@dataclass(slots=True)
class LoadOp:
    """Host slot -> paged KV: slot blocks ``first .. first+len(gpu_blocks)`` into ``gpu_blocks``."""

    kind: ClassVar[OpKind] = OpKind.LOAD
    op_id: int
    slot: int
    first: int
    gpu_blocks: list[int]
    #: a hybrid model's further KV cache groups (1, 2, ...), each ``(first, gpu_blocks)``
    #: into that group's region of the slot; ``first``/``gpu_blocks`` are group 0's (an
    #: empty list: nothing of that group to copy). Empty for one group.
    more: tuple[tuple[int, list[int]], ...] = ()
    #: a one-step lookup's chunk: the fetch (same step) that reads the slot first; the
    #: load copies it only once that fetch succeeded, else its blocks are load errors.
    #: 0: the slot already holds the chunk
    fetch_op: int = 0

    def without_lead(self, k: int) -> LoadOp:
        """This load less its first ``k`` blocks (vLLM's null blocks before a sliding
        window, which nothing reads). Every other field is kept as it is, the fetch the
        copy waits for (``fetch_op``) first of all: a trimmed load is checked as the whole
        one would have been. One group only (a hybrid load's groups are planned apart)."""
        if self.more:
            raise ValueError("a hybrid model's load is planned per group, never trimmed")
        if not 0 <= k <= len(self.gpu_blocks):
            raise ValueError(f"cannot trim {k} of {len(self.gpu_blocks)} blocks")
        return replace(self, first=self.first + k, gpu_blocks=self.gpu_blocks[k:])

    def all_gpu_blocks(self) -> list[int]:
        """Every paged block this load writes, all groups together."""
        return [*self.gpu_blocks, *(b for _, blocks in self.more for b in blocks)]


@dataclass(slots=True)
class StoreOp:
    """Paged KV -> host slot (a whole chunk: slot blocks ``0 .. len(gpu_blocks)-1``);
    with ``upload_op_id``, uploaded to the object tier once it is in the slot."""

    kind: ClassVar[OpKind] = OpKind.STORE
    op_id: int
    slot: int
    gpu_blocks: list[int]
    block_hash: bytes = b""
    upload_op_id: int | None = None
    #: a hybrid model's further KV cache groups (1, 2, ...): the blocks stored into each
    #: group's region of the slot (``gpu_blocks`` are group 0's). Empty for one group.
    more: tuple[list[int], ...] = ()
    #: the same request's loads in this step: the chunk was computed attending to what they
    #: loaded, so it is stored only if every one of them succeeded (a failed load leaves
    #: blocks vLLM recomputes; KV computed over them is wrong)
    after_loads: tuple[int, ...] = ()


@dataclass(slots=True)
class FetchOp:
    """Object tier -> host slot: the chunk whose last vLLM block hash is ``block_hash``."""

    kind: ClassVar[OpKind] = OpKind.FETCH
    op_id: int
    slot: int
    block_hash: bytes


@dataclass(slots=True)
class UploadOp:
    """Host slot -> object tier, under this worker's key for ``block_hash``."""

    kind: ClassVar[OpKind] = OpKind.UPLOAD
    op_id: int
    slot: int
    block_hash: bytes


@dataclass(slots=True)
class CheckOp:
    """A canary (:mod:`kvtier.canary`): read the object of ``block_hash`` into scratch memory
    and compare it with ``slot``, which holds the KV vLLM computed for it (stored in the
    same step by ``store_op_id``; the check is skipped, as an error, if that store failed).
    Not a mover's op: the worker reads through RemoteIO and compares itself. ``first``:
    the first chunk checked of its request, the one whose absence counts toward
    :data:`kvtier.canary.RECLAIM_AFTER` (its other chunks are absent with it)."""

    op_id: int
    slot: int
    block_hash: bytes
    store_op_id: int = 0
    first: bool = True


CopyOp = LoadOp | StoreOp


def group_parts(op: CopyOp) -> list[tuple[int, list[int]]]:
    """``(first slot block, gpu blocks)`` of each KV cache group an op copies, in group
    order (one entry for a model of one group)."""
    if isinstance(op, LoadOp):
        return [(op.first, op.gpu_blocks), *op.more]
    return [(0, op.gpu_blocks), *((0, blocks) for blocks in op.more)]


def all_blocks(op: CopyOp) -> list[int]:
    """Every GPU block an op touches, all groups."""
    return [b for _, blocks in group_parts(op) for b in blocks]


@dataclass(frozen=True, slots=True)
class OpResult:
    """The outcome of one op.

    ``ok=False`` with ``error_kind=None`` is a plain miss (a fetch of a chunk the
    object tier does not hold); otherwise ``error_kind`` is a label of
    ``kvtier:errors`` (:mod:`kvtier.metrics`). ``seconds``: how long the op took
    (a copy: its share of the step's copy time); ``nbytes``: bytes moved over the
    network (object-tier ops only).
    """

    op_id: int
    kind: OpKind
    ok: bool
    seconds: float = 0.0
    nbytes: int = 0
    error_kind: str | None = None


def by_op(results: Iterable[OpResult]) -> dict[int, OpResult]:
    """Results keyed by op id (a later result for the same op wins)."""
    return {r.op_id: r for r in results}


#: the ``error_kind`` of an op a mover refused when it was submitted (a full write queue:
#: backpressure): never attempted, counted as a drop (``kvtier:writes_dropped``), not as
#: an error
DROPPED = "dropped"


@dataclass(frozen=True, slots=True)
class GetRun:
    """Object tier -> host memory: one lookup's chunks ``(op_id, object key, destination)``,
    in order (RemoteIO reads the first alone, the rest once it was found, none after a
    miss), each verified as ``dtype``/``shape`` and written into its destination."""

    gets: Sequence[tuple[int, str, memoryview]]
    dtype: str
    shape: Sequence[int]
    #: read the first chunks on the submitting thread until this ``time.monotonic()``
    #: (then the rest on the I/O threads); 0: all on the I/O threads
    inline_until: float = 0.0


@dataclass(frozen=True, slots=True)
class Put:
    """Host memory -> object tier: ``payload`` (a chunk of ``dtype``/``shape``) under ``key``."""

    op_id: int
    key: str
    payload: memoryview
    dtype: str
    shape: Sequence[int]


#: what RemoteIO moves
ObjectIO = GetRun | Put

OpT_contra = TypeVar("OpT_contra", contravariant=True)


class Mover(Protocol[OpT_contra]):
    """What the worker drives every mover through: the copiers (:data:`CopyOp`) and
    RemoteIO (:data:`ObjectIO`). Submit ops, collect their results, close.

    Every op submitted yields exactly one :class:`OpResult`: returned by ``submit`` when
    it is known at once (a synchronous copy, an op refused), else by a later ``poll``.
    A copier's ops belong to the step: its ``poll`` waits (host side) for those
    submitted, since a store must be in its slot before vLLM frees its blocks.
    RemoteIO's ``poll`` never waits (its reads are bounded by their deadlines).
    """

    def submit(self, ops: Sequence[OpT_contra]) -> list[OpResult]:
        """Start ``ops``; returns the results known now."""
        ...

    def poll(self) -> list[OpResult]:
        """The results of ops finished since the last call (and not returned by ``submit``)."""
        ...

    def close(self) -> None:
        """Stop: nothing submitted afterwards; what is left behind is the mover's to bound."""
        ...
