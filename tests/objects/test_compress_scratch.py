"""The read path's reusable buffers: no buffer per read, never one shared by two threads.

A sealed compressed chunk opens in a per-thread scratch buffer before it is decompressed
into its slot, and an fp8 chunk is dequantised through a per-thread float32 slice; both
are made once per thread and reused by every later read on it.
"""

from __future__ import annotations

import sys
import threading
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import kv_like
from torch.profiler import ProfilerActivity, profile

from kvtier.errors import CodecError
from kvtier.objects import codec, compress
from kvtier.objects.codec import Signer, decode, encode
from kvtier.objects.compress import Compressor, Fp8Compressor, ThreadScratch
from kvtier.objects.sealing import Sealer

KEY = "model-x/tp1r0/00ab"


def chunk(raw: bytes, signer: Signer | None, form: str = "blosc2", key: str = KEY) -> bytes:
    """A stored chunk of ``raw`` in ``form`` (blosc2 or fp8e4m3), as a tier returns it."""
    got = (Compressor() if form == "blosc2" else Fp8Compressor()).compress_chunk(
        memoryview(raw), "bfloat16"
    )
    assert got is not None
    parts = encode(
        key, raw, dtype="bfloat16", shape=[len(raw)], signer=signer, compressed=(got[0], got[1])
    )
    blob = b"".join(bytes(p) for p in parts)
    assert codec.is_compressed(blob[: codec.head_length(blob[:8])])
    return blob


def address(view: memoryview) -> int:
    return int(torch.frombuffer(view, dtype=torch.uint8).data_ptr()) if view.nbytes else 0


def test_thread_scratch_is_one_bounded_buffer_per_thread() -> None:
    s = ThreadScratch(limit=1 << 20)
    first = s.view(1000)
    for n in (10, 999, 1000, 1, 0, 500):  # no longer than what it holds: the same buffer
        assert address(s.view(n)) in (0, address(first))
    assert s.allocations == 1
    s.view(1400)  # longer: grown once, by half again, so the next few fit too
    s.view(1500)
    assert s.allocations == 2
    with pytest.raises(CodecError):
        s.view((1 << 20) + 1)  # past the bound: refused, never allocated
    assert s.view(1 << 20).nbytes == 1 << 20 and s.allocations == 3
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(address(s.view(1000))))
    t.start()
    t.join()
    assert seen[0] != address(s.view(1000)) and s.allocations == 4  # its own buffer


@pytest.mark.parametrize("raw_form", [False, True])
def test_sealed_read_only_chunk_opens_without_a_buffer_per_read(raw_form: bool) -> None:
    """A sealed chunk handed over read-only (as a tier's ``get`` returns it) opens in the
    thread's scratch buffer (compressed) or in the slot itself (raw): after the first
    read, reading it again allocates nothing near its size."""
    raw = kv_like(1 << 18, seed=1)
    signer = Signer(sealer=Sealer(b"s" * 32))
    if raw_form:
        parts = encode(KEY, raw, dtype="bfloat16", shape=[len(raw)], signer=signer)
        blob = b"".join(bytes(p) for p in parts)
    else:
        blob = chunk(raw, signer)
    slot = memoryview(bytearray(len(raw)))
    decode(blob, key=KEY, signer=signer, out=slot)  # the first read makes the buffer
    peaks = []
    # tracemalloc sees every thread: an earlier test's background thread may allocate
    # during one window. A buffer per read shows in every window, so the least counts.
    for _attempt in range(3):
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            for _ in range(5):
                got = decode(blob, key=KEY, signer=signer, out=slot)
                assert got == raw  # compared in place, no copy
            peaks.append(tracemalloc.get_traced_memory()[1] - base)
        finally:
            tracemalloc.stop()
    assert min(peaks) < len(raw) // 8, peaks


