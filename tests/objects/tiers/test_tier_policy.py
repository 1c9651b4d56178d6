"""One object-tier policy: every backend's waits and retries come from
kvtier.objects.tiers.policy."""

from __future__ import annotations

import pytest

from kvtier.config import load_config
from kvtier.objects.remote import RemoteIO
from kvtier.objects.tiers.policy import RETRIES, Timeouts


def test_timeouts_follow_the_lookup_deadline_with_floors() -> None:
    short, long = Timeouts.from_ms(300), Timeouts.from_ms(4000)
    assert (short.connect_s, short.pool_wait_s, short.reply_s, short.body_s) == (0.5, 1.0, 1.0, 5.0)
    assert (long.connect_s, long.pool_wait_s, long.reply_s, long.body_s) == (4.0, 4.0, 8.0, 8.0)
    with pytest.raises(ValueError):
        Timeouts.from_ms(0)


def test_s3_client_uses_the_policy() -> None:
    from kvtier.objects.tiers.s3 import client_config

    cfg = client_config(io_threads=4, lookup_timeout_ms=300)
    waits = Timeouts.from_ms(300)
    assert cfg.connect_timeout == waits.connect_s and cfg.read_timeout == waits.body_s
    assert cfg.retries["max_attempts"] == 1 + RETRIES and cfg.max_pool_connections == 6


def test_redis_pool_uses_the_policy() -> None:
    from kvtier.objects.tiers.redis import RedisTier

    tier = RedisTier("redis://127.0.0.1:1/0", io_threads=2, lookup_timeout_ms=3000)
    try:
        pool = tier._client.connection_pool
        kw = pool.connection_kwargs
        waits = Timeouts.from_ms(3000)
        assert kw["socket_timeout"] == waits.reply_s
        assert kw["socket_connect_timeout"] == waits.connect_s
        assert kw["retry"].get_retries() == RETRIES
        assert pool.timeout == waits.pool_wait_s and pool.max_connections == 4
    finally:
        tier.close()


def test_remote_io_deadline_is_the_lookup_timeout(tmp_path) -> None:
    cfg = load_config({"remote_url": f"file://{tmp_path}", "lookup_timeout_ms": 750}, environ={})
    rio = RemoteIO.from_config(cfg, environ={})
    try:
        assert rio.timeout_s == Timeouts.from_ms(750).lookup_s == 0.75
    finally:
        rio.close()


def test_an_upload_is_stuck_after_every_attempt_could_have_timed_out(tmp_path) -> None:
    waits = Timeouts.from_ms(2000)
    assert waits.stall_s == (1 + RETRIES) * (waits.connect_s + waits.body_s) == 14.0
    cfg = load_config({"remote_url": f"file://{tmp_path}", "lookup_timeout_ms": 2000}, environ={})
    rio = RemoteIO.from_config(cfg, environ={})
    try:
        assert rio.write_stall_s == waits.stall_s
    finally:
        rio.close()
