"""A chunk's identity names the layers it holds and each layer's KV dtype.

Two engines whose slots have the same size and, layer by layer, the same shapes can
still hold other KV: another pipeline partition (``VLLM_PP_LAYER_PARTITION`` 10,12,10
against 11,12,9: stage 1 holds layers 10-21 in one, 11-22 in the other) or another
list of layers kept out of a quantized KV cache (``--kv-cache-dtype-skip-layers 0``
against ``1``: layer 0 bf16 in one, layer 1 in the other). Their object keys must
differ, and so must the chunk header's record of the layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
from kit import chunk_files

from kvtier.config import load_config
from kvtier.connectors.worker.side import WorkerSide
from kvtier.host.layout import SlotLayout
from kvtier.keys import Namespace
from tests.connectors.test_parallel_sides import (
    BPC,
    CHUNK,
    NUM_BLOCKS,
    PAGE,
    SHAPE,
    PipelineEngine,
    layer,
    make_request,
)

NS = Namespace("m", None, "bfloat16", "auto", 32, CHUNK, 1, pp_size=3)


def caches(
    layers: list[int], dtypes: dict[int, torch.dtype] | None = None
) -> dict[str, torch.Tensor]:
    dtypes = dtypes or {}
    return {layer(i): torch.zeros(SHAPE, dtype=dtypes.get(i, torch.bfloat16)) for i in layers}


def worker(
    layers: list[int], stage: int, dtypes: dict[int, torch.dtype] | None = None, ns: Namespace = NS
) -> WorkerSide:
    cfg = load_config({"cpu_bytes": "1MiB", "chunk_size": CHUNK}, environ={})
    w = WorkerSide(cfg, ns, NUM_BLOCKS)
    w.register_kv_caches(caches(layers, dtypes), rank=0, stage=stage)
    return w


H = bytes(range(32))


def test_another_pipeline_partition_gives_stage_1_other_keys() -> None:
    """Stage 1 of 1,2,2 holds layers 1-2, of 2,2,1 layers 2-3: same count, same shapes,
    same slot size, same header shape; not the same KV."""
    a, b = worker([1, 2], stage=1), worker([2, 3], stage=1)
    assert a.layout is not None and b.layout is not None
    assert a.layout.describe() == b.layout.describe()  # what the header alone can tell
    assert a._object_key(H) != b._object_key(H)
    # the same layers in another engine of the same config: the same keys (shared)
    assert worker([1, 2], stage=1)._object_key(H) == a._object_key(H)


def test_layers_kept_out_of_a_quantized_kv_cache_change_keys_and_header() -> None:
    """Layer 0 in a wider dtype than layer 1 in one engine, the other way round in the
    other: the set of dtypes, the slot size and the shapes are equal."""
    wide = {0: torch.float16}  # skip-layers 0: layer 0 keeps another dtype
    other = {1: torch.float16}  # skip-layers 1
    a, b = worker([0, 1], 0, wide), worker([0, 1], 0, other)
    assert a.layout is not None and b.layout is not None
    assert a.layout.slot_bytes == b.layout.slot_bytes
    assert a._object_key(H) != b._object_key(H)
    assert a.layout.describe()[0] == "float16*1,bfloat16*1"
    assert b.layout.describe()[0] == "bfloat16*1,float16*1"
    assert worker([0, 1], 0).layout.describe()[0] == "bfloat16"  # one dtype: its name


def test_layout_identity_covers_names_order_dtypes_and_shared_tensors() -> None:
    base = SlotLayout.from_kv_caches(caches([0, 1]), NUM_BLOCKS, BPC).identity()
    assert SlotLayout.from_kv_caches(caches([0, 1]), NUM_BLOCKS, BPC).identity() == base
    assert SlotLayout.from_kv_caches(caches([1, 0]), NUM_BLOCKS, BPC).identity() != base
    assert SlotLayout.from_kv_caches(caches([0, 2]), NUM_BLOCKS, BPC).identity() != base
    fp16 = caches([0, 1], {1: torch.float16})
    assert SlotLayout.from_kv_caches(fp16, NUM_BLOCKS, BPC).identity() != base
    # a layer that shares layer 0's KV tensor (cross-layer KV sharing) is named too
    shared = caches([0, 1])
    shared[layer(2)] = shared[layer(0)]
    layout = SlotLayout.from_kv_caches(shared, NUM_BLOCKS, BPC)
    assert len(layout.layers) == 2 and (layer(2), 0) in layout.names
    assert layout.identity() != base


def test_a_chunk_of_swapped_layer_dtypes_is_never_loaded(tmp_path: Path) -> None:
    """Two engines on one object tier, ``--kv-cache-dtype-skip-layers`` 0 and 1 (here:
    which layer keeps float16 KV beside bfloat16): the second finds nothing of the
    first's, though every chunk header would have matched before layers were named."""
    extra = {"remote_url": f"file://{tmp_path / 'kv'}"}

    def engine(dtypes: dict[int, torch.dtype]) -> PipelineEngine:
        eng = PipelineEngine([[0, 1]], cpu_bytes=8 * PAGE * 2 * BPC, extra=extra)
        w = eng.workers[0]
        w.shutdown()  # re-register with this engine's dtypes (and a fresh RemoteIO)
        kv = {
            n: t.to(dtypes.get(i, torch.bfloat16)) for i, (n, t) in enumerate(eng.caches[0].items())
        }
        w.register_kv_caches(kv, rank=0, stage=0)
        eng.caches[0] = kv
        return eng

    a = engine({0: torch.float16})
    assert a.prefill(make_request(3 * CHUNK + 1, seed=5), list(range(13))) == 0
    a.settle()
    a.shutdown()
    assert len(chunk_files(tmp_path / "kv")) == 3

    same = engine({0: torch.float16})  # the same config again: its chunks are found
    assert same.prefill(make_request(3 * CHUNK + 1, seed=5), list(range(20, 33))) == 3 * CHUNK
    same.shutdown()

    b = engine({1: torch.float16})
    assert b.prefill(make_request(3 * CHUNK + 1, seed=5), list(range(20, 33))) == 0
    b.settle()
    assert b.side.totals["fetch_ok"] == 0 and b.side.totals["hit_tokens_remote"] == 0
    b.shutdown()
