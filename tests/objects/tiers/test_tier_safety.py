"""Untrusted objects in a shared store: bounded reads, per-object misses, no stuck shutdown.

Anyone who can write the directory, bucket or Redis can plant objects. These
tests plant them with plain clients on the real services (moto S3, redis-server,
a real directory) and check that one bad object costs one miss, never memory,
an I/O thread or the whole tier.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
from botocore.exceptions import EndpointConnectionError
from kit import PAYLOAD_SIZE, collect, payload

from kvtier.config import load_config
from kvtier.errors import ObjectError, ObjectTooLarge, TierUnavailable
from kvtier.objects import codec
from kvtier.objects.health import BackoffState, ConstantBackoff
from kvtier.objects.remote import MAX_FRAME, RemoteIO
from kvtier.objects.tiers import FileTier, ObjectTier, open_tier
from kvtier.objects.tiers.redis import RedisTier
from kvtier.objects.tiers.s3 import S3Tier
from kvtier.ops import OpResult

if TYPE_CHECKING:
    from conftest import RedisServer, S3Bucket

pytestmark = pytest.mark.integration

SHAPE = [2, 8, 64]
SIZE = PAYLOAD_SIZE  # bfloat16
DT = "bfloat16"
LIMIT = SIZE + MAX_FRAME  # the most RemoteIO reads for one of these slots


def make_rio(tier: ObjectTier, **kw) -> RemoteIO:
    kw.setdefault("threads", 2)
    kw.setdefault("queue_depth", 16)
    kw.setdefault("timeout_s", 5.0)
    kw.setdefault("signer", None)
    kw.setdefault("backoff", ConstantBackoff(5.0))  # long: a wrong backoff shows in the test
    return RemoteIO(tier, **kw)


def fetch(rio: RemoteIO, op_id: int, key: str) -> tuple[OpResult, bytes]:
    dest = memoryview(bytearray(b"\xee" * SIZE))
    rio.submit_get_into(op_id, key, dest, dtype=DT, shape=SHAPE)
    return collect(rio, 1)[op_id], bytes(dest)


def store(rio: RemoteIO, op_id: int, key: str, seed: int = 1) -> OpResult:
    assert rio.submit_put(op_id, key, payload(seed), dtype=DT, shape=SHAPE)
    return collect(rio, 1)[op_id]


@dataclass
class Backend:
    """A tier opened from config plus a raw writer that bypasses kvtier (the attacker)."""

    tier: ObjectTier
    plant: Callable[[str, bytes], None]


@pytest.fixture(params=["file", "s3", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path) -> Iterator[Backend]:
    if request.param == "file":
        tier = open_tier(load_config({"remote_url": f"file://{tmp_path}/objects"}, environ={}))
        assert isinstance(tier, FileTier)

        def plant(key: str, blob: bytes) -> None:
            os.makedirs(os.path.dirname(tier.path(key)), exist_ok=True)
            with open(tier.path(key), "wb") as f:
                f.write(blob)

    elif request.param == "s3":
        bucket: S3Bucket = request.getfixturevalue("s3_bucket")
        tier = open_tier(load_config({"remote_url": bucket.url}, environ={}))
        client = bucket.server.client()

        def plant(key: str, blob: bytes) -> None:
            client.put_object(Bucket=bucket.name, Key=f"{bucket.prefix}/{key}", Body=blob)

    else:
        url = request.getfixturevalue("redis_url")
        tier = open_tier(load_config({"remote_url": url}, environ={}))
        raw = request.getfixturevalue("redis_server").client()

        def plant(key: str, blob: bytes) -> None:
            raw.set(key, blob)

    yield Backend(tier, plant)
    tier.close()


# -- 5: reads are bounded before a byte is read ----------------------------------------------


def test_get_bound_is_exact(backend: Backend) -> None:
    blob = os.urandom(5000)
    backend.plant("b", blob)
    assert backend.tier.get("b", max_bytes=5000) == blob
    assert backend.tier.get("b", max_bytes=10**9) == blob
    with pytest.raises(ObjectTooLarge):
        backend.tier.get("b", max_bytes=4999)
    assert backend.tier.get("b") == blob  # unbounded for tools and tests
    assert backend.tier.get("missing", max_bytes=100) is None
    backend.plant("empty", b"")
    assert not backend.tier.get("empty", max_bytes=100)  # b"" (truncated) or None (a miss)


def test_oversize_object_is_a_counted_miss_not_an_outage(backend: Backend) -> None:
    backend.plant("big", b"\0" * (LIMIT + 1))
    rio = make_rio(backend.tier)
    res, dest = fetch(rio, 1, "big")
    assert not res.ok and res.error_kind == "oversize", res
    assert dest == b"\xee" * SIZE
    assert rio.counters()["errors_oversize"] == 1 and rio.counters()["bytes_read"] == 0
    assert not rio.is_down
    assert store(rio, 2, "good").ok  # the tier keeps working
    res, dest = fetch(rio, 3, "good")
    assert res.ok and dest == bytes(payload())
    rio.close()


def test_sparse_giant_file_is_refused_without_allocating(tmp_path) -> None:
    tier = FileTier(str(tmp_path), background_sweep=False)
    path = tier.path("giant")
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.truncate(8 * 2**30)  # 8 GiB that cost the writer nothing
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        with pytest.raises(ObjectTooLarge):
            tier.get("giant", max_bytes=LIMIT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20 and time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("kind", ["s3", "redis"])
def test_oversize_remote_object_is_not_downloaded(kind, request, services) -> None:
    """8 MiB planted behind a 1 MB/s link: refusing it must not cost the 8 s download."""
    big = b"\0" * (8 * 2**20)
    if kind == "s3":
        bucket: S3Bucket = request.getfixturevalue("s3_bucket")
        bucket.server.client().put_object(Bucket=bucket.name, Key="p/big", Body=big)
        proxy = services.proxy((bucket.server.host, bucket.server.port))
        tier: ObjectTier = S3Tier(
            f"s3://{bucket.name}/p", endpoint_url=f"http://127.0.0.1:{proxy.port}"
        )
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        request.getfixturevalue("redis_url")  # running and flushed
        server.client().set("big", big)
        proxy = services.proxy((server.host, server.port))
        tier = RedisTier(f"redis://127.0.0.1:{proxy.port}/0")
    proxy.bandwidth_bps = 1e6
    t0 = time.perf_counter()
    with pytest.raises(ObjectTooLarge):
        tier.get("big", max_bytes=LIMIT)
    assert time.perf_counter() - t0 < 2.0
    tier.close()


def _release_fifo(path: str) -> None:
    """Open the FIFO's other end so a reader stuck in open() (the old code) can go on."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_fifo_at_a_chunk_name_never_blocks(tmp_path) -> None:
    tier = FileTier(str(tmp_path / "objects"))
    path = tier.path("fifo")
    os.makedirs(os.path.dirname(path))
    os.mkfifo(path)
    outcome: list[BaseException | bytes | None] = []

    def get() -> None:
        try:
            outcome.append(tier.get("fifo", max_bytes=LIMIT))
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=get, daemon=True)
    reader.start()
    reader.join(5)
    try:
        assert not reader.is_alive(), "get blocked on a FIFO"
        assert isinstance(outcome[0], ObjectError), outcome
        assert tier.exists(["fifo"]) == [False]
        rio = make_rio(tier, timeout_s=1.0)
        res, _ = fetch(rio, 1, "fifo")
        assert res.error_kind == "object" and not rio.is_down
        t0 = time.perf_counter()
        rio.close()
        assert time.perf_counter() - t0 < 2.0
    finally:
        _release_fifo(path)


