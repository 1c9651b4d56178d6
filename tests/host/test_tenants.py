"""The host tier's tenants (kvtier.host.tenants): quotas, soft pins, who a chunk counts to.

The rule, checked op by op under random workloads (hypothesis) and case by case: a tenant
at its quota replaces its own oldest chunks; a store never evicts a chunk of another tenant
within its quota; pins hold at most pin_max_fraction of the slots and go last.
"""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.host.index import ChunkIndex, Entry, State
from kvtier.host.tenants import LRU, PINNED, TENANT_QUOTA, Tenancy


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Drops:
    """The index's listener: which entries left, in order."""

    def __init__(self) -> None:
        self.dropped: list[Entry] = []

    def chunk_ready(self, entry: Entry) -> None:
        pass

    def chunk_dropped(self, entry: Entry) -> None:
        self.dropped.append(entry)


def tier(
    slots: int,
    quotas: dict[str, int] | None = None,
    pins: tuple[str, ...] = (),
    fraction: float = 0.5,
    write_back: bool = False,
) -> tuple[ChunkIndex, Tenancy, Clock, Drops]:
    clock = Clock()
    uploads: list[Entry] = []
    idx = ChunkIndex(
        slots,
        write_back_needed=(lambda e: not e.remote) if write_back else None,
        begin_write_back=uploads.append if write_back else None,
    )
    t = Tenancy(
        slots, quotas=quotas, pin_tenants=frozenset(pins), pin_max_fraction=fraction, clock=clock
    )
    idx.tenancy = t
    drops = Drops()
    idx.listener = drops
    return idx, t, clock, drops


def store(idx: ChunkIndex, key: bytes, tenant: int, ok: bool = True) -> Entry | None:
    entry = idx.begin(key, State.STORING, tenant=tenant)
    if entry is not None:
        idx.commit(key, ok)
    return entry


def hit(idx: ChunkIndex, key: bytes) -> None:
    """A load: pinned by its ref while it runs, released when reported."""
    idx.pin(key)
    idx.unpin(key)


def keys_of(idx: ChunkIndex, t: Tenancy, name: str) -> set[bytes]:
    tid = t.tenant_id(name)
    return {e.key for e in idx.ready_oldest_first() if e.tenant == tid}


def test_a_tenant_at_its_quota_replaces_its_own_oldest_even_with_slots_free() -> None:
    idx, t, _, drops = tier(10, {"a": 3})
    a = t.tenant_id("a")
    for i in range(5):
        store(idx, b"a%d" % i, a)
    assert keys_of(idx, t, "a") == {b"a2", b"a3", b"a4"} and idx.free_slots == 7
    assert [e.key for e in drops.dropped] == [b"a0", b"a1"]
    assert idx.evicted_by == {LRU: 0, TENANT_QUOTA: 2, PINNED: 0}
    hit(idx, b"a2")  # its LRU order: a3 is the oldest now
    store(idx, b"a5", a)
    assert keys_of(idx, t, "a") == {b"a2", b"a4", b"a5"}
    idx.check()
    t.check()


def test_a_flood_never_takes_a_chunk_of_a_tenant_within_its_quota() -> None:
    """Tenant B within its quota keeps every chunk while A (no quota) floods the tier;
    A still hits on its own recent prompts (a quota is not a ban)."""
    idx, t, _, _ = tier(8, {"b": 3})
    a, b = t.tenant_id("a"), t.tenant_id("b")
    for i in range(3):
        store(idx, b"b%d" % i, b)
    for i in range(100):
        store(idx, b"a%d" % i, a)
    assert keys_of(idx, t, "b") == {b"b0", b"b1", b"b2"}
    assert keys_of(idx, t, "a") == {b"a%d" % i for i in range(95, 100)}
    assert idx.evicted_by[LRU] == 95 and idx.evicted_by[TENANT_QUOTA] == 0


def test_untagged_chunks_fall_under_the_star_quota_and_every_unnamed_tenant_has_its_own() -> None:
    idx, t, _, _ = tier(20, {"*": 2, "big": 10})
    for name in ("", "x", "y"):
        for i in range(5):
            store(idx, f"{name}-{i}".encode(), t.tenant_id(name))
    assert [t.used[t.tenant_id(n)] for n in ("", "x", "y")] == [2, 2, 2]
    assert t.quota[t.tenant_id("big")] == 10


