"""One-step lookups: on a local directory tier the scheduler asks the directory itself.

A lookup is otherwise a read (:mod:`.lookup`): the scheduler answers "ask again", the
workers read the chunks in that step, and the next step loads them. That step is
an engine step of its own, a few milliseconds of a restart hit that vLLM's
ExampleConnector, which reads its files inside the step that computes, never pays.

Where the object tier is a directory on a local filesystem (``FileTier.reads_local``),
the scheduler can find the stored prefix as fast as it finds a host hit: a ``stat``
per chunk and worker, microseconds each. It then answers at once, and each worker
reads and checks the chunks in the step that loads them, before the load copies
one (``LoadOp.fetch_op``). A chunk that is gone by then or fails its check is never
copied: its blocks go to vLLM as load errors, and vLLM recomputes from the first one.
That is only a miss where vLLM may recompute (``kv_load_failure_policy: recompute``);
under vLLM's default, ``fail``, a load error fails the request, so lookups stay
reads there. Nor for a model with several KV cache groups (vLLM cannot map a block
error back to a request there), nor for a model with sliding-window attention (vLLM
recomputes a failed load from its first block, but it has given up the window's blocks
before it: the recomputed KV would attend to its null block), nor on any other tier
(a ``stat`` over the network would hold the scheduler for the network's time), nor
with ``inline_read_ms: 0`` (the worker's own thread reads a one-step lookup's chunks,
as it reads a lookup's first ones).

The scheduler learns each worker's object keys from vLLM's connector handshake
(:class:`~kvtier.connectors.metadata.WorkerKeys`, sent once the workers registered their
KV caches) and follows weight changes the way the workers do
(:meth:`LocalProbe.after_weight_change`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtier.config import KVTierConfig
from kvtier.errors import TierError
from kvtier.keys import KeySpace
from kvtier.objects.tiers.base import ObjectTier

from ..metadata import WorkerKeys

logger = logging.getLogger("kvtier.scheduler")


def one_step_refusal(
    cfg: KVTierConfig,
    *,
    recompute: bool,
    groups: int,
    reads_local: bool,
    sliding_window: bool = False,
) -> str | None:
    """Why lookups cannot be answered in their own step here (None: they can)."""
    if not (cfg.remote and cfg.remote.is_local):
        return "the object tier is not a directory"
    if not reads_local:
        return "the directory is not on a local filesystem"
    if not cfg.inline_read_ms:
        # the step that loads them reads the chunks on the engine's thread: an operator
        # who keeps every read on the I/O threads (a local disk that may hang) opts out
        return "inline_read_ms is 0 (no object-tier read on the engine's thread)"
    if groups > 1:
        return "the model has several KV cache groups"
    if sliding_window:
        # a failed load is recomputed from the failed block, with the window before it
        # already given up by vLLM (groups.has_sliding_window)
        return "the model has sliding-window attention (vLLM cannot recompute a failed load)"
    if not recompute:
        return "vLLM fails a request whose KV fails to load (kv_load_failure_policy: fail)"
    return None


class LocalProbe:
    """Finds how much of a prompt every worker has stored, from the scheduler."""

    def __init__(self, tier: ObjectTier, workers: Sequence[WorkerKeys]) -> None:
        self.tier = tier
        self._follow(list(workers))

    def _follow(self, workers: list[WorkerKeys]) -> None:
        self.workers = workers
        #: each worker's key space, once (with replicated KV every rank reads rank 0's);
        #: made here, not per lookup (a digest per worker)
        self.spaces: list[KeySpace] = list(dict.fromkeys(w.space for w in workers))

    def after_weight_change(self, salt: bytes) -> None:
        """The weights changed (``salt``: the scheduler's, sent to the workers with the
        step's metadata): the keys every worker makes from the next step on."""
        self._follow(
            [
                WorkerKeys(
                    w.namespace.after_weight_change(salt), w.rank, w.stage, w.weights_epoch + 1
                )
                for w in self.workers
            ]
        )

    def stored_run(self, block_hashes: Sequence[bytes]) -> int:
        """How many of a prompt's chunks (``block_hashes``, in order) every worker has
        stored, from the first: each worker's keys stop at its first gap."""
        n = len(block_hashes)
        for space in self.spaces:
            if n == 0:
                break
            try:
                found = self.tier.exists([space.key(h) for h in block_hashes[:n]])
            except TierError as exc:
                logger.debug("kvtier: one-step lookup: %s", exc)
                return 0
            n = found.index(False) if False in found else n
        return n
