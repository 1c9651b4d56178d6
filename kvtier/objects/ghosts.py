"""Ghost object tiers: what an object tier of another size would have served this engine.

Each :class:`ObjectGhost` holds chunk keys only (no bytes), least recently used first,
with the time each was last made young, fed by what the scheduler side sees of the
object tier: the uploads it plans (:meth:`ObjectGhostTiers.uploaded`) and the lookups it
starts (:meth:`ObjectGhostTiers.lookup`, which reads the run of chunks a ghost holds).

Bounded (``file_max_bytes`` on a directory tier) a ghost has that bound times its scale
and evicts by the real tier's policy (:class:`~kvtier.objects.tiers.file.DirectorySweep`):
a write that would take the tier past its bound first deletes the least recently used
objects down to ``low_water`` of the bound (the tier's sweep thread then finds it under
its bound and evicts nothing more). A read makes an object young only when it is older
than ``touch_after_s`` (the tier's ``_TOUCH_AFTER_S``); an upload of a chunk the tier holds
already writes nothing (:class:`~kvtier.objects.chunk_io.ChunkIO` asks first), so it
leaves it as old as it was; a new one is the youngest.

Unbounded (no ``file_max_bytes``; ``kvtier store gc --max-bytes`` runs outside the engine,
on a schedule it cannot see, so it is not modelled) the tier never evicts what this engine
sees: every scale of 1 or more is the tier itself, and scale 0.5 is a tier of half its
current size (half the bytes the scale-1 ghost holds, plain LRU).

The ghost is this engine's view: objects other engines write to a shared tier, and the
reads they make young, are invisible here, and so is what the tier held when the engine
started (the ghost starts empty). Where several engines share the tier the real tier
serves more than scale 1 counts (and sweeps sooner). Other approximations, each exact in
:mod:`tests.connectors.test_whatif_remote`'s single engine:

- an object is written when its upload is planned (a failed upload is not taken back;
  the real write, and the eviction it makes room with, follow on an I/O thread),
  sized ``chunk_bytes``: every worker's payload, without its header (about 130 bytes)
  and uncompressed (with ``compression`` the real objects are smaller: the ghost evicts
  early); the generation's manifest (a few hundred bytes, never evicted) is not counted;
- the workers write a step's chunks concurrently, so their mtimes, the real eviction
  order, may differ from the order the uploads were planned in; a ghost's read covers
  the chunks it holds, and the workers read a run concurrently too and may read past a
  missing chunk;
- a lookup the host tier could not give slots for all its chunks fetches less than the
  object tier holds: the ghost counts what the object tier would serve.

Where the scheduler counts (:meth:`~kvtier.connectors.lookup.RemoteLookups.count_whatif`)
a request's tokens from chunks the host tier holds because an earlier request fetched
them count as measured at every scale (``hit_tokens{tier="remote"}`` counts them too):
the ghost object tiers answer "with today's host tier, an object tier of that size".
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvtier import metrics
from kvtier.stats import StatsRecorder

#: the ghost tiers' sizes, as multiples of the real tier's bound (the ``scale`` label)
SCALES: tuple[str, ...] = metrics.WHATIF_SCALES


class ObjectGhost:
    """One what-if object tier: chunk keys in LRU order, ``capacity`` bytes (None: no
    bound; ``fraction_of``: a share of another ghost's current bytes)."""

    def __init__(
        self,
        chunk_bytes: int,
        capacity: int | None,
        *,
        low_water: float,
        touch_after_s: float,
        clock: Callable[[], float],
        fraction_of: tuple[float, ObjectGhost] | None = None,
    ) -> None:
        self.chunk_bytes = max(1, chunk_bytes)
        self.capacity = capacity
        self.low_water = low_water
        self.touch_after_s = touch_after_s
        self.clock = clock
        self.fraction_of = fraction_of
        #: key -> when it was last made young (clock), least recently used first
        self._lru: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def keys(self) -> list[bytes]:
        """The keys held, least recently used first (tests)."""
        return list(self._lru)

    @property
    def total_bytes(self) -> int:
        return len(self._lru) * self.chunk_bytes

    def put(self, key: bytes) -> None:
        """This engine uploads ``key``: a chunk the tier holds is not written again (and
        stays as old as it was); a new one is written, the youngest, after the oldest
        were evicted to ``low_water`` when it would take the tier past its bound."""
        if key in self._lru:
            return
        self._lru[key] = self.clock()
        if self.fraction_of is not None:
            share, of = self.fraction_of
            self._evict_to(int(share * of.total_bytes))
        elif self.capacity is not None and self.total_bytes > self.capacity:
            self._evict_to(int(self.capacity * self.low_water), keep=1)

    def read_run(self, keys: Sequence[bytes], start: int, stop: int) -> int:
        """End of the run of held chunks ``keys[start:stop]`` begins with; each one read
        is made young as the real tier's read makes it (only when old enough)."""
        now = self.clock()
        lru = self._lru
        i = start
        while i < stop:
            t = lru.get(keys[i])
            if t is None:
                break
            if now - t > self.touch_after_s:
                lru[keys[i]] = now
                lru.move_to_end(keys[i])
            i += 1
        return i

    def _evict_to(self, target: int, keep: int = 0) -> None:
        """The least recently used out until at most ``target`` bytes are held, but never
        the youngest ``keep`` (the write making room is not evicted for itself)."""
        lru = self._lru
        while len(lru) > keep and len(lru) * self.chunk_bytes > target:
            lru.popitem(last=False)


class ObjectGhostTiers:
    """The object ghosts of every scale in :data:`SCALES` and the
    ``kvtier:whatif_hit_tokens{tier="remote"}`` they would have served."""

    def __init__(
        self,
        chunk_bytes: int,
        max_bytes: int | None,
        stats: StatsRecorder | None = None,
        *,
        low_water: float = 0.9,
        touch_after_s: float = 60.0,
        clock: Callable[[], float] = time.time,
        scales: Sequence[str] = SCALES,
    ) -> None:
        self.stats = stats
        self.scales = tuple(scales)
        self.max_bytes = max_bytes

        def make(
            cap: int | None, fraction_of: tuple[float, ObjectGhost] | None = None
        ) -> ObjectGhost:
            return ObjectGhost(
                chunk_bytes, cap, low_water=low_water, touch_after_s=touch_after_s, clock=clock,
                fraction_of=fraction_of,
            )  # fmt: skip

        ghosts: list[ObjectGhost] = []
        #: the ghost each scale reads (an unbounded tier's scales >= 1 share one)
        self._ghost_of: list[int] = []
        if max_bytes is not None:
            ghosts = [make(max(1, round(max_bytes * float(s)))) for s in self.scales]
            self._ghost_of = list(range(len(self.scales)))
        else:
            ghosts = [make(None)]  # first: the shares are of what it holds after a write
            whole = ghosts[0]
            for s in self.scales:
                if float(s) >= 1.0:
                    self._ghost_of.append(0)
                else:
                    ghosts.append(make(None, (float(s), whole)))
                    self._ghost_of.append(len(ghosts) - 1)
        self.ghosts = tuple(ghosts)
        self._labels = tuple(("remote", s) for s in self.scales)

    def ghost(self, scale: str) -> ObjectGhost:
        return self.ghosts[self._ghost_of[self.scales.index(scale)]]

    def uploaded(self, keys: Iterable[bytes]) -> None:
        """Uploads planned this step (the object keys' block hashes)."""
        for key in keys:
            for g in self.ghosts:
                g.put(key)

    def lookup(self, keys: Sequence[bytes], start: int, stop: int) -> tuple[int, ...]:
        """A lookup from chunk ``start`` (up to ``stop``): for each scale, the end of the
        run of chunks that tier would have held (read, and so made young, once)."""
        ends = [g.read_run(keys, start, stop) for g in self.ghosts]
        return tuple(ends[i] for i in self._ghost_of)

    def count(self, tokens: Sequence[int]) -> None:
        """The tokens each scale would have served to one request."""
        if self.stats is None:
            return
        for labels, n in zip(self._labels, tokens, strict=True):
            if n:
                self.stats.inc(metrics.WHATIF_HIT_TOKENS, n, labels)
