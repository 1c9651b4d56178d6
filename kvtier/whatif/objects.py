"""Ghost object tiers: what an object tier of another size would have served this engine.

Each :class:`ObjectGhost` holds chunk keys only (no bytes; each as an 8-byte fingerprint),
least recently used first, with the time each was last made young, fed by what the
scheduler side sees of the object tier: the uploads it plans
(:meth:`ObjectGhostTiers.uploaded`) and the lookups it starts
(:meth:`ObjectGhostTiers.lookup`, which reads the run of chunks a ghost holds).

Bounded (``file_max_bytes`` on a directory tier) a ghost has that bound times its scale
and evicts by the real tier's policy (:class:`~kvtier.objects.tiers.file_sweep.DirectorySweep`):
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
:mod:`tests.connectors.scheduler.test_whatif_remote`'s single engine:

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

Where the scheduler counts (:meth:`~kvtier.connectors.scheduler.lookup.RemoteLookups.count_whatif`)
a request's tokens from chunks the host tier holds because an earlier request fetched
them count as measured at every scale (``hit_tokens{tier="remote"}`` counts them too):
the ghost object tiers answer "with today's host tier, an object tier of that size".
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvtier import metrics
from kvtier.stats import StatsRecorder
from kvtier.whatif.queue import GhostQueue, fingerprint

#: the ghost tiers' sizes, as multiples of the real tier's bound (the ``scale`` label)
SCALES: tuple[str, ...] = metrics.WHATIF_SCALES

_MAX_LOAD = 0.7  # of a ghost's table slots used, at most


def _slots_for(keys: int) -> int:
    """Table slots enough for ``keys`` keys."""
    return max(8, int(keys / _MAX_LOAD) + 1)


class ObjectGhost:
    """One what-if object tier: chunk keys in LRU order, ``capacity`` bytes (None: no
    bound; ``fraction_of``: a share of another ghost's current bytes).

    A key is kept as its 8-byte :func:`~kvtier.whatif.queue.fingerprint` (the key's bytes
    are not kept), in one open-addressing table (linear probing, backward-shift deletion)
    of flat arrays that is also the LRU list: per slot the fingerprint, when it was last
    made young and the slots of the keys used just before and after it, 24 bytes a slot,
    at most 70 % of the slots used. A bounded ghost's table grows (by half) up to the
    size its bound needs and no further: about 41 bytes a key held when it has just
    evicted to a ``low_water`` of 0.9; an unbounded one's 35 to 55 (measured with
    tracemalloc: tests/whatif/test_object_ghosts.py). Two keys sharing a fingerprint (one
    in 2**64 a pair) would share an entry: a what-if count off by a chunk."""

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
        #: the table's size once it holds the most keys the bound allows (None: no bound)
        self._full_slots: int | None = None
        if capacity is not None and fraction_of is None:
            self._full_slots = _slots_for(max(0, capacity) // self.chunk_bytes + 1)
        self._init(8 if self._full_slots is None else min(64, self._full_slots))

    def _init(self, size: int) -> None:
        self._size = size
        #: per slot: the key's fingerprint (0: an empty slot), when it was last made young
        #: (clock), and the slots of the keys used before and after it (-1: none)
        self._fps = array("q", bytes(8 * size))
        self._times = array("d", bytes(8 * size))
        self._prev = array("i", bytes(4 * size))
        self._next = array("i", bytes(4 * size))
        self._count = 0
        self._head = -1  # the least recently used key's slot
        self._tail = -1  # the most recently used key's slot

    def __len__(self) -> int:
        return self._count

    def __contains__(self, key: bytes) -> bool:
        return self._find(fingerprint(key)) >= 0

    def fingerprints(self) -> list[int]:
        """The keys held, as their :func:`~kvtier.whatif.queue.fingerprint`, least recently
        used first (tests)."""
        fps, nxt = self._fps, self._next
        out: list[int] = []
        i = self._head
        while i >= 0:
            out.append(fps[i])
            i = nxt[i]
        return out

    @property
    def total_bytes(self) -> int:
        return self._count * self.chunk_bytes

    def memory_bytes(self) -> int:
        """What the ghost keeps: its table (allocated)."""
        return self._size * 24

    def put(self, key: bytes, now: float | None = None) -> None:
        """This engine uploads ``key`` (at ``now``, else the clock's time): a chunk the
        tier holds is not written again (and stays as old as it was); a new one is
        written, the youngest, after the oldest were evicted to ``low_water`` when it
        would take the tier past its bound."""
        if now is None:
            now = self.clock()
        fp = fingerprint(key)
        fps, size = self._fps, self._size
        i = fp % size
        while True:  # (_find, keeping the empty slot it ends at)
            f = fps[i]
            if f == fp:
                return
            if not f:
                break
            i += 1
            if i == size:
                i = 0
        if self._count + 1 > size * _MAX_LOAD:
            self._add(fp, now)
        else:
            fps[i] = fp
            self._times[i] = now
            self._count += 1
            self._link_last(i)
        if self.fraction_of is not None:
            share, of = self.fraction_of
            self._evict_to(int(share * of.total_bytes))
        elif self.capacity is not None and self.total_bytes > self.capacity:
            self._evict_to(int(self.capacity * self.low_water), keep=1)

    def read_run(
        self, keys: Sequence[bytes], start: int, stop: int, now: float | None = None
    ) -> int:
        """End of the run of held chunks ``keys[start:stop]`` begins with; each one read
        (at ``now``, else the clock's time) is made young as the real tier's read makes
        it (only when old enough)."""
        if now is None:
            now = self.clock()
        times = self._times
        i = start
        while i < stop:
            slot = self._find(fingerprint(keys[i]))
            if slot < 0:
                break
            if now - times[slot] > self.touch_after_s:
                times[slot] = now
                if slot != self._tail:
                    self._unlink(slot)
                    self._link_last(slot)
            i += 1
        return i

    def _evict_to(self, target: int, keep: int = 0) -> None:
        """The least recently used out until at most ``target`` bytes are held, but never
        the youngest ``keep`` (the write making room is not evicted for itself)."""
        nxt, prv = self._next, self._prev
        while self._count > keep and self._count * self.chunk_bytes > target:
            slot = self._head
            n = nxt[slot]  # (_unlink of the head)
            self._head = n
            if n >= 0:
                prv[n] = -1
            else:
                self._tail = -1
            self._remove(slot)

    # ---- the table -------------------------------------------------------------------
    def _find(self, fp: int) -> int:
        """The slot holding ``fp``, or -1."""
        fps, size = self._fps, self._size
        i = fp % size
        while True:
            f = fps[i]
            if f == fp:
                return i
            if not f:
                return -1
            i += 1
            if i == size:
                i = 0

    def _empty_slot(self, fp: int) -> int:
        """The first empty slot of ``fp``'s probe sequence (``fp`` not held)."""
        fps, size = self._fps, self._size
        i = fp % size
        while fps[i]:
            i += 1
            if i == size:
                i = 0
        return i

    def _add(self, fp: int, t: float) -> None:
        """``fp`` (not held) in, the most recently used, made young at ``t``."""
        if (self._count + 1) > self._size * _MAX_LOAD:
            self._grow()
        i = self._empty_slot(fp)
        self._fps[i] = fp
        self._times[i] = t
        self._count += 1
        self._link_last(i)

    def _link_last(self, slot: int) -> None:
        tail = self._tail
        self._prev[slot] = tail
        self._next[slot] = -1
        if tail >= 0:
            self._next[tail] = slot
        else:
            self._head = slot
        self._tail = slot

    def _unlink(self, slot: int) -> None:
        p, n = self._prev[slot], self._next[slot]
        if p >= 0:
            self._next[p] = n
        else:
            self._head = n
        if n >= 0:
            self._prev[n] = p
        else:
            self._tail = p

    def _remove(self, slot: int) -> None:
        """Empty ``slot`` (unlinked), moving back the keys after it that probed past it
        (and relinking their neighbours to where they are now)."""
        fps, times, prv, nxt, size = self._fps, self._times, self._prev, self._next, self._size
        i = slot
        j = i
        while True:
            j += 1
            if j == size:
                j = 0
            f = fps[j]
            if not f:
                break
            home = f % size
            # move f to i unless its home lies cyclically in (i, j]
            if (i < j and (home <= i or home > j)) or (i > j and home <= i and home > j):
                fps[i] = f
                times[i] = times[j]
                p, n = prv[j], nxt[j]
                prv[i] = p
                nxt[i] = n
                if p >= 0:
                    nxt[p] = i
                else:
                    self._head = i
                if n >= 0:
                    prv[n] = i
                else:
                    self._tail = i
                i = j
        fps[i] = 0
        self._count -= 1

    def _grow(self) -> None:
        """A larger table (half as large again, up to what the bound needs), the keys in
        the same order."""
        size = max(self._size + 1, self._size * 3 // 2)
        if self._full_slots is not None and self._full_slots > self._size:
            size = min(size, self._full_slots)
        old_fps, old_times, old_next = self._fps, self._times, self._next
        i = self._head
        count = self._count
        self._init(size)
        fps, times, prv, nxt = self._fps, self._times, self._prev, self._next
        last = -1
        while i >= 0:
            fp = old_fps[i]
            j = self._empty_slot(fp)
            fps[j] = fp
            times[j] = old_times[i]
            prv[j] = last
            if last >= 0:
                nxt[last] = j
            else:
                self._head = j
            last = j
            i = old_next[i]
        if last >= 0:
            nxt[last] = -1
        self._tail = last
        self._count = count


class ObjectGhostTiers:
    """The object ghosts of every scale in :data:`SCALES` and the
    ``kvtier:whatif_hit_tokens{tier="remote"}`` they would have served.

    With ``background`` (the scheduler's) every call only queues its event, with the
    time it happened, for a :class:`~kvtier.whatif.queue.GhostQueue` thread to apply in
    order: :meth:`lookup` then returns a list that is filled with the scale's run ends
    when it is applied, which :meth:`count_run` (queued after it) reads. Without, each
    call applies at once (tests)."""

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
        background: bool = False,
    ) -> None:
        self.stats = stats
        self.scales = tuple(scales)
        self.max_bytes = max_bytes
        self.clock = clock
        self._shape = (chunk_bytes, low_water, touch_after_s)
        self._build()
        self._labels = tuple(("remote", s) for s in self.scales)
        self.queue: GhostQueue | None = None
        if background:
            self.queue = GhostQueue(
                self._apply_event, self._build, name="object ghost tiers", background=True
            )

    def _build(self) -> None:
        """Every ghost, empty."""
        chunk_bytes, low_water, touch_after_s = self._shape
        max_bytes = self.max_bytes

        def make(
            cap: int | None, fraction_of: tuple[float, ObjectGhost] | None = None
        ) -> ObjectGhost:
            return ObjectGhost(
                chunk_bytes,
                cap,
                low_water=low_water,
                touch_after_s=touch_after_s,
                clock=self.clock,
                fraction_of=fraction_of,
            )

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

    def ghost(self, scale: str) -> ObjectGhost:
        return self.ghosts[self._ghost_of[self.scales.index(scale)]]

    def uploaded(self, keys: Iterable[bytes]) -> None:
        """Uploads planned this step (the object keys' block hashes)."""
        if self.queue is not None:
            self.queue.append((_UPLOADED, list(keys), self.clock()))
        else:
            self._uploaded(keys, self.clock())

    def lookup(self, keys: Sequence[bytes], start: int, stop: int) -> Sequence[int]:
        """A lookup from chunk ``start`` (up to ``stop``): for each scale, the end of the
        run of chunks that tier would have held (read, and so made young, once); queued,
        a list filled when the queue reaches it."""
        if self.queue is None:
            return self._lookup(keys, start, stop, self.clock())
        ends: list[int] = []
        self.queue.append((_LOOKUP, keys[start:stop], start, self.clock(), ends))
        return ends

    def count(self, tokens: Sequence[int]) -> None:
        """The tokens each scale would have served to one request."""
        if self.queue is not None:
            self.queue.append((_COUNT, list(tokens)))
        else:
            self._count(tokens)

    def count_run(
        self, ends: Sequence[int], *, held: int, lo: int, cap: int, chunk_size: int
    ) -> None:
        """Count one request from its lookup's ``ends``: ``held`` tokens (the host tier
        held them already) plus, per scale, the tokens from ``lo`` up to the end of the
        run that scale held (at most ``cap``)."""
        if self.queue is not None:
            self.queue.append((_COUNT_RUN, ends, held, lo, cap, chunk_size))
        else:
            self._count_run(ends, held, lo, cap, chunk_size)

    def drain(self) -> None:
        """Apply what is queued now (tests)."""
        if self.queue is not None:
            self.queue.drain()

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close()

    # ---- applying (at once, or from the queue) --------------------------------------------
    def _apply_event(self, ev: tuple[Any, ...]) -> None:
        op = ev[0]
        if op == _UPLOADED:
            self._uploaded(ev[1], ev[2])
        elif op == _LOOKUP:
            keys, start, now, ends = ev[1], ev[2], ev[3], ev[4]
            ends[:] = self._lookup(keys, 0, len(keys), now, offset=start)
        elif op == _COUNT:
            self._count(ev[1])
        elif op == _COUNT_RUN:
            self._count_run(*ev[1:])

    def _uploaded(self, keys: Iterable[bytes], now: float) -> None:
        for key in keys:
            for g in self.ghosts:
                g.put(key, now)

    def _lookup(
        self, keys: Sequence[bytes], start: int, stop: int, now: float, offset: int = 0
    ) -> tuple[int, ...]:
        ends = [offset + g.read_run(keys, start, stop, now) for g in self.ghosts]
        return tuple(ends[i] for i in self._ghost_of)

    def _count_run(
        self, ends: Sequence[int], held: int, lo: int, cap: int, chunk_size: int
    ) -> None:
        self._count([held + max(0, min(cap, end * chunk_size) - lo) for end in ends])

    def _count(self, tokens: Sequence[int]) -> None:
        if self.stats is None:
            return
        for labels, n in zip(self._labels, tokens, strict=True):
            if n:
                self.stats.inc(metrics.WHATIF_HIT_TOKENS, n, labels)


# the queued events
_UPLOADED, _LOOKUP, _COUNT, _COUNT_RUN = range(4)
