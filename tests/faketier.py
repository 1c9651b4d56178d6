"""An in-memory object tier whose calls block on events, and RemoteIO helpers for it:
how tests force an order of events between the caller and RemoteIO's threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import kit
from kit import payload

from kvtier.errors import ObjectError
from kvtier.objects import codec
from kvtier.objects.health import NoBackoff
from kvtier.objects.remote import RemoteIO
from kvtier.objects.tiers.base import Found, ObjectTier, Parts
from kvtier.ops import OpResult

SHAPE = [2, 8, 64]
SIZE = kit.PAYLOAD_SIZE  # what payload() makes
DT = "bfloat16"
WAIT = 5.0  # bound on every wait for another thread; never reached when things work


def frame(key: str, seed: int, signer: codec.Signer | None = None) -> bytes:
    return b"".join(
        bytes(p) for p in codec.encode(key, payload(seed), dtype=DT, shape=SHAPE, signer=signer)
    )


class FakeTier(ObjectTier):
    """An in-memory tier; a key in ``hold`` blocks its reads (``read_into``) or writes
    (``put``) until that event is set, one in ``hold_payload`` its read once it was found.
    ``entered``/``active`` say which calls began and which are still running; ``calls``
    counts every backend call by kind."""

    name = "fake"

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.hold: dict[str, threading.Event] = {}
        self.hold_all: threading.Event | None = None  # every read and write blocks on it
        #: a key's read blocks here after it found the object (``found`` called)
        self.hold_payload: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = {}
        self.active: set[str] = set()
        self.calls = {"exists": 0, "read": 0, "put": 0}
        self.fail_put: set[str] = set()
        self._lock = threading.Lock()

    def _enter(self, kind: str, key: str) -> None:
        with self._lock:
            self.calls[kind] += 1
            self.active.add(key)
        self.entered.setdefault(key, threading.Event()).set()
        gate = self.hold_all if self.hold_all is not None else self.hold.get(key)
        if gate is not None:
            gate.wait()

    def _leave(self, key: str) -> None:
        with self._lock:
            self.active.discard(key)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            self.calls["exists"] += 1
            found = [k in self.objects for k in keys]
        n = found.index(False) if False in found else len(found)
        return [True] * n + [False] * (len(found) - n)

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        return self.objects.get(key)

    def read_into(
        self, key: str, dest: memoryview, max_head: int, *, found: Found = None
    ) -> bytes | None:
        self._enter("read", key)
        try:
            blob = self.objects.get(key)
            if blob is None:
                return None
            if found is not None:
                found()
            gate = self.hold_payload.get(key)  # found, its payload still on its way
            if gate is not None:
                gate.wait()
            head = len(blob) - dest.nbytes
            dest[:] = blob[head:]  # lands in the caller's slot
            return blob[:head]
        finally:
            self._leave(key)

    def put(self, key: str, parts: Parts) -> None:
        self._enter("put", key)
        try:
            if key in self.fail_put:
                raise ObjectError("fake: this object cannot be written")
            self.objects[key] = b"".join(bytes(p) for p in parts)
        finally:
            self._leave(key)

    def create_if_absent(self, key: str, parts: Parts) -> bool:
        """Stored only if absent, under the fake's lock (atomic, as every tier's is)."""
        with self._lock:
            if key in self.objects:
                return False
            self.objects[key] = b"".join(bytes(p) for p in parts)
            return True

    def delete(self, keys: Sequence[str]) -> None:
        for k in keys:
            self.objects.pop(k, None)

    def close(self) -> None:
        if self.hold_all is not None:
            self.hold_all.set()
        for ev in [*self.hold.values(), *self.hold_payload.values()]:
            ev.set()


def make_rio(tier: ObjectTier, **kw) -> RemoteIO:
    kw.setdefault("threads", 2)  # one read thread, one write thread
    kw.setdefault("queue_depth", 8)
    kw.setdefault("timeout_s", 0.2)
    kw.setdefault("signer", None)
    kw.setdefault("backoff", NoBackoff())
    return RemoteIO(tier, **kw)


def until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def collect(rio: RemoteIO, n: int) -> dict[int, OpResult]:
    return kit.collect(rio, n, timeout=WAIT)
