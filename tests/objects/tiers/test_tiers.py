"""One behaviour suite for every object tier, against real services on loopback."""

from __future__ import annotations

import functools
import multiprocessing
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from kit import open_loopback_tier, snapshot

from kvtier.config import load_config
from kvtier.errors import ConfigError, ObjectTooLarge, TierUnavailable, TruncatedError
from kvtier.objects import codec
from kvtier.objects.tiers import FileTier, ObjectTier, open_tier

if TYPE_CHECKING:
    from conftest import RedisServer, S3Bucket

pytestmark = pytest.mark.integration


def _chunk(key: str, size: int = 4096, fill: int = 7) -> list[bytes | memoryview]:
    return codec.encode(key, bytes([fill]) * size, dtype="uint8", shape=[size])


@pytest.fixture(params=["file", "s3", "redis"])
def tier(request: pytest.FixtureRequest, tmp_path) -> Iterator[ObjectTier]:
    t = open_loopback_tier(request.param, request, tmp_path)
    yield t
    t.close()


def test_put_get_exists_delete(tier: ObjectTier) -> None:
    parts = _chunk("ns/abc-1")
    tier.put("ns/abc-1", parts)
    blob = tier.get("ns/abc-1")
    assert blob == b"".join(bytes(p) for p in parts)
    payload = codec.decode(blob, key="ns/abc-1", dtype="uint8", shape=[4096])
    assert bytes(payload) == bytes([7]) * 4096
    assert tier.exists(["ns/abc-1"]) == [True]
    tier.delete(["ns/abc-1", "never-written"])
    assert tier.exists(["ns/abc-1"]) == [False]
    assert tier.get("ns/abc-1") is None


def test_missing_key_is_none_not_error(tier: ObjectTier) -> None:
    assert tier.get("missing") is None
    assert tier.exists(["missing"]) == [False]
    assert tier.exists([]) == []
    tier.delete([])


def test_batch_exists_keeps_order(tier: ObjectTier) -> None:
    keys = [f"k{i:03d}" for i in range(40)]
    for k in keys[:5] + keys[8::3]:
        tier.put(k, _chunk(k, 64))
    stored = [i < 5 or (i >= 8 and (i - 8) % 3 == 0) for i in range(len(keys))]
    # the stored prefix exactly, whatever is stored after the first gap
    assert tier.exists(keys) == [True] * 5 + [False] * (len(keys) - 5)
    assert stored[8] and stored[11]  # k008 and k011 are stored, k009 is not
    assert tier.exists(keys[8:]) == [True] + [False] * (len(keys) - 9)


def test_a_missing_first_chunk_costs_one_request(tier: ObjectTier, request) -> None:
    """A 16-chunk prompt whose first chunk is not stored: exactly one backend request."""
    keys = [f"p{i:02d}" for i in range(16)]
    for k in keys[1:]:
        tier.put(k, _chunk(k, 64))
    requests = _count_requests(tier, request)
    assert tier.exists(keys) == [False] * 16
    assert requests() == 1


def _count_requests(tier: ObjectTier, request: pytest.FixtureRequest):
    """A function returning how many backend requests ``tier`` made since this call."""
    if tier.name == "s3":
        sent = []
        tier._client.meta.events.register("before-send.s3.*", lambda **kw: sent.append(1))
        return lambda: len(sent)
    mp = pytest.MonkeyPatch()
    request.addfinalizer(mp.undo)
    if tier.name == "redis":  # round trips: a pipeline is one, like any single command
        import redis

        trips = []
        for cls, name in ((redis.Redis, "execute_command"), (redis.client.Pipeline, "execute")):
            real_fn = getattr(cls, name)

            def counted(self, *a, _real=real_fn, **k):
                trips.append(1)
                return _real(self, *a, **k)

            mp.setattr(cls, name, counted)
        return lambda: len(trips)
    seen = []  # the file tier looks a key up through its fan-out directory's fd
    real = tier._subdir
    mp.setattr(tier, "_subdir", lambda sub, *a, **k: (seen.append(sub), real(sub, *a, **k))[1])
    return lambda: len(seen)


def test_overwrite_replaces_whole_object(tier: ObjectTier) -> None:
    tier.put("k", _chunk("k", 10_000, fill=1))
    tier.put("k", _chunk("k", 100, fill=2))
    assert bytes(codec.decode(tier.get("k"), key="k")) == bytes([2]) * 100


def test_large_object_from_memoryview_parts(tier: ObjectTier) -> None:
    payload = bytearray(os.urandom(3 * 2**20 + 17))
    parts = codec.encode("big", memoryview(payload), dtype="uint8", shape=[len(payload)])
    assert isinstance(parts[1], memoryview)
    tier.put("big", parts)
    assert bytes(codec.decode(tier.get("big"), key="big")) == payload


