"""The object tier on a real Redis Cluster (3 primaries + 3 replicas on loopback) inside
real vLLM engines: engine A writes, a fresh engine B is served from the cluster with vLLM's
own outputs; then one primary is killed under a running engine: no request fails, and its
chunks hit again once the replica took over, without a restart."""

from __future__ import annotations

from pathlib import Path

import pytest
from rediscluster import RedisCluster

from tests.e2e.conftest import run_engine, start_outage

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


class _PrimaryLoss:
    """What the outage scenario's chaos thread kills and "restarts": one primary of the
    cluster; its restart is the failover (the replica promoted, the old node left dead)."""

    def __init__(self, cluster: RedisCluster) -> None:
        self.cluster = cluster
        self.port = cluster.primary_ports()[0]

    def kill(self) -> None:
        self.cluster.kill(self.port)

    def start(self) -> None:
        self.cluster.wait_failover(self.port)


def test_cluster_serves_a_fresh_engine_and_survives_a_primary_loss(
    tiny_model: str, tmp_path: Path
) -> None:
    cluster = RedisCluster(node_timeout_ms=1000)
    try:
        cluster.start()
        extra = {"cpu_bytes": "64MiB", "remote_url": cluster.url}
        w = run_engine("remote_writer", model=tiny_model, extra=extra)
        r = run_engine("remote_reader", model=tiny_model, extra=extra)
        # engine B starts with an empty host tier: the prefix can only come from the cluster
        assert r["b"]["cached"] >= 1024, r["_log"][-3000:]
        assert r["b"]["tokens"] == w["b_ref"]["tokens"]
        assert r["b"]["logprobs"] == w["b_ref"]["logprobs"]
        assert r["index"]["totals"]["hit_tokens_remote"] >= 1024

        # 6 host slots for 3 prompts x 4 chunks: the host tier alone cannot serve a round
        sig = tmp_path / "signals"
        sig.mkdir()
        loss = _PrimaryLoss(cluster)
        t = start_outage(loss, sig, deadline_s=300, poll_s=0.05)
        extra = {"cpu_bytes": "3MiB", "remote_url": cluster.url, "lookup_timeout_ms": 1000}
        o = run_engine("outage", model=tiny_model, extra=extra, signal_dir=str(sig),
                       seeds=[41, 42, 43])  # fmt: skip
        t.join(timeout=5)
        tokens = [[x["tokens"] for x in rnd] for rnd in o["rounds"]]
        assert all(tk == tokens[0] for tk in tokens), "every request completes, same output"
        totals = o["index"]["totals"]
        assert totals["error_node"] > 0, "the dead primary's chunks were counted as kind node"
        assert totals["error_unreachable"] == 0, "one node never took the whole tier down"
        assert o["remote_hits_after_restart"] >= 1024, "hits resume after the failover"
        assert o["index"]["refs"] == 0 and o["index"]["invariants"] is True
        assert o["index"]["pending_ops"] == 0
    finally:
        cluster.cleanup()
