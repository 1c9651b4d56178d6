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
    failing lookup path must not stop uploads. Thread-safe.
    """

    def __init__(self, backoff: Backoff) -> None:
        self.backoff = backoff
        self.failures = 0
        self.down_until = 0.0
        self._lock = threading.Lock()

    @property
    def is_down(self) -> bool:
        return time.monotonic() < self.down_until

    def failed(self) -> tuple[int, float]:
        """Record a failure; returns (failures in a row, seconds left failing fast)."""
        now = time.monotonic()
        with self._lock:
            if now >= self.down_until:  # ops already in flight do not stack the backoff
                self.failures += 1
                self.down_until = now + self.backoff.compute(self.failures)
            return self.failures, self.down_until - now

    def succeeded(self) -> int:
        """Record a success; returns how many failures in a row it ended (0: none)."""
        if not self.failures:  # the common case takes no lock
            return 0
        with self._lock:
            failures, self.failures, self.down_until = self.failures, 0, 0.0
        return failures
