"""Engine scenarios for tests/e2e/test_sliding_window_chunks.py: a sliding-window-only
model whose chunks complete after their first blocks left the window, and one-step
lookups whose chunk fails its check at the read.

Loaded by tests/e2e/engine.py through ``KVTIER_TEST_SCENARIO_MODULES``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tests.e2e.engine import (
    build_llm,
    generate,
    index_report,
    ktc,
    kvtier_side,
    register,
    settle,
    shutdown,
    toks,
)

#: S: 4 chunks of 256; U1, U2: what follows it; P: a prompt whose output completes chunk 1
#: in a decode step (300 + 230 tokens: chunk 1 ends at token 512)
S, U1, U2 = toks(1, 1024), toks(2, 257), toks(3, 200)
P, P_DECODE = toks(4, 300), 230
#: kvtier's chunk size here (its default)
CHUNK = 256


def reread(p_out: list[int]) -> list[int]:
    """P and its output up to token 512: its hit ends in chunk 1 (block 15), whose window
    reaches back into chunk 1's first half (blocks 11-14), the blocks vLLM had replaced
    with its null block when the decode step completed the chunk."""
    return (P + p_out)[:512]


def _small_steps(budget: int | None) -> dict[str, Any]:
    """vLLM's token budget per step (a prompt longer than it is prefilled in pieces)."""
    return {} if budget is None else {"max_num_batched_tokens": budget, "max_num_seqs": 4}


@register
def window_reference(model: str, budget: int | None = None) -> dict[str, Any]:
    """vLLM without kvtier: S+U2, then P (decoded), then P's reread split where kvtier's
    is (its first 256 tokens, chunk 0, from vLLM's own prefix cache: the cache emptied
    and those tokens alone sent first), so the two compute the same tokens in the same
    steps (another split rounds bf16 otherwise, near ties included)."""
    llm = build_llm(model, None, **_small_steps(budget))
    b = generate(llm, [S + U2])[0]
    p = generate(llm, [P], max_tokens=P_DECODE, ignore_eos=True)[0]
    again = reread(p["tokens"])
    llm.reset_prefix_cache()
    generate(llm, [again[: CHUNK + 1]], max_tokens=1)
    r = generate(llm, [again])[0]
    return {"b": b, "p": p, "r": r}


@register
def window_writer(model: str, extra: dict[str, Any]) -> dict[str, Any]:
    """kvtier with a directory tier: S+U1 (S's chunks stored and written to the
    directory); P decoded past token 512, vLLM's prefix cache emptied, P's reread (its hit
    from kvtier's host tier as far as kvtier stored P's chunks)."""
    llm = build_llm(model, extra)
    a = generate(llm, [S + U1])[0]
    p = generate(llm, [P], max_tokens=P_DECODE, ignore_eos=True)[0]
    llm.reset_prefix_cache()
    r = generate(llm, [reread(p["tokens"])])[0]
    settle(llm)
    report = index_report(llm)
    shutdown(llm)
    return {"a": a, "p": p, "r": r, "index": report}


class _Said(logging.Handler):
    """What the scheduler says about its lookups at startup (one-step or why not)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "lookups" in msg:
            self.messages.append(msg)


@register
def window_reader(
    model: str, extra: dict[str, Any], budget: int, policy: str = "recompute", spoil_chunk: int = 3
) -> dict[str, Any]:
    """A new engine under ``kv_load_failure_policy`` ``policy`` (``recompute``: where kvtier
    allows it, lookups on a local directory are answered in their own step) and chunked
    prefill (``budget`` tokens a step): S+U2. Chunk ``spoil_chunk`` of S is spoiled on
    disk as the worker is about to read it (after a one-step lookup's ``stat`` found it
    whole): the read rejects it."""
    from kvtier.objects.remote import RemoteIO
    from kvtier.ops import GetRun

    spoiled: list[str] = []
    submit = RemoteIO.submit

    def spoiling(self, ops):  # type: ignore[no-untyped-def]
        for op in ops:
            if isinstance(op, GetRun) and not spoiled and len(op.gets) > spoil_chunk:
                path = Path(self.tier.path(op.gets[spoil_chunk][1]))
                data = bytearray(path.read_bytes())
                for i in range(256, len(data) - 256, 97):  # every block of its KV
                    data[i] ^= 0xFF
                path.write_bytes(bytes(data))
                spoiled.append(str(path))
        return submit(self, ops)

    RemoteIO.submit = spoiling  # type: ignore[method-assign]
    said = _Said()
    logging.getLogger("kvtier.scheduler").addHandler(said)
    llm = build_llm(
        model,
        None,
        kv_transfer_config={
            **ktc(extra),
            "kv_load_failure_policy": policy,
        },
        **_small_steps(budget),
    )
    side = kvtier_side(llm)
    b = generate(llm, [S + U2])[0]
    settle(llm)
    return {
        "b": b,
        "index": index_report(llm),
        "one_step": side.lookups.probe is not None,
        "lookup_log": said.messages,
        "spoiled": spoiled,
    }
