"""The generated traces of bench/trace_replay.py: multi-turn chat sessions as token ids
(:class:`TraceShape`), and Mooncake-format hash-id traces (:class:`HashTraceShape`) with
their expansion into the tokens an engine is sent. Seeded: the same shape writes the
same file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: token ids the tiny model's tokenizer knows (vLLM refuses ids past its vocabulary)
TOKEN_LO, TOKEN_HI = 5, 480


@dataclass(frozen=True, slots=True)
class TraceShape:
    """What the generated trace looks like (token counts are prompt tokens)."""

    sessions: int = 120
    max_turns: int = 3
    #: sessions in progress at once: their turns interleave in the trace
    concurrent: int = 20
    system_prompts: int = 4
    system_tokens: tuple[int, int] = (100, 250)
    documents: int = 80
    doc_tokens: tuple[int, int] = (100, 300)
    #: Zipf exponent of document popularity (rank r drawn with weight r ** -zipf)
    zipf: float = 1.1
    #: share of sessions that ask about a document
    doc_share: float = 0.8
    user_tokens: tuple[int, int] = (20, 120)
    answer_tokens: tuple[int, int] = (20, 80)
    #: share of sessions under a tenant's cache_salt (its system prompt is not shared
    #: with the unsalted sessions)
    salted_share: float = 0.25
    seed: int = 0


#: what tests/e2e/test_trace_replay.py replays: about 85 requests, 46k prompt tokens
QUICK = TraceShape(sessions=40, concurrent=12, system_prompts=3, documents=30)


def _tokens(rng: random.Random, lo_hi: tuple[int, int]) -> list[int]:
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(rng.randint(*lo_hi))]


def corpus(shape: TraceShape) -> tuple[random.Random, list[list[int]], list[list[int]]]:
    """The seeded generator, the system prompts and the documents (by popularity rank)."""
    rng = random.Random(shape.seed)
    systems = [_tokens(rng, shape.system_tokens) for _ in range(shape.system_prompts)]
    docs = [_tokens(rng, shape.doc_tokens) for _ in range(shape.documents)]
    return rng, systems, docs


def generate_trace(path: Path, shape: TraceShape) -> int:
    """Write the trace as JSONL; returns the number of requests."""
    rng, systems, docs = corpus(shape)
    weights = [(r + 1) ** -shape.zipf for r in range(shape.documents)]
    started, ts, lines = 0, 0.0, []
    active: list[dict[str, Any]] = []
    while started < shape.sessions or active:
        while started < shape.sessions and len(active) < shape.concurrent:
            doc = rng.choices(docs, weights)[0] if rng.random() < shape.doc_share else []
            active.append(
                {
                    "history": systems[rng.randrange(len(systems))] + doc,
                    "turns": rng.randint(1, shape.max_turns),
                    "salt": "tenant-b" if rng.random() < shape.salted_share else None,
                }
            )
            started += 1
        s = active[rng.randrange(len(active))]
        prompt = s["history"] + _tokens(rng, shape.user_tokens)
        ts += rng.expovariate(2.0)
        line: dict[str, Any] = {"timestamp": round(ts, 3), "prompt_token_ids": prompt}
        if s["salt"]:
            line["cache_salt"] = s["salt"]
        lines.append(json.dumps(line))
        # the next turn's prompt: this one, the answer, then the next user message
        s["history"] = prompt + _tokens(rng, shape.answer_tokens)
        s["turns"] -= 1
        if not s["turns"]:
            active.remove(s)
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


@dataclass(frozen=True, slots=True)
class HashTraceShape:
    """A Mooncake-format trace (``timestamp`` in ms, ``input_length``, ``output_length``,
    ``hash_ids`` of ``block_size``-token blocks): multi-turn sessions that extend their
    earlier prompts, behind a few shared system prompts. The default has the size of
    Mooncake's conversation trace: 12,000 requests, about 145M prompt tokens."""

    requests: int = 12_000
    block_size: int = 512
    #: sessions in progress at once: their turns interleave in the trace
    concurrent: int = 60
    system_prompts: int = 8
    system_tokens: tuple[int, int] = (1_000, 6_000)
    first_user_tokens: tuple[int, int] = (1_500, 9_500)
    #: tokens added per turn (the answer and the next user message)
    turn_tokens: tuple[int, int] = (300, 3_000)
    max_turns: int = 8
    output_tokens: tuple[int, int] = (50, 600)
    #: mean gap between requests, ms
    gap_ms: float = 300.0
    seed: int = 0


