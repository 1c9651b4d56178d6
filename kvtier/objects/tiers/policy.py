"""The one policy every object-tier backend follows: how long it waits, how often it
retries.

RemoteIO owns the deadline of a lookup (``lookup_timeout_ms``) and the backoff
after the tier failed (:mod:`kvtier.objects.backoff`). A backend only bounds each request
so it cannot outlive that deadline by much, and retries a failed request
:data:`RETRIES` time(s), at once: that replaces a pooled connection the server
dropped (a restart, an idle timeout) without the caller noticing. Anything longer
is an outage and RemoteIO's business: backends never sleep.
"""

from __future__ import annotations

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
        """A request's reply (a socket read): a started read owns its slot until then."""
        return max(1.0, 2 * self.lookup_s)

    @property
    def body_s(self) -> float:
        """A pause while streaming an object's body (S3 reads 4-8 MiB chunks)."""
        return max(5.0, 2 * self.lookup_s)

    @property
    def stall_s(self) -> float:
        """An upload still in its backend call after this long is stuck (RemoteIO counts
        it and takes writes down): every attempt's connect and longest pause, and then
        some. A read is stuck past the lookup deadline itself."""
        return (1 + RETRIES) * (self.connect_s + self.body_s)