def test_a_full_tier_of_protected_tenants_skips_a_store_rather_than_break_a_quota() -> None:
    """Overcommitted quotas (their sum past the tier): a store finding every chunk
    protected is skipped (the caller counts it), never taken from a tenant within its
    quota; the storing tenant's own chunks are the last resort before that."""
    idx, t, _, _ = tier(4, {"*": 3})
    a, b = t.tenant_id("a"), t.tenant_id("b")
    store(idx, b"a0", a)
    store(idx, b"a1", a)
    store(idx, b"b0", b)
    store(idx, b"b1", b)
    assert store(idx, b"b2", b) is not None  # b within quota, no slot: its own oldest
    assert keys_of(idx, t, "a") == {b"a0", b"a1"} and b"b0" not in idx
    c = t.tenant_id("c")
    assert store(idx, b"c0", c) is None  # c holds nothing; a and b are protected
    assert len(idx) == 4


def test_a_chunk_counts_to_the_tenant_that_stored_it_whoever_hits_it() -> None:
    idx, t, _, _ = tier(10, {"a": 2, "b": 2})
    a, b = t.tenant_id("a"), t.tenant_id("b")
    store(idx, b"shared", a)
    assert idx.begin(b"shared", State.STORING, tenant=b) is None  # there already
    hit(idx, b"shared")  # b's hit: still a's
    assert (t.used[a], t.used[b]) == (1, 0)
    assert idx.get(b"shared").tenant == a


def test_pins_go_last_and_never_hold_more_than_their_fraction() -> None:
    idx, t, clock, _ = tier(6, pins=("p",), fraction=0.5)
    p, q = t.tenant_id("p"), t.tenant_id("q")
    for i in range(4):
        store(idx, b"p%d" % i, p)
        assert idx.soft_pin(b"p%d" % i, 60, p)
    # three pins at most (0.5 of 6): the oldest pin, p0, yielded and is ordinary again
    assert t.pinned == 3 and b"p0" not in t._pinned
    for i in range(10):
        store(idx, b"q%d" % i, q)
    assert {b"p1", b"p2", b"p3"} <= set(idx._entries) and b"p0" not in idx
    assert idx.evicted_by[PINNED] == 0
    # a tenant not in pin_tenants pins nothing
    assert not idx.soft_pin(b"q9", 60, q) and t.pinned == 3
    clock.now += 30
    hit(idx, b"p1")  # renewed: 60 s from now
    clock.now += 45  # p2 and p3 expired, p1 has 15 s left
    store(idx, b"q10", q)
    assert t.pinned == 1 and b"p1" in t._pinned
    # the expired pins were the oldest of their tenant's: they go before q's
    assert b"p2" not in idx or b"p3" not in idx
    t.check()
    idx.check()


def test_a_tenant_at_its_quota_looks_at_its_own_pins_only() -> None:
    """Its chunks all pinned, a tenant at its quota replaces its own oldest pin without
    walking the other tenants' older pins (a store cost ~7 ms behind 100,000 of them)."""
    idx, t, _, _ = tier(40, {"a": 4}, pins=("*",), fraction=0.9)
    a, b = t.tenant_id("a"), t.tenant_id("b")
    for i in range(20):  # b's pins are the older ones
        store(idx, b"b%d" % i, b)
        assert idx.soft_pin(b"b%d" % i, 600, b)
    for i in range(4):
        store(idx, b"a%d" % i, a)
        assert idx.soft_pin(b"a%d" % i, 600, a)

    class Everybodys(OrderedDict):
        def values(self):  # type: ignore[override]
            raise AssertionError("walked every tenant's pins")

    t._pinned = Everybodys(t._pinned)
    assert store(idx, b"a4", a) is not None
    assert b"a0" not in idx and all(b"b%d" % i in idx for i in range(20))
    assert idx.evicted_by[TENANT_QUOTA] == 1
    t._pinned = OrderedDict(t._pinned)
    t.check()
    idx.check()


def test_a_pin_asked_while_storing_takes_hold_when_the_chunk_is_ready() -> None:
    idx, t, _, _ = tier(4, pins=("*",))
    p = t.tenant_id("p")
    idx.begin(b"k", State.STORING, tenant=p)
    assert idx.soft_pin(b"k", 10, p) and t.pinned == 0
    idx.commit(b"k", True)
    assert t.pinned == 1
    idx.begin(b"f", State.STORING, tenant=p)
    idx.soft_pin(b"f", 10, p)
    idx.commit(b"f", False)  # a failed store: nothing pinned, nothing charged
    assert t.pinned == 1 and t.used[p] == 1 and not t._pending


