"""The host tier's index: chunk key (vLLM's hash of its last block) -> slot, with LRU,
ref counts and two-phase state.

The scheduler process owns it; workers only ever see slot numbers. A slot goes

    free -> storing -> ready <-> (pinned by loads / uploads) -> evicting -> free
    free -> fetching -> ready            (object tier -> host)

Only ``ready`` chunks are hits. A store or fetch that fails rolls back to free.
A chunk with a non-zero ref count (being loaded or uploaded) is never evicted.
A store of a chunk whose fetch is not reported yet *supersedes* the fetch
(:meth:`ChunkIndex.supersede`): the key gets a new slot at once, and the fetch's
slot, which its read may still be writing, is freed only when that fetch is
reported (:meth:`ChunkIndex.release_superseded`).

An :class:`IndexListener` (``ChunkIndex.listener``) hears every chunk that turns
ready and every chunk that leaves the index, whatever the reason (LRU eviction,
a write-back that finished, ``clear``, a failed store or fetch): the KV events
that cache-aware routers read are built from these two calls.

With tenants configured (``tenant_quotas``, ``pin_tenants``, ``default_tenant``) the index
asks its :class:`TenantHooks` (``ChunkIndex.tenancy``, :mod:`kvtier.host.tenants`) which
chunk a store may evict: per-tenant quotas and soft pins. Without them it is one LRU.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

from kvtier.host.gc_untrack import untrack


class State(enum.Enum):
    STORING = "storing"
    FETCHING = "fetching"
    READY = "ready"
    EVICTING = "evicting"


class _Flag:
    """A bool attribute of :class:`Entry` kept as one bit of its ``_flags`` int."""

    def __init__(self, bit: int) -> None:
        self.bit = bit

    def __get__(self, entry: Entry, owner: object = None) -> bool:
        return bool(entry._flags & self.bit)

    def __set__(self, entry: Entry, value: bool) -> None:
        entry._flags = entry._flags | self.bit if value else entry._flags & ~self.bit


@dataclass(slots=True)
class Entry:
    """One chunk in the host tier. A million of these may be held: the three flags
    share one small int (a field each would cost 16 bytes a chunk more), and the index
    takes each out of the garbage collector's lists (:mod:`kvtier.host.gc_untrack`): its fields
    must only ever hold atomic values (bytes, int, State), never a container."""

    key: bytes
    slot: int
    state: State
    refs: int = 0
    _flags: int = 0
    #: who stored (or fetched) it: a tenant id of :mod:`kvtier.host.tenants` (0: untagged)
    tenant: int = 0

    #: the chunk is known to be in the object tier
    remote = _Flag(1)
    #: the chunk came from the object tier (for hit-source accounting)
    fetched = _Flag(2)
    #: an upload of this chunk is in flight (write-back cleaning: it stays a hit meanwhile)
    uploading = _Flag(4)
    #: a starting engine's warm-up brought it in (kvtier:warmup_hit_tokens)
    warmed = _Flag(8)

    @property
    def block_hash(self) -> bytes:
        """vLLM's hash of the chunk's last block (the owner's handle for object-tier
        ops): the index's key itself."""
        return self.key


class IndexListener(Protocol):
    """Told about the host tier's contents as they change (the index's caller thread)."""

    def chunk_ready(self, entry: Entry) -> None:
        """``entry`` just turned ready (a store or a fetch committed): it is a hit now."""

    def chunk_dropped(self, entry: Entry) -> None:
        """``entry`` left the index and its slot is free or reused. Called for every
        entry that leaves, ready or not (a failed store drops one that never was)."""