def test_read_into_puts_the_payload_in_the_slot_and_returns_the_head(tier: ObjectTier) -> None:
    """The read path: the object's tail lands in the caller's buffer, the head comes back,
    and it decodes to exactly the chunk that was stored."""
    parts = _chunk("ri", 256 * 1024, fill=9)
    tier.put("ri", parts)
    head_len = len(bytes(parts[0]))
    dest = memoryview(bytearray(256 * 1024))
    head = tier.read_into("ri", dest, codec.MAX_HEADER + 8)
    assert head == bytes(parts[0]) and len(head) == head_len
    assert bytes(dest) == bytes([9]) * (256 * 1024)
    codec.verify(head, dest, key="ri")  # no error: a genuine chunk, verified in place
    assert tier.read_into("missing", dest, 100) is None


@pytest.mark.parametrize("hashed", [False, True])
def test_a_read_says_it_found_the_object_before_its_payload_lands(
    tier: ObjectTier, hashed: bool
) -> None:
    """``found`` (what lets a lookup queue the rest of its run) is called once per read
    of a stored object, while the slot is still untouched: S3's response headers,
    Redis's reply length line, the opened file; never for a missing key. A short object
    (a compressed chunk) is found too, before its read is refused."""
    parts = _chunk("fo", 256 * 1024, fill=5)
    tier.put("fo", parts)
    tier.put("short", _chunk("short", 100))
    read = tier.read_into_hashed if hashed else tier.read_into
    for key, fits in (("fo", True), ("short", False), ("missing", None)):
        dest = memoryview(bytearray(256 * 1024))
        seen: list[bytes] = []
        found = functools.partial(snapshot, seen, dest)
        if fits is False:
            with pytest.raises(TruncatedError):
                read(key, dest, codec.MAX_HEADER + 8, found=found)
        else:
            got = read(key, dest, codec.MAX_HEADER + 8, found=found)
            assert (got is not None) is bool(fits)
        assert seen == ([] if fits is None else [bytes(256 * 1024)]), key
        if fits:
            assert bytes(dest) == bytes([5]) * (256 * 1024)


def test_read_into_refuses_objects_that_cannot_fit_the_slot(tier: ObjectTier) -> None:
    tier.put("short", _chunk("short", 100))
    tier.put("long", _chunk("long", 5000))
    dest = memoryview(bytearray(b"\xee" * 1000))
    with pytest.raises(TruncatedError):
        tier.read_into("short", dest, 4096)  # 100 payload bytes cannot fill 1,000
    with pytest.raises(ObjectTooLarge):
        tier.read_into("long", dest, 256)  # more than a head's worth past the slot
    assert bytes(dest) == b"\xee" * 1000  # refused before anything was read


def test_redis_ttl(redis_url: str, redis_server: RedisServer) -> None:
    cfg = load_config({"remote_url": redis_url, "remote_ttl_s": 60}, environ={})
    with open_tier(cfg) as t:
        t.put("ttl-key", _chunk("ttl-key", 16))
    ttl = redis_server.client().ttl("ttl-key")
    assert 55 <= ttl <= 60
    cfg = load_config({"remote_url": redis_url}, environ={})
    with open_tier(cfg) as t:
        t.put("no-ttl", _chunk("no-ttl", 16))
    assert redis_server.client().ttl("no-ttl") == -1


def test_redis_password_never_leaks(services) -> None:
    secret = "s3cr3t-pw-9"
    server = services.redis(password=secret)
    good = load_config({"remote_url": server.url}, environ={})
    with open_tier(good) as t:
        t.put("a", _chunk("a", 8))
        assert t.exists(["a"]) == [True]
        assert secret not in repr(t)
    bad_url = server.url.replace(secret, "wrong-" + secret)
    with open_tier(load_config({"remote_url": bad_url}, environ={})) as t:
        with pytest.raises(TierUnavailable) as info:
            t.get("a")
        assert secret not in str(info.value) and secret not in repr(t)
    server.kill()
    with open_tier(good) as t:
        with pytest.raises(TierUnavailable) as info:
            t.exists(["a"])
        assert secret not in str(info.value)
        assert "***" in str(info.value)


def test_down_backends_raise_tier_unavailable(services, tmp_path) -> None:
    dead_redis = services.redis(start=False)
    cfg = load_config({"remote_url": dead_redis.url, "lookup_timeout_ms": 200}, environ={})
    with open_tier(cfg) as t:
        for call in (lambda: t.get("x"), lambda: t.exists(["x"]), lambda: t.put("x", [b"1"])):
            with pytest.raises(TierUnavailable):
                call()
    dead_s3 = services.s3(start=False)
    cfg = load_config(
        {
            "remote_url": "s3://nobucket/p",
            "s3_endpoint_url": dead_s3.endpoint_url,
            "lookup_timeout_ms": 200,
        },
        environ={},
    )
    with open_tier(cfg) as t:
        with pytest.raises(TierUnavailable):
            t.get("x")
        with pytest.raises(TierUnavailable):
            t.put("x", [b"1"])


