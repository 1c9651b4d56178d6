"""vLLM's KV cache groups as kvtier stores them (hybrid models, ``SupportsHMA``).

vLLM's hybrid KV cache manager gives each kind of attention its own group, with its own
block table: Gemma 2/3, gpt-oss and Mistral variants get a full-attention group and a
sliding-window group; hybrid models with recurrent state (Mamba2, gated delta-net,
short conv: Granite-4.0-H, Nemotron-H, Qwen3-Next, Jamba, LFM2) a state group beside
their attention. kvtier stores every group of a chunk in one slot under one key
(:class:`kvtier.host.layout.KVGroup`): full-attention groups whole, sliding-window groups only
the chunk's last blocks a hit reads (:func:`kvtier.host.layout.sliding_blocks`), state
groups the chunk's last block, which holds the state at the chunk's end when vLLM runs
them with ``--mamba-cache-mode align``. What it cannot store is refused here with the
reason, before the engine serves anything: state held in any other mode, a model of
recurrent state only, any other kind of group (chunked-local, cross- or encoder-only
attention, groups vLLM keeps out of transfers), or groups whose block sizes differ.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvtier.host.layout import FULL, SLIDING, STATE, KVGroup, sliding_blocks

from .engine_shape import KVCacheShape


class Refused(Exception):
    """Why kvtier cannot serve this KV cache (the connector turns it into a ConfigError)."""


def has_sliding_window(kv_cache: KVCacheShape) -> bool:
    """Whether any KV cache group holds sliding-window attention, the one group of a model
    whose every layer has a window included (kvtier stores that group whole).

    vLLM backs a hit's blocks before the window of its next token with its null block
    and never gives them back. Where a load of the window's blocks fails, vLLM recomputes
    from the first failed block with the window before it unbacked: the recomputed KV
    attends to zeros. So a model with a window gets no load that can fail at the read
    (one-step lookups, :mod:`.one_step_lookups`)."""
    return any(s.sliding for group in kv_cache.groups for s in group.specs)


def kv_groups(kv_cache: KVCacheShape, block_size: int, chunk_size: int) -> tuple[KVGroup, ...]:
    """kvtier's view of a hybrid model's groups; ``()`` for a model of one group (stored
    whole, as kvtier always has: no check of the spec beyond what the connector does).
    Raises :class:`Refused` naming the group kvtier cannot store."""
    groups = kv_cache.groups
    if len(groups) == 1 and any(s.mamba for s in groups[0].specs):
        raise Refused(
            f"its only KV cache group holds recurrent (Mamba/SSM) state "
            f"({groups[0].describe()}): "
            "a model without attention layers; kvtier stores recurrent state beside "
            "attention KV (hybrid models), vLLM's own prefix cache serves this one"
        )
    if len(groups) <= 1:
        return ()
    bpc = chunk_size // block_size
    out: list[KVGroup] = []
    for gi, group in enumerate(groups):
        specs = group.specs
        what = f"group {gi} ({group.describe()})"
        if any(s.mamba for s in specs):
            modes = {s.state_mode for s in specs}
            if modes != {"align"} or not all(s.mamba for s in specs):
                raise Refused(
                    f"its KV cache groups include Mamba/SSM state, {what}, held with "
                    f"mamba_cache_mode {sorted(map(str, modes))}: kvtier stores a chunk's "
                    "state at the chunk's end, which vLLM keeps only with "
                    "--mamba-cache-mode align (and prefix caching on)"
                )
        if group.host_resident:
            raise Refused(f"{what} is host-resident (HiSparse), which kvtier cannot move")
        if not group.transfers:
            raise Refused(f"{what} is kept out of KV transfers by vLLM")
        sizes = {s.block_size for s in specs}
        if sizes != {block_size}:
            raise Refused(
                f"{what} has blocks of {sorted(map(str, sizes))} tokens, not the engine's "
                f"{block_size}: kvtier's chunks need one block size across groups"
            )
        if all(s.mamba for s in specs):
            # the state at the chunk's end: vLLM keeps it in the block that ends there
            states = {s.states for s in specs}
            if len(states) != 1:
                raise Refused(f"{what} mixes state layouts {sorted(map(str, states))}")
            out.append(KVGroup(STATE, group.layer_names, 1, states=states.pop()))
        elif all(s.sliding for s in specs):
            windows = {s.window for s in specs if s.window is not None}
            if len(windows) != 1:
                raise Refused(f"{what} mixes sliding windows {sorted(windows)}")
            window = windows.pop()
            out.append(
                KVGroup(SLIDING, group.layer_names, sliding_blocks(window, block_size, bpc), window)
            )
        elif all(s.full for s in specs):
            out.append(KVGroup(FULL, group.layer_names, bpc))
        else:
            raise Refused(
                f"its KV cache has {len(groups)} groups and {what} is neither full nor "
                "sliding-window attention, the kinds of group kvtier stores"
            )
    return tuple(out)


def flatten_states(
    kv_caches: dict[str, Any], groups: tuple[KVGroup, ...]
) -> tuple[dict[str, Any], tuple[KVGroup, ...]]:
    """vLLM's registered KV caches with a layer given as a list of state tensors (a Mamba
    layer's conv and SSM state, as vLLM's GPU runner hands them) as one entry per tensor,
    ``name#i``, and ``groups`` naming those entries. vLLM's CPU runner hands a Mamba
    layer as one tensor of its state bytes per block: kept as it is."""
    out: dict[str, Any] = {}
    parts: dict[str, tuple[str, ...]] = {}
    for name, kv in kv_caches.items():
        if isinstance(kv, (list, tuple)):
            parts[name] = tuple(f"{name}#{i}" for i in range(len(kv)))
            out.update(zip(parts[name], kv, strict=True))
        else:
            out[name] = kv
    if not parts:
        return out, groups
    return out, tuple(
        dataclasses.replace(g, layers=tuple(n for m in g.layers for n in parts.get(m, (m,))))
        for g in groups
    )
