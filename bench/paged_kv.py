"""vLLM CPU's paged KV cache, for the benchmarks that time kvtier's copies outside the
engine (``copy_overlap.py``, ``block_runs.py``): the same flags and the same tensors."""

from __future__ import annotations

import argparse
from typing import NamedTuple

import torch

from kvtier.host.layout import SlotLayout

CHUNK_TOKENS, BLOCK_TOKENS = 256, 16


def add_args(p: argparse.ArgumentParser) -> None:
    """--tokens, --layers, --kv-heads: the prompt and the model's KV shape."""
    p.add_argument("--tokens", type=int, default=8192, help="prompt length (chunks of 256)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4, help="KV heads of 128 dims, bf16")


class PagedKV(NamedTuple):
    """One layer tensor per layer, twice a prompt's blocks (room to place chunks apart)."""

    kv: dict[str, torch.Tensor]
    layout: SlotLayout
    chunks: int
    #: blocks per chunk
    bpc: int
    num_blocks: int


def paged_kv(args: argparse.Namespace) -> PagedKV:
    """The KV cache :func:`add_args`' flags describe, zeroed, and its slot layout."""
    chunks = args.tokens // CHUNK_TOKENS
    bpc = CHUNK_TOKENS // BLOCK_TOKENS
    num_blocks = chunks * bpc * 2
    # vLLM CPU's layout: (2, blocks, block tokens, heads, head dim) per layer
    kv = {f"layer.{i}": torch.zeros(2, num_blocks, BLOCK_TOKENS, args.kv_heads, 128,
                                     dtype=torch.bfloat16) for i in range(args.layers)}  # fmt: skip
    return PagedKV(kv, SlotLayout.from_kv_caches(kv, num_blocks, bpc), chunks, bpc, num_blocks)
