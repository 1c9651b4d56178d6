"""What the host tier's what-if ghosts (kvtier.whatif.host) cost, without vLLM.

Three figures per host-tier size, on a full index (every store evicts, as in a busy
server):

- on the scheduler's path: µs per stored chunk (begin + commit) and per pin+unpin, with
  and without ghosts (the index only queues an event per settled store and per pin);
- off it: µs per stored chunk to apply the queued events (what the ghosts' thread
  spends while the engine waits for the model), with a lookup of 4 chunks every 8
  stores;
- memory: tracemalloc bytes the ghosts keep per chunk the largest (8x) ghost tracks and
  per ghost entry (the four modelled ghosts' entries together), every ghost full and
  churned; the keys are not kept (fingerprints are).

Timings are the 10th percentile of batches of 500 stores (200 pins), best of 3 runs, so
other jobs on the machine weigh less.

    .venv/bin/python bench/ghost_cost.py
    .venv/bin/python bench/ghost_cost.py --slots 4096,65536
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc

from kvtier.host.index import STORED, ChunkIndex, State
from kvtier.whatif.host import GhostTiers


def _p10(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 10]


def _full(slots: int, whatif: bool, extra: int) -> tuple[ChunkIndex, GhostTiers | None, list]:
    """A full index (and every ghost full), and ``extra`` fresh keys to store."""
    rng = random.Random(0)
    idx = ChunkIndex(slots)
    ghosts = GhostTiers(slots, idx.get) if whatif else None
    idx.ghost_events = ghosts.record if ghosts is not None else None
    keys = [rng.randbytes(32) for _ in range(slots * 9 + extra)]
    for k in keys[: slots * 9]:
        idx.begin(k, State.STORING)
        idx.commit(k, True)
    if ghosts is not None:
        ghosts.drain()
    return idx, ghosts, keys[slots * 9 :]


def on_path(slots: int, whatif: bool, stores: int = 20_000) -> tuple[float, float]:
    """(µs per evicting store, µs per pin+unpin) in the scheduler's thread."""
    idx, ghosts, run = _full(slots, whatif, stores)
    store: list[float] = []
    for b in range(0, len(run), 500):
        t = time.perf_counter()
        for k in run[b : b + 500]:
            idx.begin(k, State.STORING)
            idx.commit(k, True)
        store.append((time.perf_counter() - t) / 500 * 1e6)
        if ghosts is not None:
            ghosts.drain()  # (the thread's work, not timed here)
    held = run[-slots // 2 :]
    pin: list[float] = []
    for b in range(0, len(held), 200):
        t = time.perf_counter()
        for k in held[b : b + 200]:
            idx.pin(k)
            idx.unpin(k)
        pin.append((time.perf_counter() - t) / 200 * 1e6)
        if ghosts is not None:
            ghosts.drain()
    return _p10(store), _p10(pin)


def off_path(slots: int, stores: int = 20_000) -> float:
    """µs per stored chunk to apply the queue (stores, and a 4-chunk lookup per 8)."""
    idx, ghosts, run = _full(slots, True, stores)
    assert ghosts is not None
    rng = random.Random(2)
    held = list(run)
    apply: list[float] = []
    for b in range(0, len(run), 500):
        for n, k in enumerate(run[b : b + 500]):
            idx.begin(k, State.STORING)
            idx.commit(k, True)
            if n % 8 == 0:
                prompt = rng.sample(held[: b + n + 1], 4) if b + n >= 4 else [k] * 4
                ghosts.lookup(prompt, 0, 4, chunk_size=256, computed=0, cap=1024)
        t = time.perf_counter()
        ghosts.drain()
        apply.append((time.perf_counter() - t) / 500 * 1e6)
    return _p10(apply)


def memory(slots: int) -> tuple[float, float]:
    """(bytes per tracked chunk, bytes per ghost entry), every ghost full and churned."""
    rng = random.Random(1)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    ghosts = GhostTiers(slots, lambda k: None)
    for n in range(slots * 12):
        ghosts.record((STORED, rng.randbytes(32)))
        if n % 1000 == 0:
            ghosts.drain()
    ghosts.drain()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / len(ghosts.stack), used / sum(ghosts.stack.held)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", default="4096,65536", help="host-tier sizes in chunks")
    args = p.parse_args()
    for slots in (int(s) for s in args.slots.split(",")):
        best: dict[bool, tuple[float, float]] = {}
        applied = float("inf")
        for _ in range(3):
            for whatif in (False, True):
                got = on_path(slots, whatif)
                best[whatif] = min(best.get(whatif, got), got)
            applied = min(applied, off_path(slots))
        (s_off, p_off), (s_on, p_on) = best[False], best[True]
        per_chunk, per_entry = memory(slots)
        print(
            f"{slots:,} slots: scheduler path: store {s_off:.2f} -> {s_on:.2f} µs "
            f"(+{s_on - s_off:.2f}), pin+unpin {p_off:.2f} -> {p_on:.2f} µs; "
            f"ghosts' thread: {applied:.2f} µs per stored chunk; "
            f"{per_chunk:.0f} B per tracked chunk, {per_entry:.0f} B per ghost entry"
        )


if __name__ == "__main__":
    main()
