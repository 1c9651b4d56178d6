"""Ghost host tiers: what a host tier of 0.5x to 8x today's slots would have served.

Scale 1 is the real tier itself: :meth:`GhostTiers.lookup` counts, from the real
:class:`~kvtier.host.index.ChunkIndex` as the lookup happens, the host-tier tokens it
holds ready (so ``scale="1"`` equals ``hit_tokens{tier="host"}``). The other scales are
modelled by :class:`StackLRU`: one recency order of chunk fingerprints that every ghost
shares, each ghost holding the ``capacity`` most recently used keys of it (an LRU cache
fed the same chunks as the real tier: Mattson's stack property, which makes one table
enough for every size). A key is an 8-byte fingerprint (the chunk key's hash), kept in
two flat arrays, so a chunk costs the same whatever the key's length and however many
ghosts hold it (``bench/ghost_cost.py`` measures it; the README states it).

The index tells its changes as ``(event, key)`` (``ChunkIndex.ghost_events``: one
``append`` to a queue, on the scheduler's path, per settled store or fetch, load, touch,
eviction or reset), and lookups queue theirs (:class:`~kvtier.whatif.queue.GhostQueue`:
applied in order on a thread of its own every few tens of milliseconds, in a real engine
mostly while the scheduler's thread waits for the model). Nothing else runs on the
scheduler's path. The counters move when the queue is applied, every scale together,
and reach ``/metrics`` with the next step's stats; what is counted does not depend on
when that happens.

Where the real tier is not plain LRU, the model chooses, and these are its
approximations (each is exact when nothing fails and nothing is busy when an eviction
picks its victim):

- every chunk the real tier stores, fetches, loads or touches becomes the most recent
  in every ghost, as in an LRU cache of that size fed the same chunks: a ghost that did
  not hold a chunk the real tier served (a smaller one) takes it in, as a tier of that
  size would have once it recomputed and stored it. A lookup reads the ghosts as it
  begins (:meth:`GhostTiers.peek`), before its own loads and fetches;
- a chunk enters the ghosts when its store or fetch settles (the real tier takes its
  slot when it begins, a step or two earlier); a store that fails changes nothing in
  them (the real tier loses the chunk it evicted for it); a store the real tier skipped
  for want of a slot enters at once (a larger tier would have stored it);
- a ghost evicts its least recently used chunk, busy or not: it does not pass over
  chunks being stored, pinned by a load, or waiting for their write-back as the real
  tier does (those are young or few);
- an explicit eviction or a reset (``reset_prefix_cache``) empties the chunk, or every
  chunk, from every ghost at once.

A chunk fetched from the object tier is a ghost hit too but counts as the object tier's
(as the real tier counts ``hit_tokens{tier="remote"}``): only chunks filled by a store
count as the host tier's.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvtier import metrics
from kvtier.host import index
from kvtier.host.index import Entry, State
from kvtier.whatif.queue import GhostQueue, fingerprint

if TYPE_CHECKING:
    from kvtier.stats import StatsRecorder

#: the ghost tiers' sizes, as multiples of the real tier's slots (the ``scale`` label)
SCALES: tuple[str, ...] = metrics.WHATIF_SCALES

# a log position's byte: 0 is a dead position (the key moved on or left)
_READY = 1
_FETCHED = 2  # filled by a fetch from the object tier: a hit of that tier, not the host's
_LIVE = re.compile(b"[^\x00]")


class FingerprintTable:
    """Fingerprint -> log position, open addressing (linear probing, backward-shift
    deletion) in two flat arrays: 12 bytes a table slot, at most 70 % of them used."""

    def __init__(self, max_keys: int) -> None:
        size = 16
        while size * 7 < max_keys * 10:
            size *= 2
        self._init(size)

    def _init(self, size: int) -> None:
        self.mask = size - 1
        self.fps = array("q", bytes(8 * size))
        self.pos = array("i", bytes(4 * size))
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def find(self, fp: int) -> int:
        """The slot holding ``fp``, or -1."""
        fps, mask = self.fps, self.mask
        i = fp & mask
        while True:
            f = fps[i]
            if f == fp:
                return i
            if not f:
                return -1
            i = (i + 1) & mask

    def add(self, fp: int, pos: int) -> int:
        """Put ``fp`` (not present) at ``pos``; returns its slot."""
        if (self.count + 1) * 10 > (self.mask + 1) * 7:
            self._grow()
        fps, mask = self.fps, self.mask
        i = fp & mask
        while fps[i]:
            i = (i + 1) & mask
        fps[i] = fp
        self.pos[i] = pos
        self.count += 1
        return i

    def remove(self, slot: int) -> None:
        """Empty ``slot``, moving back the keys after it that probed past it."""
        fps, pos, mask = self.fps, self.pos, self.mask
        i = slot
        j = i
        while True:
            j = (j + 1) & mask
            f = fps[j]
            if not f:
                break
            home = f & mask
            # move f to i unless its home lies cyclically in (i, j]
            if (i < j and (home <= i or home > j)) or (i > j and home <= i and home > j):
                fps[i] = f
                pos[i] = pos[j]
                i = j
        fps[i] = 0
        self.count -= 1

    def _grow(self) -> None:
        fps, pos = self.fps, self.pos
        self._init(2 * (self.mask + 1))
        for i, f in enumerate(fps):
            if f:
                self.add(f, pos[i])

    def memory_bytes(self) -> int:
        return len(self.fps) * self.fps.itemsize + len(self.pos) * self.pos.itemsize


class StackLRU:
    """LRU caches of several capacities over one recency order (the ghosts' keys).

    ``log`` holds a fingerprint per use, oldest first, and ``flags`` a byte per log
    position (0: dead, the key was used again later or left). Ghost ``g`` holds exactly
    the live positions from ``start[g]`` on, ``held[g]`` of them, at most ``caps[g]``: a
    use appends, and each ghost over its capacity moves its start past its oldest live
    position. The largest ghost's evictions leave the table. The log is compacted when
    half of it is dead."""

    def __init__(self, caps: Sequence[int]) -> None:
        if list(caps) != sorted(caps):
            raise ValueError("ghost capacities must be ascending")
        self.caps = [max(1, c) for c in caps]
        self.clear()

    def clear(self) -> None:
        """Every ghost empty."""
        self.table = FingerprintTable(self.caps[-1] + 1)
        self.log = array("q")
        self.flags = bytearray()
        self.start = [0] * len(self.caps)
        self.held = [0] * len(self.caps)

    def __len__(self) -> int:
        """Keys held by the largest ghost (the table's)."""
        return len(self.table)

    def position(self, fp: int) -> int:
        """The key's live log position, or -1 when no ghost holds it."""
        slot = self.table.find(fp)
        return -1 if slot < 0 else self.table.pos[slot]

    def keys(self, g: int) -> list[tuple[int, int]]:
        """Ghost ``g``'s keys and flags, least recently used first (tests)."""
        return [(self.log[m.start()], m[0][0]) for m in _LIVE.finditer(self.flags, self.start[g])]

    def use(self, fp: int, flags: int) -> None:
        """``fp`` is the most recently used key of every ghost now, with ``flags``."""
        table = self.table
        slot = table.find(fp)
        new = len(self.log)
        start, held = self.start, self.held
        if slot >= 0:
            old = table.pos[slot]
            if old == new - 1:  # the most recent already (a store settling at once)
                self.flags[old] = flags
                return
            self.flags[old] = 0
            table.pos[slot] = new
            for g, s in enumerate(start):
                if old < s:
                    held[g] += 1
        else:
            table.add(fp, new)
            for g in range(len(held)):
                held[g] += 1
        self.log.append(fp)
        self.flags.append(flags)
        self._evict_over()
        if len(self.log) > 2 * len(table) + 4096:
            self._compact()

    def remove(self, fp: int) -> None:
        """No ghost holds ``fp`` any more."""
        slot = self.table.find(fp)
        if slot < 0:
            return
        pos = self.table.pos[slot]
        self.flags[pos] = 0
        for g, s in enumerate(self.start):
            if pos >= s:
                self.held[g] -= 1
        self.table.remove(slot)

    def _evict_over(self) -> None:
        flags, start, held, caps = self.flags, self.start, self.held, self.caps
        last = len(caps) - 1
        for g in range(last + 1):
            while held[g] > caps[g]:
                q = _LIVE.search(flags, start[g])
                assert q is not None, "a ghost holds more keys than the log"
                p = q.start()
                start[g] = p + 1
                held[g] -= 1
                if g == last:  # out of the largest ghost: out of every ghost
                    flags[p] = 0
                    self.table.remove(self.table.find(self.log[p]))

    def _compact(self) -> None:
        """Drop the dead positions: every live key gets its new position."""
        log, flags, table = self.log, self.flags, self.table
        new_log = array("q")
        new_flags = bytearray()
        for m in _LIVE.finditer(flags):
            p = m.start()
            fp = log[p]
            table.pos[table.find(fp)] = len(new_log)
            new_log.append(fp)
            new_flags.append(flags[p])
        # a ghost's start: the live positions before it are out of that ghost
        self.start = [s - flags.count(0, 0, s) for s in self.start]
        self.log, self.flags = new_log, new_flags

    def memory_bytes(self) -> int:
        """What the ghosts keep: the table, the log and its flags (allocated)."""
        return (
            self.table.memory_bytes()
            + self.log.buffer_info()[1] * self.log.itemsize
            + len(self.flags)
        )


# the queue's own events, after the index's (kvtier.host.index: STORED .. CLEARED)
_PEEK, _LOOKUP = 100, 101


class GhostTiers:
    """The ghosts of every scale in :data:`SCALES`, fed by one :class:`ChunkIndex` (set
    its ``ghost_events`` to :attr:`record`), and the ``kvtier:whatif_hit_tokens`` they
    would have served (:meth:`lookup`). With ``background`` (the scheduler's), a thread
    applies the queued events; without, :meth:`drain` does (tests, benchmarks)."""

    def __init__(
        self,
        num_slots: int,
        real: Callable[[bytes], Entry | None],
        stats: StatsRecorder | None = None,
        scales: Sequence[str] = SCALES,
        *,
        background: bool = False,
        mirror: bool = True,
    ) -> None:
        """``mirror=False`` models the real tier's own size too (tests compare it with
        the index)."""
        self.num_slots = num_slots
        self.stats = stats
        self.scales = tuple(scales)
        self._real = real
        caps = [max(1, round(num_slots * float(s))) for s in self.scales]
        #: the scales read from the real index (its own size), the others modelled
        self._is_real = [mirror and c == num_slots for c in caps]
        modelled = [i for i, r in enumerate(self._is_real) if not r]
        order = sorted(modelled, key=lambda i: caps[i])
        self.stack = StackLRU([caps[i] for i in order])
        #: scale index -> its ghost in the stack
        self._ghost_of = {i: g for g, i in enumerate(order)}
        self._labels = tuple(("host", s) for s in self.scales)
        #: the events, applied in order (on a thread of their own with ``background``)
        self.queue = GhostQueue(
            self._apply_event, self.stack.clear, name="host ghost tiers", background=background
        )
        #: the index's ``ghost_events``: one append per change, nothing else on its path
        self.record: Callable[[tuple[int, bytes]], None] = self.queue.append

    def capacity(self, scale: str) -> int:
        return max(1, round(self.num_slots * float(scale)))

    def ghost_keys(self, scale: str) -> list[tuple[int, bool]]:
        """A modelled scale's keys (fingerprints), least recently used first, and
        whether each was fetched (tests; call :meth:`drain` first)."""
        g = self._ghost_of[self.scales.index(scale)]
        return [(fp, bool(f & _FETCHED)) for fp, f in self.stack.keys(g)]

    # ---- lookups -----------------------------------------------------------------------
    def peek(self, keys: Sequence[bytes], first: int, stop: int | None = None) -> list[list[bool]]:
        """What the ghosts hold of a prompt's chunks ``first``.., read when the queue
        reaches this point: before the lookup loads, touches or fetches any of them
        (those make the chunks the most recent in every ghost, as a tier of any size
        would once it served or computed them). :meth:`lookup` counts from it."""
        holder: list[list[bool]] = []
        self.queue.append((_PEEK, keys[first:stop], holder))
        return holder

    def lookup(
        self,
        keys: Sequence[bytes],
        first: int,
        stop: int,
        *,
        chunk_size: int,
        computed: int,
        cap: int,
        peek: list[list[bool]] | None = None,
    ) -> None:
        """One lookup of the prompt tokens ``computed..cap`` (chunks ``first..stop`` of
        ``keys``): scale 1 is counted now, from the real index; the other scales when
        the queue is applied, from ``peek`` (taken now when not given), and go to
        ``kvtier:whatif_hit_tokens``."""
        if peek is None:
            peek = self.peek(keys, first, stop)
        real = self._real
        ready = State.READY
        fetched: list[bool] = []
        for i in range(first, stop):
            entry = real(keys[i])
            if entry is None or entry.state is not ready:
                break
            fetched.append(entry.fetched)
        tokens = _host_tokens(fetched, first, chunk_size, computed, cap)
        # counted with the other scales, when the queue reaches it: every scale's counter
        # moves at once
        self.queue.append((_LOOKUP, peek, first, stop, chunk_size, computed, cap, tokens))

    # ---- applying the queue --------------------------------------------------------------
    def drain(self) -> list[list[int]]:
        """Apply every queued event now; returns each lookup's tokens per scale (in
        :data:`SCALES` order)."""
        return self.queue.drain()

    def close(self) -> None:
        self.queue.close()

    def _apply_event(self, ev: tuple[Any, ...]) -> list[int] | None:
        if ev[0] == _LOOKUP:
            return self._count(*ev[1:])
        if ev[0] == _PEEK:
            ev[2][:] = self._runs(ev[1])
        else:
            self._apply(ev[0], ev[1])
        return None

    def _apply(self, op: int, key: bytes) -> None:
        stack = self.stack
        if op == index.CLEARED:
            stack.clear()
        elif op == index.STORED or op == index.SKIPPED_STORE:
            stack.use(fingerprint(key), _READY)
        elif op == index.FETCHED or op == index.SKIPPED_FETCH:
            stack.use(fingerprint(key), _READY | _FETCHED)
        elif op == index.TOUCHED:
            fp = fingerprint(key)
            pos = stack.position(fp)
            if pos >= 0:
                stack.use(fp, stack.flags[pos])
        elif op == index.EVICTED:
            stack.remove(fingerprint(key))

    def _runs(self, keys: Sequence[bytes]) -> list[list[bool]]:
        """Each stack ghost's run of hits ``keys`` begins with (fetched or not, each)."""
        stack = self.stack
        start = stack.start
        runs: list[list[bool]] = [[] for _ in start]
        alive = list(range(len(start)))
        for key in keys:
            pos = stack.position(fingerprint(key))
            if pos < 0:
                break
            fetched = bool(stack.flags[pos] & _FETCHED)
            still = []
            for g in alive:
                if pos >= start[g]:
                    runs[g].append(fetched)
                    still.append(g)
            alive = still
            if not alive:
                break
        return runs

    def _count(
        self,
        peek: list[list[bool]],
        first: int,
        stop: int,
        chunk_size: int,
        computed: int,
        cap: int,
        real_tokens: int,
    ) -> list[int]:
        out: list[int] = []
        for i in range(len(self.scales)):
            if self._is_real[i]:
                tokens = real_tokens
            else:
                run = peek[self._ghost_of[i]][: stop - first] if peek else []
                tokens = _host_tokens(run, first, chunk_size, computed, cap)
            if self.stats is not None and tokens:
                self.stats.inc(metrics.WHATIF_HIT_TOKENS, tokens, self._labels[i])
            out.append(tokens)
        return out


def _host_tokens(fetched: list[bool], first: int, chunk_size: int, computed: int, cap: int) -> int:
    """Tokens of ``computed..cap`` in the run of chunks from ``first`` (``fetched[i]``
    for chunk ``first + i``) that the host tier serves: its stored chunks, not fetched."""
    limit = min((first + len(fetched)) * chunk_size, cap)
    tokens = 0
    for i, was_fetched in enumerate(fetched):
        if not was_fetched:
            c = first + i
            tokens += max(0, min(limit, (c + 1) * chunk_size) - max(computed, c * chunk_size))
    return tokens
