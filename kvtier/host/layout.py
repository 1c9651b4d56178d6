"""Moving KV between vLLM's paged per-layer tensors and a host slot.

vLLM hands a connector one tensor per attention layer with the block index on
one dimension — dim 0 for the standardized ``[num_blocks, H, block_size, C]``
views (MLA: H == 1), dim 1 for layouts that keep K and V outermost
(``[2, num_blocks, ...]``). A slot holds ``blocks_per_chunk`` blocks of every
layer, laid out layer after layer, each layer region shaped exactly like the
layer tensor with its block dimension cut to ``blocks_per_chunk``. Copies are
one slice copy per run of blocks (a few at most, ascending or descending) or one
``index_select`` / ``index_copy_`` per layer and chunk, never per token.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import prefault

if TYPE_CHECKING:
    from .cuda import PinnedBuffer

#: slot sizes are rounded up to this, so every slot starts on an aligned address
SLOT_ALIGN = 4096


def _place_layer(
    layers: list[LayerLayout],
    names: list[tuple[str, int]],
    seen: dict[int, int],
    name: str,
    kv: torch.Tensor,
    num_blocks: int,
    blocks: int,
    offset: int,
    group: int = 0,
) -> int:
    """Give layer ``name`` its region of the slot: the region of a tensor already placed
    (``seen``: address -> region; layers sharing one KV tensor are stored once), else a
    new one of ``blocks`` blocks at ``offset``. Returns the next free offset."""
    if kv.data_ptr() in seen:
        names.append((name, seen[kv.data_ptr()]))
        return offset
    seen[kv.data_ptr()] = len(layers)
    names.append((name, len(layers)))
    dim = find_block_dim(kv.shape, num_blocks)
    shape = list(kv.shape)
    shape[dim] = blocks
    nbytes = math.prod(shape) * kv.element_size()
    layers.append(LayerLayout(name, kv.dtype, dim, tuple(shape), offset, nbytes, group))
    return offset + nbytes


def find_block_dim(shape: Sequence[int], num_blocks: int) -> int:
    """Which dimension of a layer's KV tensor indexes blocks (0 or 1)."""
    if shape[0] == num_blocks:
        return 0
    if len(shape) > 1 and shape[1] == num_blocks:
        return 1
    raise ValueError(f"cannot find the block dimension ({num_blocks} blocks) in KV shape {shape}")


@dataclass(frozen=True, slots=True)
class LayerLayout:
    name: str
    dtype: torch.dtype
    block_dim: int
    #: the layer region's shape inside a slot (block dim cut to blocks_per_chunk)
    slot_shape: tuple[int, ...]
    offset: int
    nbytes: int
    #: the KV cache group whose blocks this region holds (hybrid models; 0 otherwise)
    group: int = 0


