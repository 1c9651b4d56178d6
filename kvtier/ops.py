"""The transfer contract: the ops the scheduler side plans and the one result type
every mover (host copies, object-tier I/O) answers with.

Four kinds of op move a chunk's bytes, each its own type, each carrying its
kind:

- :class:`LoadOp` host slot -> paged KV (the copier),
- :class:`StoreOp` paged KV -> host slot (the copier),
- :class:`FetchOp` object tier -> host slot (:class:`kvtier.objects.remote.RemoteIO`),
- :class:`UploadOp` host slot -> object tier (:class:`kvtier.objects.remote.RemoteIO`).

Every op the worker accepts yields exactly one :class:`OpResult`. Plain
dataclasses of ints and bytes: vLLM pickles the ops from the scheduler process to
the workers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar


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
