"""bench/tier_throughput.py's encoded chunks: sealed ÷ plain (AES-256-GCM) through
RemoteIO, and compression (ratio, speed, and the restart hit's fetch of compressed chunks,
optionally through a slow link)."""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable

from tier_cases import Case, MiB, open_case, time_restart_runs, timed, wait_for_results

from kvtier.objects import codec, compress
from kvtier.objects.health import ConstantBackoff
from kvtier.objects.remote import MAX_FRAME, RemoteIO
from kvtier.objects.sealing import Sealer
from kvtier.objects.tiers.base import Found, ObjectTier


def aes_gcm_speed(size: int, rounds: int) -> dict[str, float]:
    """GB/s of kvtier's sealing on one core: seal into its scratch buffer, open in place."""
    sealer = Sealer(os.urandom(32))
    plain = memoryview(os.urandom(size))
    buf = memoryview(bytearray(size))
    seal_t, open_t = [], []
    for _ in range(max(rounds, 3) * 4):
        t0 = time.perf_counter()
        seal, ct = sealer.seal(b"aad", plain)
        t1 = time.perf_counter()
        buf[:] = ct
        t2 = time.perf_counter()
        sealer.open_into(seal, b"aad", buf)
        open_t.append(time.perf_counter() - t2)
        seal_t.append(t1 - t0)
    assert bytes(buf) == bytes(plain)
    return {
        "seal_gbps": size / statistics.median(seal_t) / 1e9,
        "open_gbps": size / statistics.median(open_t) / 1e9,
    }


