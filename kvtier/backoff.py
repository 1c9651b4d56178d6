"""How long the object tier stays "down" after consecutive failures.

Small immutable values in the style of redis-py's ``backoff.py``: RemoteIO is
given one and asks it ``compute(failures)``, so tests can use a fixed, short
delay and deployments a capped exponential one.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass

__all__ = ["Backoff", "ConstantBackoff", "ExponentialBackoff", "NoBackoff"]


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
