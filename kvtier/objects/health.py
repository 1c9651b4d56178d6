"""How long the object tier stays "down" after consecutive failures.

Small immutable values in the style of redis-py's ``backoff.py``: RemoteIO is
given one and asks it ``compute(failures)``, so tests can use a fixed, short
delay and deployments a capped exponential one.
"""

from __future__ import annotations

import random
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

__all__ = ["Backoff", "BackoffState", "ConstantBackoff", "ExponentialBackoff", "NoBackoff"]


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
        self._lock = threading.Lock()

    @property
    def is_down(self) -> bool:
        """Failing fast: backing off, or a probe is out and has not reported."""
        now = time.monotonic()
        return now < self.down_until or (self._probe != 0 and now < self._probe_until)

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

    def probe_over(self, token: int | None) -> None:
        """The op :meth:`admit` made a probe (``token``) is over: if it neither failed nor
        succeeded (an error about one object), the next op may probe."""
        if token and self._probe == token:
            with self._lock:
                if self._probe == token:
                    self._probe = 0

    def failed(self) -> tuple[int, float]:
        """Record a failure; returns (failures in a row, seconds left failing fast)."""
        now = time.monotonic()
        with self._lock:
            if now >= self.down_until:  # ops already in flight do not stack the backoff
                self.failures += 1
                self.down_until = now + self.backoff.compute(self.failures)
                self._probe = 0  # (the probe's own failure, or one that ends it)
            return self.failures, self.down_until - now

    def succeeded(self) -> int:
        """Record a success; returns how many failures in a row it ended (0: none)."""
        if not self.failures:  # the common case takes no lock
            return 0
        with self._lock:
            failures, self.failures, self.down_until = self.failures, 0, 0.0
            self._probe = 0
        return failures
