"""A lookup's chunks read on the submitting thread (``inline_until``), beside the I/O
threads, from a real directory tier: the same results as the I/O threads' alone (verified,
none used after a miss, a forged first chunk a counted miss that ends the run), all
reported by the time the submit returns, within the budget; and which directories count
as local (``reads_local``)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from kit import PAYLOAD_SIZE, before_reads, collect, payload

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.objects import codec
from kvtier.objects.health import ConstantBackoff
from kvtier.objects.remote import RemoteIO
from kvtier.objects.tiers import FileTier
from kvtier.objects.tiers.file import filesystem_type, is_local

SHAPE = [2, 8, 64]
DT = "bfloat16"
LONG = 60.0  # a budget no test reaches


def make_rio(tier: FileTier, signer: bytes = b"k") -> RemoteIO:
    return RemoteIO(
        tier,
        threads=4,
        queue_depth=16,
        timeout_s=5.0,
        signer=codec.Signer(signer),
        backoff=ConstantBackoff(60),
    )


def store(rio: RemoteIO, keys: list[str]) -> None:
    for i, k in enumerate(keys):
        assert rio.submit_put(i, k, payload(int(k[-1])), dtype=DT, shape=SHAPE)
    assert rio.flush(10) == 0
    collect(rio, len(keys))


def read_run(rio: RemoteIO, keys: list[str], budget_s: float) -> list[memoryview]:
    dests = [memoryview(bytearray(PAYLOAD_SIZE)) for _ in keys]
    rio.submit_get_run(
        [(100 + i, k, d) for i, (k, d) in enumerate(zip(keys, dests, strict=True))],
        dtype=DT,
        shape=SHAPE,
        inline_until=time.monotonic() + budget_s,
    )
    return dests


@pytest.fixture
def reads(monkeypatch) -> list[tuple[str, str]]:
    """Every read of the tier: (key, the thread that made it)."""
    seen: list[tuple[str, str]] = []
    before_reads(
        monkeypatch, FileTier, lambda key: seen.append((key, threading.current_thread().name))
    )
    return seen


def test_a_run_read_inline_is_reported_when_the_submit_returns(tmp_path, reads) -> None:
    rio = make_rio(FileTier(str(tmp_path / "t")))
    keys = [f"c{i}" for i in range(6)]
    store(rio, keys)
    dests = read_run(rio, keys, LONG)
    res = {r.op_id: r for r in rio.poll()}  # no waiting: the submit read them
    assert sorted(res) == list(range(100, 106)) and all(r.ok for r in res.values()), res
    assert [bytes(d) for d in dests] == [bytes(payload(i)) for i in range(6)]
    me = threading.current_thread().name
    assert reads[0] == ("c0", me), "the first chunk is read on the submitting thread"
    assert sorted(k for k, _ in reads) == keys, "every chunk read once"
    rio.close()


def test_the_submitting_thread_and_the_io_threads_share_a_run_each_chunk_read_once(
    tmp_path, monkeypatch
) -> None:
    """Once the first chunk was found, the rest are queued and the submitting thread
    serves the queue beside the I/O threads: both read, no chunk is read twice (its slot
    written twice), every chunk is reported by the time the submit returns, and no entry
    this thread read is left in the queue (a second lookup would find it full)."""
    rio = make_rio(FileTier(str(tmp_path / "t")))
    keys = [f"h{i}" for i in range(8)]
    store(rio, keys)
    by: list[tuple[str, str]] = []

    def slow(key: str) -> None:
        by.append((key, threading.current_thread().name))
        time.sleep(0.02)

    before_reads(monkeypatch, FileTier, slow)
    dests = read_run(rio, keys, LONG)
    res = {r.op_id: r for r in rio.poll()}  # no waiting
    assert sorted(res) == list(range(100, 108)) and all(r.ok for r in res.values()), res
    assert [bytes(d) for d in dests] == [bytes(payload(i)) for i in range(8)]
    assert sorted(k for k, _ in by) == keys, by
    me = threading.current_thread().name
    readers = {name for _, name in by}
    assert me in readers and any(n.startswith("kvtier-read") for n in readers), by
    # what this thread read it took off the read queue: nothing left holding its room
    assert rio.queue._rq.qsize() == 0
    rio.close()


def test_a_chunk_an_io_thread_took_but_has_not_started_is_waited_for(tmp_path, monkeypatch) -> None:
    """An I/O thread that took a chunk off the read queue may lose the CPU before it
    marks the read started; the submitter must still wait for that chunk (within its
    hold), not take the chunk for unstarted work of nobody's: every chunk is reported by
    the time the submit returns. Forced: each I/O thread pauses after taking a chunk."""
    rio = make_rio(FileTier(str(tmp_path / "t")))
    keys = [f"p{i}" for i in range(8)]
    store(rio, keys)
    real = rio.queue._execute
    paused: list[str] = []
    took = threading.Event()

    def late_start(op) -> None:
        if threading.current_thread().name.startswith("kvtier-read"):
            paused.append(op.key)
            took.set()
            time.sleep(0.2)  # taken, not yet started, while the submitter reads the rest
        else:  # the submitter reads on once an I/O thread holds a chunk (however loaded
            took.wait(5.0)  # the machine, the case under test always happens)
        real(op)

    monkeypatch.setattr(rio.queue, "_execute", late_start)
    read_run(rio, keys, LONG)
    res = {r.op_id: r for r in rio.poll()}  # no waiting
    assert paused, "no I/O thread took a chunk: nothing was tested"
    assert sorted(res) == list(range(100, 108)) and all(r.ok for r in res.values()), res
    rio.close()


def test_a_chunk_an_io_thread_is_reporting_is_waited_for(tmp_path, monkeypatch) -> None:
    """An I/O thread reporting a chunk may lose the CPU between marking it done and
    publishing its result; a submitter that sees it done must find the result in the next
    poll. Forced: each I/O thread pauses while it builds a result."""
    import kvtier.objects.io_queue as io_queue

    rio = make_rio(FileTier(str(tmp_path / "t")))
    keys = [f"q{i}" for i in range(8)]
    store(rio, keys)
    real = io_queue.OpResult
    paused: list[int] = []

    def late_result(op_id, *args):
        if threading.current_thread().name.startswith("kvtier-read"):
            paused.append(op_id)
            time.sleep(0.2)  # reporting, not yet published, while the submitter waits
        return real(op_id, *args)

    monkeypatch.setattr(io_queue, "OpResult", late_result)
    # the submitting thread reads slowly, so the I/O threads take chunks of the run too
    # (else, on a busy machine, it read all eight before they woke and nothing was tested)
    me = threading.current_thread()

    def slow_on_the_submitter(key: str) -> None:
        if threading.current_thread() is me:
            time.sleep(0.05)

    before_reads(monkeypatch, FileTier, slow_on_the_submitter)
    read_run(rio, keys, LONG)
    res = {r.op_id: r for r in rio.poll()}  # no waiting
    assert paused, "no I/O thread reported a chunk: nothing was tested"
    assert sorted(res) == list(range(100, 108)) and all(r.ok for r in res.values()), res
    rio.close()


def test_an_inline_run_stops_at_its_first_gap(tmp_path, reads) -> None:
    rio = make_rio(FileTier(str(tmp_path / "t")))
    store(rio, ["g0", "g1", "g3", "g4"])
    dests = read_run(rio, ["g0", "g1", "g2", "g3", "g4"], LONG)
    res = {r.op_id: r for r in rio.poll()}
    assert [res[100 + i].ok for i in range(3)] == [True, True, False]
    assert all(res[100 + i].error_kind is None for i in (2, 3, 4))  # misses, not errors
    read = [k for k, _ in reads]
    assert read[0] == "g0" and "g2" in read and len(read) == len(set(read))
    # past the gap: a chunk an I/O thread had started is read (and unused); one not
    # started is skipped unread, its slot never written
    for i in (3, 4):
        if f"g{i}" in read:
            assert res[100 + i].ok and bytes(dests[i]) == bytes(payload(i))
        else:
            assert not res[100 + i].ok and bytes(dests[i]) == bytes(PAYLOAD_SIZE)
    c = rio.take_counters()
    assert c["gets_skipped"] == 5 - len(read) and c["ops_fetch"] == len(read), c
    rio.close()


def test_a_forged_first_chunk_is_a_counted_miss_and_ends_the_run(tmp_path, reads) -> None:
    tier = FileTier(str(tmp_path / "t"))
    store(make_rio(tier, signer=b"someone else"), ["f0", "f1", "f2"])
    rio = make_rio(tier)
    read_run(rio, ["f0", "f1", "f2"], LONG)
    res = {r.op_id: r for r in rio.poll()}
    assert res[100].error_kind == "signature" and not any(r.ok for r in res.values()), res
    # the rest were queued once a stat found f0: those the I/O threads reached while it
    # was read and checked are read (and rejected) too, each once
    read = [k for k, _ in reads]
    assert read[0] == "f0" and len(read) == len(set(read)), read
    assert all(res[100 + int(k[1])].error_kind == "signature" for k in read)
    rio.close()


def test_past_its_budget_the_run_goes_on_on_the_io_threads(tmp_path, monkeypatch) -> None:
    """With a budget shorter than one read, the first chunk is read here and the rest,
    all found, by the read threads."""
    rio = make_rio(FileTier(str(tmp_path / "t")))
    keys = [f"s{i}" for i in range(5)]
    store(rio, keys)
    by: dict[str, str] = {}

    def slow(key: str) -> None:
        by[key] = threading.current_thread().name
        time.sleep(0.05)

    before_reads(monkeypatch, FileTier, slow)
    dests = read_run(rio, keys, 0.01)
    res = collect(rio, 5)
    assert all(r.ok for r in res.values()), res
    assert [bytes(d) for d in dests] == [bytes(payload(i)) for i in range(5)]
    assert by["s0"] == threading.current_thread().name, by
    assert all(by[k].startswith("kvtier-read") for k in keys[1:]), by
    rio.close()


def test_an_inline_submit_waits_for_the_threads_reads_at_most_its_budget_again(
    tmp_path, monkeypatch
) -> None:
    """The submitting thread waits for the reads the I/O threads started, so they are
    reported in its step, but not past twice its budget: a slow disk's reads are then
    reported in a later step, never holding the engine for them."""
    rio = make_rio(FileTier(str(tmp_path / "t")))
    keys = [f"b{i}" for i in range(3)]
    store(rio, keys)

    def slow_on_threads(key: str) -> None:
        if threading.current_thread().name.startswith("kvtier-read"):
            time.sleep(2.0)

    before_reads(monkeypatch, FileTier, slow_on_threads)
    t0 = time.monotonic()
    read_run(rio, keys, 0.1)
    took = time.monotonic() - t0
    assert took < 1.0, f"the submit waited {took:.2f} s for the threads' 2 s reads"
    res = collect(rio, 3)
    assert all(r.ok for r in res.values()), res
    rio.close()


def test_a_run_while_reads_are_down_is_not_read_inline(tmp_path, reads) -> None:
    rio = make_rio(FileTier(str(tmp_path / "t")))
    rio.health.reads.failed()
    read_run(rio, ["d0", "d1"], LONG)
    res = {r.op_id: r for r in rio.poll()}
    assert [res[100].error_kind, res[101].error_kind] == ["unreachable", None]
    assert reads == []
    rio.close()


MOUNTS = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
40 27 0:50 / /mnt/shared rw,relatime - nfs4 server:/export rw
41 40 0:51 / /mnt/shared/scratch rw,relatime - tmpfs tmpfs rw
42 27 0:52 / /mnt/my\\040disk rw,relatime - xfs /dev/sdb rw
43 27 0:53 / /mnt/s3 rw,relatime - fuse.s3fs s3fs rw
"""


