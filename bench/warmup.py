#!/usr/bin/env python3
"""Warm-up throughput (issue 61): ``warm_host_tier`` against the tier's raw reads.

Goal: a starting engine's warm-up reads its hot chunks at >= 80 % of the tier's raw read
throughput measured in the same run, so warm-up is bounded by the store, not by kvtier.

No vLLM engine: for each object tier (a file directory; redis-server and moto's S3
server, started on loopback by harness.py, each skipped with "unavailable: reason" when
it cannot start) this

1. stores ``--chunks`` chunks of the bench model's slot size (bench/ttft.py's model: 8
   layers x 1024 hidden, 16 heads / 8 KV heads, bf16, 256-token chunks of 32-token
   blocks: 8 x 2 x 256 x 8 x 64 x 2 B = 4 MiB a chunk) in kvtier's format, uploaded
   from a host slab through ``RemoteIO.from_config`` as an engine uploads, and its
   generation's manifest with a hot list naming every chunk;
2. times, in ``--rounds`` interleaved rounds (who goes first alternates; after one
   untimed round of each, which opens the connections), ``warm_host_tier`` filling a
   committed host slab of exactly those chunks (manifest read, plan, reads verified into
   slots 0..N-1, ``--io-threads`` I/O threads, half of them reading) against the raw
   client reading the same objects (head included) on as many threads as RemoteIO
   reads on: ``readinto`` a preallocated buffer (file; the page cache warm for both
   sides before each round, or cold with ``--file-cache cold``), redis-py ``GET``,
   boto3 ``get_object().read()`` with kvtier's botocore Config;
3. checks that every chunk was warmed (outcome "done", all N chunks reported, each
   slot's bytes those uploaded) and prints, per tier, chunks, MiB, warm-up seconds and
   MB/s (1e6 B/s; medians), the raw client's MB/s, warm-up / raw and the goal;
4. runs ``--split-rounds`` more warm-ups with their steps timed (kvtier's functions
   wrapped in this process, never changed): the manifest read, the planning, the tier's
   reads into the slots (of which the CRC-32 computed as the bytes land) and the
   verification (``codec.verify``), each read thread's busy time, and the rest of the
   wall time (read threads waiting for work: queueing, the poll loop's 2 ms sleeps):
   where the time goes.

``--json`` prints one JSON object instead of the tables, ``--out FILE`` writes it too.
One line per phase goes to stderr. The defaults (64 chunks, 256 MiB, 9 rounds) take about
a minute on 2 cores; moto's puts are most of it.

    make bench-warmup                        # all three tiers
    python bench/warmup.py --only file --chunks 8 --rounds 1
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from harness import Unavailable, positive_int
from restart_tiers import BUCKET, object_tier, set_page_cache

TIERS = ("file", "redis", "s3")
#: warm-up throughput / the raw client's (issue 61's goal)
GOAL = 0.8
MB = 1e6
MiB = 2**20


def log(msg: str) -> None:
    print(f"[warmup bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _tiers(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in TIERS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"tiers among {', '.join(TIERS)}, got {text!r}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n", 1)[0],
        epilog=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--only",
        type=_tiers,
        default=list(TIERS),
        help="comma-separated tiers: file, redis, s3 (default: all)",
    )
    parser.add_argument(
        "--chunks",
        type=positive_int,
        default=64,
        help="hot chunks stored and warmed (default 64: 256 MiB of the bench model)",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=9,
        help="timed rounds of each side, interleaved (medians reported)",
    )
    parser.add_argument(
        "--io-threads",
        type=positive_int,
        default=4,
        help="kvtier's io_threads (RemoteIO reads on ceil(n/2) of them; the "
        "raw client reads on as many)",
    )
    parser.add_argument("--layers", type=positive_int, default=8, help="the model's layers")
    parser.add_argument("--hidden", type=positive_int, default=1024, help="its hidden size")
    parser.add_argument("--heads", type=positive_int, default=16, help="its attention heads")
    parser.add_argument("--kv-heads", type=positive_int, default=8, help="its KV heads")
    parser.add_argument("--chunk-tokens", type=positive_int, default=256, help="chunk_size")
    parser.add_argument("--block-size", type=positive_int, default=32, help="vLLM's block size")
    parser.add_argument(
        "--file-cache",
        choices=["warm", "cold"],
        default="warm",
        help="the file tier's objects in the page cache before each round "
        "of either side (warm: a restart on the node that wrote them) or "
        "dropped from it (cold)",
    )
    parser.add_argument(
        "--split-rounds",
        type=int,
        default=3,
        help="more warm-ups with their steps timed, after the timed rounds (medians; 0: none)",
    )
    parser.add_argument(
        "--in-flight-per-thread",
        type=positive_int,
        help="what if: warm-up's reads in flight per read thread "
        "(kvtier.connectors.worker.warmup.IN_FLIGHT_PER_THREAD, set in this "
        "process only; default: kvtier's)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="also write the result JSON to this file")
    args = parser.parse_args(argv)
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error("--hidden must be a multiple of --heads, --heads of --kv-heads")
    if args.split_rounds < 0:
        parser.error("--split-rounds must be >= 0")
    if args.chunk_tokens % args.block_size:
        parser.error("--chunk-tokens must be a multiple of --block-size")
    return args


# ---- the model's slot and the engine's pieces --------------------------------------------


def engine_parts(args: argparse.Namespace, extra: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(config, slot layout, namespace with the layers) of one engine worker of the bench
    model: one (2, blocks, block size, KV heads, head size) bf16 KV cache per layer,
    ``--chunks`` slots of host tier, all of it warm-up budget."""
    import torch

    from kvtier.config import load_config
    from kvtier.host.layout import SlotLayout
    from kvtier.keys import Namespace

    head = args.hidden // args.heads
    bpc = args.chunk_tokens // args.block_size
    shape = (2, bpc, args.block_size, args.kv_heads, head)  # one chunk's blocks suffice
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.empty(shape, dtype=torch.bfloat16)
        for i in range(args.layers)
    }
    layout = SlotLayout.from_kv_caches(caches, bpc, bpc)
    host = args.chunks * layout.slot_bytes
    cfg = load_config(
        {
            "cpu_bytes": host,
            "chunk_size": args.chunk_tokens,
            "io_threads": args.io_threads,
            "warmup": True,
            "warmup_bytes": host,
            **extra,
        },
        environ={},
    )
    ns = Namespace(
        "",
        None,
        "bfloat16",
        "auto",
        args.block_size,
        args.chunk_tokens,
        1,
        fingerprint=hashlib.blake2b(b"kvtier warm-up bench", digest_size=16).hexdigest(),
        label="warmup-bench",
        layers=layout.identity(),
    )
    return cfg, layout, ns


