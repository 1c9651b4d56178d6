"""The object tier on a real Redis Cluster (3 primaries + 3 replicas on loopback) inside
real vLLM engines: engine A writes, a fresh engine B is served from the cluster with vLLM's
own outputs; then one primary is killed under a running engine: no request fails, and its
chunks hit again once the replica took over, without a restart. While it is dead, the
chunks on the other primaries keep hitting: each chunk's node is known from its key's hash
slot and the cluster's slot map."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from local_cluster import RedisCluster
from redis.crc import key_slot

from tests.e2e.conftest import run_engine, start_outage

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


SCENARIOS = {"KVTIER_TEST_SCENARIO_MODULES": "tests.e2e.cluster_scenarios"}


class _PrimaryLoss:
    """What the outage scenario's chaos thread kills and "restarts": one primary of the
    cluster; its restart is the failover (the replica promoted, the old node left dead).

    Which primary is chosen when the kill is asked for, from the keys the first round
    wrote (``keys.json``): the node of the first chunk of the first prompt that is not on
    the node of that prompt's chunk 0. That prompt left the host tier during the first
    round (6 host slots, 8 newer chunks), so while the node is dead its leading chunks can
    only hit on the surviving primaries, and the next one is the dead node's.
    """

    def __init__(self, cluster: RedisCluster, sig: Path, prompts: int) -> None:
        self.cluster, self.sig, self.prompts = cluster, sig, prompts
        self.port = 0
        self.owners: list[list[int]] = []  # per prompt of round 1: each chunk's primary
        self.chunk_size = 0

    def kill(self) -> None:
        report = json.loads((self.sig / "keys.json").read_text())
        self.chunk_size = int(report["chunk_size"])
        round1 = [keys for _, keys in report["requests"][: self.prompts]]
        self.owners = [
            [self.cluster.port_of_slot(key_slot(k.encode())) for k in keys] for keys in round1
        ]
        first = self.owners[0]
        split = [p for p in first[1:] if p != first[0]]
        if split:
            self.port = split[0]
        else:  # all the first prompt's chunks on one node: kill another, holding most
            others = [p for p in self.cluster.primary_ports() if p != first[0]]
            held = [p for o in self.owners for p in o]
            self.port = max(others, key=held.count)
        self.cluster.kill(self.port)

    def surviving_run(self, prompt: int) -> int:
        """Tokens of the prompt's leading chunks whose keys are on surviving primaries (a
        lookup stops at its first miss: the chunks after the dead node's cannot hit)."""
        run = 0
        for port in self.owners[prompt]:
            if port == self.port:
                break
            run += 1
        return run * self.chunk_size

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
        seeds = [41, 42, 43]
        loss = _PrimaryLoss(cluster, sig, len(seeds))
        t = start_outage(loss, sig, deadline_s=300, poll_s=0.05)
        extra = {"cpu_bytes": "3MiB", "remote_url": cluster.url, "lookup_timeout_ms": 1000}
        o = run_engine(
            "cluster_outage",
            model=tiny_model,
            extra=extra,
            signal_dir=str(sig),
            seeds=seeds,
            env=SCENARIOS,
        )
        t.join(timeout=5)
        tokens = [[x["tokens"] for x in rnd] for rnd in o["rounds"]]
        assert all(tk == tokens[0] for tk in tokens), "every request completes, same output"
        # round 2 ran with the primary dead: each prompt's chunks up to the first one on the
        # dead node hit (host tier or surviving primaries; the first prompt's only from
        # the primaries), so vLLM's cached count is at least their tokens
        during = [x["cached"] for x in o["rounds"][1]]
        expected = [loss.surviving_run(i) for i in range(len(seeds))]
        assert expected[0] > 0, f"the first prompt's chunk 0 is on a live primary {loss.owners}"
        assert all(c >= e for c, e in zip(during, expected, strict=True)), (
            f"hit tokens while {loss.port} was dead {during}, at least {expected} expected "
            f"(each chunk's primary: {loss.owners})"
        )
        totals = o["index"]["totals"]
        assert totals["error_node"] > 0, "the dead primary's chunks were counted as kind node"
        assert totals["error_unreachable"] == 0, "one node never took the whole tier down"
        assert o["remote_hits_after_restart"] >= 1024, "hits resume after the failover"
        assert o["index"]["refs"] == 0 and o["index"]["invariants"] is True
        assert o["index"]["pending_ops"] == 0
    finally:
        cluster.cleanup()