def test_fp8_dequantise_allocates_no_buffer_per_read() -> None:
    """Dequantising goes through this thread's float32 slice: no torch allocation of a
    slice's size (64 KiB) while a 600 KiB chunk is read, and one slice per thread."""
    raw = kv_like(300_000 * 2, seed=2)
    form, stream, _ = Fp8Compressor().compress_chunk(memoryview(raw), "bfloat16")  # type: ignore[misc]
    out = memoryview(bytearray(len(raw)))
    compress.decompress_into(form, memoryview(stream), out, "bfloat16")
    made = compress.fp8_work_allocations()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(3):
            compress.decompress_into(form, memoryview(stream), out, "bfloat16")
    big = [e.name for e in prof.events() if e.cpu_memory_usage >= 16384]
    assert not big, big
    assert compress.fp8_work_allocations() == made
    args = (form, memoryview(stream), out, "bfloat16")
    t = threading.Thread(target=compress.decompress_into, args=args)
    t.start()
    t.join()
    assert compress.fp8_work_allocations() == made + 1


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(1, 48).map(lambda k: k * 1024), min_size=4, max_size=4),
    seeds=st.lists(st.integers(0, 2**16), min_size=4, max_size=4),
    forms=st.lists(st.sampled_from(["blosc2", "fp8e4m3"]), min_size=4, max_size=4),
)
def test_concurrent_reads_never_mix_bytes(
    sizes: list[int], seeds: list[int], forms: list[str]
) -> None:
    """Four threads read their own sealed compressed chunks (blosc2 and fp8, of other
    sizes, so the buffers grow under each other) at once, switching threads every
    microsecond: every read is exactly its own chunk's bytes."""
    signer = Signer(b"h" * 32, sealer=Sealer(b"s" * 32))
    work = []
    for i, (n, seed, form) in enumerate(zip(sizes, seeds, forms, strict=True)):
        raw = kv_like(n, seed)
        blobs = [chunk(raw, signer, form, key=f"{KEY}/{i}")]
        want = bytearray(len(raw))
        decode(blobs[0], key=f"{KEY}/{i}", signer=signer, out=memoryview(want), lossy=True)
        small = kv_like(n // 2, seed + 1)  # a shorter chunk too: reads of two sizes
        blobs.append(chunk(small, signer, form, key=f"{KEY}/{i}s"))
        want_small = bytearray(len(small))
        decode(blobs[1], key=f"{KEY}/{i}s", signer=signer, out=memoryview(want_small), lossy=True)
        work.append((i, blobs, [bytes(want), bytes(want_small)]))
    start = threading.Barrier(len(work))
    bad: list[str] = []

    def reader(i: int, blobs: list[bytes], wants: list[bytes]) -> None:
        slots = [memoryview(bytearray(len(w))) for w in wants]
        start.wait()
        for r in range(6):
            j = r % 2
            key = f"{KEY}/{i}" + ("s" if j else "")
            try:  # bytes overwritten by another read would fail the GCM tag, or differ
                got = decode(blobs[j], key=key, signer=signer, out=slots[j], lossy=True)
            except CodecError as exc:
                bad.append(f"thread {i} read {r}: {exc}")
                continue
            if bytes(got) != wants[j]:
                bad.append(f"thread {i} read {r}")

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=reader, args=w) for w in work]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(old)
    assert not bad, bad


@pytest.mark.parametrize("sealed", [False, True])
def test_remote_reads_on_four_threads_each_get_their_own_chunk(
    tmp_path: Path, sealed: bool
) -> None:
    """RemoteIO with four read threads fetching 24 compressed chunks of other sizes at once
    (each thread's scratch grows under the others'): every slot holds its own chunk."""
    from kvtier.objects.remote import RemoteIO
    from kvtier.objects.tiers import FileTier
    from kvtier.ops import OpResult

    def rio(compressor: Compressor) -> RemoteIO:
        signer = Signer(b"h" * 32, sealer=Sealer(b"s" * 32)) if sealed else None
        return RemoteIO(
            FileTier(str(tmp_path / "o")),
            threads=8,
            queue_depth=64,
            timeout_s=20.0,
            signer=signer,
            compressor=compressor,
        )

    def results(r: RemoteIO, n: int) -> dict[int, OpResult]:
        got: list[OpResult] = []
        while len(got) < n:
            got += r.poll()
        return {x.op_id: x for x in got}

    n, size = 24, 1 << 15
    chunks = []
    for i in range(n):
        x = bytearray(kv_like(size // 2, seed=i))
        x[: (i * 1237) % size] = bytes((i * 1237) % size)  # zeros: other compressed sizes
        chunks.append(bytes(x))
    w = rio(Compressor())
    for i, c in enumerate(chunks):
        w.submit_put(i, f"k{i}", memoryview(c), dtype="bfloat16", shape=[len(c)])
    assert all(r.ok for r in results(w, n).values())
    w.close()
    r = rio(Compressor())
    slots = [memoryview(bytearray(size)) for _ in range(n)]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for i, slot in enumerate(slots):
            r.submit_get_into(i, f"k{i}", slot, dtype="bfloat16", shape=[size])
        res = results(r, n)
        made = r.work.scratch.allocations
        for i, slot in enumerate(slots):  # the same reads again: every buffer is reused
            r.submit_get_into(n + i, f"k{i}", slot, dtype="bfloat16", shape=[size])
        again = results(r, n)
    finally:
        sys.setswitchinterval(old)
        r.close()
    assert all(x.ok for x in res.values()) and all(x.ok for x in again.values()), res
    assert [bytes(s) == c for s, c in zip(slots, chunks, strict=True)] == [True] * n
    # every compressed object is read whole into its read thread's scratch buffer (sized
    # for a slot plus the largest header), opened there when sealed and decompressed from
    # there: one buffer per read thread, never one per read
    assert 0 < made <= r.read_threads, made
    assert r.work.scratch.allocations <= made + r.read_threads, "a scratch buffer per read"
    assert r.take_compression()["read"][1] < n * size  # they were read compressed