def block_hash(i: int) -> bytes:
    """The stand-in of vLLM's block hash of chunk ``i``'s last block (32 bytes)."""
    return hashlib.blake2b(f"warm-up bench chunk {i}".encode(), digest_size=32).digest()


def store_hot_chunks(cfg: Any, ns: Any, slab: Any, n: int) -> list[str]:
    """Fill ``slab``'s first ``n`` slots with random bytes, upload them as an engine does
    (RemoteIO from the config, ``submit_put`` from the slots) and write the generation's
    manifest whose hot list names them, hottest first; returns their object keys."""
    from kvtier.hotset import HotList
    from kvtier.keys import KeySpace
    from kvtier.objects import manifest
    from kvtier.objects.remote import RemoteIO

    keys = KeySpace.worker(ns, 0, 0)
    dtype, shape = slab.layout.describe()
    rio = RemoteIO.from_config(cfg)
    try:
        for i in range(n):
            slab.slot_memoryview(i)[:] = os.urandom(slab.layout.slot_bytes)
        written = 0
        i = 0
        deadline = time.monotonic() + 600
        while written < n:
            while i < n and i - written < 2 * rio.write_threads:
                if not rio.submit_put(
                    i, keys.key(block_hash(i)), slab.slot_memoryview(i), dtype=dtype, shape=shape
                ):
                    break  # the write queue is full: later
                i += 1
            for res in rio.poll():
                if not res.ok:
                    raise RuntimeError(f"upload of chunk {res.op_id} failed: {res}")
                written += 1
            if time.monotonic() > deadline:
                raise RuntimeError(f"{written} of {n} chunks uploaded in 600 s")
            time.sleep(0.002)
        now = time.time()
        hot = HotList(now, tuple((block_hash(j), float(n - j)) for j in range(n)))
        manifest.write_manifest(rio.tier, manifest.Manifest.of(ns, now, hot=hot), rio.signer)
    finally:
        rio.close()
    return [keys.key(block_hash(j)) for j in range(n)]


