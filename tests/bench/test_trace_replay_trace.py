"""``bench/trace_replay.py``'s trace and size choice, without an engine: the trace is
what the planner reads and has the structure it claims (sessions that extend their
earlier prompts, shared system prompts, Zipf-popular documents, a salted tenant)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import trace_replay  # noqa: E402

from kvtier.sizing.trace import Tokenizer, TraceStats, read_trace  # noqa: E402


def test_trace_is_read_by_the_planner_and_has_its_structure(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    shape = trace_replay.QUICK
    n = trace_replay.generate_trace(path, shape)
    stats = TraceStats()
    reqs = list(read_trace(str(path), Tokenizer(None), stats))
    assert stats.bad_lines == 0 and stats.requests == n == len(reqs)
    assert shape.sessions <= n <= shape.sessions * shape.max_turns
    assert all(r.timestamp is not None for r in reqs)
    stamps = [r.timestamp or 0.0 for r in reqs]
    assert stamps == sorted(stamps)
    assert all(
        trace_replay.TOKEN_LO <= t < trace_replay.TOKEN_HI for r in reqs for t in r.token_ids
    )
    salts = Counter(r.cache_salt for r in reqs)
    assert set(salts) == {None, "tenant-b"} and salts[None] > salts["tenant-b"]
    # later turns extend an earlier prompt of the same session (same salt), and not the
    # one right before it only: sessions interleave
    ext = [
        (i, j)
        for j, b in enumerate(reqs)
        for i, a in enumerate(reqs[:j])
        if a.cache_salt == b.cache_salt
        and len(b.token_ids) > len(a.token_ids)
        and b.token_ids[: len(a.token_ids)] == a.token_ids
    ]
    assert len(ext) >= n - shape.sessions
    assert any(j - i > 1 for i, j in ext)
    # the system prompts are shared: few distinct first blocks
    firsts = Counter((r.cache_salt, tuple(r.token_ids[:32])) for r in reqs)
    assert len(firsts) <= 2 * shape.system_prompts
    # every prompt starts with a system prompt; documents follow it with Zipf popularity
    _, systems, docs = trace_replay.corpus(shape)
    by_rank: Counter[int] = Counter()
    for r in reqs:
        sys_p = next(x for x in systems if r.token_ids[: len(x)] == x)
        rest = r.token_ids[len(sys_p) :]
        by_rank.update(i for i, d in enumerate(docs) if rest[: len(d)] == d)
    assert by_rank[0] >= 5 and by_rank[0] > 2 * by_rank[shape.documents // 2]
    # the same seed writes the same trace
    again = tmp_path / "again.jsonl"
    trace_replay.generate_trace(again, shape)
    assert again.read_bytes() == path.read_bytes()


def test_sizes_at_fractions_of_the_range_and_never_below_the_longest_prompt() -> None:
    served = [0, 0, 10, 10, 40, 60, 80, 95, 100]
    assert trace_replay.pick_slots(served, 1) == [4, 5, 7]  # >= 20, 50, 90 of 100
    assert trace_replay.pick_slots(served, 6) == [6, 6, 7]
    assert trace_replay.rate_at(served, 200, 4) == 0.2
    assert trace_replay.rate_at(served, 200, 99) == 0.5


def test_model_per_request_agrees_with_the_planner(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    trace_replay.generate_trace(path, trace_replay.QUICK)
    served, total = trace_replay.planner_served(path, 128)
    k = trace_replay.max_request_chunks(path, 128)
    for slots in (k, 2 * k, 5 * k):
        hits = trace_replay.lru_hits_per_request(path, slots, 128)
        assert sum(hits) == served[min(slots, len(served) - 1)] > 0
    assert total == sum(
        len(json.loads(ln)["prompt_token_ids"]) for ln in path.read_text().splitlines()
    )


def test_hash_id_trace_is_planned_from_its_ids_as_its_tokens_replay(tmp_path: Path) -> None:
    """``--hash-ids``: the planner reads the Mooncake-format lines without their tokens,
    the engine gets each id's tokens (the vocabulary of the tiny model): one curve."""
    hash_trace, tokens = tmp_path / "h.jsonl", tmp_path / "t.jsonl"
    shape = trace_replay.HASH_QUICK
    trace_replay.generate_hash_trace(hash_trace, shape)
    n = trace_replay.expand_trace(hash_trace, tokens, shape.block_size)
    assert n == shape.requests
    served, total = trace_replay.planner_served(hash_trace, 128, shape.block_size)
    assert trace_replay.planner_served(tokens, 128) == (served, total)
    lines = [json.loads(ln) for ln in tokens.read_text().splitlines()]
    assert all(
        trace_replay.TOKEN_LO <= t < trace_replay.TOKEN_HI
        for x in lines
        for t in x["prompt_token_ids"]
    )
    slots = trace_replay.pick_slots(served, trace_replay.max_request_chunks(tokens, 128))
    rates = [trace_replay.rate_at(served, total, s) for s in slots]
    assert all(b - a >= 0.05 for a, b in zip(rates, rates[1:], strict=False)), rates
