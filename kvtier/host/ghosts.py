"""Ghost host tiers: what a host tier of 0.5x to 8x today's slots would have served.

Each :class:`Ghost` holds chunk keys only (no bytes) in LRU order, with the capacity of
the real :class:`~kvtier.host.index.ChunkIndex` times its scale. The index itself feeds
them (``ChunkIndex.ghosts``): every begin, commit, pin, touch, drop, explicit eviction,
clear and supersede the real tier sees reaches each ghost as it happens, so every path
that changes the host tier (stores, fetches, loads, write-back, resets) is covered.

A ghost evicts by the real tier's policy: the least recently used *idle* ready chunk.
A chunk the real tier holds busy (being stored or fetched, pinned by a load, held by an
upload) is passed over; with write-back, a chunk the real tier would have to upload
first is not evicted but turns *evicting* in the ghost (no hit, slot taken) until the
real tier lets go of it, one per slot asked for, as the real tier does. Slots held by
fetches a store superseded count against the ghost too. At scale 1 the ghost therefore
holds exactly the real tier's chunks. Where a ghost differs from the real tier the model
is an approximation, and these are its choices:

- a chunk only a ghost holds is idle and already uploaded (write-back never pins it);
- a store or fetch the real tier skipped for want of a slot, but a ghost had room for,
  turns ready in the ghost at once (a larger tier would have stored it a step later);
- a chunk a ghost began to write back, but the real tier kept, stays evicting in the
  ghost until the real tier uploads it (``WriteBack.clean_oldest``) or drops it.

The ghost of the real tier's own size (scale 1) is not kept: it would hold exactly the
real tier's chunks, so :class:`RealTier` reads the index instead (the tests run the
modelled one beside the index and check they agree). Cost, measured in
``docs/performance.md``: an ``OrderedDict`` entry per chunk each other ghost holds, and a
few dict operations per ghost and stored chunk, done inline in :class:`GhostTiers`' hooks.

A chunk fetched from the object tier is a ghost hit too but counts as the object tier's
(as the real tier counts ``hit_tokens{tier="remote"}``): :meth:`GhostTiers.lookup` adds
only the chunks the ghost filled by a store, so scale 1 equals ``hit_tokens{tier="host"}``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvtier import metrics
from kvtier.host.index import Entry, State

if TYPE_CHECKING:
    from kvtier.stats import StatsRecorder

#: the ghost tiers' sizes, as multiples of the real tier's slots (the ``scale`` label)
SCALES: tuple[str, ...] = metrics.WHATIF_SCALES

# a ghost entry's flags (a small int: CPython shares these objects, an entry costs none)
_PENDING = 1  # being stored or fetched: no hit yet, slot taken
_EVICTING = 2  # leaving (write-back, reset, failed store still held): no hit, slot taken
_FETCHED = 4  # filled by a fetch from the object tier: a hit of that tier, not the host's
_BUSY = _PENDING | _EVICTING


class Ghost:
    """One what-if host tier: ``capacity`` slots of chunk keys, LRU order, flags each."""

    def __init__(
        self,
        capacity: int,
        real: Callable[[bytes], Entry | None],
        write_back_needed: Callable[[Entry], bool] | None = None,
    ) -> None:
        self.capacity = max(1, capacity)
        self._real = real
        self._write_back_needed = write_back_needed
        #: key -> flags, least recently used first
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        #: keys the ghost holds evicting (released when the real tier lets go)
        self._evicting: set[bytes] = set()
        #: real slots held by superseded fetches that count against this ghost too
        self._superseded: set[int] = set()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def ready_keys(self) -> set[bytes]:
        """The keys that are hits in this ghost (tests)."""
        return {k for k, f in self._lru.items() if not f & _BUSY}

    @property
    def used(self) -> int:
        return len(self._lru) + len(self._superseded)

    # ---- the real tier's events ----------------------------------------------------------
    def begin(self, key: bytes, fetched: bool, evict_ok: bool) -> None:
        """The real tier claims a slot for ``key`` (before it evicts anything itself)."""
        flags = self._lru.get(key)
        if flags is not None:
            if not flags & _BUSY:
                self._lru.move_to_end(key)  # still held here: a larger tier kept it
                return
            self._remove(key)  # a stale evicting entry the real tier no longer holds
        if self._take_slot(evict_ok):
            self._lru[key] = _PENDING | (_FETCHED if fetched else 0)

    def begun(self, key: bytes, ok: bool) -> None:
        """After the real claim: one the real tier skipped (no slot) that this ghost had
        room for turns ready here (a larger tier would have stored it)."""
        if not ok:
            flags = self._lru.get(key)
            if flags is not None and flags & _PENDING:
                self._lru[key] = flags & _FETCHED

    def commit(self, key: bytes, ok: bool, still_held: bool) -> None:
        """A store or fetch of ``key`` settled in the real tier."""
        flags = self._lru.get(key)
        if flags is None:
            return
        if ok:
            if flags & _BUSY:
                self._evicting.discard(key)
                self._lru[key] = flags & _FETCHED
            self._lru.move_to_end(key)
        elif flags & _PENDING:
            if still_held:  # freed when its last holder lets go (``dropped``)
                self._mark_evicting(key)
            else:
                self._remove(key)

    def touch(self, key: bytes) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)

    def dropped(self, key: bytes) -> None:
        """The real tier dropped ``key``. Its own LRU evictions are no concern of a ghost
        (it evicts by itself), but a chunk leaving for any other reason is gone here too
        once it is busy or evicting here (a failed store, a finished write-back)."""
        flags = self._lru.get(key)
        if flags is not None and flags & _BUSY:
            self._remove(key)

    def forget(self, key: bytes) -> None:
        """An explicit eviction of ``key`` (the real tier's ``evict``)."""
        if key in self._lru:
            self._mark_evicting(key)

    def clear(self, held: Callable[[bytes], bool]) -> None:
        """The real tier was emptied: nothing stored before is a hit anywhere. A chunk the
        real tier still holds (busy) keeps its slot here until it is dropped."""
        keep = [k for k in self._lru if held(k)]
        self._lru = OrderedDict.fromkeys(keep, _EVICTING)
        self._evicting = set(keep)

    def supersede(self, key: bytes, old_slot: int) -> None:
        """A store of ``key`` supersedes its fetch: one more slot, the fetch's still held."""
        if self._take_slot(True):
            self._superseded.add(old_slot)

    def superseded(self, key: bytes, old_slot: int, ok: bool) -> None:
        """After the real supersede: the key is being stored (``ok``), or nothing changed."""
        if not ok:
            self._superseded.discard(old_slot)
        elif key in self._lru:
            self._evicting.discard(key)
            self._lru[key] = _PENDING
            self._lru.move_to_end(key)

    def released(self, old_slot: int) -> None:
        """The fetch a store superseded was reported: its slot is free."""
        self._superseded.discard(old_slot)

    # ---- lookups -------------------------------------------------------------------------
    def ready_run(self, keys: Sequence[bytes], start: int, stop: int) -> tuple[int, list[bool]]:
        """End of the run of ghost hits ``keys[start:stop]`` begins with, and whether each
        of them was fetched (the object tier's hit)."""
        get = self._lru.get
        fetched: list[bool] = []
        for i in range(start, stop):
            flags = get(keys[i])
            if flags is None or flags & _BUSY:
                break
            fetched.append(bool(flags & _FETCHED))
        return start + len(fetched), fetched

    # ---- internals -----------------------------------------------------------------------
    def _remove(self, key: bytes) -> None:
        del self._lru[key]
        self._evicting.discard(key)

    def _mark_evicting(self, key: bytes) -> None:
        self._lru[key] = _EVICTING | (self._lru[key] & _FETCHED)
        self._evicting.add(key)

    def _take_slot(self, evict_ok: bool) -> bool:
        """Room for one more chunk, by the real tier's policy (ChunkIndex._take_slot)."""
        lru = self._lru
        if len(lru) + len(self._superseded) < self.capacity:
            return True
        if not evict_ok:
            return False
        if self._evicting and self._release_evicting():
            return True
        real = self._real
        needed = self._write_back_needed
        ready = State.READY
        began: bytes | None = None
        victim: bytes | None = None
        for key, flags in lru.items():
            if flags & _BUSY:
                continue
            entry = real(key)
            if entry is not None:
                if entry.refs or entry.state is not ready:
                    continue
                if needed is not None and needed(entry):
                    if began is None:
                        began = key
                    continue
            victim = key
            break
        if began is not None:
            self._mark_evicting(began)
        if victim is None:
            return False
        del lru[victim]
        return True

    def _release_evicting(self) -> bool:
        """Free one evicting chunk whose write-back the real tier no longer needs (it
        uploaded or dropped it): only a ghost of another size than the real tier's holds
        such a chunk (at scale 1 the real tier's drop releases it at once)."""
        for key in self._evicting:
            entry = self._real(key)
            if entry is None or (
                entry.state is State.READY
                and not (self._write_back_needed is not None and self._write_back_needed(entry))
            ):
                self._remove(key)
                return True
        return False


class RealTier:
    """The scale-1 "ghost" when :class:`GhostTiers` mirrors the real tier: a ghost of
    the real tier's own size holds exactly its chunks (``tests/kvtier/test_ghosts.py``
    checks that model against the index), so this one reads the index instead of
    keeping a copy: no memory and no work per hook."""

    def __init__(self, capacity: int, real: Callable[[bytes], Entry | None]) -> None:
        self.capacity = capacity
        self._real = real

    def ready_run(self, keys: Sequence[bytes], start: int, stop: int) -> tuple[int, list[bool]]:
        """As :meth:`Ghost.ready_run`, from the real index's ready entries."""
        real = self._real
        ready = State.READY
        fetched: list[bool] = []
        for i in range(start, stop):
            entry = real(keys[i])
            if entry is None or entry.state is not ready:
                break
            fetched.append(entry.fetched)
        return start + len(fetched), fetched


class GhostTiers:
    """The ghosts of every scale in :data:`SCALES`, fed by one :class:`ChunkIndex`, and
    the ``kvtier:whatif_hit_tokens`` they would have served (:meth:`lookup`).

    The scale-1 ghost is the real tier itself (:class:`RealTier`) unless ``mirror`` is
    False (tests: the modelled ghost, which must equal it). The hooks below run once per
    chunk the real tier stores, pins or drops, inside the scheduler's step: each does the
    common case (a dict probe or a move to the end per ghost) inline and calls into a
    :class:`Ghost` only where that ghost must decide something (a slot, a busy chunk)."""

    def __init__(
        self,
        num_slots: int,
        real: Callable[[bytes], Entry | None],
        stats: StatsRecorder | None = None,
        write_back_needed: Callable[[Entry], bool] | None = None,
        scales: Sequence[str] = SCALES,
        *,
        mirror: bool = True,
    ) -> None:
        self.num_slots = num_slots
        self.stats = stats
        self.scales = tuple(scales)
        self._real = real
        self._write_back_needed = write_back_needed
        ghosts: list[Ghost | RealTier] = []
        for s in self.scales:
            capacity = max(1, round(num_slots * float(s)))
            if mirror and capacity == num_slots:
                ghosts.append(RealTier(capacity, real))
            else:
                ghosts.append(Ghost(capacity, real, write_back_needed))
        self.ghosts: tuple[Ghost | RealTier, ...] = tuple(ghosts)
        #: the ghosts that keep keys of their own (every hook reaches these only)
        self._own: tuple[Ghost, ...] = tuple(g for g in ghosts if isinstance(g, Ghost))
        self._labels = tuple(("host", s) for s in self.scales)

    def ghost(self, scale: str) -> Ghost | RealTier:
        return self.ghosts[self.scales.index(scale)]

    # the index's hooks: each reaches every ghost that keeps keys
    def begin(self, key: bytes, fetched: bool, evict_ok: bool) -> None:
        pending = _PENDING | (_FETCHED if fetched else 0)
        real = self._real
        needed = self._write_back_needed
        ready = State.READY
        for g in self._own:  # Ghost.begin, inline
            lru = g._lru
            flags = lru.get(key)
            if flags is not None:
                if not flags & _BUSY:
                    lru.move_to_end(key)  # still held here: a larger tier kept it
                    continue
                g._remove(key)  # a stale evicting entry the real tier no longer holds
            if len(lru) + len(g._superseded) < g.capacity:
                lru[key] = pending
                continue
            if evict_ok and not g._evicting and lru:
                # Ghost._take_slot's common case: its least recently used chunk can go
                oldest, old_flags = lru.popitem(last=False)
                if not old_flags & _BUSY:
                    entry = real(oldest)
                    if entry is None or (
                        not entry.refs
                        and entry.state is ready
                        and (needed is None or not needed(entry))
                    ):
                        lru[key] = pending
                        continue
                lru[oldest] = old_flags  # put back where it was: the full policy decides
                lru.move_to_end(oldest, last=False)
            if g._take_slot(evict_ok):
                lru[key] = pending

    def begun(self, key: bytes, ok: bool) -> None:
        for g in self._own:
            g.begun(key, ok)

    def commit(self, key: bytes, ok: bool, still_held: bool) -> None:
        if not ok:
            for g in self._own:
                g.commit(key, ok, still_held)
            return
        for g in self._own:
            lru = g._lru
            flags = lru.get(key)
            if flags is None:
                continue
            if flags & _BUSY:
                g._evicting.discard(key)
                lru[key] = flags & _FETCHED
            lru.move_to_end(key)

    def touch(self, key: bytes) -> None:
        for g in self._own:
            lru = g._lru
            if key in lru:
                lru.move_to_end(key)

    def dropped(self, key: bytes) -> None:
        for g in self._own:
            flags = g._lru.get(key)
            if flags is not None and flags & _BUSY:
                g._remove(key)

    def forget(self, key: bytes) -> None:
        for g in self._own:
            g.forget(key)

    def clear(self, held: Callable[[bytes], bool]) -> None:
        for g in self._own:
            g.clear(held)

    def supersede(self, key: bytes, old_slot: int) -> None:
        for g in self._own:
            g.supersede(key, old_slot)

    def superseded(self, key: bytes, old_slot: int, ok: bool) -> None:
        for g in self._own:
            g.superseded(key, old_slot, ok)

    def released(self, old_slot: int) -> None:
        for g in self._own:
            g.released(old_slot)

    def lookup(
        self,
        keys: Sequence[bytes],
        first: int,
        stop: int,
        *,
        chunk_size: int,
        computed: int,
        cap: int,
    ) -> list[int]:
        """One lookup: the host-tier tokens each ghost would have served of the prompt
        tokens ``computed..cap`` (chunks ``first..stop`` of ``keys``), as the real tier
        counts its own loads (tokens of stored chunks; fetched ones are the object tier's).
        Each ghost's count goes to ``kvtier:whatif_hit_tokens``; returned for tests."""
        out: list[int] = []
        for g, labels in zip(self.ghosts, self._labels, strict=True):
            end, fetched = g.ready_run(keys, first, stop)
            limit = min(end * chunk_size, cap)
            tokens = 0
            for i, was_fetched in enumerate(fetched):
                if not was_fetched:
                    c = first + i
                    tokens += max(
                        0, min(limit, (c + 1) * chunk_size) - max(computed, c * chunk_size)
                    )
            out.append(tokens)
            if self.stats is not None and tokens:
                self.stats.inc(metrics.WHATIF_HIT_TOKENS, tokens, labels)
        return out