# ---- the raw client -------------------------------------------------------------------------


@contextlib.contextmanager
def raw_reader(
    kind: str, extra: dict[str, Any], rio: Any, keys: list[str], threads: int
) -> Iterator[tuple[Callable[[int], int], list[str]]]:
    """(read object ``i`` whole with the backend's own client, returning its bytes; the
    file paths, for the page cache) for the objects of ``keys``, as stored by ``rio``'s
    tier."""
    if kind == "file":
        paths = [rio.tier.path(k) for k in keys]
        sizes = [os.path.getsize(p) for p in paths]
        bufs = [memoryview(bytearray(s)) for s in sizes]  # preallocated, touched

        def read(i: int) -> int:
            buf = bufs[i]
            got = 0
            with open(paths[i], "rb", buffering=0) as f:
                while got < buf.nbytes:
                    n = f.readinto(buf[got:])
                    if not n:
                        raise RuntimeError(f"{paths[i]}: short read")
                    got += n
            return got

        yield read, paths
    elif kind == "redis":
        import redis

        pool = redis.ConnectionPool.from_url(extra["remote_url"], max_connections=threads + 1)
        client = redis.Redis(connection_pool=pool)
        if client.exists(keys[0]) != 1:
            raise RuntimeError(f"redis: {keys[0]} is not where the raw client looks")

        def read(i: int) -> int:
            return len(client.get(keys[i]) or b"")

        try:
            yield read, []
        finally:
            client.close()
    else:
        import boto3

        from kvtier.objects.tiers.s3 import client_config

        client = boto3.session.Session().client(
            "s3",
            endpoint_url=extra["s3_endpoint_url"],
            region_name="us-east-1",
            config=client_config(threads, 2000),  # kvtier's botocore Config, a pool as large
        )
        names = [rio.tier.object_key(k) for k in keys]

        def read(i: int) -> int:
            return len(client.get_object(Bucket=BUCKET, Key=names[i])["Body"].read())

        yield read, []


# ---- the timed split --------------------------------------------------------------------------