def test_symlink_at_a_chunk_name_is_not_followed(tmp_path) -> None:
    tier = FileTier(str(tmp_path / "objects"))
    outside = tmp_path / "elsewhere"
    outside.write_bytes(b"".join(codec.encode("link", payload(), dtype=DT, shape=SHAPE)))
    os.makedirs(os.path.dirname(tier.path("link")))
    os.symlink(outside, tier.path("link"))
    with pytest.raises(ObjectError):
        tier.get("link", max_bytes=LIMIT)
    assert tier.exists(["link"]) == [False]
    rio = make_rio(tier)
    res, dest = fetch(rio, 1, "link")
    assert res.error_kind == "object" and dest == b"\xee" * SIZE
    rio.close()


class _StuckTier(ObjectTier):
    """A backend whose get never returns and whose close waits for the lock get holds."""

    name = "file"

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entered = threading.Event()
        self.release = threading.Event()

    def exists(self, keys):
        return [False for _ in keys]

    def get(self, key, max_bytes=None):
        with self.lock:
            self.entered.set()
            self.release.wait()
        return None

    def put(self, key, parts):
        pass

    def delete(self, keys):
        pass

    def close(self):
        with self.lock:
            pass


def test_stuck_backend_call_does_not_block_close() -> None:
    tier = _StuckTier()
    rio = make_rio(tier, timeout_s=0.3)
    rio.submit_get_into(1, "k", memoryview(bytearray(SIZE)), dtype=DT, shape=SHAPE)
    assert tier.entered.wait(5)
    closer = threading.Thread(target=rio.close, daemon=True)
    t0 = time.perf_counter()
    closer.start()
    closer.join(5)
    try:
        assert not closer.is_alive(), "RemoteIO.close hung on a stuck backend call"
        assert time.perf_counter() - t0 < 1.5
    finally:
        tier.release.set()


