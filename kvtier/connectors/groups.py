"""vLLM's KV cache groups as kvtier stores them (hybrid models, ``SupportsHMA``).

vLLM's hybrid KV cache manager gives each kind of attention its own group, with its own
block table: Gemma 2/3, gpt-oss and Mistral variants get a full-attention group and a
sliding-window group. kvtier stores every group of a chunk in one slot under one key
(:class:`kvtier.host.layout.KVGroup`): full-attention groups whole, sliding-window groups only
the chunk's last blocks a hit reads (:func:`kvtier.host.layout.sliding_blocks`). What it
cannot store is refused here with the reason, before the engine serves anything:
Mamba/SSM state (one state per request, not per token), and any other kind of group
(chunked-local, cross- or encoder-only attention, groups vLLM keeps out of transfers),
or groups whose block sizes differ.
"""

from __future__ import annotations

from typing import Any

from kvtier.host.layout import FULL, SLIDING, KVGroup, sliding_blocks


class Refused(Exception):
    """Why kvtier cannot serve this KV cache (the connector turns it into a ConfigError)."""


def specs_of(group: Any) -> list[Any]:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return list(spec.kv_cache_specs.values())
    return [spec]


def describe(group: Any) -> str:
    kinds = "/".join(sorted({type(s).__name__ for s in specs_of(group)}))
    return f"{kinds} x {len(group.layer_names)} layers"


def has_sliding_window(kv_cache_config: Any) -> bool:
    """Whether any KV cache group holds sliding-window attention, the one group of a model
    whose every layer has a window included (kvtier stores that group whole).

    vLLM backs a hit's blocks before the window of its next token with its null block
    and never gives them back. Where a load of the window's blocks fails, vLLM recomputes
    from the first failed block with the window before it unbacked: the recomputed KV
    attends to zeros. So a model with a window gets no load that can fail at the read
    (one-step lookups, :mod:`.probe`)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return any(isinstance(s, SlidingWindowSpec) for group in kv_cache_config.kv_cache_groups
               for s in specs_of(group))


def kv_groups(kv_cache_config: Any, block_size: int, chunk_size: int) -> tuple[KVGroup, ...]:
    """kvtier's view of a hybrid model's groups; ``()`` for a model of one group (stored
    whole, as kvtier always has: no check of the spec beyond what the connector does).
    Raises :class:`Refused` naming the group kvtier cannot store."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) <= 1:
        return ()
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    bpc = chunk_size // block_size
    out: list[KVGroup] = []
    for gi, group in enumerate(groups):
        specs = specs_of(group)
        what = f"group {gi} ({describe(group)})"
        if any(isinstance(s, MambaSpec) for s in specs):
            raise Refused(
                f"its KV cache groups include Mamba/SSM state, {what}: recurrent state held "
                "once per request rather than per token, which kvtier's chunks of tokens "
                "cannot store or restore"
            )
        for attr in ("host_resident",):
            if getattr(group, attr, False):
                raise Refused(f"{what} is host-resident (HiSparse), which kvtier cannot move")
        if getattr(group, "enable_kv_transfer", True) is False:
            raise Refused(f"{what} is kept out of KV transfers by vLLM")
        sizes = {getattr(s, "block_size", None) for s in specs}
        if sizes != {block_size}:
            raise Refused(
                f"{what} has blocks of {sorted(map(str, sizes))} tokens, not the engine's "
                f"{block_size}: kvtier's chunks need one block size across groups"
            )
        if all(isinstance(s, SlidingWindowSpec) for s in specs):
            windows = {s.sliding_window + int(getattr(s, "extra_retained_tokens", 0) or 0)
                       for s in specs}
            if len(windows) != 1:
                raise Refused(f"{what} mixes sliding windows {sorted(windows)}")
            window = windows.pop()
            out.append(KVGroup(SLIDING, tuple(group.layer_names),
                               sliding_blocks(window, block_size, bpc), window))
        elif all(type(s) in (FullAttentionSpec, MLAAttentionSpec)
                 and getattr(s, "attention_chunk_size", None) is None for s in specs):
            out.append(KVGroup(FULL, tuple(group.layer_names), bpc))
        else:
            raise Refused(
                f"its KV cache has {len(groups)} groups and {what} is neither full nor "
                "sliding-window attention, the kinds of group kvtier stores"
            )
    return tuple(out)
