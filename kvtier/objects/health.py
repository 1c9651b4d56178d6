"""Whether the object tier is reachable, per direction: backoff after failures, the
per-direction state, and warnings that do not flood.

The backoffs are small immutable values in the style of redis-py's ``backoff.py``:
RemoteIO is given one and asks it ``compute(failures)``, so tests can use a fixed, short
delay and deployments a capped exponential one. RemoteIO keeps one :class:`TierHealth`:
reads and writes back off separately (a store that refuses writes must not stop hits; a
failing read path must not stop uploads), with the same :class:`Backoff` policy. A Redis
Cluster node's :class:`BackoffState` is the same machinery, per node.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

__all__ = [
    "Backoff",
    "BackoffState",
    "ConstantBackoff",
    "ExponentialBackoff",
    "NoBackoff",
    "RateLimitedLog",
    "TierHealth",
]

log = logging.getLogger("kvtier.remote")


class Backoff(ABC):
    """Seconds to wait before the next attempt after ``failures`` failures in a row."""

    @abstractmethod
    def compute(self, failures: int) -> float: ...


@dataclass(frozen=True, slots=True)
class NoBackoff(Backoff):
    """Retry at once (tests, or a tier that is never shared)."""

    def compute(self, failures: int) -> float:
        return 0.0


@dataclass(frozen=True, slots=True)
class ConstantBackoff(Backoff):
    """The same delay after every failure."""

    seconds: float

    def compute(self, failures: int) -> float:
        return self.seconds if failures > 0 else 0.0


@dataclass(frozen=True, slots=True)
class ExponentialBackoff(Backoff):
    """``base * 2**(failures-1)`` capped at ``cap``; with ``jitter`` a random value up to that.

    Jitter spreads the retries of many replicas that lost the same backend at
    the same moment, so they do not all come back in lockstep.
    """

    base: float = 0.05
    cap: float = 5.0
    jitter: bool = False

    def __post_init__(self) -> None:
        if self.base < 0 or self.cap < 0:
            raise ValueError("backoff base and cap must not be negative")

    def compute(self, failures: int) -> float:
        if failures <= 0:
            return 0.0
        # cap the exponent first: 2**10000 would overflow a float
        delay = min(self.cap, self.base * 2.0 ** min(failures - 1, 62))
        return random.uniform(0.0, delay) if self.jitter else delay


class BackoffState:
    """Failures in a row of one kind of operation, and until when to fail fast.

    RemoteIO keeps one for reads and one for writes: a store that refuses
    writes (read-only replica, failed-over primary) must not stop hits, and a
    failing lookup path must not stop uploads; the Redis Cluster tier keeps one per
    node. Once a backoff is over, one op goes first (:meth:`admit` makes it the
    *probe*) and the others keep failing fast until it reports: a backend that is
    still hung costs one op per backoff, not every op queued meanwhile. Thread-safe.
    """

    def __init__(self, backoff: Backoff, probe_lease_s: float = 30.0) -> None:
        self.backoff = backoff
        #: how long a probe may go unreported before another op may probe (a safety net:
        #: every admitted probe reports through :meth:`failed`, :meth:`succeeded` or
        #: :meth:`probe_over`)
        self.probe_lease_s = probe_lease_s
        self.failures = 0
        self.down_until = 0.0
        self._probe = 0  # the token of the probe in flight (0: none)
        self._probe_until = 0.0
        self._tokens = 0
        self._lock = threading.Condition()  # notified when a probe reports

    @property
    def is_down(self) -> bool:
        """Failing fast: backing off, or a probe is out and has not reported."""
        now = time.monotonic()
        return now < self.down_until or (self._probe != 0 and now < self._probe_until)

    @property
    def backing_off(self) -> bool:
        """Failing fast for the backoff's delay (a probe out is not: an upload waits for it)."""
        return time.monotonic() < self.down_until

    def admit(self) -> int | None:
        """May an op go to the backend now? None: no, fail it fast. 0: yes (no failures).
        A positive token: yes, as the one probe after a backoff; hand the token to
        :meth:`probe_over` when the op is over, whatever became of it."""
        if not self.failures:  # the common case takes no lock
            return 0
        now = time.monotonic()
        with self._lock:
            if not self.failures:
                return 0
            if now < self.down_until or (self._probe != 0 and now < self._probe_until):
                return None
            self._tokens += 1
            self._probe, self._probe_until = self._tokens, now + self.probe_lease_s
            return self._probe

    def admit_waiting(self, timeout: float) -> int | None:
        """:meth:`admit`, but while another op's probe is out, wait for its report (at most
        ``timeout`` seconds) instead of failing fast. For uploads: queued behind a probe of
        a backend that is back, failing them fast would drop them for nothing."""
        end = time.monotonic() + timeout
        while True:
            token = self.admit()
            if token is not None:
                return token
            with self._lock:
                now = time.monotonic()
                probing = self._probe != 0 and now < self._probe_until
                if now < self.down_until or now >= end:
                    return None  # backing off (the probe failed), or waited long enough
                if probing:
                    self._lock.wait(min(end, self._probe_until) - now)

    def probe_over(self, token: int | None) -> None:
        """The op :meth:`admit` made a probe (``token``) is over: if it neither failed nor
        succeeded (an error about one object), the next op may probe."""
        if token and self._probe == token:
            with self._lock:
                if self._probe == token:
                    self._probe = 0
                    self._lock.notify_all()

    def failed(self) -> tuple[int, float]:
        """Record a failure; returns (failures in a row, seconds left failing fast)."""
        now = time.monotonic()
        with self._lock:
            if now >= self.down_until:  # ops already in flight do not stack the backoff
                self.failures += 1
                self.down_until = now + self.backoff.compute(self.failures)
                self._probe = 0  # (the probe's own failure, or one that ends it)
                self._lock.notify_all()
            return self.failures, self.down_until - now

    def succeeded(self) -> int:
        """Record a success; returns how many failures in a row it ended (0: none)."""
        if not self.failures:  # the common case takes no lock
            return 0
        with self._lock:
            failures, self.failures, self.down_until = self.failures, 0, 0.0
            self._probe = 0
            self._lock.notify_all()
        return failures


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
            self.tier_name,
            failures,
            "writes" if write else "reads",
            delay,
            exc,
        )

    def timed_out(self, write: bool, detail: str) -> None:
        """A call still running past its deadline (a hung mount, a server that stopped
        answering): counted like a failure, so a tier that keeps timing out goes down."""
        failures, delay = self.of(write).failed()
        self.log.warning(
            "object tier %s is timing out (%d failures in a row), %s fail fast for %.2f s: %s",
            self.tier_name,
            failures,
            "writes" if write else "reads",
            delay,
            detail,
        )

    def succeeded(self, write: bool) -> None:
        """The tier answered (even with an error about one object): that direction is up."""
        if self.of(write).succeeded():
            log.info(
                "object tier %s is reachable again (%s)",
                self.tier_name,
                "writes" if write else "reads",
            )