def test_a_pinned_chunk_is_evicted_only_once_no_unpinned_one_can_go() -> None:
    idx, t, _, _ = tier(4, pins=("*",), fraction=1.0)
    p = t.tenant_id("p")
    for i in range(4):
        store(idx, b"k%d" % i, p)
    for i in range(3):
        idx.soft_pin(b"k%d" % i, 60, p)
    store(idx, b"n0", p)  # k3 is the one unpinned chunk
    assert b"k3" not in idx and idx.evicted_by[PINNED] == 0
    idx.soft_pin(b"n0", 60, p)
    store(idx, b"n1", p)  # everything is pinned: the oldest pin goes
    assert b"k0" not in idx and idx.evicted_by[PINNED] == 1


def test_write_back_under_tenants_begins_an_upload_instead_of_dropping() -> None:
    idx, t, _, _ = tier(2, {"a": 2}, write_back=True)
    a = t.tenant_id("a")
    store(idx, b"a0", a)
    store(idx, b"a1", a)
    assert store(idx, b"a2", a) is None  # a0 must be uploaded first: its upload begins
    assert idx.get(b"a0").state is State.EVICTING and idx.evicted_by[TENANT_QUOTA] == 1
    idx.unpin(b"a0")  # the upload is done: the slot is free
    assert store(idx, b"a2", a) is not None  # within its quota again: the freed slot
    assert t.used[a] == 2 and idx.evicted_by[TENANT_QUOTA] == 1
    idx.check()
    t.check()


def test_clear_and_supersede_keep_the_accounting() -> None:
    idx, t, _, _ = tier(4, {"a": 3})
    a = t.tenant_id("a")
    idx.begin(b"f", State.FETCHING, tenant=a)
    assert idx.supersede(b"f", a) is not None and t.used[a] == 1
    idx.commit(b"f", True)
    store(idx, b"x", a)
    idx.pin(b"x")
    idx.clear()
    assert t.used[a] == 1  # x is held by its load until it lets go
    idx.unpin(b"x")
    assert t.used[a] == 0 and len(idx) == 0
    t.check()


def test_tenant_labels_are_bounded() -> None:
    t = Tenancy(10, metrics_max=2)
    ids = [t.tenant_id(n) for n in ("a", "b", "c", "d")]
    assert [t.label(i) for i in ids] == ["a", "b", "other", "other"]
    assert t.label(t.tenant_id(None)) == "untagged"
    assert set(t.usage_by_label()) == {"untagged", "a", "b", "other"}


# ---- the rule under random workloads ---------------------------------------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "store", "store", "hit", "pin", "tick", "fail", "load"]),
        st.integers(0, 3),  # tenant
        st.integers(0, 30),  # key
    ),
    max_size=150,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=OPS,
    slots=st.integers(2, 12),
    quotas=st.dictionaries(st.sampled_from(["t1", "t2", "t3", "*"]), st.integers(1, 6)),
    fraction=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
)
def test_no_tenant_within_quota_loses_a_chunk_to_another_and_pins_stay_bounded(
    ops: list[tuple[str, int, int]], slots: int, quotas: dict[str, int], fraction: float
) -> None:
    idx, t, clock, drops = tier(slots, quotas, pins=("t1", "t2"), fraction=fraction)
    names = ["", "t1", "t2", "t3"]
    held: list[bytes] = []  # chunks a load holds (refs) across ops
    for op, who, k in ops:
        tid = t.tenant_id(names[who])
        key = b"k%d" % k
        used_before = list(t.used)
        at_quota = t.at_quota(tid)
        drops.dropped.clear()
        if op in ("store", "fail"):
            store(idx, key, tid, ok=op == "store")
        elif op == "hit" and idx.is_ready(key):
            hit(idx, key)
        elif op == "load" and idx.is_ready(key):
            idx.pin(key)
            held.append(key)
        elif op == "pin":
            idx.soft_pin(key, 10.0, tid)
        elif op == "tick":
            clock.now += 4.0
            if held:
                idx.unpin(held.pop(0))
        for entry in drops.dropped:
            if op not in ("store", "fail"):
                continue
            owner = entry.tenant
            if owner != tid:
                q = t.quota[owner]
                # never another tenant's chunk while it is within its quota
                assert q is None or used_before[owner] > q, (entry, used_before, q)
            if at_quota:
                assert owner == tid  # over quota: only its own chunks go
        assert t.pinned <= int(fraction * slots)
        q = t.quota[tid]
        if op == "store" and q is not None and used_before[tid] <= q:
            assert t.used[tid] <= q  # a store never takes a tenant past its quota
        assert sum(t.used) == len(idx)
        idx.check()
        t.check()