class TenantHooks(Protocol):
    """What the index asks and tells its tenants' accounting (kvtier.host.tenants.Tenancy):
    a slot taken and freed, a chunk turning ready and leaving ready, a hit, and where to
    find a victim for a store."""

    def charge(self, entry: Entry) -> None: ...
    def uncharge(self, entry: Entry) -> None: ...
    def ready(self, entry: Entry) -> None: ...
    def unready(self, entry: Entry) -> None: ...
    def touch(self, entry: Entry) -> None: ...
    def pin(self, entry: Entry, ttl_s: float, by: int) -> bool: ...
    def expire(self) -> None: ...
    def at_quota(self, tid: int) -> bool: ...
    def own_victims(self, tid: int) -> Iterator[tuple[Iterable[Entry], str]]: ...
    def victims(self, tid: int) -> Iterator[tuple[Iterable[Entry], str]]: ...


# What the index tells the ghost tiers (kvtier.whatif.host) as ``(event, key)``: the
# changes a host tier of another size would see too, one per settled store or fetch,
# load (pin), touch, explicit eviction and reset
STORED, FETCHED, SKIPPED_STORE, SKIPPED_FETCH, TOUCHED, EVICTED, CLEARED = range(7)
GhostEvents = Callable[[tuple[int, bytes]], None]


