"""Whether vLLM gives kvtier's queued object-tier writes time to flush when it is stopped.

kvtier flushes queued writes in the worker's ``shutdown`` (up to ``shutdown_flush_s``).
vLLM only calls it if it lets the engine wind down: with its default
``--shutdown-timeout 0`` the API server kills the engine on SIGTERM at once, and the
executor gives worker processes ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (5 s) before
it kills them. A rolling restart then loses the chunks of the last requests before it,
exactly the ones the next replica would hit. Startup says so, with the flags to set.

Within that flush the engine hands off first (:func:`hand_off`): the hot chunks its host
tier holds that the object tier lacks (``write_back``: not uploaded yet), hottest first,
as the scheduler last listed them (:mod:`kvtier.connectors.scheduler.hot`), so a replica
that leaves takes none of the fleet's working set with it. They go ahead of the uploads
queued before the stop (``first``: :class:`kvtier.objects.io_queue.WriteQueue`), which are
flushed after, in what is left of ``shutdown_flush_s``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.config import VLLM_WORKER_SHUTDOWN_ENV, KVTierConfig
from kvtier.ops import Put

from ..engine_shape import EngineShape

if TYPE_CHECKING:
    from kvtier.objects.remote import RemoteIO

#: vLLM's default for ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``
VLLM_WORKER_SHUTDOWN_DEFAULT_S = 5.0


def shutdown_window_warning(
    cfg: KVTierConfig, shape: EngineShape, environ: Mapping[str, str]
) -> str | None:
    """What vLLM's stop would cut short of kvtier's flush, and what to set; None when
    nothing is written to an object tier or vLLM allows for it."""
    need = cfg.vllm_shutdown_timeout_s()
    if need is None:
        return None
    short: list[str] = []
    engine = shape.shutdown_timeout_s  # vLLM >= 0.32
    if engine is not None and engine < need:
        short.append(f"--shutdown-timeout is {engine} (0 kills the engine at once)")
    if shape.executor_backend == "mp":  # the workers are processes of their own
        try:
            window = float(environ.get(VLLM_WORKER_SHUTDOWN_ENV, VLLM_WORKER_SHUTDOWN_DEFAULT_S))
        except ValueError:
            window = VLLM_WORKER_SHUTDOWN_DEFAULT_S
        if window < need:
            short.append(f"{VLLM_WORKER_SHUTDOWN_ENV} is {window:g}")
    if not short:
        return None
    return (
        f"vLLM's {' and '.join(short)}: when vLLM is stopped, object-tier writes still "
        f"queued (the last requests' chunks) are lost, not flushed (shutdown_flush_s="
        f"{cfg.shutdown_flush_s:g}). Start vLLM with --shutdown-timeout {need} and "
        f"{VLLM_WORKER_SHUTDOWN_ENV}={need}, and give it at least that long to stop (Kubernetes: "
        f"terminationGracePeriodSeconds); the Helm chart and `kvtier size --emit` set both"
    )


@dataclass(frozen=True, slots=True)
class HandoffReport:
    """What became of the chunks :func:`hand_off` was given: written, or left (not
    written within the time, refused at submit or failed)."""

    chunks: int
    written: int
    failed: int
    seconds: float

    @property
    def left(self) -> int:
        return self.chunks - self.written

    def describe(self) -> str:
        return (
            f"handed off {self.written} of {self.chunks} hot chunks the object tier "
            f"lacked, hottest first, in {self.seconds:.1f} s; {self.left} left "
            f"({self.failed} failed, {self.left - self.failed} not written in time)"
        )


def hand_off(
    remote: RemoteIO,
    puts: Sequence[Put],
    deadline: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    wait: Callable[[float], None] = time.sleep,
    window: int = 0,
) -> HandoffReport:
    """Write ``puts`` (hottest first) through ``remote``, ahead of the uploads queued
    already, until each is reported or ``deadline`` (``clock()``) passes. At most
    ``window`` (default: twice the write threads) are queued at once, so the hottest go
    first; one a full queue refuses is offered again once a write is done. Results of
    other ops polled meanwhile are dropped (the engine is stopping: the flush counts
    those)."""
    began = clock()
    window = window or 2 * max(1, remote.write_threads)
    ids = {p.op_id for p in puts}
    written = failed = 0
    reported: set[int] = set()
    i = 0
    while len(reported) < len(puts):
        while i < len(puts) and i - len(reported) < window:  # queued, not yet reported
            put = puts[i]
            if not remote.submit_put(
                put.op_id, put.key, put.payload, dtype=put.dtype, shape=put.shape, first=True
            ):
                break  # the queue is full: offered again once a write is done
            i += 1
        for res in remote.poll():
            if res.op_id in ids and res.op_id not in reported:
                reported.add(res.op_id)
                written += res.ok
                failed += not res.ok
        left = deadline - clock()
        if len(reported) >= len(puts) or left <= 0:
            break
        wait(min(0.005, left))
    return HandoffReport(len(puts), written, failed, clock() - began)
