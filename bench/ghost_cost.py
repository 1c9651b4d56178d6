"""What the host tier's what-if ghosts (kvtier.host.ghosts) cost, without vLLM.

Per stored chunk on a full host index (every store evicts, as in a busy server), with
and without ghosts, and per pin+unpin of a held chunk (a load); then tracemalloc bytes
per entry the ghosts keep, after every ghost filled and churned, keys not counted (they
are the index's own bytes objects while it holds the chunk). Timings are the 10th
percentile of batches of 500 stores (200 pins), best of 3 runs, so other jobs on the
machine weigh less.

    .venv/bin/python bench/ghost_cost.py
    .venv/bin/python bench/ghost_cost.py --slots 4096,65536
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc

from kvtier.host.ghosts import Ghost, GhostTiers
from kvtier.host.index import ChunkIndex, State


def _p10(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 10]


def per_op(slots: int, whatif: bool, stores: int = 20_000) -> tuple[float, float]:
    """(µs per evicting store, µs per pin+unpin) on a full index of ``slots``."""
    rng = random.Random(0)
    idx = ChunkIndex(slots)
    if whatif:
        idx.ghosts = GhostTiers(slots, idx.get)
    keys = [rng.randbytes(32) for _ in range(slots * 9 + stores)]
    for k in keys[: slots * 9]:  # the real tier and every ghost full
        idx.begin(k, State.STORING)
        idx.commit(k, True)
    run = keys[slots * 9 :]
    store: list[float] = []
    for b in range(0, len(run), 500):
        t = time.perf_counter()
        for k in run[b : b + 500]:
            idx.begin(k, State.STORING)
            idx.commit(k, True)
        store.append((time.perf_counter() - t) / 500 * 1e6)
    held = run[-slots // 2 :]
    pin: list[float] = []
    for b in range(0, len(held), 200):
        t = time.perf_counter()
        for k in held[b : b + 200]:
            idx.pin(k)
            idx.unpin(k)
        pin.append((time.perf_counter() - t) / 200 * 1e6)
    return _p10(store), _p10(pin)


def memory(slots: int) -> tuple[float, float]:
    """(bytes per entry the ghosts keep, ghost bytes per real slot), every ghost full."""
    rng = random.Random(1)
    keys = [rng.randbytes(32) for _ in range(slots * 12)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    ghosts = GhostTiers(slots, lambda k: None)
    for k in keys:
        ghosts.begin(k, False, True)
        ghosts.commit(k, True, False)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    kept = sum(len(g) for g in ghosts.ghosts if isinstance(g, Ghost))
    return used / kept, used / slots


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", default="4096,65536", help="host-tier sizes in chunks")
    args = p.parse_args()
    for slots in (int(s) for s in args.slots.split(",")):
        best: dict[bool, tuple[float, float]] = {}
        for _ in range(3):
            for whatif in (False, True):
                got = per_op(slots, whatif)
                best[whatif] = min(best.get(whatif, got), got)
        (s_off, p_off), (s_on, p_on) = best[False], best[True]
        per_entry, per_slot = memory(slots)
        print(
            f"{slots:,} slots: store {s_off:.2f} -> {s_on:.2f} µs (+{s_on - s_off:.2f}), "
            f"pin+unpin {p_off:.2f} -> {p_on:.2f} µs, {per_entry:.0f} B per ghost entry, "
            f"{per_slot:,.0f} B of ghosts per real slot"
        )


if __name__ == "__main__":
    main()
