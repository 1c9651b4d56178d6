"""Hand-off on drain: the scheduler lists the hot chunks the object tier lacks
(connectors/scheduler/hot.py), and a draining worker writes them first, hottest first, within
``shutdown_flush_s`` (connectors/worker/shutdown.py), counting what it wrote and what it left."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from copyfakes import make_caches

from kvtier import metrics
from kvtier.config import load_config
from kvtier.connectors.metadata import FetchOp, KVTierMetadata, StoreOp
from kvtier.connectors.scheduler.hot import HotChunks
from kvtier.connectors.worker import side as worker_mod
from kvtier.connectors.worker.shutdown import hand_off
from kvtier.host.index import ChunkIndex, Entry, State
from kvtier.keys import Namespace
from kvtier.objects.remote import RemoteIO
from kvtier.objects.tiers import FileTier
from kvtier.ops import OpKind, OpResult, Put
from kvtier.stats import series_id

NUM_BLOCKS, BS, BPC = 40, 32, 4
KV_FIRST = (2, NUM_BLOCKS, BS, 4, 16)


def key(c: str) -> bytes:
    return c.encode() * 32


# ---- the scheduler's list ----------------------------------------------------------------


def _ready(index: ChunkIndex, k: bytes) -> Entry:
    entry = index.begin(k, State.STORING)
    assert entry is not None
    assert index.commit(k, True) is entry
    return entry


def test_the_scheduler_lists_hot_chunks_the_object_tier_lacks_hottest_first() -> None:
    index = ChunkIndex(8)
    now = [100.0]
    hot = HotChunks(
        index,
        lambda e: not e.remote,
        send_s=30,
        handoff_s=30,
        clock=lambda: now[0],
        wall=lambda: 5000.0,
    )
    a, b, c, d, e = (_ready(index, key(x)) for x in "abcde")
    c.remote = True  # uploaded already (or host-only)
    d.uploading = True  # its upload is in flight
    storing = index.begin(key("f"), State.STORING)
    assert storing is not None
    for k, n in ((b"a", 1), (b"b", 3), (b"c", 5), (b"d", 4), (b"e", 2), (b"f", 6), (b"g", 7)):
        for _ in range(n):
            hot.hit(key(k.decode()))
    assert hot.report() == (None, None), "not time yet: nothing sent"
    now[0] += 29
    assert hot.report() == (None, None)
    now[0] += 1
    heat, handoff = hot.report()
    assert heat is not None and heat.at == 5000.0 and len(heat) == 7
    assert heat.entries[0] == (key("g"), 7.0)
    assert handoff == ((key("b"), b.slot), (key("e"), e.slot), (key("a"), a.slot))
    now[0] += 30
    assert hot.report() == (None, None), "no hit since, the same list: nothing sent"
    index.evict(key("b"))
    now[0] += 30
    assert hot.report() == (None, ((key("e"), e.slot), (key("a"), a.slot)))


def test_the_hand_off_list_names_the_latest_hits_within_a_second() -> None:
    """An engine that serves for under SEND_S, or goes idle, before it drains: the hand-off
    list is brought up to date every HANDOFF_S with the hits not yet taken into the heat,
    most hit first, ahead of the older hot list (the drain writes what it last named)."""
    index = ChunkIndex(8)
    now = [100.0]
    hot = HotChunks(
        index,
        lambda e: not e.remote,
        send_s=30,
        handoff_s=1,
        clock=lambda: now[0],
        wall=lambda: 5000.0,
    )
    a, b, c = (_ready(index, key(x)) for x in "abc")
    for _ in range(2):
        hot.hit(key("a"))
    assert hot.report() == (None, None), "the first report starts the clocks"
    now[0] += 1
    assert hot.report() == (None, ((key("a"), a.slot),)), "a second later: named, no heat"
    now[0] += 0.5
    for _ in range(3):
        hot.hit(key("c"))
    hot.hit(key("b"))
    assert hot.report() == (None, None), "within the second: not yet"
    now[0] += 0.5
    assert hot.report() == (None, ((key("c"), c.slot), (key("a"), a.slot), (key("b"), b.slot)))
    now[0] += 1
    assert hot.report() == (None, None), "unchanged: nothing sent"
    now[0] += 30
    heat, handoff = hot.report()
    assert heat is not None and len(heat) == 3 and handoff is None, "taken, the same list"


def test_a_scheduler_counts_its_loads_and_sends_them_with_the_hand_off_list() -> None:
    """Through SchedulerSide: a prompt stored under write_back (not uploaded), then hit
    twice; after SEND_S the step's metadata carries those hits (a chunk per load) and the
    chunks as the hand-off list, the hottest (the whole prompt, hit as often) first."""
    from tests.connectors.scheduler.test_scheduler_side import (
        report,
        request,
        run_prompt,
        schedule_new,
        write_back_side,
    )

    side = write_back_side("4MiB")
    assert side.write_back.enabled, "a trusted generation: write_back uploads"
    now = [0.0]
    side.hot.clock = lambda: now[0]
    run_prompt(side, request("a", 1, 2048), first_block=100)
    for n in range(2):
        b = request(f"b{n}", 1, 2048)
        assert side.get_num_new_matched_tokens(b, 0) == (2016, False)
        side._kv_cache_manager.blocks[b.request_id] = list(range(500, 564))
        side.update_state_after_alloc(b, None, 2016)
        meta = schedule_new(side, b, 2016, 32, first_block=500)
        assert meta.heat is None and meta.handoff is None, "not time yet"
        report(side, meta)
        side.request_finished(b, [])
    now[0] += 30
    meta = schedule_new(side, request("c", 9, 64), 0, 64, first_block=700)
    assert meta.heat is not None and len(meta.heat) == 8
    assert {h for _, h in meta.heat.entries} == {2.0}
    assert meta.handoff is not None and len(meta.handoff) == 8
    for k, slot in meta.handoff:
        entry = side.index.get(k)
        assert entry is not None and entry.slot == slot and not entry.remote
    # equally hot: in key order, the same on every engine
    assert [k for k, _ in meta.handoff] == sorted(k for k, _ in meta.heat.entries)


# ---- the worker's drain ----------------------------------------------------------------


class Recording(FileTier):
    """A directory that records the keys of the chunks written to it, in order."""

    def __init__(self, root: str) -> None:
        super().__init__(root, background_sweep=False)
        self.puts: list[str] = []

    def put(self, key: str, parts: Any) -> None:
        if "manifest" not in key and "reclaim" not in key:
            self.puts.append(key)
        super().put(key, parts)


def _worker(tmp_path: Path) -> tuple[worker_mod.WorkerSide, Recording]:
    cfg = load_config(
        {
            "cpu_bytes": "64MiB",
            "chunk_size": BPC * BS,
            "write_policy": "write_back",
            "remote_url": f"file://{tmp_path}",
        },
        environ={},
    )
    ns = Namespace("", None, "bfloat16", "auto", BS, BPC * BS, 1, fingerprint="f" * 32, label="m")
    tier = Recording(str(tmp_path))

    def remote(c: Any) -> RemoteIO:  # one write thread: the writes land in queue order
        return RemoteIO(tier, threads=2, queue_depth=8, timeout_s=5, signer=None)

    w = worker_mod.WorkerSide(cfg, ns, NUM_BLOCKS, remote)
    w.register_kv_caches(make_caches(KV_FIRST, layers=2), rank=0, stage=0)
    assert w.slab is not None and w.remote is not None and w.remote.write_threads == 1
    return w, tier


def _step(w: worker_mod.WorkerSide, step: int, **ops: Any) -> None:
    assert w.slab is not None
    meta = KVTierMetadata(step=step, host_bytes=w.slab.nbytes, **ops)
    w.start_load_kv(meta)
    w.wait_for_save(meta)


def test_a_draining_worker_writes_the_hot_list_first_hottest_first(
    tmp_path: Path, caplog: Any
) -> None:
    w, tier = _worker(tmp_path)
    stores = [
        StoreOp(i + 1, slot, [4 * slot + j for j in range(4)], key(x))
        for i, (slot, x) in enumerate([(0, "a"), (1, "b"), (2, "c"), (3, "d")])
    ]
    _step(w, 1, stores=stores)
    # since: slot 1 stored over with another chunk, slot 3 fetched into
    _step(
        w,
        2,
        stores=[StoreOp(10, 1, [20, 21, 22, 23], key("x"))],
        fetches=[[FetchOp(11, 3, key("y"))]],
    )
    hot = ((key("c"), 2), (key("b"), 1), (key("a"), 0), (key("d"), 3), (key("e"), 5))
    _step(w, 3, handoff=hot)
    assert [p.op_id for p in w.handoff_puts()] == [-1, -2], "only slots still holding them"
    with caplog.at_level(logging.INFO, logger="kvtier"):
        w.shutdown()
    assert tier.puts == [w._object_key(key("c")), w._object_key(key("a"))]
    report = w.last_handoff
    assert report is not None and (report.chunks, report.written, report.left) == (2, 2, 0)
    counted = w.stats.take()["counters"]
    assert counted.get(series_id(metrics.HANDOFF_CHUNKS, ("written",))) == 2, counted
    assert counted.get(series_id(metrics.HANDOFF_CHUNKS, ("left",)), 0) == 0, counted
    assert "handed off 2 of 2 hot chunks" in caplog.text


def test_a_weight_change_voids_the_list_and_the_slots(tmp_path: Path) -> None:
    """After a weight change the slots hold the old identity's bytes: writing them under
    the new keys would serve another model's KV."""
    w, tier = _worker(tmp_path)
    _step(w, 1, stores=[StoreOp(1, 0, [0, 1, 2, 3], key("a"))], handoff=((key("a"), 0),))
    _step(w, 2, weights_epoch=1, weights_salt=b"s")
    assert w.handoff == () and w.handoff_puts() == []
    w.shutdown()
    assert tier.puts == [] and w.last_handoff is None