class Split:
    """One warm-up with its steps timed: kvtier's functions wrapped on this process's
    objects (module attributes and the tier instance), restored after."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.t: dict[str, float] = {
            "manifest_read_s": 0.0,
            "plan_s": 0.0,
            "tier_reads_s": 0.0,
            "crc_s": 0.0,
            "verify_s": 0.0,
        }
        self.calls = {"reads": 0, "verifies": 0}

    def _timed(self, name: str, fn: Callable[..., Any], count: str = "") -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                with self.lock:
                    self.t[name] += dt
                    if count:
                        self.calls[count] += 1

        return wrapper

    @contextlib.contextmanager
    def installed(self, rio: Any) -> Iterator[None]:
        from kvtier.connectors.worker import warmup
        from kvtier.objects import codec

        saved = [
            (warmup.manifest, "read_manifest", warmup.manifest.read_manifest),
            (warmup, "plan_warmup", warmup.plan_warmup),
            (codec, "verify", codec.verify),
        ]
        # the CRC-32 of the payload as it lands (codec.LandingCrc) or after the read, in
        # every module that took the function by name (the tiers)
        crc = codec.payload_crc32
        saved += [
            (mod, "payload_crc32", crc)
            for name, mod in list(sys.modules.items())
            if name.startswith("kvtier.") and getattr(mod, "payload_crc32", None) is crc
        ]
        timed_crc = self._timed("crc_s", crc)
        for mod in {id(m): m for m, _n, _f in saved if _n == "payload_crc32"}.values():
            mod.payload_crc32 = timed_crc
        warmup.manifest.read_manifest = self._timed(
            "manifest_read_s", warmup.manifest.read_manifest
        )
        warmup.plan_warmup = self._timed("plan_s", warmup.plan_warmup)
        codec.verify = self._timed("verify_s", codec.verify, "verifies")
        tier = rio.tier
        # the read of an unsealed, uncompressed chunk (ChunkIO._read): into the slot, its
        # CRC-32 computed as the bytes land
        tier.read_into_hashed = self._timed("tier_reads_s", tier.read_into_hashed, "reads")
        try:
            yield
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)
            del tier.read_into_hashed

    def row(self, wall: float, threads: int) -> dict[str, Any]:
        t = dict(self.t)
        busy = (t["tier_reads_s"] + t["verify_s"]) / threads
        return {
            "wall_s": wall,
            **t,
            "reads": self.calls["reads"],
            "verifies": self.calls["verifies"],
            "read_threads": threads,
            # each read thread's time in the tier's reads and the verification
            "read_thread_busy_s": busy,
            # the wall time left once that and the manifest read and planning are taken:
            # read threads waiting for work (queueing, the poll loop's 2 ms sleeps)
            "rest_s": wall - busy - t["manifest_read_s"] - t["plan_s"],
        }


def median_split(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each field's median over the split's rounds."""
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out["rounds"] = len(rows)
    return out


# ---- one tier ---------------------------------------------------------------------------------


