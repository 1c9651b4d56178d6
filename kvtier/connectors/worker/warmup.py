"""A starting engine's warm-up (``warmup: true``): the hottest chunks of its generation are
read from the object tier into its host tier before it serves.

The worker side does the reading, the scheduler side decides when the chunks may be hits:

- **Each worker**, in ``register_kv_caches`` (vLLM's engine start, before it reports
  ready: blocking there holds vLLM's health check, so a readiness probe holds traffic),
  right after its host slab is allocated and committed: reads its generation's manifest
  and the hot list in it (:func:`kvtier.objects.manifest.read_manifest`; every engine
  sharing the generation adds to it, :mod:`kvtier.hotset`), plans with
  :func:`kvtier.hotset.plan_warmup` within :meth:`KVTierConfig.warmup_budget` and reads
  the planned chunks, hottest first, into slots 0, 1, 2, ... of its slab through its
  RemoteIO (verified as any fetch: checksum, signature, decryption, decompression), a few
  reads per I/O thread in flight, for at most ``warmup_timeout_s``
  (:func:`warm_host_tier`). What landed goes to the scheduler in vLLM's connector
  handshake (``WorkerKeys.warm``, a :class:`~kvtier.connectors.metadata.WarmReport`). The
  progress is logged every :data:`LOG_EVERY_S`. A tier that is down, a manifest that
  cannot be read, any error: one warning, and the engine starts cold. With ``cpu_bytes:
  auto`` the slab comes with the first step (its size is the scheduler's): no warm-up,
  said once.
- **The scheduler** (:class:`kvtier.connectors.scheduler.warm_chunks.WarmChunks`) keeps
  the slots of the chunks every worker read out of use (:meth:`ChunkIndex.reserve`), and
  makes them host hits (:meth:`ChunkIndex.adopt`) only once the engine trusts their
  generation. **The canary rule:** warmed chunks are the object tier's bytes, so until the
  engine's own computed chunks matched the stored ones (``canary_check_tokens``,
  :mod:`kvtier.canary`) they are held, unloadable, like any object-tier chunk of an
  unchecked generation; once the checks pass they become host hits; a mismatch (the engine
  forks), a generation re-claimed as empty (its chunks were never checked), a weight
  change or a reset drop them and free their slots. With ``canary_first_hit: false`` they
  are hits at once. Only chunks every worker read into the same slot are taken; a read
  still running at the timeout keeps its slot out of use for the engine's life (logged; at
  most a few per I/O thread).

Metrics: ``kvtier:warmup_bytes_total``, ``kvtier:warmup_seconds`` and the loads of warmed
chunks, ``kvtier:warmup_hit_tokens_total`` (a part of ``hit_tokens{tier="host"}``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtier.config import KVTierConfig, format_size
from kvtier.hotset import plan_warmup
from kvtier.objects import manifest
from kvtier.ops import OpResult

from ..metadata import WarmReport

if TYPE_CHECKING:
    from kvtier.host.layout import HostSlab
    from kvtier.objects.remote import RemoteIO

logger = logging.getLogger("kvtier.warmup")

#: how often a running warm-up logs its progress (seconds)
LOG_EVERY_S = 5.0
#: reads in flight per read thread (more only wait in the queue, where their deadline runs)
IN_FLIGHT_PER_THREAD = 2
#: the longest wait for a report between polls (a report wakes it at once)
POLL_S = 0.02
#: vLLM's own wait for its engine to start (model load and warm-up together), its default
READY_TIMEOUT_S = 600.0
#: after the timeout, how long the queue may take to report the reads it had not begun
#: (they time out there and write nothing); what is still unreported is held for good
SETTLE_S = 1.0


def warm_host_tier(
    remote: RemoteIO,
    generation: str,
    object_key: Callable[[bytes], str],
    slab: HostSlab,
    cfg: KVTierConfig,
    *,
    rank: int = 0,
    clock: Callable[[], float] = time.monotonic,
) -> WarmReport:
    """Read the hottest chunks of ``generation`` into ``slab`` (slot ``i`` the ``i``-th
    planned), within ``cfg``'s budget and timeout. Never raises: a failure is a warning
    and a cold start (what landed before it is kept)."""
    t0 = clock()
    ready_s = _ready_timeout_s()
    if rank == 0 and cfg.warmup_timeout_s >= ready_s / 2:
        logger.warning(
            "kvtier: warmup_timeout_s %.0f s is at least half of vLLM's wait for its "
            "engine to start (VLLM_ENGINE_READY_TIMEOUT_S %.0f s), which the model's "
            "load and the warm-up share: raise it",
            cfg.warmup_timeout_s,
            ready_s,
        )
    try:
        return _warm(remote, generation, object_key, slab, cfg, rank, clock, t0)
    except Exception as exc:  # noqa: BLE001  a cache never fails the engine
        logger.warning(
            "kvtier worker rank %d: warm-up failed (%s: %s): the engine starts cold",
            rank,
            type(exc).__name__,
            exc,
        )
        return WarmReport(seconds=clock() - t0, host_bytes=slab.nbytes)


def _warm(
    remote: RemoteIO,
    generation: str,
    object_key: Callable[[bytes], str],
    slab: HostSlab,
    cfg: KVTierConfig,
    rank: int,
    clock: Callable[[], float],
    t0: float,
) -> WarmReport:
    deadline = t0 + cfg.warmup_timeout_s
    try:
        found = manifest.read_manifest(remote.tier, generation, remote.signer)
    except Exception as exc:  # noqa: BLE001  a tier down, a bad manifest: start cold
        logger.warning(
            "kvtier worker rank %d: warm-up could not read generation %s's hot "
            "list (%s): the engine starts cold",
            rank,
            generation,
            exc,
        )
        return WarmReport(seconds=clock() - t0, host_bytes=slab.nbytes)
    hot = found.hot if found is not None else None
    slot_bytes = slab.layout.slot_bytes
    keys = (
        plan_warmup(
            hot,
            chunk_bytes=slot_bytes,
            host_bytes=slab.nbytes,
            warmup_bytes=cfg.warmup_budget(slab.nbytes),
        )
        if hot
        else []
    )
    if not keys:
        logger.info(
            "kvtier worker rank %d: warm-up: generation %s has no hot list yet "
            "(%s): nothing to read",
            rank,
            generation,
            "no manifest" if found is None else "no hot chunk",
        )
        return WarmReport(seconds=clock() - t0, host_bytes=slab.nbytes)
    logger.info(
        "kvtier worker rank %d: warm-up: reading the %d hottest chunks of generation "
        "%s (%s of a budget of %s) within %.0f s",
        rank,
        len(keys),
        generation,
        format_size(len(keys) * slot_bytes),
        format_size(cfg.warmup_budget(slab.nbytes)),
        cfg.warmup_timeout_s,
    )
    # op ids below 0: never the scheduler's (a late result is dropped by the worker)
    dtype, shape = slab.layout.describe()
    window = max(1, IN_FLIGHT_PER_THREAD * remote.read_threads)
    ok_slots: set[int] = set()
    pending: set[int] = set()
    nbytes = misses = errors = 0
    nxt = 0
    said = t0
    timed_out = stopped = False
    while nxt < len(keys) or pending:
        now = clock()
        if now >= deadline:
            timed_out = True
            break
        if remote.reads_down:
            logger.warning(
                "kvtier worker rank %d: warm-up: the object tier's reads fail (down): stopped", rank
            )
            stopped = True
            break
        while nxt < len(keys) and len(pending) < window:
            remote.submit_get_into(
                -(nxt + 1),
                object_key(keys[nxt]),
                slab.slot_memoryview(nxt),
                dtype=dtype,
                shape=shape,
            )
            pending.add(nxt)
            nxt += 1
        results = remote.poll()
        for res in results:
            slot = -res.op_id - 1
            if slot not in pending:
                continue
            pending.discard(slot)
            if res.ok:
                ok_slots.add(slot)
                nbytes += res.nbytes
            elif res.error_kind:
                errors += 1
            else:
                misses += 1
        if now - said >= LOG_EVERY_S:
            said = now
            _progress(rank, len(ok_slots), len(keys), nbytes, now - t0)
        if not results:  # woken by the next report (timeouts are found by the poll)
            remote.wait_for_fetch(POLL_S)
    if pending:  # reads not begun time out in the queue; one begun may still write
        settle = clock() + min(SETTLE_S, remote.timeout_s)
        while pending and clock() < settle:
            for res in remote.poll():
                slot = -res.op_id - 1
                if slot in pending:
                    pending.discard(slot)
                    if res.ok:  # landed and verified after all
                        ok_slots.add(slot)
                        nbytes += res.nbytes
            time.sleep(0.002)
    landed = [(keys[s], s) for s in sorted(ok_slots)]
    seconds = clock() - t0
    outcome = "timeout" if timed_out else "stopped" if stopped else "done"
    logger.info(
        "kvtier worker rank %d: warm-up %s: %d of %d chunks, %s in %.1f s (%.0f MB/s); "
        "%d not in the tier, %d failed%s",
        rank,
        "timed out" if timed_out else outcome,
        len(landed),
        len(keys),
        format_size(nbytes),
        seconds,
        nbytes / 1e6 / seconds if seconds > 0 else 0.0,
        misses,
        errors,
        f", {len(pending)} reads still running (their slots stay out of use)" if pending else "",
    )
    return WarmReport(
        chunks=tuple(landed),
        busy=tuple(sorted(pending)),
        nbytes=nbytes,
        seconds=seconds,
        planned=len(keys),
        host_bytes=slab.nbytes,
        outcome=outcome,
    )


def _ready_timeout_s() -> float:
    try:
        return float(os.environ.get("VLLM_ENGINE_READY_TIMEOUT_S", READY_TIMEOUT_S))
    except ValueError:
        return READY_TIMEOUT_S


def _progress(rank: int, done: int, total: int, nbytes: int, seconds: float) -> None:
    logger.info(
        "kvtier worker rank %d: warm-up: %d of %d chunks (%.0f%%), %s, %.1f s",
        rank,
        done,
        total,
        100.0 * done / total,
        format_size(nbytes),
        seconds,
    )


def is_warmup_result(res: OpResult) -> bool:
    """A result of a warm-up read (a late one, after the warm-up ended): not the
    scheduler's."""
    return res.op_id < 0