# ---- the drive, against a queue that takes time --------------------------------------------


class SlowQueue:
    """A RemoteIO's surface: a write queue of ``depth`` and one write thread taking
    ``per_put_s`` of the fake clock per write; keys in ``failing`` fail."""

    write_threads = 1

    def __init__(
        self,
        clock: list[float],
        per_put_s: float,
        depth: int = 1,
        failing: frozenset[str] = frozenset(),
    ) -> None:
        self.clock, self.per_put_s, self.depth, self.failing = clock, per_put_s, depth, failing
        self.queue: list[Put] = []
        self.order: list[str] = []
        self.refused = 0
        self.busy_until = clock[0]

    def submit_put(
        self,
        op_id: int,
        key: str,
        payload: memoryview,
        *,
        dtype: str,
        shape: list[int],
        first: bool = False,
    ) -> bool:
        assert first, "a hand-off goes ahead of the queued uploads"
        if len(self.queue) >= self.depth:
            self.refused += 1
            return False
        if not self.queue:
            self.busy_until = self.clock[0] + self.per_put_s
        self.queue.append(Put(op_id, key, payload, dtype, shape))
        return True

    def poll(self) -> list[OpResult]:
        out = []
        while self.queue and self.clock[0] >= self.busy_until:
            op = self.queue.pop(0)
            self.order.append(op.key)
            out.append(OpResult(op.op_id, OpKind.UPLOAD, op.key not in self.failing))
            self.busy_until += self.per_put_s
        return out


