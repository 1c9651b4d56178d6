"""What is hot: decayed hit counts per chunk key, bounded, merged across engines.

Every engine counts its hits per host-index key (vLLM's block hash of a chunk's last
block, the same on every replica sharing a tier: ``PYTHONHASHSEED``), on the scheduler's
thread, one dict update per hit (:class:`HitCounter`). Every :data:`SEND_S` the counts since
the last send go, as a :class:`HotList` *delta*, to the engine's manifest writer, which
merges them with the list its generation's manifest holds and writes the sum back
(:func:`merge`): the manifest then holds the fleet's working set, decayed with a half-life
of :data:`HALF_LIFE_S`, bounded to :data:`LIMIT` keys, hottest first. No server of its own.

What the merge guarantees: heat adds up (a delta is added once: each write adds only the
hits since that writer's previous successful write, never its totals again), ages (every
heat halves every ``HALF_LIFE_S``; lists written at different times are decayed to a common
time before they add) and stays bounded (the coldest keys beyond ``LIMIT`` are dropped, and
any below :data:`MIN_HEAT`). Two writers whose read-then-write of the manifest overlap (a
few milliseconds in a minute) keep one's delta: the other's last interval of hits is lost,
never anything older, since each write starts from what is stored. A write that fails keeps
its delta for the next.

A stored list is untrusted input (:meth:`HotList.from_json`: bounded length, keys of
bounded size, finite heats in range, no duplicate).

This module is also where a starting engine's warm-up is planned (:func:`plan_warmup`):
which keys of the merged list to fetch, hottest first, within a byte budget.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

__all__ = [
    "HALF_LIFE_S",
    "LIMIT",
    "MAX_HEAT",
    "MAX_KEY_BYTES",
    "MIN_HEAT",
    "SEND_S",
    "HitCounter",
    "HotList",
    "merge",
    "plan_warmup",
]

#: the most keys a hot list holds (a manifest's list: ~57 bytes of JSON per 32-byte key,
#: so ~230 KB at most)
LIMIT = 4096
#: heat halves in this long (seconds): a working set of the last hour or so
HALF_LIFE_S = 1800.0
#: a key colder than this is dropped (one hit, ~3.3 hours of half-lives later)
MIN_HEAT = 0.01
#: the hottest a key may be in a stored list (no real fleet gets near it)
MAX_HEAT = float(2**40)
#: the longest key a stored list may hold (vLLM's block hashes are 32 bytes or less)
MAX_KEY_BYTES = 64
#: how often a scheduler hands its hits to the manifest writer (seconds)
SEND_S = 30.0


@dataclass(frozen=True, slots=True)
class HotList:
    """Keys and their heat as of ``at`` (Unix seconds), hottest first."""

    at: float = 0.0
    entries: tuple[tuple[bytes, float], ...] = ()

    def __len__(self) -> int:
        return len(self.entries)

    def decayed(self, now: float, half_life_s: float = HALF_LIFE_S) -> dict[bytes, float]:
        """Each key's heat as of ``now`` (a list from the future, clock skew, is not
        heated up: its age counts as 0)."""
        factor = 0.5 ** (max(0.0, now - self.at) / half_life_s)
        return {key: heat * factor for key, heat in self.entries}

    def to_json(self) -> list[list[Any]]:
        """``[[base64 key, heat], ...]``, hottest first, heats to 3 decimals."""
        return [[base64.b64encode(k).decode(), round(h, 3)] for k, h in self.entries]

    @classmethod
    def from_json(cls, raw: object, at: object) -> HotList:
        """A stored list, or ValueError naming what is wrong with it: longer than
        :data:`LIMIT`, an entry not a ``[key, heat]`` pair, a key not base64 of 1 to
        :data:`MAX_KEY_BYTES` bytes, a heat not a finite number in (0, MAX_HEAT], a key
        twice, or a time not a finite number >= 0."""
        if (
            not isinstance(at, int | float)
            or isinstance(at, bool)
            or not (math.isfinite(at) and at >= 0.0)
        ):
            raise ValueError("hot list time is not a time")
        if not isinstance(raw, list):
            raise ValueError("hot list is not a list")
        if len(raw) > LIMIT:
            raise ValueError(f"hot list holds {len(raw)} keys (at most {LIMIT})")
        entries: list[tuple[bytes, float]] = []
        seen: set[bytes] = set()
        for item in raw:
            if not isinstance(item, list) or len(item) != 2:
                raise ValueError("hot list entry is not a [key, heat] pair")
            text, heat = item
            if not isinstance(text, str) or len(text) > 4 * MAX_KEY_BYTES:
                raise ValueError("hot list key is not a short string")
            try:
                key = base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError("hot list key is not base64") from None
            if not 0 < len(key) <= MAX_KEY_BYTES:
                raise ValueError(f"hot list key of {len(key)} bytes")
            if (
                not isinstance(heat, int | float)
                or isinstance(heat, bool)
                or not (math.isfinite(heat) and 0.0 < heat <= MAX_HEAT)
            ):
                raise ValueError("hot list heat is not a number in range")
            if key in seen:
                raise ValueError("hot list names a key twice")
            seen.add(key)
            entries.append((key, float(heat)))
        entries.sort(key=_hottest_first)
        return cls(float(at), tuple(entries))


def _hottest_first(entry: tuple[bytes, float]) -> tuple[float, bytes]:
    """Sort order: heat descending, then key (ties the same on every engine)."""
    return -entry[1], entry[0]


def top(heats: dict[bytes, float], at: float, limit: int = LIMIT) -> HotList:
    """The ``limit`` hottest of ``heats`` at or above :data:`MIN_HEAT`, as of ``at``."""
    kept = [(k, min(h, MAX_HEAT)) for k, h in heats.items() if h >= MIN_HEAT]
    kept.sort(key=_hottest_first)  # (a sort: 10x faster than heapq.nsmallest at this size)
    return HotList(at, tuple(kept[:limit]))


def merge(
    *lists: HotList, now: float, limit: int = LIMIT, half_life_s: float = HALF_LIFE_S
) -> HotList:
    """The sum of ``lists``, each decayed to ``now``, bounded to its ``limit`` hottest."""
    heats: dict[bytes, float] = {}
    for hot in lists:
        for key, heat in hot.decayed(now, half_life_s).items():
            heats[key] = heats.get(key, 0.0) + heat
    return top(heats, now, limit)


class HitCounter:
    """The scheduler side's hits per chunk key since the last :meth:`take`.

    :meth:`hit` is one dict update (the scheduler's step pays it per chunk loaded); the
    dict is bounded: past ``2 * limit`` keys it keeps its ``limit`` most hit (a sort of
    the dict, ~2 ms, once per ``limit`` new keys at most). :meth:`take`, every
    :data:`SEND_S`, costs a merge of two lists of at most ``limit`` keys (a few ms).
    :attr:`own` keeps this engine's decayed heat across takes, which orders its hand-off
    at drain."""

    def __init__(self, limit: int = LIMIT, half_life_s: float = HALF_LIFE_S) -> None:
        self.limit = limit
        self.half_life_s = half_life_s
        self._counts: dict[bytes, int] = {}
        #: this engine's own hits, decayed, as of its last take
        self.own = HotList()

    def hit(self, key: bytes) -> None:
        counts = self._counts
        counts[key] = counts.get(key, 0) + 1
        if len(counts) > 2 * self.limit:
            kept = sorted(counts.items(), key=itemgetter(1), reverse=True)[: self.limit]
            self._counts = dict(kept)

    def __len__(self) -> int:
        return len(self._counts)

    def recent(self) -> list[bytes]:
        """The keys hit since the last :meth:`take`, most hit first (ties in key order)."""
        counts = self._counts
        return sorted(counts, key=lambda k: (-counts[k], k))

    def take(self, now: float) -> HotList | None:
        """The hits since the last take as a delta as of ``now`` (Unix seconds), folded
        into :attr:`own`; None when there was none."""
        if not self._counts:
            return None
        counts, self._counts = self._counts, {}
        delta = top({k: float(n) for k, n in counts.items()}, now, self.limit)
        self.own = merge(self.own, delta, now=now, limit=self.limit, half_life_s=self.half_life_s)
        return delta


def plan_warmup(
    hot: HotList,
    *,
    chunk_bytes: int,
    host_bytes: int,
    warmup_bytes: int,
    have: Sequence[bytes] | frozenset[bytes] = frozenset(),
) -> list[bytes]:
    """The keys a starting engine fetches into its host tier, hottest first: as many of
    ``hot`` as fit in ``warmup_bytes`` and the host tier's ``host_bytes`` (whole chunks of
    ``chunk_bytes``), skipping those it already holds (``have``)."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    room = min(max(0, warmup_bytes), max(0, host_bytes)) // chunk_bytes
    held = set(have)
    out: list[bytes] = []
    for key, _heat in hot.entries:
        if len(out) >= room:
            break
        if key not in held:
            out.append(key)
    return out
