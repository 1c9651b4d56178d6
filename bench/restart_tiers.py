"""The object tiers of ``bench/ttft.py``'s restart hits: each tier's server for the run
(harness's redis-server and moto), the written objects copied from the file tier into
another tier, and the backend's own client timed on the same objects.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness import create_bucket, start_moto, start_redis

BUCKET = "kvtier-bench"


@contextlib.contextmanager
def object_tier(kind: str, workdir: str) -> Iterator[tuple[dict, dict]]:
    """(extra config, env) of one object tier, its server started for the duration."""
    if kind == "file":
        path = os.path.join(workdir, "tier")
        shutil.rmtree(path, ignore_errors=True)
        yield {"remote_url": f"file://{path}"}, {}
        return
    if kind == "redis":
        proc, url = start_redis(Path(workdir))
        extra: dict[str, Any] = {"remote_url": url}
        env: dict[str, str] = {}
    else:
        proc, endpoint, env = start_moto(Path(workdir))
        extra = {"remote_url": f"s3://{BUCKET}/kv", "s3_endpoint_url": endpoint}
    try:
        if kind == "s3":
            create_bucket(endpoint, BUCKET)
        yield extra, env
    finally:
        proc.stop()


def _s3_client(endpoint: str, **kw: Any) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
        **kw,
    )


def copy_objects(src_root: str, kind: str, extra: dict) -> int:
    """Store the file tier's objects, byte for byte under the same keys, in an S3 or Redis
    tier (the sweep writes its prompts through one engine, not one engine per tier)."""
    from urllib.parse import unquote

    if kind == "s3":
        client = _s3_client(extra["s3_endpoint_url"])

        def put(key: str, data: bytes) -> None:
            client.put_object(Bucket=BUCKET, Key="kv/" + key, Body=data)
    else:
        import redis

        rclient = redis.Redis.from_url(extra["remote_url"])

        def put(key: str, data: bytes) -> None:
            rclient.set(key, data)

    n = 0
    for dirpath, _dirs, files in os.walk(src_root):
        for name in files:
            if name.startswith(".") or name.startswith("h-"):
                continue  # temp files; hashed names do not give the key back
            with open(os.path.join(dirpath, name), "rb") as f:
                put(unquote(name), f.read())
            n += 1
    return n


def set_file_cache(extra: dict, state: str) -> int:
    """Put a file tier's objects in the page cache (``warm``: each read once) or out of
    it (``cold``: ``POSIX_FADV_DONTNEED``, no root needed); the files handled (0 for other
    tiers). Done before kvtier's restart hits and before each raw-client read, so both
    find the same state: ``warm`` is a vLLM restarted on the node that wrote the chunks
    (the page cache outlives the process), ``cold`` one that never read them. Left alone,
    each would find a different share cached (the raw client re-reading what kvtier had
    just brought in; some VMs drain their page cache within a minute)."""
    from kvtier.config import parse_remote

    remote = parse_remote("remote_url", extra.get("remote_url"))
    if not (remote and remote.is_local):
        return 0
    root = remote.directory
    return set_page_cache(
        [os.path.join(d, f) for d, _s, files in os.walk(root) for f in files], state
    )


def set_page_cache(paths: list[str], state: str) -> int:
    """:func:`set_file_cache` for these files only (a raw-client read's chunks, not the
    whole tier before each of them); the files handled (symlinks are not followed)."""
    if state not in ("warm", "cold"):
        raise ValueError(f"file cache state {state!r}: warm or cold")
    n = 0
    buf = bytearray(1 << 20)
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # a symlink, or a file swept meanwhile
        try:
            if state == "cold":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while os.readv(fd, [buf]):
                    pass
        finally:
            os.close(fd)
        n += 1
    return n


def raw_client(
    kind: str,
    extra: dict,
    lengths: list[int],
    *,
    chunk_tokens: int = 256,
    threads: int = 2,
    reps: int = 5,
    file_cache: str = "warm",
) -> dict:
    """What the backend's own client takes for one prompt's chunks, read as kvtier reads
    them: stored objects of the run (as many as a prompt of each length loads), each into
    a buffer of its size, on ``threads`` threads (kvtier's read threads at io_threads=4).

    ``parallel_s``: all of them queued at once; ``first_then_rest_s``: the first alone,
    then the rest (what a lookup does on a tier whose latency it does not know yet).
    Medians of ``reps``. File: open + readinto, the chunks' page cache set to
    ``file_cache`` before each timed read (:func:`set_page_cache`, as the whole tier's is
    before kvtier's restart hits);
    Redis: redis-py GET; S3: boto3 GetObject."""
    from concurrent.futures import ThreadPoolExecutor

    from kvtier.config import RemoteURL

    if kind == "file":
        root = RemoteURL.parse(extra["remote_url"]).directory
        keys = sorted(
            os.path.join(d, f)
            for d, _s, files in os.walk(root)
            for f in files
            if not f.startswith((".", "h-"))
        )

        def get(k: str) -> int:
            with open(k, "rb", buffering=0) as f:
                buf = bytearray(os.fstat(f.fileno()).st_size)
                return f.readinto(buf) or 0
    elif kind == "redis":
        import redis

        pool = redis.ConnectionPool.from_url(extra["remote_url"], max_connections=threads + 1)
        rclient = redis.Redis(connection_pool=pool)
        keys = sorted(k.decode() for k in rclient.scan_iter(count=1000))

        def get(k: str) -> int:
            return len(rclient.get(k) or b"")
    else:
        from kvtier.objects.tiers.s3 import client_config

        client = _s3_client(extra["s3_endpoint_url"], config=client_config(threads * 2, 2000))
        paginator = client.get_paginator("list_objects_v2")
        keys = sorted(
            o["Key"]
            for page in paginator.paginate(Bucket=BUCKET, Prefix="kv/")
            for o in page.get("Contents", [])
        )

        def get(k: str) -> int:
            return len(client.get_object(Bucket=BUCKET, Key=k)["Body"].read())

    out = {}
    with ThreadPoolExecutor(threads) as pool_:
        list(pool_.map(get, keys[: threads * 2]))  # connections opened, code paths warm
        for n in lengths:
            chunks = keys[: -(-((n - 1) // 32 * 32) // chunk_tokens)]
            par, seq = [], []
            for _ in range(reps):
                if kind == "file":  # (the keys are the chunks' paths)
                    set_page_cache(chunks, file_cache)
                t0 = time.perf_counter()
                nbytes = sum(pool_.map(get, chunks))
                par.append(time.perf_counter() - t0)
                if kind == "file":
                    set_page_cache(chunks, file_cache)
                t1 = time.perf_counter()
                get(chunks[0])
                list(pool_.map(get, chunks[1:]))
                seq.append(time.perf_counter() - t1)
            out[str(n)] = {
                "objects": len(chunks),
                "bytes": nbytes,
                "threads": threads,
                "parallel_s": statistics.median(par),
                "first_then_rest_s": statistics.median(seq),
            }
    return out
