"""kvtier's KV events through vLLM's own publisher, read by a real ZMQ subscriber.

The engine runs with ``kv_events_config`` (vLLM's ZMQ publisher); this process
subscribes like a router would and decodes vLLM's msgpack ``KVEventBatch``. The
block hashes kvtier must announce are taken from vLLM's own GPU events in the same
stream (the block chain of each prompt, found by its tokens, as a router would),
never from kvtier.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kit import free_port

from tests.e2e.conftest import run_engine

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

SCENARIOS = {"KVTIER_TEST_SCENARIO_MODULES": "tests.e2e.events_scenarios"}
BS, CHUNK = 32, 256
BPC = CHUNK // BS


class Subscriber:
    """A ZMQ SUB socket on vLLM's publisher: every batch, with its sequence number."""

    def __init__(self, endpoint: str, topic: str = "kv") -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.connect(endpoint)  # before the engine binds: nothing is missed
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.batches: list[tuple[int, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(100):
                _topic, seq, payload = self._sock.recv_multipart()
                self.batches.append((int.from_bytes(seq, "big"), self._decoder.decode(payload)))

    def wait_for(self, done: Callable[[], bool], timeout: float = 10.0) -> bool:
        """Whether ``done()`` held within ``timeout`` seconds of batches arriving (the
        receiving thread may still be reading what the engine sent before it exited)."""
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)
        self._ctx.term()

    def events(self, until: float | None = None, after: float | None = None) -> Iterator[Any]:
        for _seq, batch in self.batches:
            if (until is None or batch.ts <= until) and (after is None or batch.ts > after):
                yield from batch.events


def gpu_chain(sub: Subscriber, prompt: list[int]) -> list[Any]:
    """The hashes vLLM published for ``prompt``'s full blocks (its medium-GPU events),
    followed block by block from the first one by parent hash and tokens."""
    from vllm.distributed.kv_events import BlockStored

    by_parent_tokens: dict[tuple[Any, tuple[int, ...]], Any] = {}
    for ev in sub.events():
        if isinstance(ev, BlockStored) and ev.medium == "GPU":
            parent = ev.parent_block_hash
            for i, h in enumerate(ev.block_hashes):
                tokens = tuple(ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size])
                by_parent_tokens[(parent, tokens)] = h
                parent = h
    chain: list[Any] = []
    parent = None
    for b in range(len(prompt) // BS):
        h = by_parent_tokens.get((parent, tuple(prompt[b * BS : (b + 1) * BS])))
        if h is None:
            break
        chain.append(h)
        parent = h
    return chain


def kvtier_stored(events: Iterator[Any], medium: str) -> list[Any]:
    from vllm.distributed.kv_events import BlockStored

    return [e for e in events if isinstance(e, BlockStored) and e.medium == medium]


def kvtier_removed(events: Iterator[Any]) -> list[Any]:
    from vllm.distributed.kv_events import BlockRemoved

    return [e for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"]


def chunk_hashes(chain: list[Any], c: int) -> list[Any]:
    return chain[c * BPC : (c + 1) * BPC]


def check_chunk_event(ev: Any, chain: list[Any], prompt: list[int], c: int, locality: str) -> None:
    assert ev.block_hashes == chunk_hashes(chain, c)
    assert ev.parent_block_hash == (chain[c * BPC - 1] if c else None)
    assert ev.token_ids == prompt[c * CHUNK : (c + 1) * CHUNK]
    assert ev.block_size == BS
    assert ev.locality == locality
    assert ev.group_idx == 0


def stored_chunks(events: list[Any], chain: list[Any]) -> list[int]:
    """Which of ``chain``'s chunks the events announce, in order."""
    out = []
    for ev in events:
        for c in range(len(chain) // BPC):
            if ev.block_hashes == chunk_hashes(chain, c):
                out.append(c)
    return out


@pytest.fixture
def subscribers() -> Iterator[list[Subscriber]]:
    subs: list[Subscriber] = []
    yield subs
    for s in subs:
        s.close()


def test_events_follow_the_host_and_object_tiers(
    tiny_model: str, tmp_path: Path, subscribers: list[Subscriber]
) -> None:
    # 512 KiB a chunk on the tiny model: 8 slots; a write-through directory tier
    extra = {"cpu_bytes": "4MiB", "remote_url": f"file://{tmp_path / 'kv'}"}
    port = free_port()
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    subscribers.append(sub)
    w = run_engine(
        "events_writer", env=SCENARIOS, model=tiny_model, extra=extra, endpoint=f"tcp://*:{port}"
    )
    seqs = [seq for seq, _ in sub.batches]
    assert seqs and seqs == list(range(len(seqs))), "every batch from the first one arrived"
    assert w["failed_reports"] == 1 and w["events_dropped"] == 0
    marks, prompts = w["marks"], w["prompts"]
    chains = {name: gpu_chain(sub, p) for name, p in prompts.items()}
    for name, chain in chains.items():
        assert len(chain) >= 4 * BPC, f"vLLM published {name}'s blocks ({len(chain)})"

    def phase(start: str | None, end: str) -> list[Any]:
        return list(sub.events(after=marks[start] if start else None, until=marks[end]))

    # A: each of its four full chunks turned ready in the host tier, then was uploaded
    a_events = phase(None, "a")
    cpu = kvtier_stored(iter(a_events), "CPU")
    assert stored_chunks(cpu, chains["a"]) == [0, 1, 2, 3] and len(cpu) == 4
    for c, ev in enumerate(cpu):
        check_chunk_event(ev, chains["a"], prompts["a"], c, "LOCAL")
    # uploads finish in any order (parallel I/O threads)
    storage = kvtier_stored(iter(a_events), "STORAGE")
    order = stored_chunks(storage, chains["a"])
    assert sorted(order) == [0, 1, 2, 3] and len(storage) == 4
    for c, ev in zip(order, storage, strict=True):
        check_chunk_event(ev, chains["a"], prompts["a"], c, "REMOTE")
    assert not kvtier_removed(iter(a_events))

    # B: its third chunk's store failed: no event of either tier for it
    b_events = phase("a", "b")
    assert stored_chunks(kvtier_stored(iter(b_events), "CPU"), chains["b"]) == [0, 1, 3]
    assert sorted(stored_chunks(kvtier_stored(iter(b_events), "STORAGE"), chains["b"])) == [0, 1, 3]
    assert len(kvtier_stored(iter(b_events), "CPU")) == 3
    assert not kvtier_removed(iter(b_events))
    failed = set(chunk_hashes(chains["b"], 2))
    for ev in list(sub.events()):
        if getattr(ev, "medium", None) in ("CPU", "STORAGE"):
            assert not failed & set(ev.block_hashes), ev

    # C: eight slots held A0-3 and B0, B1, B3; C's four chunks evicted A's three oldest
    c_events = phase("b", "c")
    assert stored_chunks(kvtier_stored(iter(c_events), "CPU"), chains["c"]) == [0, 1, 2, 3]
    removed = [h for ev in kvtier_removed(iter(c_events)) for h in ev.block_hashes]
    assert sorted(removed) == sorted(chains["a"][: 3 * BPC])
    assert all(ev.locality == "LOCAL" for ev in kvtier_removed(iter(c_events)))
    assert w["index_before_reset"]["totals"]["evictions"] == 3

    # reset_prefix_cache(reset_connector=True): one BlockRemoved for the 8 chunks held
    r_events = phase("c", "reset")
    reset = kvtier_removed(iter(r_events))
    assert len(reset) == 1
    held = (
        chains["a"][3 * BPC : 4 * BPC]
        + [h for c in (0, 1, 3) for h in chunk_hashes(chains["b"], c)]
        + chains["c"][: 4 * BPC]
    )
    assert sorted(reset[0].block_hashes) == sorted(held)
    assert not kvtier_stored(iter(r_events), "CPU")
    assert w["index"]["used_slots"] == 0 and w["events_tracked"] == 0

    # a fresh engine on the same tier: A's chunks come back through fetches; the CPU
    # events are this replica's, the STORAGE ones were the writer's
    port2 = free_port()
    sub2 = Subscriber(f"tcp://127.0.0.1:{port2}")
    subscribers.append(sub2)
    r = run_engine(
        "events_reader", env=SCENARIOS, model=tiny_model, extra=extra, endpoint=f"tcp://*:{port2}"
    )
    assert r["cached"] >= 1024 and r["index"]["totals"]["fetch_ok"] == 4
    chain = gpu_chain(sub2, r["prompts"]["a"])
    assert chain[: 4 * BPC] == chains["a"][: 4 * BPC], "same prompt, same vLLM hashes"
    seqs = [seq for seq, _ in sub2.batches]
    assert seqs and seqs == list(range(len(seqs))), "every batch from the first one arrived"
    # fetches finish in any order (parallel I/O threads), each event names its parent
    sub2.wait_for(lambda: len(kvtier_stored(sub2.events(), "CPU")) >= 4)
    cpu = kvtier_stored(sub2.events(), "CPU")
    order = stored_chunks(cpu, chain)
    media = sorted({(type(e).__name__, getattr(e, "medium", None)) for e in sub2.events()})
    assert sorted(order) == [0, 1, 2, 3] and len(cpu) == 4, (order, len(sub2.batches), media)
    for c, ev in zip(order, cpu, strict=True):
        check_chunk_event(ev, chain, r["prompts"]["a"], c, "LOCAL")
    assert not kvtier_stored(sub2.events(), "STORAGE")
    assert not kvtier_removed(sub2.events())