def test_s3_missing_bucket_is_unavailable(s3_bucket: S3Bucket) -> None:
    cfg = load_config({"remote_url": "s3://no-such-bucket-kvtier/x"}, environ={})
    with open_tier(cfg) as t, pytest.raises(TierUnavailable, match="NoSuchBucket"):
        t.put("x", [b"1"])


def test_s3_explicit_endpoint_wins(s3_bucket: S3Bucket, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # discard port
    cfg = load_config(
        {"remote_url": s3_bucket.url, "s3_endpoint_url": s3_bucket.endpoint_url}, environ={}
    )
    with open_tier(cfg) as t:
        t.put("e", _chunk("e", 8))
        assert t.exists(["e"]) == [True]
    # the object lands under the URL's prefix, visible to any S3 client
    keys = [
        o["Key"]
        for o in s3_bucket.server.client().list_objects_v2(Bucket=s3_bucket.name)["Contents"]
    ]
    assert keys == ["kv/e"]


def test_open_tier_without_url_is_config_error() -> None:
    with pytest.raises(ConfigError, match="remote_url"):
        open_tier(load_config({}, environ={}))


def test_file_tier_odd_keys(tmp_path) -> None:
    t = FileTier(str(tmp_path))
    for key in ("a/b/../c", ".hidden", "x" * 400, "ünï cödé", "%2F"):
        t.put(key, _chunk(key, 8))
        assert t.exists([key]) == [True]
        assert bytes(codec.decode(t.get(key), key=key)) == bytes([7]) * 8
        assert os.path.dirname(os.path.dirname(t.path(key))) == str(tmp_path)
    assert not any(n.startswith(".tmp-") for _, _, names in os.walk(tmp_path) for n in names)


def _writer(root: str, worker: int, rounds: int) -> None:
    t = FileTier(root)
    for i in range(rounds):
        for key in ("shared-0", "shared-1", f"own-{worker}-{i}"):
            size = 1000 + 997 * ((worker + i) % 7)
            t.put(key, codec.encode(key, bytes([worker]) * size, dtype="u8", shape=[size]))


def test_file_tier_concurrent_processes(tmp_path) -> None:
    root = str(tmp_path / "shared")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(root, w, 25)) for w in range(4)]
    for p in procs:
        p.start()
    t = FileTier(root)
    deadline = time.monotonic() + 60
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        for key in ("shared-0", "shared-1"):  # readers never see a partial object
            blob = t.get(key)
            if blob is not None:
                codec.decode(blob, key=key, dtype="u8")
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    keys = ["shared-0", "shared-1"] + [f"own-{w}-{i}" for w in range(4) for i in range(25)]
    assert all(t.exists(keys))
    for key in keys:
        codec.decode(t.get(key), key=key, dtype="u8")
    leftovers = [n for _, _, names in os.walk(root) for n in names if n.startswith(".tmp-")]
    assert leftovers == []


def test_rediss_tls_and_auth_from_the_url(services) -> None:
    secret = "tls-s3cret"
    server = services.redis(tls=True, password=secret)
    assert server.url.startswith("rediss://")
    with open_tier(load_config({"remote_url": server.url}, environ={})) as t:
        t.put("tls", _chunk("tls", 1000))
        assert t.exists(["tls", "nope"]) == [True, False]
        assert bytes(codec.decode(t.get("tls"), key="tls")) == bytes([7]) * 1000
        assert secret not in repr(t)
    # a client that does not trust the server's certificate never talks to it
    untrusted = server.url.split("?")[0]
    with open_tier(load_config({"remote_url": untrusted}, environ={})) as t:
        with pytest.raises(TierUnavailable) as info:
            t.get("tls")
        assert secret not in str(info.value)
    # ... nor one whose certificate names another host (the test certificate is for
    # 127.0.0.1 only): a trusted CA is not enough, the name must match too
    other_name = server.url.replace("@127.0.0.1:", "@localhost:")
    assert "localhost" in other_name
    with open_tier(load_config({"remote_url": other_name}, environ={})) as t:
        with pytest.raises(TierUnavailable, match="(?i)hostname|match|certificate"):
            t.get("tls")
    # turning verification off takes an explicit opt-in, and then really is off
    unverified = f"{untrusted}?ssl_cert_reqs=none"
    with pytest.raises(ConfigError, match="remote_tls_insecure"):
        load_config({"remote_url": unverified}, environ={})
    cfg = load_config({"remote_url": unverified, "remote_tls_insecure": True}, environ={})
    with open_tier(cfg) as t:
        assert bytes(codec.decode(t.get("tls"), key="tls")) == bytes([7]) * 1000
    # a chunk-sized reply over TLS (read straight from the socket into its buffer)
    with open_tier(load_config({"remote_url": server.url}, environ={})) as t:
        t.put("big", _chunk("big", 3 * 2**20 + 5))
        dest = memoryview(bytearray(3 * 2**20 + 5))
        head = t.read_into("big", dest, 4096)
        assert head is not None and bytes(dest) == bytes([7]) * (3 * 2**20 + 5)
