"""A fake of kvtier's CUDA stream interface (``kvtier.host.cuda_copier.StreamOps``), and paged KV.

The fake logs every stream and event call, so the copy path's bookkeeping runs
and is checked on the CPU: the copies themselves are real torch copies of CPU
tensors.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch

from kvtier.host.layout import find_block_dim
from kvtier.ops import OpKind, OpResult


def make_caches(shape, dtype=torch.bfloat16, layers: int = 3, seed: int = 0):
    """Random paged KV of ``layers`` attention layers, named as vLLM names them."""
    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=g).to(dtype)
        for i in range(layers)
    }


def blocks_of(kv: torch.Tensor, blocks: list[int], num_blocks: int) -> torch.Tensor:
    """The bytes of ``blocks`` of one layer, in that order."""
    dim = find_block_dim(kv.shape, num_blocks)
    return kv.index_select(dim, torch.tensor(blocks)).view(torch.uint8)


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
        names = ["load", "save", "scatter"]
        s = FakeStream(names[len(self.streams)] if len(self.streams) < len(names) else "x")
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
        # (CUDA times events of any two streams of a device: a load's copies start on the
        # load stream, its scatters end on the scatter stream)
        assert start.timing and end.timing and start.recorded_on and end.recorded_on
        return 0.001  # each layer's copies "took" 1 ms


def times(results: list[OpResult]) -> dict[int, float | None]:
    """A copier's results as op id -> seconds, None for a failed op (each op once,
    every result a copy's)."""
    out: dict[int, float | None] = {}
    for r in results:
        assert r.kind in (OpKind.LOAD, OpKind.STORE) and r.op_id not in out, r
        out[r.op_id] = r.seconds if r.ok else None
    return out


def save_every_layer(copier: Any, stores: list[Any]) -> dict[int, float | None]:
    """Stores through ``copier`` as a forward pass drives them (begin, each layer, finish):
    their :func:`times`."""
    copier.begin_saves(stores)
    for li in range(len(copier.kv)):
        copier.save_layer(li)
    return times(copier.finish_saves())


def load_every_layer(copier: Any, loads: list[Any]) -> dict[int, float | None]:
    """Loads through ``copier`` as a forward pass drives them (begin, wait for each layer,
    finish): their :func:`times`, from begin and finish together."""
    out = times(copier.begin_loads(loads))
    for li in range(len(copier.kv)):
        copier.wait_layer(li)
    out.update(times(copier.finish_loads()))
    return out
