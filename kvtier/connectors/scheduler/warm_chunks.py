"""The scheduler's part of a warm start (``warmup: true``): the chunks the workers' warm-up
read into their slabs (:mod:`kvtier.connectors.worker.warmup`, reported in vLLM's
handshake as :class:`~kvtier.connectors.metadata.WarmReport`) are held out of use until
the engine trusts their generation, then adopted as host hits; see the warm-up's module
docstring for the rules (the canary rule first).
"""

from __future__ import annotations

import logging

from kvtier import metrics
from kvtier.config import format_size
from kvtier.host.index import ChunkIndex
from kvtier.stats import StatsRecorder

from ..metadata import WarmReport

logger = logging.getLogger("kvtier.warmup")


class WarmChunks:
    """The scheduler side: the chunks the workers' warm-up read, held out of use until the
    engine trusts their generation, then host hits (see the warm-up's module docstring)."""

    def __init__(
        self, index: ChunkIndex, stats: StatsRecorder, *, world_size: int, host_bytes: int
    ) -> None:
        self.index = index
        self.stats = stats
        self.world_size = world_size
        self.host_bytes = host_bytes
        #: held chunks: key -> slot (reserved in the index, not hits)
        self.held: dict[bytes, int] = {}
        #: chunks made hits so far
        self.adopted = 0

    def take(self, reports: list[WarmReport]) -> None:
        """The workers' reports (vLLM's handshake): hold the chunks every worker read into
        the same slot, keep the slots of reads still running out of use for good."""
        if not reports:
            return
        busy = {s for r in reports for s in r.busy}
        if busy:
            self.index.reserve(sorted(busy))  # never released: a read may still write
        nbytes = sum(r.nbytes for r in reports)
        self.stats.inc(metrics.WARMUP_BYTES, nbytes)
        self.stats.set(metrics.WARMUP_SECONDS, max(r.seconds for r in reports))
        if len(reports) != self.world_size or any(r.host_bytes != self.host_bytes for r in reports):
            logger.warning(
                "kvtier: warm-up: %d of %d workers reported, host tier of %s: "
                "their chunks are not used",
                len(reports),
                self.world_size,
                format_size(self.host_bytes),
            )
            return
        common = set(reports[0].chunks)
        for r in reports[1:]:
            common &= set(r.chunks)
        wanted = [
            (k, s)
            for k, s in reports[0].chunks
            if (k, s) in common and s not in busy and s < self.index.num_slots
        ]
        slots = set(self.index.reserve(s for _k, s in wanted))
        self.held = {k: s for k, s in wanted if s in slots}
        if self.held:
            logger.info(
                "kvtier: warm-up brought %d chunks (%s) into the host tier",
                len(self.held),
                format_size(nbytes),
            )

    def adopt(self) -> int:
        """The engine trusts the generation: the held chunks are host hits now (those the
        engine stored meanwhile keep their own copy: the warm one's slot is freed)."""
        held, self.held = self.held, {}
        n = 0
        for key, slot in held.items():
            if self.index.adopt(key, slot) is None:
                self.index.release(slot)
            else:
                n += 1
        self.adopted += n
        if held:
            logger.info("kvtier: %d warmed chunks are host hits now (the generation is trusted)", n)
        return n

    def drop(self, why: str) -> int:
        """The held chunks are never hits (``why``): their slots are free again."""
        held, self.held = self.held, {}
        for slot in held.values():
            self.index.release(slot)
        if held:
            logger.warning("kvtier: %d warmed chunks dropped unused: %s", len(held), why)
        return len(held)