class _UnboundedTier(_StuckTier):
    """A tier whose get ignores max_bytes: the object is refused before it reaches the slot."""

    def get(self, key, max_bytes=None):
        return b"\0" * (LIMIT + 10)

    def close(self):
        pass


def test_tier_without_a_bound_still_gets_oversize() -> None:
    rio = make_rio(_UnboundedTier())
    res, dest = fetch(rio, 1, "k")
    assert res.error_kind == "oversize" and dest == b"\xee" * SIZE
    rio.close()


# -- 6: one bad object is one miss; only the connection backs off, per direction ------------


def test_redis_key_of_the_wrong_type_is_one_miss(redis_url: str, redis_server) -> None:
    redis_server.client().lpush("list-key", b"x")
    tier = RedisTier(redis_url)
    with pytest.raises(ObjectError):
        tier.get("list-key", max_bytes=LIMIT)
    with pytest.raises(ObjectError):
        tier.get("list-key")
    rio = make_rio(tier)
    res, _ = fetch(rio, 1, "list-key")
    assert res.error_kind == "object"
    assert not rio.is_down and rio.counters()["errors_unreachable"] == 0
    assert store(rio, 2, "good").ok
    assert fetch(rio, 3, "good")[0].ok
    assert rio.counters()["errors_object"] == 1
    rio.close()


def test_full_redis_refuses_writes_but_keeps_serving_hits(services) -> None:
    server = services.redis()
    rio = make_rio(RedisTier(server.url))
    assert store(rio, 1, "kept").ok
    server.client().config_set("maxmemory-policy", "noeviction")
    server.client().config_set("maxmemory", 1)  # every write is refused: OOM
    res = store(rio, 2, "new")
    assert not res.ok and res.error_kind == "object", res
    assert not rio.is_down
    res, dest = fetch(rio, 3, "kept")
    assert res.ok and dest == bytes(payload())
    rio.close()


def test_readonly_replica_backs_off_writes_not_reads(services) -> None:
    """A failed-over primary that became a replica: writes back off, hits go on."""
    server = services.redis()
    rio = make_rio(RedisTier(server.url))
    assert store(rio, 1, "kept").ok
    dead = services.redis(start=False)
    server.client().replicaof(dead.host, dead.port)
    res = store(rio, 2, "new")
    assert res.error_kind == "unreachable"
    assert rio.writes_down and not rio.reads_down
    res, dest = fetch(rio, 3, "kept")
    assert res.ok and dest == bytes(payload())
    res, dest = fetch(rio, 4, "kept")  # reads stay up while writes back off
    assert res.ok and dest == bytes(payload())
    res = store(rio, 5, "newer")  # during the write backoff: fails fast
    assert res.error_kind == "unreachable" and res.seconds < 0.5
    rio.close()


