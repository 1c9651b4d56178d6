"""One object-tier op as the op queue holds it (:mod:`kvtier.objects.op_queue`)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence

from kvtier.ops import OpKind

__all__ = ["QueuedOp", "ReadQueue", "byte_view"]


class QueuedOp:
    """One queued op. ``lock`` + ``done`` make reporting happen exactly once."""

    __slots__ = ("op_id", "kind", "key", "buf", "dtype", "shape", "t0", "deadline", "lock",
                 "done", "seq", "started", "stall_at", "stuck", "run", "pos",
                 "queued", "taken")  # fmt: skip

    def __init__(
        self,
        seq: int,
        op_id: int,
        kind: OpKind,
        key: str,
        timeout_s: float,
        buf: memoryview | None = None,
        dtype: str = "",
        shape: Sequence[int] = (),
    ) -> None:
        self.seq = seq
        self.op_id = op_id
        self.kind = kind
        self.key = key
        self.buf = buf
        self.dtype = dtype
        self.shape = list(shape)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + timeout_s
        self.lock = threading.Lock()
        self.done = False
        #: its backend call has begun (a get: its bytes are being read into ``buf``, the
        #: caller's slot); set under ``lock``, only while not ``done``: from then on the
        #: op is reported only when the call is over
        self.started = False
        #: when a started op counts as stuck (a get: its deadline)
        self.stall_at = self.deadline
        #: counted as stuck (poll() saw it started and past ``stall_at``)
        self.stuck = False
        #: the run of gets (one prompt's consecutive chunks) this get is ``pos`` in
        self.run: list[QueuedOp] | None = None
        self.pos = 0
        #: put on the read queue already (never twice: a get read twice at once would
        #: write its slot twice)
        self.queued = False
        #: taken off the read queue (by an I/O thread, or the submitter reading inline):
        #: set as it leaves the queue, under the queue's lock (:class:`ReadQueue`)
        self.taken = False


class ReadQueue(queue.Queue["QueuedOp | None"]):
    """The read queue: an op is marked ``taken`` in the same step that removes it, so
    whoever sees it not taken knows it is still queued (no thread holds it unstarted)."""

    def _get(self) -> QueuedOp | None:
        op: QueuedOp | None = super()._get()
        if op is not None:
            op.taken = True
        return op


def byte_view(buf: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