def run_encryption(case: Case, args: argparse.Namespace, chunks: list[bytes]) -> list[dict]:
    """The encryption table: sealed ÷ plain put and get, sync and through RemoteIO."""
    size = len(chunks[0])
    shape = [size // 2]
    total = size * len(chunks)
    hmac_key = b"bench-key" if args.hmac else None
    plain_signer = codec.Signer(hmac_key) if hmac_key else None
    sealed_signer = codec.Signer(hmac_key, sealer=Sealer(os.urandom(32)))
    sides = {"plain": plain_signer, "sealed": sealed_signer}
    slots = [memoryview(bytearray(size)) for _ in chunks]
    # the host tier's slots the uploads read from: plaintext, never changed by sealing
    sources = [memoryview(bytearray(c)) for c in chunks]
    tier = open_case(case, args.putget_threads)
    rios = {
        side: RemoteIO(
            open_case(case, args.putget_threads),
            threads=args.putget_threads,
            queue_depth=len(chunks) + 1,
            timeout_s=60.0,
            signer=signer,
            backoff=ConstantBackoff(0.1),
        )
        for side, signer in sides.items()
    }

    def keys(side: str) -> list[str]:
        return [f"enc-{side}-{i}" for i in range(len(chunks))]

    def put_sync(side: str) -> Callable[[], None]:
        def run() -> None:
            for k, src in zip(keys(side), sources, strict=True):
                tier.put(k, codec.encode(k, src, dtype="bfloat16", shape=shape, signer=sides[side]))

        return run

    def get_sync(side: str) -> Callable[[], None]:
        def run() -> None:
            for k, slot in zip(keys(side), slots, strict=True):
                head = tier.read_into(k, slot, MAX_FRAME)
                assert head is not None
                codec.verify(head, slot, key=k, dtype="bfloat16", shape=shape, signer=sides[side])

        return run

    def put_async(side: str) -> Callable[[], None]:
        def run() -> None:
            rio = rios[side]
            for i, (k, src) in enumerate(zip(keys(side), sources, strict=True)):
                assert rio.submit_put(i, k, src, dtype="bfloat16", shape=shape)
            wait_for_results(rio, len(chunks))

        return run

    def get_async(side: str) -> Callable[[], None]:
        def run() -> None:
            rio = rios[side]
            for i, (k, slot) in enumerate(zip(keys(side), slots, strict=True)):
                rio.submit_get_into(i, k, slot, dtype="bfloat16", shape=shape)
            wait_for_results(rio, len(chunks))

        return run

    ops = [
        ("sync, 1 thread", "put", put_sync),
        ("sync, 1 thread", "get", get_sync),
        (f"RemoteIO, {rios['plain'].write_threads} threads", "put", put_async),
        (f"RemoteIO, {rios['plain'].read_threads} threads", "get", get_async),
    ]
    put_sync("plain")()
    put_sync("sealed")()
    rows = []
    for mode, op, make in ops:
        times: dict[str, list[float]] = {"plain": [], "sealed": []}
        fns = [("plain", make("plain")), ("sealed", make("sealed"))]
        for r in range(args.rounds):  # interleaved, alternating who goes first
            for side, fn in fns if r % 2 == 0 else fns[::-1]:
                times[side].append(timed(fn))
            if op == "get":
                assert [bytes(s) for s in slots] == chunks, "a sealed chunk did not open"
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append(
            {
                "backend": case.name,
                "mode": mode,
                "op": op,
                "chunk_mib": size / MiB,
                "plain_gbps_median": total / med["plain"] / 1e9,
                "sealed_gbps_median": total / med["sealed"] / 1e9,
                "sealed_over_plain": med["plain"] / med["sealed"],
            }
        )
    for rio in rios.values():
        rio.close()  # closes its tier too
    tier.close()
    return rows


def kv_like_chunks(size: int, n: int, seed: int = 0) -> list[bytes]:
    """bf16 chunks shaped like K/V: normal values with per-channel scales (a few channels
    much larger than the rest), rounded to bf16 (round to nearest even)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        scale = rng.uniform(0.1, 3.1, 128).astype(np.float32)
        scale[rng.choice(128, 4, replace=False)] *= 20  # outlier channels
        x = (rng.standard_normal((size // 256, 128)).astype(np.float32) * scale).reshape(-1)
        bits = x.view(np.uint32)
        bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        out.append(bf16.tobytes()[:size])
    return out


def engine_chunks(kv_dir: str) -> list[bytes]:
    """The payloads of the raw (unsealed, uncompressed) chunks a file:// tier holds."""
    out = []
    for root, _, files in os.walk(kv_dir):
        for name in sorted(files):
            if name.startswith("."):
                continue
            with open(os.path.join(root, name), "rb") as f:
                blob = f.read()
            try:
                out.append(bytes(codec.decode(blob, key=name)))
            except Exception:  # noqa: BLE001  # sealed, compressed or not a chunk: skipped
                continue
    if not out:
        raise SystemExit(f"--kv-dir {kv_dir}: no raw kvtier chunk found")
    return out


def compression_speed(chunks: list[bytes], rounds: int) -> list[dict]:
    """Stored ÷ raw and one-thread GB/s of each candidate on ``chunks`` (best of rounds)."""
    cands: dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes, memoryview], None]]] = {}
    comp = compress.Compressor()

    def unshuffle(c: bytes, d: memoryview) -> None:
        compress.decompress_into("blosc2", memoryview(c), d)

    cands["blosc2 shuffle+zstd-1 (kvtier)"] = (
        lambda b: comp.compress(memoryview(b), 2)[0],
        unshuffle,
    )
    fp8 = compress.Fp8Compressor()

    def quantise(b: bytes) -> bytes:
        got = fp8.compress_chunk(memoryview(b), "bfloat16")
        assert got is not None
        return got[1]

    def dequantise(c: bytes, d: memoryview) -> None:
        compress.decompress_into("fp8e4m3", memoryview(c), d, "bfloat16")

    cands["fp8 e4m3, scale per 128 (lossy)"] = (quantise, dequantise)
    try:
        import numpy as np
        import zstandard
    except ImportError:
        pass
    else:
        zc, zd = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()

        def planes(b: bytes) -> bytes:
            return zc.compress(np.frombuffer(b, np.uint8).reshape(-1, 2).T.tobytes())

        def unplanes(c: bytes, d: memoryview) -> None:
            flat = np.frombuffer(zd.decompress(c, max_output_size=d.nbytes), np.uint8)
            np.frombuffer(d, np.uint8).reshape(-1, 2)[:] = flat.reshape(2, -1).T

        cands["zstandard-1 on byte planes"] = (planes, unplanes)
    rows = []
    raw = sum(len(c) for c in chunks)
    for name, (cfn, dfn) in cands.items():
        best_c = best_d = float("inf")
        stored = 0
        slot = memoryview(bytearray(len(chunks[0])))
        for _ in range(rounds):
            t0 = time.perf_counter()
            blobs = [cfn(c) for c in chunks]
            best_c = min(best_c, time.perf_counter() - t0)
            stored = sum(len(b) for b in blobs)
            t0 = time.perf_counter()
            for b, c in zip(blobs, chunks, strict=True):
                dfn(b, slot[: len(c)])
            best_d = min(best_d, time.perf_counter() - t0)
        assert "lossy" in name or bytes(slot[: len(chunks[-1])]) == chunks[-1], name
        rows.append(
            {
                "codec": name,
                "ratio": stored / raw,
                "compress_gbps": raw / best_c / 1e9,
                "decompress_gbps": raw / best_d / 1e9,
            }
        )
    return rows