def _puts(n: int) -> list[Put]:
    return [Put(-1 - i, f"k{i}", memoryview(b"x"), "u8", [1]) for i in range(n)]


def _drive(q: SlowQueue, clock: list[float], n: int, within: float, window: int = 0) -> Any:
    def wait(s: float) -> None:
        clock[0] += s

    return hand_off(
        q,  # type: ignore[arg-type]
        _puts(n),
        clock[0] + within,
        clock=lambda: clock[0],
        wait=wait,
        window=window,
    )


def test_the_drive_writes_in_order_and_counts_what_the_time_left() -> None:
    clock = [0.0]
    q = SlowQueue(clock, per_put_s=1.0, depth=2)
    report = _drive(q, clock, 10, within=4.5)
    assert q.order == ["k0", "k1", "k2", "k3"], "hottest first, the rest left"
    assert (report.chunks, report.written, report.failed, report.left) == (10, 4, 0, 6)
    assert "handed off 4 of 10" in report.describe() and "6 left" in report.describe()


def test_a_full_queue_is_offered_again_and_a_failed_write_is_left() -> None:
    clock = [0.0]
    q = SlowQueue(clock, per_put_s=0.01, depth=1, failing=frozenset({"k1"}))
    report = _drive(q, clock, 4, within=100.0, window=3)  # more than the queue takes
    assert q.refused > 0, "the queue refused some: they were offered again"
    assert q.order == ["k0", "k1", "k2", "k3"]
    assert (report.written, report.failed, report.left) == (3, 1, 1)
    assert report.seconds < 100.0, "it stops once every write is reported"


