"""The one policy every object-tier backend follows: how long it waits, how often it
retries.

RemoteIO owns the deadline of a lookup (``lookup_timeout_ms``) and the backoff
after the tier failed (:mod:`kvtier.objects.health`). A backend only bounds each request
so it cannot outlive that deadline by much, and retries a failed request
:data:`RETRIES` time(s), at once: that replaces a pooled connection the server
dropped (a restart, an idle timeout) without the caller noticing. Anything longer
is an outage and RemoteIO's business: backends never sleep.

A read has a deadline of its own (its lookup's): RemoteIO runs it inside
:func:`call_deadline`, and a backend that says so (``ObjectTier.bounds_reads``)
waits for no socket longer than :func:`time_left` (a read of a hung server returns
at its deadline, instead of holding its I/O thread for a socket timeout).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

#: immediate retries of a failed request (redis-py's Retry, botocore's attempts - 1,
#: the Redis tier's own write path)
RETRIES = 1


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Every backend's waits, derived from the one setting ``lookup_timeout_ms``."""

    lookup_s: float

    @classmethod
    def from_ms(cls, lookup_timeout_ms: int) -> Timeouts:
        if lookup_timeout_ms <= 0:
            raise ValueError("lookup_timeout_ms must be positive")
        return cls(lookup_timeout_ms / 1000)

    @property
    def connect_s(self) -> float:
        """Opening a connection."""
        return max(0.5, self.lookup_s)

    @property
    def pool_wait_s(self) -> float:
        """Waiting for a pooled connection while every one is in use."""
        return max(1.0, self.lookup_s)

    @property
    def reply_s(self) -> float:
        """A request's reply (a socket wait) outside a call deadline: an upload's; a
        read waits at most what is left of its deadline (:func:`call_deadline`)."""
        return max(1.0, 2 * self.lookup_s)

    @property
    def body_s(self) -> float:
        """A pause while streaming an object's body (S3 reads 4-8 MiB chunks)."""
        return max(5.0, 2 * self.lookup_s)

    @property
    def stall_s(self) -> float:
        """An upload still in its backend call after this long is stuck (RemoteIO counts
        it and takes writes down): every attempt's connect and longest pause, and then
        some. A read is stuck past the lookup deadline itself (for a tier that ends its
        reads by it, a grace after it)."""
        return (1 + RETRIES) * (self.connect_s + self.body_s)


class _Deadline(threading.local):
    at: float | None = None


_deadline = _Deadline()


@contextmanager
def call_deadline(at: float | None) -> Iterator[None]:
    """The backend calls this thread makes in the block end by ``at`` (a
    ``time.monotonic()``; None: only the backend's own timeouts)."""
    outer, _deadline.at = _deadline.at, at
    try:
        yield
    finally:
        _deadline.at = outer


def time_left() -> float | None:
    """Seconds left to this thread's :func:`call_deadline` (at most 0: it has passed);
    None outside one."""
    at = _deadline.at
    return None if at is None else at - time.monotonic()