@pytest.mark.parametrize(
    ("path", "fstype", "local"),
    [
        ("/var/kvtier", "ext4", True),
        ("/mnt/shared/kvtier", "nfs4", False),
        ("/mnt/shared", "nfs4", False),
        ("/mnt/sharedx/kvtier", "ext4", True),  # a name that only starts like a mount point
        ("/mnt/shared/scratch/kv", "tmpfs", True),  # the longest mount point wins
        ("/mnt/my disk/kv", "xfs", True),  # the kernel's escapes
        ("/mnt/s3/kv", "fuse.s3fs", False),
    ],
)
def test_which_directories_are_local(path: str, fstype: str, local: bool) -> None:
    assert filesystem_type(path, MOUNTS) == fstype
    assert is_local(path, MOUNTS) is local


def test_an_unreadable_mount_table_is_not_local(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr("kvtier.objects.tiers.file._MOUNTINFO", str(tmp_path / "absent"))
    assert filesystem_type(str(tmp_path)) is None and not is_local(str(tmp_path))
    assert FileTier(str(tmp_path / "t")).reads_local is False


def test_this_machines_tmp_directory_tier_reads_locally(tmp_path) -> None:
    assert filesystem_type(str(tmp_path)) is not None
    assert FileTier(str(tmp_path / "t")).reads_local is is_local(str(tmp_path))


def test_inline_read_ms_is_checked() -> None:
    assert load_config({}).inline_read_ms == 20
    assert load_config({"inline_read_ms": 0}).inline_read_ms == 0
    with pytest.raises(ConfigError, match="inline_read_ms"):
        load_config({"inline_read_ms": -1})
    with pytest.raises(ConfigError, match="inline_read_ms"):
        load_config({}, environ={"KVTIER_INLINE_READ_MS": "soon"})


def test_an_inline_run_asks_the_kernel_for_its_files_up_to_its_first_gap(
    tmp_path, monkeypatch
) -> None:
    """Before an inline run's first read, every stored file up to the run's first gap is
    handed to the kernel's readahead (a cold disk then reads them at once, not one by
    one); a planted symlink is not followed, and the hint never fails the run."""
    tier = FileTier(str(tmp_path / "t"))
    rio = make_rio(tier)
    store(rio, ["w0", "w1", "w3"])
    # as on a cold disk (just written, they are in the page cache: then no hint, below)
    monkeypatch.setattr(FileTier, "_in_page_cache", lambda self, key: False)
    hinted: list[int] = []
    real = FileTier._open_regular

    def opened(self: FileTier, key: str):  # type: ignore[no-untyped-def]
        got = real(self, key)
        if got is not None:
            hinted.append(got[1].st_size)
        return got

    monkeypatch.setattr(FileTier, "_open_regular", opened)
    advised: list[tuple[int, int]] = []
    monkeypatch.setattr("os.posix_fadvise", lambda fd, off, n, advice: advised.append((n, advice)))
    read_run(rio, ["w0", "w1", "w2", "w3"], LONG)
    res = {r.op_id: r for r in rio.poll()}
    assert [res[100 + i].ok for i in range(3)] == [True, True, False]
    assert advised[:2] == [(hinted[0], os.POSIX_FADV_WILLNEED)] * 2 and len(advised) == 2
    link = Path(tier.path("w9"))
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(tier.path("w0"))
    advised.clear()
    tier.will_read(["w9", "w0"])  # refused like a read: no hint, no exception
    assert advised == []
    rio.close()


def test_a_run_whose_files_are_in_the_page_cache_is_not_hinted(tmp_path, monkeypatch) -> None:
    """A warm restart's run (its first and last files in the page cache) opens no file
    for a hint; a run whose last file is on the device only, or missing, is hinted."""
    tier = FileTier(str(tmp_path / "t"))
    rio = make_rio(tier)
    store(rio, ["w0", "w1", "w2"])
    advised: list[int] = []
    monkeypatch.setattr("os.posix_fadvise", lambda fd, off, n, advice: advised.append(advice))
    tier.will_read(["w0", "w1", "w2"])
    assert advised == []
    tier.will_read(["w0", "w1", "w7"])  # the last one is not stored: hinted up to it
    assert advised == [os.POSIX_FADV_WILLNEED] * 2
    advised.clear()
    cold = {"w2"}
    real = FileTier._in_page_cache
    monkeypatch.setattr(
        FileTier, "_in_page_cache", lambda self, key: key not in cold and real(self, key)
    )
    tier.will_read(["w0", "w1", "w2"])
    assert advised == [os.POSIX_FADV_WILLNEED] * 3
    rio.close()


def test_the_page_cache_probe_sees_a_dropped_file(tmp_path) -> None:
    """``_in_page_cache`` asks the kernel without waiting for the device: a file just
    written is there, one whose pages were dropped is not (tmpfs keeps every page), a
    missing one is not."""
    tier = FileTier(str(tmp_path / "t"))
    rio = make_rio(tier)
    store(rio, ["w0"])
    assert tier._in_page_cache("w0")
    assert not tier._in_page_cache("w5")
    fd = os.open(tier.path("w0"), os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    keeps_pages = filesystem_type(str(tmp_path)) == "tmpfs"
    assert tier._in_page_cache("w0") is keeps_pages
    rio.close()