# ---- ahead of the queued uploads -----------------------------------------------------------


def test_the_write_queue_takes_first_uploads_ahead_in_their_order() -> None:
    from kvtier.objects.io_queue import QueuedOp, WriteQueue

    def op(name: str, first: bool = False) -> QueuedOp:
        o = QueuedOp(0, 0, OpKind.UPLOAD, name, 5.0)
        o.first = first
        return o

    q = WriteQueue(maxsize=8)
    for o in (op("a"), op("b"), op("h1", True), op("h2", True), op("c")):
        q.put_nowait(o)
    got = [q.get_nowait().key for _ in range(2)]  # type: ignore[union-attr]
    q.put_nowait(op("h3", True))
    q.put(None)  # close()'s stop request: an ordinary item
    rest = [q.get_nowait() for _ in range(q.qsize())]
    assert got + [o.key if o else None for o in rest] == ["h1", "h2", "h3", "a", "b", "c", None]


class Gate(Recording):
    """A directory whose first chunk write waits until the test opens the gate."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        import threading

        self.gate = threading.Event()
        self.waiting = threading.Event()

    def put(self, key: str, parts: Any) -> None:
        if not self.puts and "manifest" not in key and "reclaim" not in key:
            self.waiting.set()
            assert self.gate.wait(10)
        super().put(key, parts)


def test_a_hand_off_goes_ahead_of_the_uploads_already_queued(tmp_path: Path) -> None:
    tier = Gate(str(tmp_path))
    rio = RemoteIO(tier, threads=2, queue_depth=8, timeout_s=5, signer=None)
    data = memoryview(bytearray(64))
    try:
        for i in range(3):  # the first holds the one write thread, two stay queued
            assert rio.submit_put(i + 1, f"cold{i}", data, dtype="u8", shape=[64])
        assert tier.waiting.wait(10)

        def wait(s: float) -> None:  # first called once both hot puts are queued
            tier.gate.set()
            time.sleep(s)

        report = hand_off(
            rio,
            [Put(-1 - i, f"hot{i}", data, "u8", [64]) for i in range(2)],
            float("inf"),
            wait=wait,
        )
        assert report.written == 2
        assert rio.flush(10) == 0
    finally:
        rio.close()
    assert tier.puts.index("hot1") < tier.puts.index("cold1"), tier.puts
    assert tier.puts[0] == "cold0" and tier.puts.index("hot0") < tier.puts.index("hot1")