class ChunkIndex:
    """Fixed number of slots; evicts least-recently-used ready chunks with no refs."""

    def __init__(
        self,
        num_slots: int,
        write_back_needed: Callable[[Entry], bool] | None = None,
        begin_write_back: Callable[[Entry], None] | None = None,
    ) -> None:
        """With write-back, a victim for which ``write_back_needed(entry)`` holds is not
        evicted at once: ``begin_write_back(entry)`` starts its upload, the chunk turns
        ``evicting`` with one ref held for the uploader, whose ``unpin`` frees the slot.
        At most one write-back begins per slot asked for, so a burst of stores never
        empties the whole host tier into the object tier at once."""
        if num_slots <= 0:
            raise ValueError("the host tier needs at least one slot")
        self.num_slots = num_slots
        self._write_back_needed = write_back_needed
        self._begin_write_back = begin_write_back
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        # key -> entry, in LRU order (oldest first)
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        # the keys of the READY entries: a lookup's probes touch this table alone (half
        # the memory reads of entry and state; ~34 bytes a chunk at 1M chunks)
        self._ready: set[bytes] = set()
        # slot -> a fetch's entry a store superseded: out of the key map, its slot still
        # taken until the fetch is reported (a read may be writing into it)
        self._superseded: dict[int, Entry] = {}
        # slots taken out of use by reserve() (a warm-up's chunks, held until trusted)
        self._reserved: set[int] = set()
        self.evictions = 0
        #: evictions by reason ("lru", "tenant_quota", "pinned"), adding up to ``evictions``
        self.evicted_by: dict[str, int] = {"lru": 0, "tenant_quota": 0, "pinned": 0}
        #: per-tenant quotas and soft pins (None: one LRU for everybody)
        self.tenancy: TenantHooks | None = None
        #: told about every chunk that turns ready or leaves (None: nobody listens)
        self.listener: IndexListener | None = None
        #: where the changes a tier of another size would see go (the what-if ghosts'
        #: queue, :mod:`kvtier.whatif.host`); None: nowhere
        self.ghost_events: GhostEvents | None = None

    # ---- queries ---------------------------------------------------------------------
    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def is_ready(self, key: bytes) -> bool:
        return key in self._ready

    def ready_run(self, keys: Sequence[bytes], start: int, stop: int) -> int:
        """End of the run of ready chunks ``keys[start:stop]`` begins with: ``keys[i]`` is
        ready for every ``start <= i <`` the result. Every key is probed (a run has gaps:
        LRU may evict a middle chunk), in one tight loop: this is a lookup's cost."""
        ready = self._ready.__contains__
        i = start
        for key in islice(keys, start, stop):
            if not ready(key):
                break
            i += 1
        return i

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def ready_oldest_first(self) -> Iterator[Entry]:
        """Ready chunks (pinned ones included), least recently used first."""
        return (e for e in self._entries.values() if e.state is State.READY)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    def total_refs(self) -> int:
        return sum(e.refs for e in self._entries.values())

    # ---- allocation ------------------------------------------------------------------
    def begin(
        self, key: bytes, state: State, *, evict_ok: bool = True, tenant: int = 0
    ) -> Entry | None:
        """Reserve a slot for ``key`` in ``state`` (storing or fetching), charged to
        ``tenant`` (with tenants configured: a tenant at its quota evicts its own).

        Returns None when the key is already present or no slot can be freed.
        """
        if key in self._entries:
            return None
        slot = self._take_slot(evict_ok, tenant)
        if slot is None:
            if self.ghost_events is not None:  # a larger tier would have stored it
                skipped = SKIPPED_FETCH if state is State.FETCHING else SKIPPED_STORE
                self.ghost_events((skipped, key))
            return None
        entry = Entry(key=key, slot=slot, state=state, tenant=tenant)
        untrack(entry)  # it holds atomic values only (kvtier.host.gc_untrack)
        self._entries[key] = entry
        if self.tenancy is not None:
            self.tenancy.charge(entry)
        return entry

    def supersede(self, key: bytes, tenant: int = 0) -> Entry | None:
        """A store of ``key`` while its fetch is unreported: a new slot, ``storing``.

        The request computing the chunk stores it now (it may have no later step in
        which to do so: a request that finishes with its prefill frees its blocks). The
        fetch's entry leaves the key map at once, so it can never turn ready; its slot
        stays taken until :meth:`release_superseded` is called for that entry, when
        its fetch is reported. Returns None (and changes nothing) when ``key`` is not
        ``fetching`` or no slot can be freed.
        """
        old = self._entries.get(key)
        if old is None or old.state is not State.FETCHING:
            return None
        slot = self._take_slot(True, tenant)
        if slot is None:
            return None
        del self._entries[key]
        old.state = State.EVICTING  # (never ready: the ready set is unchanged)
        self._superseded[old.slot] = old
        entry = Entry(key=key, slot=slot, state=State.STORING, tenant=tenant)
        untrack(entry)
        self._entries[key] = entry
        if self.tenancy is not None:  # the fetch's slot is no tenant's any more
            self.tenancy.uncharge(old)
            self.tenancy.charge(entry)
        return entry

    def reserve(self, slots: Iterable[int]) -> list[int]:
        """Take these slots out of use while they are free (a warm-up's chunks, held until
        the engine trusts their generation: :mod:`kvtier.connectors.scheduler.warm_chunks`);
        returns those that were free, in the order given. One pass over the free list (at
        startup)."""
        free = set(self._free)
        taken: list[int] = []
        for slot in slots:
            if slot in free:
                free.discard(slot)
                taken.append(slot)
        if taken:
            gone = set(taken)
            self._free = [s for s in self._free if s not in gone]
            self._reserved |= gone
        return taken

    def release(self, slot: int) -> None:
        """A slot :meth:`reserve` took is free again."""
        if slot in self._reserved:
            self._reserved.discard(slot)
            self._free.append(slot)

    def adopt(self, key: bytes, slot: int) -> Entry | None:
        """The chunk a warm-up read into ``slot`` (taken by :meth:`reserve`) is ready: a
        host hit from now on, known to be in the object tier (never uploaded again).
        None when ``key`` is in the index already or ``slot`` is not reserved (the caller
        releases the slot)."""
        if key in self._entries or slot not in self._reserved:
            return None
        self._reserved.discard(slot)
        entry = Entry(key=key, slot=slot, state=State.FETCHING)
        untrack(entry)
        self._entries[key] = entry
        if self.tenancy is not None:
            self.tenancy.charge(entry)
        self.commit(key, True)
        entry.fetched = False  # on the request path it is a host hit
        entry.warmed = True
        return entry

    def release_superseded(self, entry: Entry) -> bool:
        """The fetch of a superseded ``entry`` was reported: free its slot. False when
        ``entry`` is not a superseded one. Nobody is told: the chunk was never a hit,
        and its key now names the store that superseded it."""
        if self._superseded.get(entry.slot) is not entry:
            return False
        del self._superseded[entry.slot]
        self._free.append(entry.slot)
        return True

    @property
    def superseded(self) -> int:
        """Slots still held by fetches a store superseded (not yet reported)."""
        return len(self._superseded)

    def commit(self, key: bytes, ok: bool) -> Entry | None:
        """Finish a store or fetch: ready on success, slot freed on failure. A store or
        fetch that ``clear`` caught in flight is not committed: its slot is freed now (or
        when the last holder lets go), whatever the outcome."""
        entry = self._entries.get(key)
        if entry is not None and entry.state is State.EVICTING and not entry.refs:
            self._drop(entry)
            return None
        if entry is None or entry.state not in (State.STORING, State.FETCHING):
            return None
        if ok:
            entry.fetched = entry.state is State.FETCHING
            entry.remote = entry.remote or entry.fetched
            self._become(entry, State.READY)
            self._entries.move_to_end(key)
            if self.ghost_events is not None:
                self.ghost_events((FETCHED if entry.fetched else STORED, key))
            if self.listener is not None:
                self.listener.chunk_ready(entry)
        elif entry.refs:
            self._become(entry, State.EVICTING)  # freed when the last holder lets go
        else:
            self._drop(entry)
        return entry

    def hold(self, entry: Entry) -> None:
        """Keep a chunk in any state from being evicted (an upload reads its slot)."""
        entry.refs += 1

    def pin(self, key: bytes) -> Entry:
        entry = self._entries[key]
        if entry.state is not State.READY:
            raise ValueError(f"cannot pin chunk in state {entry.state.value}")
        entry.refs += 1
        self._entries.move_to_end(key)
        if self.tenancy is not None:
            self.tenancy.touch(entry)
        if self.ghost_events is not None:
            self.ghost_events((TOUCHED, key))
        return entry

    def unpin(self, key: bytes) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.refs <= 0:
            raise ValueError(f"unbalanced unpin of {key!r}")
        entry.refs -= 1
        if entry.refs == 0 and entry.state is State.EVICTING:
            self._drop(entry)

    def touch(self, key: bytes) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)
            if self.tenancy is not None:
                self.tenancy.touch(self._entries[key])
            if self.ghost_events is not None:
                self.ghost_events((TOUCHED, key))

    def soft_pin(self, key: bytes, ttl_s: float, tenant: int) -> bool:
        """Soft-pin ``key``'s chunk for ``ttl_s`` seconds, asked by a request of ``tenant``
        (:mod:`kvtier.host.tenants`: only ``pin_tenants`` may). False when nothing pins."""
        entry = self._entries.get(key)
        if entry is None or self.tenancy is None or entry.state is State.EVICTING:
            return False
        return self.tenancy.pin(entry, ttl_s, tenant)

    def evict(self, key: bytes) -> bool:
        """Evict one chunk now (or as soon as its refs drop). Returns False if absent."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        if self.ghost_events is not None:
            self.ghost_events((EVICTED, key))
        if entry.refs:
            self._become(entry, State.EVICTING)
        else:
            self._drop(entry)
        return True

    def clear(self) -> int:
        """Empty the index: drop every idle ready chunk now (returns how many), and
        every other one (pinned by a load or an upload, being stored or fetched) as soon
        as it is released or settles. None of them is a hit again: after a reset
        (vLLM's ``reset_prefix_cache``, and so sleep mode, where weights may change)
        nothing stored before it is served."""
        victims = [e for e in self._entries.values() if e.refs == 0 and e.state is State.READY]
        for entry in victims:
            self._drop(entry)
        for entry in self._entries.values():
            self._become(entry, State.EVICTING)
        if self.ghost_events is not None:
            self.ghost_events((CLEARED, b""))
        return len(victims)

    # ---- internals ---------------------------------------------------------------------
    def _take_slot(self, evict_ok: bool, tenant: int = 0) -> int | None:
        """A free slot, else the least recently used idle chunk's slot. Chunks that must be
        written back first are passed over; the oldest of them begins its write-back (one
        per call), and when nothing else can go the caller gets None (the store is skipped,
        the slot frees once that upload is done)."""
        if self.tenancy is not None:
            return self._take_tenant_slot(self.tenancy, evict_ok, tenant)
        if self._free:
            return self._free.pop()
        if not evict_ok:
            return None
        began = False
        for entry in self._entries.values():
            if entry.state is not State.READY or entry.refs:
                continue
            if self._write_back_needed is not None and self._write_back_needed(entry):
                if not began:
                    began = True
                    self.evictions += 1
                    self.evicted_by["lru"] += 1
                    self._become(entry, State.EVICTING)
                    entry.refs += 1
                    if self._begin_write_back is not None:
                        self._begin_write_back(entry)
                continue
            self.evictions += 1
            self.evicted_by["lru"] += 1
            self._drop(entry)
            return self._free.pop()  # the slot _drop just freed
        return None

    def _take_tenant_slot(self, tenancy: TenantHooks, evict_ok: bool, tenant: int) -> int | None:
        """:meth:`_take_slot` under tenants (kvtier.host.tenants): a tenant at its quota
        replaces its own chunks, free slots or not; else a free slot; else a victim in the
        order :meth:`TenantHooks.victims` gives (never another tenant's within its quota)."""
        tenancy.expire()
        if tenancy.at_quota(tenant):
            return self._evict_first(tenancy.own_victims(tenant))
        if self._free:
            return self._free.pop()
        if not evict_ok:
            return None
        return self._evict_first(tenancy.victims(tenant))

    def _evict_first(self, groups: Iterator[tuple[Iterable[Entry], str]]) -> int | None:
        """The first idle ready candidate's slot (groups of candidates in order, each with
        its reason), counted under its reason. As in :meth:`_take_slot`, the first one that
        must be written back first begins its write-back instead (one per call); the lists
        change only after the walk."""
        write_back: tuple[Entry, str] | None = None
        victim: tuple[Entry, str] | None = None
        needed = self._write_back_needed
        ready = State.READY
        for entries, reason in groups:
            for entry in entries:
                if entry.state is not ready or entry.refs:
                    continue
                if needed is not None and needed(entry):
                    write_back = write_back or (entry, reason)
                    continue
                victim = (entry, reason)
                break
            if victim is not None:
                break
        if write_back is not None:
            entry, reason = write_back
            self.evictions += 1
            self.evicted_by[reason] += 1
            self._become(entry, State.EVICTING)
            entry.refs += 1
            if self._begin_write_back is not None:
                self._begin_write_back(entry)
        if victim is None:
            return None
        entry, reason = victim
        self.evictions += 1
        self.evicted_by[reason] += 1
        self._drop(entry)
        return self._free.pop()

    def _become(self, entry: Entry, state: State) -> None:
        """Every state change of an entry in the index goes through here (the ready set)."""
        if state is State.READY:
            self._ready.add(entry.key)
            if self.tenancy is not None and entry.state is not State.READY:
                entry.state = state
                self.tenancy.ready(entry)
        elif entry.state is State.READY:
            self._ready.discard(entry.key)
            if self.tenancy is not None:
                self.tenancy.unready(entry)
        entry.state = state

    def _drop(self, entry: Entry) -> None:
        del self._entries[entry.key]
        self._ready.discard(entry.key)
        if self.tenancy is not None:
            if entry.state is State.READY:
                self.tenancy.unready(entry)
            self.tenancy.uncharge(entry)
        self._free.append(entry.slot)
        if self.listener is not None:
            self.listener.chunk_dropped(entry)

    def check(self) -> None:
        """Assert the invariants (tests and debug): every slot is free xor owned once."""
        owned = (
            [e.slot for e in self._entries.values()] + list(self._superseded) + list(self._reserved)
        )
        assert len(owned) == len(set(owned)), "a slot is owned twice"
        assert not set(owned) & set(self._free), "a slot is both free and owned"
        assert len(owned) + len(self._free) == self.num_slots, "a slot leaked"
        assert all(e.refs >= 0 for e in self._entries.values())
        ready = {e.key for e in self._entries.values() if e.state is State.READY}
        assert self._ready == ready, "the ready set is not the ready entries"
