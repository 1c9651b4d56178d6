"""A fake of kvtier's CUDA stream interface (``kvtier.transfer.StreamOps``).

It logs every stream and event call, so the copy path's bookkeeping runs and is
checked on the CPU: the copies themselves are real torch copies of CPU tensors.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


class FakeEvent:
    n = 0

    def __init__(self) -> None:
        FakeEvent.n += 1
        self.id = FakeEvent.n
        self.recorded_on: FakeStream | None = None

    def __repr__(self) -> str:
        return f"ev{self.id}"


class FakeOps:
    """Logs stream/event calls; ``on_record`` lets a test look at memory at record time."""

    def __init__(self) -> None:
        self.compute = FakeStream("compute")
        self.cur = self.compute
        self.streams: list[FakeStream] = []
        self.log: list[tuple[Any, ...]] = []
        self.on_record: Any = None
        self.fail_sync = False

    def new_stream(self) -> FakeStream:
        s = FakeStream(["load", "save"][len(self.streams)] if len(self.streams) < 2 else "x")
        self.streams.append(s)
        return s

    def new_event(self, timing: bool = False) -> FakeEvent:
        ev = FakeEvent()
        ev.timing = timing
        return ev

    def current_stream(self) -> FakeStream:
        return self.cur

    @contextmanager
    def use_stream(self, stream: FakeStream):
        prev, self.cur = self.cur, stream
        try:
            yield
        finally:
            self.cur = prev

    def record(self, event: FakeEvent, stream: FakeStream) -> None:
        event.recorded_on = stream
        self.log.append(("record", event, stream.name))
        if self.on_record is not None:
            self.on_record(event, stream)

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        assert event.recorded_on is not None, "waiting on an event never recorded"
        self.log.append(("wait", stream.name, event))

    def synchronize(self, event: FakeEvent) -> None:
        if self.fail_sync:
            raise RuntimeError("cudaErrorLaunchFailure")
        self.log.append(("sync", event))

    def elapsed_s(self, start: FakeEvent, end: FakeEvent) -> float:
        assert start.timing and end.timing and start.recorded_on is end.recorded_on
        return 0.001  # each layer's copies "took" 1 ms
