"""Whether the object tier is reachable, per direction, and warnings that do not flood.

RemoteIO keeps one :class:`TierHealth`: reads and writes back off separately
(a store that refuses writes must not stop hits; a failing read path must not
stop uploads), with the same :class:`~kvtier.objects.backoff.Backoff` policy.
"""

from __future__ import annotations

import logging
import threading
import time

from kvtier.objects.backoff import Backoff, BackoffState

log = logging.getLogger("kvtier.remote")


class RateLimitedLog:
    """At most one warning per ``interval`` seconds; the rest are counted and mentioned."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._last = -float("inf")
        self._suppressed = 0
        self._lock = threading.Lock()

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        if suppressed:
            log.warning(msg + " (%d similar warnings suppressed)", *args, suppressed)
        else:
            log.warning(msg, *args)


class TierHealth:
    """Reads and writes of one tier: failures in a row, and until when to fail fast."""

    def __init__(self, tier_name: str, backoff: Backoff) -> None:
        self.tier_name = tier_name
        self.reads = BackoffState(backoff)
        self.writes = BackoffState(backoff)
        self.log = RateLimitedLog()

    @property
    def is_down(self) -> bool:
        return self.reads.is_down or self.writes.is_down

    def of(self, write: bool) -> BackoffState:
        return self.writes if write else self.reads

    def failed(self, write: bool, exc: Exception) -> None:
        """A connection-level failure: that direction fails fast for the backoff's delay."""
        failures, delay = self.of(write).failed()
        self.log.warning(
            "object tier %s unavailable (%d failures in a row), %s fail fast for %.2f s: %s",
            self.tier_name, failures, "writes" if write else "reads", delay, exc,
        )  # fmt: skip

    def timed_out(self, write: bool, detail: str) -> None:
        """A call still running past its deadline (a hung mount, a server that stopped
        answering): counted like a failure, so a tier that keeps timing out goes down."""
        failures, delay = self.of(write).failed()
        self.log.warning(
            "object tier %s is timing out (%d failures in a row), %s fail fast for %.2f s: %s",
            self.tier_name, failures, "writes" if write else "reads", delay, detail,
        )  # fmt: skip

    def succeeded(self, write: bool) -> None:
        """The tier answered (even with an error about one object): that direction is up."""
        if self.of(write).succeeded():
            log.info("object tier %s is reachable again (%s)", self.tier_name,
                     "writes" if write else "reads")  # fmt: skip
