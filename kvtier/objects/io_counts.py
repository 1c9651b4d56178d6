"""What object-tier I/O counts and tells: :class:`IOCounts` and :class:`FlushReport`.

The running counters (cumulative, and taken per interval), the compression tallies by
direction, and what a flush left behind. The op queue (:mod:`kvtier.objects.io_queue`)
owns one and counts into it; the counters have a lock of their own, taken last.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvtier import metrics
from kvtier.stats import Totals

__all__ = ["COUNTERS", "ERROR_KINDS", "FlushReport", "IOCounts", "ZCOUNTERS"]

#: error kinds RemoteIO reports and counts: every kind but a failed copy's ("load")
ERROR_KINDS = tuple(k for k in metrics.ERROR_KINDS if k != "load")
COUNTERS = (
    "writes_dropped",
    "reads_dropped",
    "bytes_read",
    "bytes_written",
    "ops_fetch",
    "ops_upload",
    "gets_skipped",
    "reads_stuck",
    "writes_stuck",
    "puts_existing",
    "seals",
    "writes_yielded",
) + tuple("errors_" + k for k in ERROR_KINDS)
#: per direction: KV bytes, their bytes as stored (compressed or not), microseconds spent
#: compressing (write) or decompressing (read)
ZCOUNTERS = tuple(f"z_{what}_{d}" for d in ("read", "write") for what in ("raw", "stored", "us"))


@dataclass(frozen=True, slots=True)
class FlushReport:
    """What became of the uploads pending when :meth:`RemoteIO.flush` began (every one
    is in exactly one of: written, failed, still queued, still in a backend call)."""

    pending: int
    written: int
    failed: dict[str, int]
    queued: int
    writing: int
    timeout_s: float

    @property
    def missing(self) -> int:
        """Uploads that were not written (failed, or not finished within the flush)."""
        return sum(self.failed.values()) + self.queued + self.writing

    def describe(self) -> str:
        failed = ", ".join(f"{k}: {n}" for k, n in sorted(self.failed.items()))
        return (
            f"{self.pending} pending: {self.written} written, "
            f"{sum(self.failed.values())} failed ({failed or 'none'}), "
            f"{self.queued} still queued after {self.timeout_s:.1f} s (dropped at close), "
            f"{self.writing} still in a backend call (left behind, may or may not land)"
        )


class IOCounts:
    """The counters of :data:`COUNTERS` and :data:`ZCOUNTERS`, guarded by their own lock
    (a leaf: nothing else is taken while it is held)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = Totals(COUNTERS + ZCOUNTERS)  # guarded by self._lock
        self._taken = dict.fromkeys(COUNTERS + ZCOUNTERS, 0)
        self._z_taken = dict.fromkeys(ZCOUNTERS, 0)

    def counters(self) -> dict[str, int]:
        """Cumulative counters since start."""
        with self._lock:
            return dict(self._totals)

    def take_compression(self) -> dict[str, tuple[int, int, float]]:
        """Per direction ("read", "write"), since the previous call: KV bytes moved, their
        bytes in the object tier (compressed or not), seconds spent (de)compressing."""
        with self._lock:
            delta = {k: self._totals[k] - self._z_taken[k] for k in ZCOUNTERS}
            self._z_taken = {k: self._totals[k] for k in ZCOUNTERS}
        return {
            d: (delta[f"z_raw_{d}"], delta[f"z_stored_{d}"], delta[f"z_us_{d}"] / 1e6)
            for d in ("read", "write")
        }

    def count_z(self, direction: str, raw: int, stored: int, seconds: float) -> None:
        with self._lock:
            self._totals[f"z_raw_{direction}"] += raw
            self._totals[f"z_stored_{direction}"] += stored
            self._totals[f"z_us_{direction}"] += round(seconds * 1e6)

    def take_counters(self) -> dict[str, int]:
        """Counter increments since the previous call (for per-interval stats)."""
        with self._lock:
            delta = {k: v - self._taken[k] for k, v in self._totals.items()}
            self._taken = dict(self._totals)
        return delta

    def add(self, counter: str, n: int) -> None:
        with self._lock:
            self._totals[counter] += n
