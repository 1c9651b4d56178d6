"""The scheduler side's hot chunks: hits counted per key, sent to the workers now and then.

The scheduler counts a hit per chunk it plans a load of (a host hit, or a chunk the
object tier brought in: :meth:`~.plans.Planner.plan_loads`), one dict update each
(:class:`kvtier.hotset.HitCounter`). Every :data:`kvtier.hotset.SEND_S` the step's
metadata carries what was counted since (``KVTierMetadata.heat``: rank 0's manifest writer
adds it to the generation's hot list) and the hand-off list (``KVTierMetadata.handoff``:
the hottest chunks the host tier holds that the object tier lacks, each with its slot,
hottest first), which each worker writes first when the engine drains
(:func:`~.shutdown.hand_off`). The hand-off list is brought up to date more often, every
:data:`HANDOFF_S` of steps (sent when it changed), with the hits not yet folded into the
heat first: a drain writes what the last list named, and an engine that went idle or
served for under :data:`~kvtier.hotset.SEND_S` had named nothing of its last hits.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvtier.host.index import ChunkIndex, Entry, State
from kvtier.hotset import LIMIT, SEND_S, HitCounter, HotList

#: a hand-off list: (chunk key, host slot), hottest first
Handoff = tuple[tuple[bytes, int], ...]
#: seconds between updates of the hand-off list (a walk of at most 2 x LIMIT keys)
HANDOFF_S = 1.0


class HotChunks:
    """Hits per chunk key, and what the workers are told of them every ``send_s``."""

    def __init__(
        self,
        index: ChunkIndex,
        needs_upload: Callable[[Entry], bool],
        *,
        limit: int = LIMIT,
        send_s: float = SEND_S,
        handoff_s: float = HANDOFF_S,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.index = index
        #: whether the object tier lacks a chunk and may have it (write_back's ``needed``:
        #: not uploaded, shareable, the generation trusted)
        self.needs_upload = needs_upload
        self.counter = HitCounter(limit)
        #: one hit of a chunk key (the planner calls it per chunk loaded)
        self.hit = self.counter.hit
        self.send_s = send_s
        self.handoff_s = handoff_s
        self.clock = clock
        self.wall = wall
        self._sent_at: float | None = None  # the first report's time, then the last send's
        self._listed_at = 0.0  # when the hand-off list was last brought up to date
        self._sent: Handoff = ()

    def report(self) -> tuple[HotList | None, Handoff | None]:
        """What this step's metadata carries: the hits since the last report (None: none,
        or not time yet) and the hand-off list (None: not time yet, or unchanged)."""
        now = self.clock()
        if self._sent_at is None:
            self._sent_at = self._listed_at = now
        heat = None
        if now - self._sent_at >= self.send_s:
            self._sent_at = now
            heat = self.counter.take(self.wall())
        elif now - self._listed_at < self.handoff_s:
            return None, None
        self._listed_at = now
        handoff = self.handoff()
        if handoff == self._sent:
            return heat, None
        self._sent = handoff
        return heat, handoff

    def handoff(self) -> Handoff:
        """The chunks hit since the heat was last taken (most hit first), then those of
        this engine's hot list, that the host tier holds ready and the object tier lacks
        (no upload in flight either)."""
        out: list[tuple[bytes, int]] = []
        listed: set[bytes] = set()
        for key in (*self.counter.recent(), *(k for k, _ in self.counter.own.entries)):
            if key in listed:
                continue
            listed.add(key)
            entry = self.index.get(key)
            if (
                entry is not None
                and entry.state is State.READY
                and not entry.uploading
                and self.needs_upload(entry)
            ):
                out.append((key, entry.slot))
        return tuple(out)