def run_tier(kind: str, args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    """Store, warm up against raw reads, check, split: one tier's row."""
    from kvtier.connectors.worker.warmup import warm_host_tier
    from kvtier.host.layout import HostSlab
    from kvtier.keys import KeySpace
    from kvtier.objects.remote import RemoteIO
    from kvtier.threads import faster_thread_switches

    with object_tier(kind, workdir) as (extra, env):
        os.environ.update(env)
        cfg, layout, ns = engine_parts(args, extra)
        n = args.chunks
        log(f"{kind}: storing {n} chunks of {layout.slot_bytes / MiB:.2f} MiB and the manifest")
        t0 = time.monotonic()
        slab = HostSlab(n * layout.slot_bytes, layout, commit=True)  # as the engine's slab
        try:
            keys = store_hot_chunks(cfg, ns, slab, n)
            digests = [
                hashlib.blake2b(slab.slot_memoryview(i), digest_size=16).digest() for i in range(n)
            ]
            stored_s = time.monotonic() - t0
            faster_thread_switches()  # as the engine's worker does before it warms up
            rio = RemoteIO.from_config(cfg)  # the starting engine's
            try:
                return _measure(
                    kind,
                    args,
                    extra,
                    cfg,
                    ns,
                    slab,
                    rio,
                    keys,
                    digests,
                    stored_s,
                    warm_host_tier,
                    KeySpace.worker(ns, 0, 0).key,
                )
            finally:
                rio.close()
        finally:
            slab.close()


def _zero(slab: Any, n: int) -> None:
    zeros = bytes(slab.layout.slot_bytes)
    for i in range(n):
        slab.slot_memoryview(i)[:] = zeros


def _measure(
    kind: str,
    args: argparse.Namespace,
    extra: dict[str, Any],
    cfg: Any,
    ns: Any,
    slab: Any,
    rio: Any,
    keys: list[str],
    digests: list[bytes],
    stored_s: float,
    warm: Callable[..., Any],
    object_key: Callable[[bytes], str],
) -> dict[str, Any]:
    n = args.chunks
    threads = rio.read_threads
    gen = ns.generation()
    reports: list[Any] = []

    def warm_up() -> float:
        _zero(slab, n)  # untimed: what the check below finds was written by this round
        if paths:
            set_page_cache(paths, args.file_cache)
        t0 = time.perf_counter()
        rep = warm(rio, gen, object_key, slab, cfg)
        dt = time.perf_counter() - t0
        reports.append(rep)
        return dt

    raw_bytes: list[int] = []

    def raw() -> float:
        if paths:
            set_page_cache(paths, args.file_cache)
        t0 = time.perf_counter()
        got = sum(pool.map(read, range(n)))
        dt = time.perf_counter() - t0
        raw_bytes.append(got)
        return dt

    with (
        raw_reader(kind, extra, rio, keys, threads) as (read, paths),
        ThreadPoolExecutor(threads) as pool,
    ):
        log(
            f"{kind}: one untimed round of each (connections opened), then {args.rounds} "
            f"timed rounds, {threads} read threads"
        )
        first_warm, first_raw = warm_up(), raw()
        times: dict[str, list[float]] = {"warm": [], "raw": []}
        sides = [("warm", warm_up), ("raw", raw)]
        for r in range(args.rounds):
            for name, fn in sides if r % 2 == 0 else sides[::-1]:
                times[name].append(fn())
        last = reports[-1]
        # every chunk warmed, into its slot, with the uploaded bytes
        keyed = {k: s for k, s in last.chunks}
        bad = [
            i
            for i in range(n)
            if keyed.get(block_hash(i)) != i
            or hashlib.blake2b(slab.slot_memoryview(i), digest_size=16).digest() != digests[i]
        ]
        warmed = n - len(bad)
        split: dict[str, Any] = {}
        if args.split_rounds:
            log(f"{kind}: {args.split_rounds} more warm-ups, their steps timed")
            rows = []
            for _ in range(args.split_rounds):
                timer = Split()
                with timer.installed(rio):
                    wall = warm_up()
                rows.append(timer.row(wall, threads))
            split = median_split(rows)
    warm_s = statistics.median(times["warm"])
    raw_s = statistics.median(times["raw"])
    warm_mbps = last.nbytes / MB / warm_s
    raw_mbps = raw_bytes[-1] / MB / raw_s
    ratio = warm_mbps / raw_mbps
    # the best rounds of each side: on a shared machine, what each can do undisturbed
    best_ratio = (last.nbytes / min(times["warm"])) / (raw_bytes[-1] / min(times["raw"]))
    return {
        "tier": kind,
        "chunks": n,
        "chunk_bytes": slab.layout.slot_bytes,
        "mib": n * slab.layout.slot_bytes / MiB,
        "io_threads": args.io_threads,
        "read_threads": threads,
        "rounds": args.rounds,
        "file_cache": args.file_cache if kind == "file" else None,
        "warmup_s": warm_s,
        "warmup_mbps": warm_mbps,
        "warmup_bytes": last.nbytes,
        "warmup_all_s": times["warm"],
        "warmup_report_s": last.seconds,
        "raw_s": raw_s,
        "raw_mbps": raw_mbps,
        "raw_bytes": raw_bytes[-1],
        "raw_all_s": times["raw"],
        "first_warmup_s": first_warm,
        "first_raw_s": first_raw,
        "ratio": ratio,
        "ratio_best": best_ratio,
        "goal": GOAL,
        "met": ratio >= GOAL,
        "outcome": last.outcome,
        "planned": last.planned,
        "warmed": warmed,
        "not_warmed": bad[:10],
        "store_s": stored_s,
        "split": split,
    }


# ---- output -----------------------------------------------------------------------------------


def print_tables(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(
        f"\nWarm-up throughput: warm_host_tier against the raw client on the same objects "
        f"(chunks of {cfg['chunk_bytes'] / MiB:.2f} MiB, io_threads {cfg['io_threads']}, "
        f"median of {cfg['rounds']} rounds; MB = 1e6 B; goal warm-up / raw >= {GOAL})"
    )
    for kind, why in result["unavailable"].items():
        print(f"\n{kind}: unavailable: {why}")
    for row in result["tiers"]:
        name = row["tier"] + (f" (page cache {row['file_cache']})" if row["file_cache"] else "")
        print(f"\n{name}, {row['read_threads']} read threads (raw: as many)")
        print(
            "| chunks warmed | MiB | warm-up s | warm-up MB/s | raw MB/s | warm-up / raw "
            "(best rounds) | goal | met |"
        )
        print("|---|---|---|---|---|---|---|---|")
        print(
            f"| {row['warmed']} of {row['chunks']} | {row['mib']:.0f} | {row['warmup_s']:.3f} "
            f"| {row['warmup_mbps']:,.0f} | {row['raw_mbps']:,.0f} | {row['ratio']:.2f} "
            f"({row['ratio_best']:.2f}) | >= {row['goal']} | {'yes' if row['met'] else 'NO'} |"
        )
        sp = row["split"]
        if sp:
            ms = {k: v * 1e3 for k, v in sp.items() if k.endswith("_s")}
            print(
                f"where a warm-up's time goes (median of {sp['rounds']} timed warm-ups, "
                f"{ms['wall_s']:.1f} ms): manifest read {ms['manifest_read_s']:.1f} ms, "
                f"planning {ms['plan_s']:.2f} ms; over {sp['read_threads']} read threads: "
                f"the tier's reads into the slots {ms['tier_reads_s']:.1f} ms (of which "
                f"CRC-32 {ms['crc_s']:.1f} ms), verification {ms['verify_s']:.1f} ms, "
                f"{ms['read_thread_busy_s']:.1f} ms per thread; the rest "
                f"{ms['rest_s']:.1f} ms (read threads waiting: queueing, polling)"
            )
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kvtier.connectors.worker import warmup

    if args.in_flight_per_thread:
        warmup.IN_FLIGHT_PER_THREAD = args.in_flight_per_thread
    t0 = time.monotonic()
    result: dict[str, Any] = {"config": {}, "tiers": [], "unavailable": {}}
    workdir = tempfile.mkdtemp(prefix="kvtier-warmup-bench-")
    try:
        for kind in args.only:
            try:
                row = run_tier(kind, args, os.path.join(workdir, kind))
            except Unavailable as exc:
                log(f"{kind}: unavailable: {exc}")
                result["unavailable"][kind] = str(exc)
                continue
            result["tiers"].append(row)
            log(
                f"{kind}: warm-up {row['warmup_mbps']:,.0f} MB/s, raw {row['raw_mbps']:,.0f} "
                f"MB/s, ratio {row['ratio']:.2f} [{time.monotonic() - t0:.0f} s]"
            )
    finally:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    first = result["tiers"][0] if result["tiers"] else {}
    result["config"] = {
        "chunks": args.chunks,
        "rounds": args.rounds,
        "io_threads": args.io_threads,
        "layers": args.layers,
        "hidden": args.hidden,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "chunk_tokens": args.chunk_tokens,
        "block_size": args.block_size,
        "chunk_bytes": first.get("chunk_bytes", 0),
        "goal": GOAL,
        "in_flight_per_thread": warmup.IN_FLIGHT_PER_THREAD,
        "seconds": time.monotonic() - t0,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.json:
        print(json.dumps(result))
    else:
        print_tables(result)
    bad = [r["tier"] for r in result["tiers"] if r["warmed"] != r["chunks"]]
    if bad:
        log(f"not every chunk was warmed: {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