#: KVGroup.kind
FULL, SLIDING, STATE = "full", "sliding", "state"


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV cache group of a hybrid model (vLLM's hybrid KV cache manager gives each
    its own block table) and what a chunk's slot holds of it.

    A full-attention group: every block of the chunk. A sliding-window group: only the
    chunk's last ``blocks`` blocks, the ones a hit ending at the chunk's end reads (vLLM
    backs the blocks before the window with its null block): :func:`sliding_blocks`. A
    state group (Mamba/SSM, gated delta-net, short conv: recurrent state): the chunk's
    last block, which holds the state at the chunk's end (vLLM's ``align`` mode)."""

    kind: str
    #: vLLM's layer names, in vLLM's group order
    layers: tuple[str, ...]
    #: blocks of each chunk stored, the chunk's last ones (a full group: all)
    blocks: int
    #: a sliding-window group: the tokens vLLM keeps before the next one (its window plus
    #: the trailing tokens it retains); 0 for full attention
    window: int = 0
    #: a state group: each state tensor of a layer, (shape of one block, dtype), as vLLM's
    #: spec names them (conv, then SSM or recurrent state); in the layout's digest, so a
    #: chunk of one state layout never loads into another (vLLM's CPU runner hands the
    #: state as raw bytes per block, whose shape says nothing of it)
    states: tuple[tuple[tuple[int, ...], str], ...] = ()

    def describe(self) -> list[Any]:
        out: list[Any] = [self.kind, self.window, self.blocks, list(self.layers)]
        if self.states:  # (groups of other kinds keep the digest they always had)
            out.append([[list(shape), dtype] for shape, dtype in self.states])
        return out


def sliding_blocks(window: int, block_size: int, blocks_per_chunk: int) -> int:
    """Blocks of a chunk a sliding-window group stores: the last ``ceil(window / bs)``.

    vLLM frees a sliding-window block (null block in its table) once every token in it is
    ``window`` or more tokens behind the computed end (``get_num_skipped_tokens``). A hit
    ending at a chunk boundary ``N`` keeps the blocks from token ``N - window + 1`` on: at
    most ``ceil((window - 1) / bs)`` blocks, all inside the last ``ceil(window / bs)`` of the
    chunk, which the step completing the chunk still holds (vLLM drops the blocks the
    window left only when it next allocates, after that step's stores were copied). A
    window longer than a chunk keeps whole chunks."""
    return max(1, min(blocks_per_chunk, -(-window // block_size)))


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """Byte layout of one slot; identical in every worker of one engine."""

    layers: tuple[LayerLayout, ...]
    blocks_per_chunk: int
    slot_bytes: int
    #: every registered layer name -> index in ``layers`` of the region holding its KV
    #: (layers that share one KV tensor name the same region)
    names: tuple[tuple[str, int], ...] = ()
    #: a hybrid model's KV cache groups, the slot's regions in group order (a layer's
    #: ``group``); empty for a model of one group
    groups: tuple[KVGroup, ...] = ()

    @classmethod
    def from_kv_caches(
        cls,
        kv_caches: Mapping[str, torch.Tensor],
        num_blocks: int,
        blocks_per_chunk: int,
        groups: Sequence[KVGroup] = (),
    ) -> SlotLayout:
        if len(groups) > 1:
            return cls._of_groups(kv_caches, num_blocks, blocks_per_chunk, tuple(groups))
        layers: list[LayerLayout] = []
        offset = 0
        seen: dict[int, int] = {}
        names: list[tuple[str, int]] = []
        for name, kv in kv_caches.items():
            offset = _place_layer(
                layers, names, seen, name, kv, num_blocks, blocks_per_chunk, offset
            )
        if not layers:
            raise ValueError("no KV cache tensors were registered")
        return cls(tuple(layers), blocks_per_chunk, _align(offset), tuple(names))

    @classmethod
    def _of_groups(
        cls,
        kv_caches: Mapping[str, torch.Tensor],
        num_blocks: int,
        blocks_per_chunk: int,
        groups: tuple[KVGroup, ...],
    ) -> SlotLayout:
        """Regions group after group, each group's layers in its order, each holding that
        group's ``blocks`` blocks. vLLM's hybrid manager lays groups over the same memory
        (a tensor serves one layer of each group, block ids never overlap at one time), so
        a tensor appears once per group that uses it, never merged across groups."""
        layers: list[LayerLayout] = []
        names: list[tuple[str, int]] = []
        offset = 0
        for gi, group in enumerate(groups):
            seen: dict[int, int] = {}
            for name in group.layers:
                kv = kv_caches.get(name)
                if kv is None:
                    raise ValueError(f"KV cache group {gi} names layer {name!r}, not registered")
                offset = _place_layer(
                    layers, names, seen, name, kv, num_blocks, group.blocks, offset, gi
                )
        if not layers:
            raise ValueError("no KV cache tensors were registered")
        return cls(tuple(layers), blocks_per_chunk, _align(offset), tuple(names), groups)

    def group_layout(self, group: int) -> SlotLayout:
        """One group's regions as a layout of their own (offsets into the same slot,
        ``blocks_per_chunk`` = the blocks the group stores): what its copier moves."""
        idx = [i for i, ll in enumerate(self.layers) if ll.group == group]
        local = {g: i for i, g in enumerate(idx)}
        names = tuple((n, local[i]) for n, i in self.names if i in local)
        return SlotLayout(
            tuple(self.layers[i] for i in idx), self.groups[group].blocks, self.slot_bytes, names
        )

    def identity(self) -> str:
        """Digest of which layers a slot holds and how: every layer's name (vLLM's,
        ``model.layers.12.self_attn.attn``), the region it lands in, and each region's KV
        dtype, block dimension and shape. It goes into the worker's object keys
        (``Namespace.layers``): two engines whose stage 1 holds layers 10-21 and 11-22,
        or whose layer 0 keeps bf16 KV in one and fp8 in the other, never share a chunk,
        though their slots may have the same size and, stage by stage, the same shapes."""
        regions = [
            [str(ll.dtype).removeprefix("torch."), ll.block_dim, list(ll.slot_shape)]
            for ll in self.layers
        ]
        parts: list[Any] = [sorted(self.names), regions, self.blocks_per_chunk]
        if self.groups:
            # hybrid: which group each region holds, and each group's kind, window, layers
            # and blocks stored (one model of one group keeps the digest it always had)
            parts.append([[g.describe() for g in self.groups], [ll.group for ll in self.layers]])
        blob = json.dumps(parts).encode()
        return hashlib.blake2b(blob, digest_size=16, person=b"kvtier-layers").hexdigest()

    def describe(self) -> tuple[str, list[int]]:
        """(dtype, shape) recorded in stored chunks so a foreign layout is rejected.

        The shape names the first layer's block dimension and region shape too:
        attention backends differ there (K/V outermost or blocks outermost) with
        the same byte count, and a chunk laid out for one must never load into
        the other.
        """
        first = self.layers[0]
        return self.dtypes(), [
            len(self.layers),
            self.blocks_per_chunk,
            self.slot_bytes,
            first.block_dim,
            *first.slot_shape,
        ]

    def dtypes(self) -> str:
        """The layers' KV dtypes in slot order, as runs: ``"bfloat16"`` when all share
        one, else e.g. ``"bfloat16*1,float8_e4m3fn*3"`` (which layer has which)."""
        runs: list[list[Any]] = []
        for layer in self.layers:
            name = str(layer.dtype).removeprefix("torch.")
            if runs and runs[-1][0] == name:
                runs[-1][1] += 1
            else:
                runs.append([name, 1])
        if len(runs) == 1:
            return str(runs[0][0])
        return ",".join(f"{name}*{n}" for name, n in runs)


def slot_bytes_for(per_block_bytes: Sequence[int], blocks_per_chunk: int) -> int:
    """Slot size from per-layer bytes per block (the scheduler has no tensors)."""
    return _align(sum(per_block_bytes) * blocks_per_chunk)


def align_slot(nbytes: int) -> int:
    """A slot's size for ``nbytes`` of regions (slots start on aligned addresses)."""
    return _align(nbytes)


