"""What a request's lookup answer leaves out: a chunk being stored, and the misses.

:class:`StoreWaits`: when the first chunk a request's run of ready chunks lacks is
being stored (by a request that finished, or one in the same step: its store is
reported a step or two later, since vLLM's async scheduling plans the next step
before this one's reports are in), the answer is "ask again" until it settles, at
most ``wait_s`` per request. :func:`count_misses`: when vLLM allocates the request,
the prompt tokens kvtier was asked about and did not serve, by reason
(``kvtier:miss_tokens``).
"""

from __future__ import annotations

import logging
import time

from kvtier import metrics
from kvtier.host.index import ChunkIndex, State
from kvtier.stats import StatsRecorder

from .requests import ChunkKeys, RequestState, loadable_chunks

logger = logging.getLogger("kvtier.scheduler")

#: StoreWaits.since: the request gave up waiting for a store
STORE_WAIT_OVER = -1.0

#: the miss reason (metrics.MISS_REASONS) of a chunk the index holds but could not serve;
#: a ready one was not ready when the request was answered (it is counted as absent)
MISS_BY_STATE: dict[State, str] = {
    State.STORING: "storing",
    State.FETCHING: "fetching",
    State.EVICTING: "evicting",
    State.READY: "absent",
}


class StoreWaits:
    def __init__(
        self, index: ChunkIndex, keys: ChunkKeys, *, chunk_size: int, wait_s: float
    ) -> None:
        self.index = index
        self.keys = keys
        self.chunk_size = chunk_size
        #: how long a request waits for a chunk being stored, at most
        self.wait_s = wait_s
        #: request id -> since when (time.monotonic) it waits, STORE_WAIT_OVER once it gave
        #: up (its misses then count as "storing")
        self.since: dict[str, float] = {}

    def should_wait(self, st: RequestState, c: int, cap: int) -> bool:
        """True when the request should ask again because chunk ``c``, the first one its
        run of ready chunks lacks, is being stored. Waits at most ``wait_s`` per request;
        then its misses count as "storing"."""
        if c >= loadable_chunks(st, cap, self.chunk_size):
            return False
        entry = self.index.get(self.keys.key(st, c))
        if entry is None or entry.state is not State.STORING:
            return False
        rid = st.request.request_id
        now = time.monotonic()
        since = self.since.setdefault(rid, now)
        if since == STORE_WAIT_OVER:
            return False
        if now - since > self.wait_s:
            self.since[rid] = STORE_WAIT_OVER
            logger.info(
                "kvtier: request %s gave up waiting for a chunk being stored "
                "(%.2f s); it is counted as a miss",
                rid,
                now - since,
            )
            return False
        return True

    def forget(self, request_id: str) -> None:
        self.since.pop(request_id, None)


def count_misses(
    stats: StatsRecorder,
    index: ChunkIndex,
    keys: ChunkKeys,
    st: RequestState,
    *,
    chunk_size: int,
    served_end: int,
    reusable: int,
    cap: int,
    tier_down: bool,
) -> None:
    """Count the prompt tokens kvtier was asked about and did not serve, by reason: the
    state of the first chunk not served decides for the full chunks after it (absent
    while the object tier's reads fail fast, ``tier_down``: "tier_down"; absent where a
    priced lookup declined to ask the tier: "declined"), the part past the last full chunk
    is the "tail"."""
    if served_end < reusable:
        first = served_end // chunk_size
        entry = index.get(keys.key(st, first))
        reason = "absent" if entry is None else MISS_BY_STATE[entry.state]
        if reason == "absent" and tier_down:
            reason = "tier_down"  # (the lookup was answered at once: reads fail fast)
        declined = st.lookup.declined_from if st.lookup is not None else None
        if reason == "absent" and declined is not None and first >= declined:
            reason = "declined"  # (the tier was never asked: it may hold them)
        stats.inc(metrics.MISS_TOKENS, reusable - served_end, (reason,))
    tail = cap - max(reusable, served_end)
    if tail > 0:
        stats.inc(metrics.MISS_TOKENS, tail, ("tail",))