class LinkTier(ObjectTier):
    """A tier behind a link of ``gbit`` Gbit/s that every read shares (a NIC, an uplink):
    each object read holds the link for its bytes' time on the wire."""

    def __init__(self, inner: ObjectTier, gbit: float) -> None:
        self.inner, self.name = inner, inner.name
        self.bytes_per_s = gbit * 1e9 / 8
        self._lock = threading.Lock()
        self._free_at = 0.0

    def _wire(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + nbytes / self.bytes_per_s
            wait = self._free_at - now
        time.sleep(wait)

    def exists(self, keys):  # type: ignore[no-untyped-def]
        return self.inner.exists(keys)

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        blob = self.inner.get(key, max_bytes)
        if blob is not None:
            self._wire(len(blob))
        return blob

    def read_into(
        self, key: str, dest: memoryview, max_head: int, *, found: Found = None
    ) -> bytes | None:
        head = self.inner.read_into(key, dest, max_head, found=found)
        if head is not None:
            self._wire(len(head) + dest.nbytes)
        return head

    def put(self, key, parts):  # type: ignore[no-untyped-def]
        self.inner.put(key, parts)

    def delete(self, keys):  # type: ignore[no-untyped-def]
        self.inner.delete(keys)

    def close(self) -> None:
        self.inner.close()


def auto_learn_rounds(n: int) -> int:
    """Rounds of ``n`` uploads read back the auto replica learns from before the timed runs."""
    return max(4, -(-(compress.MIN_READS + 1) // n))


def auto_replica(
    reader: Callable[[], ObjectTier],
    args: argparse.Namespace,
    chunks: list[bytes],
    n: int,
    prefix: str = "z",
) -> tuple[RemoteIO, compress.AutoCompressor]:
    """A replica with ``compression: auto`` through the same link: it uploads rounds of
    ``n`` chunks and reads each round back (its own hits time both forms), then uploads
    the timed run's chunks (``{prefix}-auto-*``) in the form it settled on (auto starts raw, and
    needs ``MIN_READS`` timed reads before it chooses)."""
    size = len(chunks[0])
    rounds = auto_learn_rounds(n)
    z = compress.AutoCompressor(compress.Compressor())
    rio = RemoteIO(
        reader(),
        threads=args.putget_threads,
        queue_depth=2 * n + 1,
        timeout_s=60.0,
        signer=None,
        backoff=ConstantBackoff(0.1),
        compressor=z,
    )
    slots = [memoryview(bytearray(size)) for _ in range(n)]
    seq = 0

    def upload(name: str) -> None:
        nonlocal seq
        for i in range(n):
            seq += 1
            rio.submit_put(
                seq,
                f"{name}-{i}",
                memoryview(chunks[i % len(chunks)]),
                dtype="bfloat16",
                shape=[size // 2],
            )
        if rio.flush(60.0):
            raise RuntimeError("auto replica: uploads left unwritten")
        rio.poll()

    for r in range(rounds):
        upload(f"{prefix}-learn-{r}")
        rio.submit_get_run(
            [(i, f"{prefix}-learn-{r}-{i}", slots[i]) for i in range(n)],
            dtype="bfloat16",
            shape=[size // 2],
        )
        wait_for_results(rio, n)
    upload(f"{prefix}-auto")
    return rio, z


def run_compression_hit(
    case: Case, args: argparse.Namespace, chunks: list[bytes], link_gbit: float | None = None
) -> dict:
    """Latency of one restart hit's fetches (a lookup run), raw and compressed objects
    alternating, each read by an engine of that setting (RemoteIO with or without a
    compressor); with ``link_gbit``, through a link of that bandwidth."""
    size = len(chunks[0])
    shape = [size // 2]
    n = args.hit_chunks
    # keys of this call alone: a tier dir or server shared with an earlier call (another
    # link speed) already holds its objects, which an upload would not write again
    prefix = f"z{uuid.uuid4().hex[:8]}"
    comp = compress.Compressor()
    writer = open_case(case, args.putget_threads)
    stored = {"none": 0, "lossless": 0}
    for side in stored:
        for i in range(n):
            k, c = f"{prefix}-{side}-{i}", chunks[i % len(chunks)]
            z = ("blosc2", comp.compress(memoryview(c), 2)[0]) if side == "lossless" else None
            parts = codec.encode(k, c, dtype="bfloat16", shape=shape, compressed=z)
            stored[side] += codec.encoded_size(parts)
            writer.put(k, parts)
    writer.close()

    def reader() -> ObjectTier:
        tier = open_case(case, args.putget_threads)
        return tier if link_gbit is None else LinkTier(tier, link_gbit)

    rios = {
        side: RemoteIO(
            reader(),
            threads=args.putget_threads,
            queue_depth=n + 1,
            timeout_s=60.0,
            signer=None,
            backoff=ConstantBackoff(0.1),
            compressor=comp if side == "lossless" else None,
        )
        for side in stored
    }
    slots = [memoryview(bytearray(size)) for _ in range(n)]
    reps = max(args.rounds, 3) * 5

    def bit_exact() -> None:
        for i in range(n):
            assert bytes(slots[i]) == chunks[i % len(chunks)], "not bit-exact"

    rios["auto"], auto = auto_replica(reader, args, chunks, n, prefix)
    auto_compressed = auto.compressing  # the form its timed run was stored in
    times = time_restart_runs(rios, prefix, slots, shape, reps, bit_exact)
    auto_raw, auto_stored, _ = rios["auto"].take_compression()["write"]  # all its uploads
    for rio in rios.values():
        rio.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    name = case.name if link_gbit is None else f"{case.name} @ {link_gbit:g} Gbit/s"
    return {
        "backend": name,
        "chunks": n,
        "chunk_mib": size / MiB,
        "runs": reps,
        "stored_over_raw": stored["lossless"] / stored["none"],
        "none_ms_median": med["none"] * 1000,
        "lossless_ms_median": med["lossless"] * 1000,
        "lossless_over_none": med["lossless"] / med["none"],
        "auto_ms_median": med["auto"] * 1000,
        "auto_over_none": med["auto"] / med["none"],
        "auto_compressing": auto_compressed,
        "auto_stored_over_raw": auto_stored / auto_raw,
    }
