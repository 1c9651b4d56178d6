"""An upload right after the Redis server restarted succeeds: every idle connection of the
pool died with the old server, and the put's one retry opens a new connection instead of
taking the next dead one (which failed the upload and backed the tier's writes off: the
chunks stored right after a restart were lost, tests/e2e/test_trust.py's outage test)."""

from __future__ import annotations

import redis

from kvtier.objects import codec
from kvtier.objects.tiers.redis import RedisTier


def test_a_put_after_a_server_restart_opens_a_new_connection(services) -> None:
    server = services.redis()
    tier = RedisTier(server.url)
    try:

        def put(i: int) -> None:
            tier.put(f"k{i}", codec.encode(f"k{i}", bytes([i]) * 4096, dtype="uint8", shape=[4096]))

        put(0)
        # several idle, connected connections in the pool: three held at once, then given
        # back (puts from threads would overlap only by chance: once they ran one by one
        # on one connection and the test had nothing to check)
        pool = tier._client.connection_pool
        held = [pool.get_connection() for _ in range(3)]
        for connection in held:
            pool.release(connection)
        assert len(pool._connections) >= 3  # type: ignore[attr-defined]  # idle, all dead soon
        server.restart()  # same port, empty, every pooled connection now dead
        put(9)  # one attempt on a dead connection, the retry on a new one
        assert redis.Redis.from_url(server.url).exists("k9") == 1
    finally:
        tier.close()
