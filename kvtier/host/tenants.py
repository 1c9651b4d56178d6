"""Who keeps the host tier: per-tenant quotas and soft pins (issue 60).

One rule, whatever the settings (docs/operations.md, "Tenants"):

- **A tenant at its quota replaces its own least recently used chunks**, even while
  slots are free: a quota is a cap, so one tenant's flood never grows past it. Those
  evictions are counted as ``kvtier:evictions_total{reason="tenant_quota"}``; a store is
  never dropped silently (when none of its own chunks can go, it is a counted
  ``stores_skipped``).
- **A store never evicts another tenant's chunk while that tenant is within its quota.**
  Other tenants' chunks a store may take, in order: those of a tenant holding more than its
  quota (``tenant_quota``), then those of tenants without a quota (one shared LRU), then the
  storing tenant's own. A tenant without a quota (none named and no ``"*"``) is neither
  capped nor protected: without ``tenant_quotas`` the tier is the one LRU it always was.
- **A chunk counts once, to the tenant that stored (or fetched) it.** Another tenant's hit
  renews its place in its owner's LRU but does not move it: ownership never changes, so a
  hit costs no bookkeeping beyond the LRU move, no tenant can push its usage onto another
  by reading its chunks, and the tenant that paid for the prefill is the one whose quota
  keeps it.
- **Soft pins.** A pinned chunk (a request of a tenant in ``pin_tenants`` with
  ``pin_ttl_s``) is evicted only when no unpinned chunk can go; pins hold at most
  ``pin_max_fraction`` of the slots, the least recently renewed pin yields first; a hit
  renews the TTL; an expired or yielded pin is an ordinary chunk again, the oldest of its
  tenant's. Pins count to their owner's quota.

Cost: O(1) per store, hit and eviction (a dict move per list; the walks skip only chunks
being loaded or uploaded, as the plain LRU does). Each ready chunk is in one ordered dict
besides the index's own (its tenant's, the shared one, or the pins'); a pin's deadline and
TTL are kept beside it, off the chunk's record. Tenants are small ints on the record.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping

from kvtier.host.index import Entry, State

#: the tenant of requests that name none (and of those whose name was refused)
UNTAGGED = 0
#: its label on the metrics
UNTAGGED_LABEL = "untagged"
#: the label of every tenant past ``tenant_metrics_max``
OTHER_LABEL = "other"
#: distinct tenant names one engine keeps apart; later new names run untagged
MAX_TENANTS = 4096
#: eviction reasons (the ``reason`` label of kvtier:evictions_total)
LRU, TENANT_QUOTA, PINNED = "lru", "tenant_quota", "pinned"


class Tenancy:
    """Tenants, their quotas (in slots) and usage, their LRU lists and the soft pins.

    The index (:class:`kvtier.host.index.ChunkIndex`) calls :meth:`charge` and
    :meth:`uncharge` as a slot is taken and freed, :meth:`ready` and :meth:`unready` as a
    chunk turns ready and stops being ready, :meth:`touch` on a hit; it asks
    :meth:`at_quota`, :meth:`own_victims` and :meth:`victims` when it needs a slot."""

    def __init__(
        self,
        num_slots: int,
        *,
        quotas: Mapping[str, int] | None = None,
        pin_tenants: frozenset[str] = frozenset(),
        pin_max_fraction: float = 0.5,
        metrics_max: int = 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``quotas``: tenant name -> slots, ``"*"`` for every tenant not named (the
        untagged ones included); ``pin_tenants``: who may pin (``"*"``: anyone)."""
        quotas = dict(quotas or {})
        self._star = quotas.pop("*", None)
        self._quotas = quotas
        self._pin_any = "*" in pin_tenants
        self._pin_tenants = pin_tenants
        self.max_pins = int(pin_max_fraction * num_slots)
        self.metrics_max = metrics_max
        self.clock = clock
        self._ids: dict[str, int] = {}
        self.names: list[str] = []
        #: per tenant id: its quota in slots (None: no quota), slots it holds, its ready
        #: unpinned chunks oldest first (tenants without a quota share ``_pool``)
        self.quota: list[int | None] = []
        self.used: list[int] = []
        self._lru: list[OrderedDict[bytes, Entry]] = []
        self.may_pin: list[bool] = []
        #: per tenant id its metrics label, and slots held per label (kept as slots are
        #: taken and freed, so the step's gauges cost the labels, not the tenants)
        self._label_of: list[str] = []
        self._label_used: dict[str, int] = {}
        self._pool: OrderedDict[bytes, Entry] = OrderedDict()
        #: tenants with a quota holding more than it (a quota met by fetches in flight)
        self._over: set[int] = set()
        #: ready pinned chunks, least recently renewed first; key -> (deadline, ttl)
        self._pinned: OrderedDict[bytes, Entry] = OrderedDict()
        #: the same per tenant id, in the same order (a tenant at its quota looks at its
        #: own pins without walking everybody's)
        self._pinned_by: dict[int, OrderedDict[bytes, Entry]] = {}
        self._pin_times: dict[bytes, tuple[float, float]] = {}
        #: (deadline, key), at most one per pinned key (a renewal re-pushes it when popped)
        self._expiry: list[tuple[float, bytes]] = []
        self._queued: set[bytes] = set()
        #: pins asked for chunks not ready yet (being stored or fetched): key -> ttl
        self._pending: dict[bytes, float] = {}
        self._add("")  # UNTAGGED

    # ---- tenants -------------------------------------------------------------------
    def tenant_id(self, name: str | None) -> int:
        """The id of tenant ``name`` (None or "": untagged), made on first use; past
        :data:`MAX_TENANTS` names a new one runs untagged."""
        if not name:
            return UNTAGGED
        tid = self._ids.get(name)
        if tid is None:
            if len(self.names) >= MAX_TENANTS:
                return UNTAGGED
            tid = self._add(name)
        return tid

    def _add(self, name: str) -> int:
        tid = len(self.names)
        self._ids[name] = tid
        self.names.append(name)
        self.quota.append(self._quotas.get(name, self._star))  # untagged: "*" too
        self.used.append(0)
        self._lru.append(OrderedDict() if self.quota[tid] is not None else self._pool)
        self.may_pin.append(bool(name) and (self._pin_any or name in self._pin_tenants))
        label = self.label(tid)
        self._label_of.append(label)
        self._label_used.setdefault(label, 0)
        return tid

    def label(self, tid: int) -> str:
        """The ``tenant`` label: its name for the first ``metrics_max`` tenants seen,
        "untagged", or "other" (bounded cardinality)."""
        if tid == UNTAGGED:
            return UNTAGGED_LABEL
        return self.names[tid] if tid <= self.metrics_max else OTHER_LABEL

    def usage_by_label(self) -> dict[str, int]:
        """Slots held per ``tenant`` label (every label seen so far, 0 included): at most
        ``metrics_max`` + 2 of them."""
        return dict(self._label_used)

    @property
    def pinned(self) -> int:
        return len(self._pinned)

    # ---- the index's hooks ---------------------------------------------------------
    def charge(self, entry: Entry) -> None:
        t = entry.tenant
        self.used[t] += 1
        self._label_used[self._label_of[t]] += 1
        q = self.quota[t]
        if q is not None and self.used[t] > q:
            self._over.add(t)

    def uncharge(self, entry: Entry) -> None:
        t = entry.tenant
        self.used[t] -= 1
        self._label_used[self._label_of[t]] -= 1
        q = self.quota[t]
        if q is not None and self.used[t] <= q:
            self._over.discard(t)
        self._pending.pop(entry.key, None)

    def ready(self, entry: Entry) -> None:
        ttl = self._pending.pop(entry.key, None)
        self._lru[entry.tenant][entry.key] = entry
        if ttl is not None:
            self._pin(entry, ttl)

    def unready(self, entry: Entry) -> None:
        key = entry.key
        if self._pinned.pop(key, None) is None:
            self._lru[entry.tenant].pop(key, None)
        else:
            del self._pin_times[key]
            del self._pinned_by[entry.tenant][key]

    def touch(self, entry: Entry) -> None:
        """A hit (a load, or a store finding it there): its LRU place, and a pin's TTL."""
        key = entry.key
        times = self._pin_times.get(key)
        if times is not None:
            self._pin_times[key] = (self.clock() + times[1], times[1])
            self._pinned.move_to_end(key)
            self._pinned_by[entry.tenant].move_to_end(key)
            return
        lru = self._lru[entry.tenant]
        if key in lru:
            lru.move_to_end(key)

    def pin(self, entry: Entry, ttl_s: float, by: int) -> bool:
        """Soft-pin ``entry`` for ``ttl_s`` seconds from now (renewed by each hit) for
        tenant ``by``, if it may pin (``pin_tenants``); a chunk not ready yet is pinned when
        it turns ready. Pins past ``max_pins``: the least recently renewed yields."""
        if not self.may_pin[by] or ttl_s <= 0 or self.max_pins <= 0:
            return False
        self._pin(entry, ttl_s)
        return True

    def _pin(self, entry: Entry, ttl_s: float) -> None:
        key = entry.key
        if entry.state is not State.READY:
            self._pending[key] = ttl_s
            return
        if self.max_pins <= 0:
            return
        self._pin_times[key] = (self.clock() + ttl_s, ttl_s)
        own = self._pinned_by.setdefault(entry.tenant, OrderedDict())
        if key in self._pinned:
            self._pinned.move_to_end(key)
            own.move_to_end(key)
        else:
            self._lru[entry.tenant].pop(key, None)
            self._pinned[key] = entry
            own[key] = entry
            if key not in self._queued:
                self._queued.add(key)
                heapq.heappush(self._expiry, (self._pin_times[key][0], key))
        while len(self._pinned) > self.max_pins:
            self._unpin(next(iter(self._pinned.values())))

    def _unpin(self, entry: Entry) -> None:
        """An ordinary chunk again, the oldest of its tenant's (it went unrenewed longest)."""
        key = entry.key
        del self._pinned[key]
        del self._pin_times[key]
        del self._pinned_by[entry.tenant][key]
        lru = self._lru[entry.tenant]
        lru[key] = entry
        lru.move_to_end(key, last=False)

    def pins_left(self, limit: int) -> dict[bytes, float]:
        """The pinned chunks and the seconds each pin has left (those asked for chunks not
        ready yet: their whole TTL), the ``limit`` with the most left: what the object
        tier's manifest records (:mod:`kvtier.objects.tenant_keys`, ``Pins``)."""
        now = self.clock()
        left = {
            key: deadline - now for key, (deadline, _) in self._pin_times.items() if deadline > now
        }
        for key, ttl in self._pending.items():
            left[key] = max(left.get(key, 0.0), ttl)
        if len(left) > limit:
            left = dict(sorted(left.items(), key=lambda kv: -kv[1])[:limit])
        return left

    def expire(self) -> None:
        """Pins past their deadline turn ordinary (amortised O(1): one heap item each)."""
        now = self.clock()
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, key = heapq.heappop(heap)
            times = self._pin_times.get(key)
            if times is None:
                self._queued.discard(key)
            elif times[0] <= now:
                self._queued.discard(key)
                self._unpin(self._pinned[key])
            else:  # renewed since: its next deadline
                heapq.heappush(heap, (times[0], key))

    # ---- choosing victims ----------------------------------------------------------
    def at_quota(self, tid: int) -> bool:
        q = self.quota[tid]
        return q is not None and self.used[tid] >= q

    def own_victims(self, tid: int) -> Iterator[tuple[Iterable[Entry], str]]:
        """A tenant at its quota: its own chunks, unpinned oldest first, then its pins
        (groups of candidates, oldest first, each with its eviction reason)."""
        yield self._lru[tid].values(), TENANT_QUOTA
        yield self._pinned_by.get(tid, {}).values(), TENANT_QUOTA

    def victims(self, tid: int) -> Iterator[tuple[Iterable[Entry], str]]:
        """A tenant within its quota and no slot free: over-quota tenants' chunks, the
        unquota'd tenants' LRU, its own chunks, then pins (oldest renewed first) of tenants
        not protected by a quota. Never a chunk of another tenant within its quota."""
        for other in list(self._over):
            yield self._lru[other].values(), TENANT_QUOTA
        yield self._pool.values(), LRU
        if self.quota[tid] is not None:
            yield self._lru[tid].values(), LRU
        quota, over = self.quota, self._over
        yield (
            (
                e
                for e in self._pinned.values()
                if e.tenant == tid or quota[e.tenant] is None or e.tenant in over
            ),
            PINNED,
        )

    def check(self) -> None:
        """Assert the accounting (tests): lists hold ready chunks once, usage adds up."""
        seen: set[bytes] = set()
        for lru in [self._pool, *(d for d in self._lru if d is not self._pool), self._pinned]:
            assert not seen & lru.keys(), "a chunk in two lists"
            seen |= lru.keys()
        assert set(self._pin_times) == set(self._pinned), "pin times out of step"
        by_tenant = [(k, e.tenant) for k, e in self._pinned.items()]
        assert sorted(by_tenant, key=lambda kt: kt[1]) == sorted(
            ((k, t) for t, own in self._pinned_by.items() for k in own), key=lambda kt: kt[1]
        ), "pins per tenant out of step"
        for t, own in self._pinned_by.items():
            assert list(own) == [k for k, tt in by_tenant if tt == t], "pin order per tenant"
        assert len(self._pinned) <= max(0, self.max_pins), "pins over their fraction"
        by_label: dict[str, int] = dict.fromkeys(self._label_used, 0)
        for tid, n in enumerate(self.used):
            by_label[self._label_of[tid]] += n
        assert by_label == self._label_used, "usage by label out of step"