class _FullDiskTier(FileTier):
    """A FileTier whose temp files are /dev/full: every write gets a real ENOSPC."""

    def _create_temp(self, dir_fd: int) -> tuple[int, str]:
        return os.open("/dev/full", os.O_WRONLY), ".tmp-never-created"


def test_full_disk_on_write_does_not_stop_hits(tmp_path) -> None:
    root = str(tmp_path / "objects")
    with FileTier(root) as ok:
        ok.put("kept", codec.encode("kept", payload(), dtype=DT, shape=SHAPE))
    tier = _FullDiskTier(root)
    with pytest.raises(ObjectError, match="space"):
        tier.put("new", codec.encode("new", payload(), dtype=DT, shape=SHAPE))
    rio = make_rio(tier)
    res = store(rio, 1, "new")
    assert res.error_kind == "object", res
    assert not rio.is_down
    res, dest = fetch(rio, 2, "kept")
    assert res.ok and dest == bytes(payload())
    assert rio.counters()["errors_object"] == 1 and rio.counters()["errors_unreachable"] == 0
    rio.close()


def test_s3_object_in_glacier_is_one_miss(s3_bucket: S3Bucket) -> None:
    blob = b"".join(codec.encode("cold", payload(), dtype=DT, shape=SHAPE))
    s3_bucket.server.client().put_object(
        Bucket=s3_bucket.name, Key="kv/cold", Body=blob, StorageClass="GLACIER"
    )
    tier = S3Tier(s3_bucket.url)
    with pytest.raises(ObjectError, match="InvalidObjectState"):
        tier.get("cold", max_bytes=LIMIT)
    rio = make_rio(tier)
    res, _ = fetch(rio, 1, "cold")
    assert res.error_kind == "object" and not rio.is_down
    assert store(rio, 2, "warm").ok and fetch(rio, 3, "warm")[0].ok
    rio.close()


def test_s3_missing_bucket_is_still_an_outage(s3_bucket: S3Bucket) -> None:
    tier = S3Tier("s3://no-such-bucket-kvtier/x")
    with pytest.raises(TierUnavailable, match="NoSuchBucket"):
        tier.get("k", max_bytes=LIMIT)
    rio = make_rio(tier)
    assert store(rio, 1, "k").error_kind == "unreachable" and rio.writes_down
    rio.close()


def test_s3_exists_stops_sending_heads_after_a_failure(s3_bucket: S3Bucket) -> None:
    tier = S3Tier(s3_bucket.url)
    calls = 0

    def head_object(**kw):
        nonlocal calls
        calls += 1
        time.sleep(0.005)
        raise EndpointConnectionError(endpoint_url="http://127.0.0.1:9")

    tier._client.head_object = head_object
    with pytest.raises(TierUnavailable):
        tier.exists([f"k{i}" for i in range(100)])
    time.sleep(0.5)
    assert calls <= 10, f"{calls} HEADs sent after the endpoint failed"
    tier.close()


def test_file_errors_are_sorted_by_errno(tmp_path) -> None:
    tier = FileTier(str(tmp_path), background_sweep=False)
    assert isinstance(tier._error("put", OSError(errno.ENOSPC, "full")), ObjectError)
    assert isinstance(tier._error("get", OSError(errno.ELOOP, "link")), ObjectError)
    assert isinstance(tier._error("get", OSError(errno.ESTALE, "nfs")), ObjectError)
    assert isinstance(tier._error("get", OSError(errno.ENOTCONN, "nfs")), TierUnavailable)
    assert isinstance(tier._error("put", OSError(errno.EROFS, "ro")), TierUnavailable)


def test_backoff_state_counts_and_clears() -> None:
    state = BackoffState(ConstantBackoff(0.2))
    assert not state.is_down and state.succeeded() == 0
    assert state.failed()[0] == 1 and state.is_down
    assert state.failed()[0] == 1  # in flight during the backoff: not stacked
    assert state.succeeded() == 1 and not state.is_down