#: the hash-id replay of `make bench-trace` (``--hash-ids``): Mooncake-format lines with
#: 32-token blocks (the engine's block size), prompts the tiny model takes
HASH_REPLAY = HashTraceShape(
    requests=240,
    block_size=32,
    concurrent=16,
    system_prompts=4,
    system_tokens=(64, 320),
    first_user_tokens=(40, 240),
    turn_tokens=(20, 120),
    max_turns=5,
    output_tokens=(1, 8),
    gap_ms=400.0,
)
#: what tests/e2e/test_trace_replay.py replays with ``--quick --hash-ids``
HASH_QUICK = HashTraceShape(
    requests=60,
    block_size=32,
    concurrent=8,
    system_prompts=3,
    system_tokens=(64, 256),
    first_user_tokens=(40, 200),
    turn_tokens=(20, 100),
    max_turns=4,
    output_tokens=(1, 4),
    gap_ms=200.0,
)


def expand_trace(hash_trace: Path, path: Path, block_size: int) -> int:
    """The hash-id trace as the engine sees it: each id as the tokens ``kvtier bench
    --trace`` sends for it (:func:`kvtier.sizing.trace.block_tokens`, in the tiny model's
    vocabulary), timestamps in seconds; returns the number of requests."""
    from kvtier.sizing.trace import TraceFormat, expand_tokens, parse_line

    lines = []
    for ln in hash_trace.read_text().splitlines():
        req = parse_line(ln, None, TraceFormat(block_size=block_size))
        lines.append(
            json.dumps(
                {
                    "timestamp": req.timestamp,
                    "prompt_token_ids": expand_tokens(req, TOKEN_LO, TOKEN_HI),
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def generate_hash_trace(path: Path, shape: HashTraceShape) -> int:
    """Write the trace as JSONL; returns the number of prompt tokens. A session's next
    prompt is its last one plus new tokens: its full blocks keep their ids, the partial
    last block and everything after get new ones (Mooncake's ids are prefix-chained)."""
    rng = random.Random(f"kvtier-hash-trace:{shape.seed}")
    bs = shape.block_size
    next_id = 0

    def new_ids(k: int) -> list[int]:
        nonlocal next_id
        next_id += k
        return list(range(next_id - k, next_id))

    systems = []
    for _ in range(shape.system_prompts):
        n = rng.randint(*shape.system_tokens) // bs * bs  # whole blocks: shared as such
        systems.append((n, new_ids(n // bs)))
    active: list[dict[str, Any]] = []
    ts, total = 0.0, 0
    with path.open("w") as f:
        for _ in range(shape.requests):
            while len(active) < shape.concurrent:
                n_sys, ids_sys = systems[rng.randrange(len(systems))]
                active.append(
                    {
                        "full": list(ids_sys),
                        "n": n_sys + rng.randint(*shape.first_user_tokens),
                        "turns": rng.randint(1, shape.max_turns),
                    }
                )
            s = active[rng.randrange(len(active))]
            n, full = s["n"], s["full"]
            need = -(-n // bs)
            full += new_ids(n // bs - len(full))  # new whole blocks
            ids = full + new_ids(need - len(full))  # and the partial last one
            ts += rng.expovariate(1.0 / shape.gap_ms)
            f.write(
                json.dumps(
                    {
                        "timestamp": int(ts),
                        "input_length": n,
                        "output_length": rng.randint(*shape.output_tokens),
                        "hash_ids": ids,
                    },
                    separators=(",", ":"),
                )
                + "\n"
            )
            total += n
            s["n"] = n + rng.randint(*shape.turn_tokens)
            s["turns"] -= 1
            if not s["turns"]:
                active.remove(s)
    return total
