"""bench/tier_throughput.py's reads and writes: the put/get table (kvtier's tier ÷ the
raw client), the read-into-slot table through RemoteIO, the restart hit's fetch, and the
Redis Cluster table (1 node vs 3 primaries)."""

from __future__ import annotations

import argparse
import os
import statistics
from concurrent.futures import ThreadPoolExecutor

from tier_cases import (
    Case,
    MiB,
    cluster_case,
    key_spread,
    local_cluster,
    mbps,
    open_case,
    poll_results,
    redis_case,
    time_restart_runs,
    timed,
    wait_for_results,
)

from kvtier.objects import codec
from kvtier.objects.health import ConstantBackoff
from kvtier.objects.remote import MAX_FRAME, RemoteIO
from kvtier.objects.sealing import Sealer
from kvtier.objects.tiers.base import ObjectTier


def run_case(
    case: Case, args: argparse.Namespace, chunks: list[bytes], fresh_puts: bool = False
) -> list[tuple]:
    """The put/get table: sync (one thread) and RemoteIO at ``--putget-threads``.

    With ``fresh_puts`` both sides' objects are deleted (untimed) before each put round:
    RemoteIO does not write a chunk whose key already exists (its ``exists`` check), so
    without it the RemoteIO put row after the first round times that check, not a write.
    """
    size = len(chunks[0])
    shape = [size // 2]
    keys = [f"bench-{i}" for i in range(len(chunks))]
    total = size * len(chunks)
    signer = codec.Signer(b"bench-key") if args.hmac else None
    slots = [memoryview(bytearray(size)) for _ in chunks]
    tier = open_case(case, args.putget_threads)

    def kv_put_sync() -> None:
        for k, c in zip(keys, chunks, strict=True):
            tier.put(k, codec.encode(k, c, dtype="bfloat16", shape=shape, signer=signer))

    def kv_get_sync() -> None:
        for k, slot in zip(keys, slots, strict=True):
            blob = tier.get(k)
            assert blob is not None
            slot[:] = codec.decode(blob, key=k, dtype="bfloat16", shape=shape, signer=signer)

    def raw_put_sync() -> None:
        for k, c in zip(keys, chunks, strict=True):
            case.raw_put(k, c)

    def raw_get_sync() -> None:
        for k in keys:
            blob = case.raw_get(k)  # held like kvtier holds its blob, so malloc sees the same
            assert len(blob) == size

    rio = RemoteIO(
        tier,
        threads=args.putget_threads,
        queue_depth=len(chunks) + 1,
        timeout_s=60.0,
        signer=signer,
        backoff=ConstantBackoff(0.1),
    )

    def kv_put_async() -> None:
        for i, (k, c) in enumerate(zip(keys, chunks, strict=True)):
            assert rio.submit_put(i, k, memoryview(c), dtype="bfloat16", shape=shape)
        wait_for_results(rio, len(keys))

    def kv_get_async() -> None:
        for i, (k, slot) in enumerate(zip(keys, slots, strict=True)):
            rio.submit_get_into(i, k, slot, dtype="bfloat16", shape=shape)
        wait_for_results(rio, len(keys))

    # RemoteIO gives reads and writes their own threads; the raw side gets as many per op
    put_pool = ThreadPoolExecutor(max_workers=rio.write_threads)
    get_pool = ThreadPoolExecutor(max_workers=rio.read_threads)

    def raw_put_pool() -> None:
        list(put_pool.map(case.raw_put, keys, chunks))

    def raw_get_pool() -> None:
        list(get_pool.map(case.raw_get, keys))

    pairs = [
        ("sync, 1 thread", "put", kv_put_sync, raw_put_sync),
        ("sync, 1 thread", "get", kv_get_sync, raw_get_sync),
        (f"RemoteIO, {rio.write_threads} threads", "put", kv_put_async, raw_put_pool),
        (f"RemoteIO, {rio.read_threads} threads", "get", kv_get_async, raw_get_pool),
    ]
    rows = []
    raw_put_sync()  # objects exist for the first get round of both sides
    kv_put_sync()
    raw_keys = [case.raw_key(k) for k in keys] if fresh_puts else []  # type: ignore[attr-defined]
    for mode, op, kv_fn, raw_fn in pairs:
        kv_t: list[float] = []
        raw_t: list[float] = []
        for r in range(args.rounds):  # interleaved, alternating who goes first
            order = ((raw_fn, raw_t), (kv_fn, kv_t))
            for fn, times in order if r % 2 == 0 else order[::-1]:
                if fresh_puts and op == "put":
                    tier.delete(raw_keys if fn is raw_fn else keys)
                times.append(timed(fn))
        rows.append(
            (
                case.name,
                mode,
                op,
                mbps(total, min(kv_t)),
                mbps(total, min(raw_t)),
                statistics.median(raw_t) / statistics.median(kv_t),
            )
        )
    for slot, c in zip(slots, chunks, strict=True):
        assert bytes(slot) == c, "a fetched chunk differs from what was written"
    rio.close()  # closes the tier too
    put_pool.shutdown()
    get_pool.shutdown()
    return rows


def _measure_into(
    case: Case,
    args: argparse.Namespace,
    tier: ObjectTier,
    rio: RemoteIO,
    pool: ThreadPoolExecutor,
    chunks: list[bytes],
    conc: int,
    signer: codec.Signer | None,
) -> dict:
    """One row of the read-into table: ``conc`` chunks in flight, async / sync / raw."""
    size = len(chunks[0])
    shape = [size // 2]
    n_obj = len(chunks)
    slots = [memoryview(bytearray(size)) for _ in range(conc)]
    raw_bufs = [memoryview(bytearray(MAX_FRAME + size)) for _ in range(conc)]
    batches = max(1, round(args.round_mib * MiB / (conc * size)))
    nbytes = batches * conc * size
    # the batches of a round take turns over all stored objects
    plan = [[(b * conc + j) % n_obj for j in range(conc)] for b in range(batches)]

    def kv_async() -> None:
        for batch in plan:
            for i, c in enumerate(batch):
                rio.submit_get_into(i, f"into-{c}", slots[i], dtype="bfloat16", shape=shape)
            res = poll_results(rio, len(batch))
            if any(not r.ok for r in res):
                raise RuntimeError(f"RemoteIO get failed: {res}")

    def read_verify(c: int, slot: memoryview) -> None:
        k = f"into-{c}"
        head = tier.read_into(k, slot, MAX_FRAME)
        assert head is not None
        codec.verify(head, slot, key=k, dtype="bfloat16", shape=shape, signer=signer)

    def raw_one(c: int, buf: memoryview) -> None:
        case.raw_read_object(tier, f"into-{c}", buf[: case.obj_sizes[c]])  # type: ignore[attr-defined]

    def kv_sync() -> None:
        for batch in plan:
            list(pool.map(read_verify, batch, slots))

    def raw() -> None:
        for batch in plan:
            list(pool.map(raw_one, batch, raw_bufs))

    times: dict[str, list[float]] = {"raw": [], "async": [], "sync": []}
    fns = [("raw", raw), ("async", kv_async), ("sync", kv_sync)]
    raw()  # warm connections and pools
    kv_async()
    kv_sync()
    for r in range(args.rounds):  # interleaved, rotating who goes first
        for name, fn in fns[r % 3 :] + fns[: r % 3]:
            times[name].append(timed(fn))
    for i, c in enumerate(plan[-1]):  # the slots hold what was stored
        assert bytes(slots[i]) == chunks[c], "a fetched chunk differs from what was written"
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    return {
        "backend": case.name,
        "raw_reader": case.raw_reader,
        "io_threads": rio_threads(rio),
        "read_threads": rio.read_threads,
        "concurrency": conc,
        "chunk_mib": size / MiB,
        "bytes_per_round": nbytes,
        "rounds": args.rounds,
        **{f"{k}_gbps_best": nbytes / best[k] / 1e9 for k in best},
        **{f"{k}_gbps_median": nbytes / med[k] / 1e9 for k in med},
        "async_over_raw": med["raw"] / med["async"],
        "sync_over_raw": med["raw"] / med["sync"],
    }


def rio_threads(rio: RemoteIO) -> int:
    return rio.tier._bench_threads  # type: ignore[attr-defined]


def run_into(case: Case, args: argparse.Namespace, chunks: list[bytes]) -> list[dict]:
    """The read-into table: kvtier async / sync and the raw reader, per io_threads and
    concurrency, on objects stored once through the tier."""
    size = len(chunks[0])
    shape = [size // 2]
    keys = [f"into-{i}" for i in range(len(chunks))]
    signer = codec.Signer(b"bench-key") if args.hmac else None
    writer = open_case(case, max(args.threads))
    case.obj_sizes = []  # type: ignore[attr-defined]
    for k, c in zip(keys, chunks, strict=True):
        parts = codec.encode(k, c, dtype="bfloat16", shape=shape, signer=signer)
        writer.put(k, parts)
        case.obj_sizes.append(codec.encoded_size(parts))  # type: ignore[attr-defined]
    writer.close()
    rows = []
    for threads in args.threads:
        tier = open_case(case, threads)
        depth = max(args.concurrency) + 1
        rio = RemoteIO(
            tier,
            threads=threads,
            queue_depth=depth,
            timeout_s=60.0,
            signer=signer,
            backoff=ConstantBackoff(0.1),
        )
        n_read = rio.read_threads
        pool = ThreadPoolExecutor(max_workers=n_read)
        for conc in args.concurrency:
            rows.append(_measure_into(case, args, tier, rio, pool, chunks, conc, signer))
        rio.close()  # closes the tier too
        pool.shutdown()
    return rows


def run_hit_latency(case: Case, args: argparse.Namespace, chunks: list[bytes]) -> dict:
    """Latency of one restart hit's fetches (a lookup run), plain and sealed alternating."""
    size = len(chunks[0])
    shape = [size // 2]
    n = args.hit_chunks
    hmac_key = b"bench-key" if args.hmac else None
    sides = {
        "plain": codec.Signer(hmac_key) if hmac_key else None,
        "sealed": codec.Signer(hmac_key, sealer=Sealer(os.urandom(32))),
    }
    writer = open_case(case, args.putget_threads)
    for side, signer in sides.items():
        for i in range(n):
            k = f"hit-{side}-{i}"
            writer.put(
                k,
                codec.encode(
                    k, chunks[i % len(chunks)], dtype="bfloat16", shape=shape, signer=signer
                ),
            )
    writer.close()
    rios = {
        side: RemoteIO(
            open_case(case, args.putget_threads),
            threads=args.putget_threads,
            queue_depth=n + 1,
            timeout_s=60.0,
            signer=signer,
            backoff=ConstantBackoff(0.1),
        )
        for side, signer in sides.items()
    }
    slots = [memoryview(bytearray(size)) for _ in range(n)]
    reps = max(args.rounds, 3) * 5

    def opened() -> None:
        for i in range(n):
            assert bytes(slots[i]) == chunks[i % len(chunks)], "a sealed chunk did not open"

    times = time_restart_runs(rios, "hit", slots, shape, reps, opened)
    for rio in rios.values():
        rio.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "backend": case.name,
        "chunks": n,
        "chunk_mib": size / MiB,
        "runs": reps,
        "io_threads": args.putget_threads,
        "read_threads": rios["plain"].read_threads,
        "plain_ms_median": med["plain"] * 1000,
        "sealed_ms_median": med["sealed"] * 1000,
        "added_ms": (med["sealed"] - med["plain"]) * 1000,
    }


def run_cluster(args: argparse.Namespace, chunks: list[bytes]) -> tuple[list[tuple], dict]:
    """The put/get table on one node and on a 3-primary cluster, and the key spread."""
    node = redis_case(args)
    node.raw_key = lambda key: "raw/" + key  # type: ignore[attr-defined]
    rows = [("redis x1", *r[1:]) for r in run_case(node, args, chunks, fresh_puts=True)]
    with local_cluster(3) as ports:
        case = cluster_case(ports, args.putget_threads)
        rows += run_case(case, args, chunks, fresh_puts=True)
        spread = key_spread(case.client, args.spread_keys)  # type: ignore[attr-defined]
        case.client.close()  # type: ignore[attr-defined]
    return rows, spread