def _align(n: int) -> int:
    return (n + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


class HostSlab:
    """One host allocation of exactly ``nbytes``, cut into fixed-size slots.

    On the CPU backend this is an anonymous mapping whose pages are committed
    (as pinning commits them on CUDA), so no hit waits for page faults: before
    returning with ``commit`` (a slab allocated at startup), else in the background
    from the start. With ``pin=True`` (KV on CUDA) the buffer is an
    exact-size mapping registered with ``cudaHostRegister`` (see
    ``kvtier.host.cuda``), never ``Tensor.pin_memory()``, which rounds each
    allocation up to a power of two.
    """

    def __init__(
        self, nbytes: int, layout: SlotLayout, pin: bool = False, commit: bool = False
    ) -> None:
        self.layout = layout
        self.num_slots = nbytes // layout.slot_bytes
        if self.num_slots < 1:
            raise ValueError(
                f"host tier of {nbytes} bytes holds no chunk of {layout.slot_bytes} bytes"
            )
        self.pinned = False
        #: ``commit``: every page was committed before the constructor returned
        self.committed = False
        self._pinned_buffer: PinnedBuffer | None = None
        if pin:
            from .cuda import PinnedBuffer

            self._pinned_buffer = PinnedBuffer(nbytes)
            self.buffer = self._pinned_buffer.tensor
            self.pinned = self._pinned_buffer.pinned
        else:
            self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            # a process vLLM forks later does not inherit the slab: shared copy-on-write
            # with it, every write into a committed slot would fault and copy its page
            self._map.madvise(mmap.MADV_DONTFORK)
            # torch.frombuffer keeps a reference to the mapping for the tensor's lifetime
            self.buffer = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes)
            self._populating: threading.Thread | None = None
            if commit:
                self.committed = prefault.commit_now(self.buffer.data_ptr(), nbytes)
            else:
                self._populating = threading.Thread(
                    target=prefault.populate_in_steps,
                    args=(self._map, nbytes),
                    name="kvtier-slab-populate",
                    daemon=True,
                )
                self._populating.start()

    def with_layout(self, layout: SlotLayout) -> HostSlab:
        """This slab's memory through another layout of the same slot size (one KV cache
        group's regions: :meth:`SlotLayout.group_layout`). A view: nothing is allocated."""
        if layout.slot_bytes != self.layout.slot_bytes:
            raise ValueError(f"slot of {layout.slot_bytes} bytes, not {self.layout.slot_bytes}")
        view = object.__new__(HostSlab)
        view.layout = layout
        view.num_slots = self.num_slots
        view.pinned = self.pinned
        view._pinned_buffer = None  # the owner unregisters it
        view.buffer = self.buffer  # (keeps the mapping alive)
        return view

    def close(self) -> None:
        """Unregister pinned memory now (it is also unregistered when collected)."""
        if self._pinned_buffer is not None:
            self._pinned_buffer.close()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def slot_bytes(self, slot: int) -> torch.Tensor:
        """The raw bytes of one slot (a view, no copy)."""
        start = slot * self.layout.slot_bytes
        return self.buffer[start : start + self.layout.slot_bytes]

    def slot_memoryview(self, slot: int) -> memoryview:
        return memoryview(self.slot_bytes(slot).numpy())  # type: ignore[arg-type]  # a buffer

    def layer_view(self, slot: int, layer: int) -> torch.Tensor:
        """Slot region of one layer, shaped like the layer tensor (a view)."""
        ll = self.layout.layers[layer]
        start = slot * self.layout.slot_bytes + ll.offset
        raw = self.buffer[start : start + ll.nbytes]
        return raw.view(ll.dtype).view(ll.slot_shape)


#: at most this many runs in a block list are copied run by run (:func:`block_runs`);
#: more, and one index copy of the whole list costs less than a Python call per run
MAX_RUNS = 4


@dataclass(frozen=True, slots=True)
class Run:
    """Slot blocks ``at .. at+count-1`` live in KV blocks ``low .. low+count-1``, in that
    order, or in the reverse order when ``descending``."""

    at: int
    low: int
    count: int
    descending: bool = False


def block_runs(blocks: Sequence[int]) -> list[Run] | None:
    """``blocks`` as at most :data:`MAX_RUNS` runs of consecutive blocks, ascending
    (``b, b+1, ...``) or descending (``b, b-1, ...``), else None (an index copy).

    vLLM's allocator hands out ascending runs from a fresh pool, and descending ones once
    it has cycled: it frees a request's blocks in reverse order and hands the most recently
    freed out first. Each run is copied as one slice (``narrow`` + ``copy_``, the reversed
    ones through ``flip``), which beats ``index_copy_`` / ``index_select`` on the CPU."""
    runs: list[Run] = []
    i, n = 0, len(blocks)
    while i < n:
        j = i + 1
        step = blocks[j] - blocks[i] if j < n and abs(blocks[j] - blocks[i]) == 1 else 1
        while j < n and blocks[j] - blocks[j - 1] == step:
            j += 1
        if len(runs) == MAX_RUNS:
            return None
        runs.append(Run(i, min(blocks[i], blocks[j - 1]), j - i, step < 0))
        i = j
    return runs or None


def copy_runs(
    kv: torch.Tensor,
    block_dim: int,
    region: torch.Tensor,
    runs: Sequence[Run],
    *,
    to_slot: bool,
) -> None:
    """Each run as one slice copy between one layer's KV blocks and its slot ``region``
    (into the slot when ``to_slot``, else out of it); a descending run through ``flip``."""
    for r in runs:
        blocks = kv.narrow(block_dim, r.low, r.count)
        part = region.narrow(block_dim, r.at, r.count)
        dst, src = (part, blocks) if to_slot else (blocks, part)
        dst.copy_(src.flip(block_dim) if r.descending else src)


def gather_blocks(
    kv: torch.Tensor,
    block_dim: int,
    gpu_blocks: torch.Tensor | None,
    dst: torch.Tensor,
    runs: Sequence[Run] | None = None,
) -> None:
    """Copy ``gpu_blocks`` of one layer into ``dst`` (a slot region, same block order);
    ``runs``: the same blocks as :func:`block_runs` gives them, each copied as a slice."""
    if runs is not None:
        copy_runs(kv, block_dim, dst, runs, to_slot=True)
    elif gpu_blocks is None:
        raise ValueError("gather_blocks: neither runs nor block ids")
    elif dst.device == kv.device and dst.is_contiguous():
        torch.index_select(kv, block_dim, gpu_blocks, out=dst)
    else:
        dst.copy_(kv.index_select(block_dim, gpu_blocks), non_blocking=True)


def scatter_blocks(
    kv: torch.Tensor,
    block_dim: int,
    gpu_blocks: torch.Tensor | None,
    src: torch.Tensor,
    runs: Sequence[Run] | None = None,
) -> None:
    """Copy ``src`` (slot blocks in order) into ``gpu_blocks`` of one layer; ``runs``: the
    same blocks as :func:`block_runs` gives them, each copied as a slice."""
    if src.device != kv.device:
        src = src.to(kv.device, non_blocking=True)
    if runs is not None:
        copy_runs(kv, block_dim, src, runs, to_slot=False)
    elif gpu_blocks is None:
        raise ValueError("scatter_blocks: neither runs nor block ids")
    else:
        kv.index_copy_(block_dim, gpu_blocks, src)
