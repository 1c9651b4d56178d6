"""Hit-rate curves from a request trace: ``kvtier size --model M --trace FILE``.

An operator buying host RAM and object storage needs "what hit rate does each size
give for *my* traffic", not a guess of warm sessions. kvtier's keys are a pure
function of the prompt tokens, so one pass over a trace answers it for every size at
once: vLLM's GPU prefix cache is simulated in front (block LRU, a fixed size), and the
chunk keys it does not serve are run through an LRU stack (Mattson's stack distances,
depths counted with a Fenwick tree), which gives the hit rate of every LRU tier size
from one histogram.

Keys are made as the connector makes them: :func:`kvtier.keys.token_block_hashes`
builds vLLM's chain of block hashes (tokens, parent, ``cache_salt``) and
:func:`kvtier.keys.chunk_block_hashes` — the very function the connector calls —
cuts it into chunks. Hits follow the scheduler's rules: the last prompt token is
always computed, vLLM's own hit comes first, kvtier serves the run of chunks after it
up to the first chunk it lacks, and every full chunk of a prompt is then stored or
touched in order.

Memory is bounded: the trace is streamed line by line, the GPU model holds at most
its own size, and the stack tracks at most ``max_chunks`` keys (deeper keys count as
misses at every size, so the curve is exact up to that many chunks).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kvtier.keys import chunk_block_hashes, token_block_hashes

#: kvtier's host slots are aligned to this many bytes (kvtier.layout.SLOT_ALIGN; that
#: module imports torch, which `kvtier size` must not)
SLOT_ALIGN = 4096
DEFAULT_MAX_CHUNKS = 1 << 20
CURVE_POINTS = 40


class TraceError(Exception):
    """The trace cannot be read at all (missing file, no tokenizer for text prompts)."""


# ------------------------------------------------------------------------- reading


#: the trace formats ``--trace-format`` names; ``auto`` tells them apart line by line
TRACE_FORMATS = ("auto", "tokens", "text", "messages", "mooncake", "bailian")
#: tokens per hash id when ``--trace-block-size`` is not given: Mooncake's FAST'25 traces
#: hash 512-token blocks, the Qwen/Bailian traces 16-token blocks
HASH_BLOCK_SIZE = {"mooncake": 512, "bailian": 16}
#: the fields that tell a Bailian line from a Mooncake one (both have ``hash_ids``)
BAILIAN_FIELDS = ("chat_id", "parent_chat_id", "turn")
#: hash ids are chained through Python's int hash, exact below this bound (2**61 - 1)
MAX_HASH_ID = 2**61 - 2
#: longest prompt a hash-id line may claim (its keys are made, not read from the line)
MAX_INPUT_LENGTH = 2**24
MAX_TRACE_BLOCK_SIZE = 2**20


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace: the token ids vLLM would see, or a hash-id line's blocks.

    A hash-id line (Mooncake, Bailian) has ``hash_ids``: one id per ``block_size`` tokens
    of its prompt of ``length`` tokens, the last block possibly partial; ``token_ids`` is
    then empty. Text and chat lines read without a tokenizer (``kvtier bench --trace``)
    keep ``text`` or ``messages`` and no token ids.
    """

    token_ids: list[int]
    cache_salt: str | None = None
    timestamp: float | None = None
    hash_ids: list[int] | None = None
    length: int = 0
    block_size: int = 0
    output_length: int | None = None
    fmt: str = "tokens"
    text: str | None = None
    messages: list[dict[str, Any]] | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.length if self.hash_ids is not None else len(self.token_ids)


@dataclass(frozen=True, slots=True)
class TraceFormat:
    """How to read the lines: ``fmt`` one of :data:`TRACE_FORMATS`; ``block_size`` the
    tokens per hash id (None: 512 for Mooncake lines, 16 for Bailian lines)."""

    fmt: str = "auto"
    block_size: int | None = None

    def hash_block_size(self, flavour: str) -> int:
        return self.block_size or HASH_BLOCK_SIZE[flavour]


def block_size_error(chunk_size: int, trace_block_size: int) -> str | None:
    """Why a kvtier chunk cannot be cut from the trace's blocks, or None when it can."""
    if chunk_size % trace_block_size == 0 or trace_block_size % chunk_size == 0:
        return None
    return (f"--chunk-size {chunk_size} and the trace's {trace_block_size}-token hash blocks: "
            "one must be a multiple of the other (a chunk is a run of whole trace blocks, or "
            "a trace block whole chunks); the trace says nothing of which tokens two blocks "
            "with different ids share, so a chunk cannot straddle a block boundary")


@dataclass(slots=True)
class TraceStats:
    """What the reader saw: good and bad lines, with the first few reasons."""

    requests: int = 0
    bad_lines: int = 0
    bad_examples: list[str] = field(default_factory=list)
    first_timestamp: float | None = None
    last_timestamp: float | None = None
    #: good lines by format, and the tokens per hash id seen
    formats: dict[str, int] = field(default_factory=dict)
    block_sizes: set[int] = field(default_factory=set)
    output_tokens: int = 0
    #: good lines that gave an ``output_length``
    output_known: int = 0

    def bad(self, lineno: int, reason: str) -> None:
        self.bad_lines += 1
        if len(self.bad_examples) < 5:
            self.bad_examples.append(f"line {lineno}: {reason}")

    def good(self, req: TraceRequest) -> None:
        self.requests += 1
        self.formats[req.fmt] = self.formats.get(req.fmt, 0) + 1
        if req.hash_ids is not None:
            self.block_sizes.add(req.block_size)
        if req.output_length is not None:
            self.output_tokens += req.output_length
            self.output_known += 1
        if req.timestamp is not None:
            if self.first_timestamp is None:
                self.first_timestamp = req.timestamp
            self.last_timestamp = req.timestamp

    @property
    def format(self) -> str | None:
        """The trace's format; "mixed" when its lines differ."""
        if not self.formats:
            return None
        return next(iter(self.formats)) if len(self.formats) == 1 else "mixed"


class _BadLine(ValueError):
    pass


class Tokenizer:
    """The model's tokenizer, loaded on the first text prompt (token-id traces need none)."""

    def __init__(self, source: str | None) -> None:
        self.source = source
        self._tok: Any = None

    def _get(self) -> Any:
        if self._tok is None:
            if not self.source:
                raise TraceError("the trace has text prompts; pass --tokenizer or a model dir")
            try:
                from transformers import AutoTokenizer

                self._tok = AutoTokenizer.from_pretrained(self.source)
            except Exception as e:  # noqa: BLE001 - any loader failure means the same thing
                raise TraceError(f"cannot load the tokenizer from {self.source}: {e}") from e
        return self._tok

    def prompt(self, text: str) -> list[int]:
        """As vLLM's /v1/completions tokenizes: with the tokenizer's special tokens (BOS)."""
        return list(self._get()(text, add_special_tokens=True)["input_ids"])

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """As vLLM's /v1/chat/completions: the chat template rendered to text (with the
        generation prompt), then tokenized without adding special tokens again."""
        tok = self._get()
        if not getattr(tok, "chat_template", None):
            raise TraceError(f"the tokenizer of {self.source} has no chat template")
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template error is this line's fault
            raise _BadLine(f"chat template failed: {e}") from e
        return list(tok(text, add_special_tokens=False)["input_ids"])


#: token ids vLLM can hold (int64); msgpack and the tokenizer refuse larger ones
MAX_TOKEN_ID = 2**63 - 1


def _timestamp(v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool):
        raise _BadLine("timestamp is not a number or ISO 8601 time")
    if isinstance(v, int | float):
        try:
            f = float(v)  # an int of hundreds of digits does not fit a float
        except OverflowError:
            raise _BadLine("timestamp is out of range") from None
        if math.isfinite(f):
            return f
        raise _BadLine("timestamp is out of range")
    if isinstance(v, str):
        try:
            return datetime.fromisoformat(v).timestamp()
        except ValueError:
            pass
    raise _BadLine("timestamp is not a number or ISO 8601 time")


def _token_ids(v: Any) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                          and 0 <= t <= MAX_TOKEN_ID for t in v):
        raise _BadLine("prompt_token_ids is not a list of integers in [0, 2**63)")
    return v


def _count(obj: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    v = obj.get(name)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise _BadLine(f"{name} is not an integer in [{lo}, {hi}]")
    return v


def _detect(obj: dict[str, Any]) -> str:
    if "hash_ids" in obj:
        return "bailian" if any(k in obj for k in BAILIAN_FIELDS) else "mooncake"
    if "prompt_token_ids" in obj:
        return "tokens"
    if "prompt" in obj:
        return "tokens" if isinstance(obj["prompt"], list) else "text"
    if "messages" in obj:
        return "messages"
    raise _BadLine("no prompt_token_ids, prompt, messages or hash_ids")


def _hash_line(obj: dict[str, Any], flavour: str, form: TraceFormat,
               salt: str | None) -> TraceRequest:
    """A Mooncake or Bailian line: ``hash_ids`` of ``block_size``-token blocks."""
    bs = form.hash_block_size(flavour)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not ids or not all(
            isinstance(h, int) and not isinstance(h, bool) and 0 <= h <= MAX_HASH_ID
            for h in ids):
        raise _BadLine(f"hash_ids is not a non-empty list of integers in [0, {MAX_HASH_ID}]")
    n = _count(obj, "input_length", 1, MAX_INPUT_LENGTH)
    if n is None:
        n = len(ids) * bs  # no length: whole blocks
    if -(-n // bs) != len(ids):
        raise _BadLine(f"input_length {n} is {-(-n // bs)} blocks of {bs} tokens but the line "
                       f"has {len(ids)} hash_ids (is the trace block size {bs}? "
                       "--trace-block-size)")
    out = _count(obj, "output_length", 0, MAX_INPUT_LENGTH)
    ts = _timestamp(obj.get("timestamp"))
    if ts is not None and flavour == "mooncake" and not isinstance(obj["timestamp"], str):
        ts /= 1000.0  # Mooncake's timestamps are milliseconds (an ISO 8601 time is a time)
    return TraceRequest([], salt, ts, ids, n, bs, out, flavour)


def parse_line(line: str, tokenizer: Tokenizer | None,
               form: TraceFormat = TraceFormat()) -> TraceRequest:
    """One JSONL line -> a request; raises _BadLine (counted) or TraceError (fatal).

    Without a tokenizer (``kvtier bench --trace`` sends text as it is) text and chat
    lines keep their ``text`` or ``messages`` and no token ids."""
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise _BadLine(f"not JSON ({e.args[0][:60]})") from e
    except RecursionError:  # the decoder recurses once per nesting level
        raise _BadLine("JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise _BadLine("not a JSON object")
    salt = obj.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise _BadLine("cache_salt is not a non-empty string")
    fmt = _detect(obj)
    if form.fmt != "auto" and fmt != form.fmt:
        if {fmt, form.fmt} <= set(HASH_BLOCK_SIZE):
            fmt = form.fmt  # a hash-id line read as the format asked for
        else:
            raise _BadLine(f"a {fmt} line, not {form.fmt} (--trace-format)")
    if fmt in HASH_BLOCK_SIZE:
        return _hash_line(obj, fmt, form, salt)
    ts = _timestamp(obj.get("timestamp"))
    out = _count(obj, "output_length", 0, MAX_INPUT_LENGTH)
    req = TraceRequest([], salt, ts, output_length=out, fmt=fmt)
    if "prompt_token_ids" in obj:
        req.token_ids = _token_ids(obj["prompt_token_ids"])
    elif fmt == "tokens":
        req.token_ids = _token_ids(obj["prompt"])
    elif fmt == "text":
        p = obj["prompt"]
        if not isinstance(p, str):
            raise _BadLine("prompt is neither text nor token ids")
        req.text = p
        if tokenizer is not None:
            req.token_ids = tokenizer.prompt(p)
        elif not p:
            raise _BadLine("empty prompt")
    else:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs
        ):
            raise _BadLine("messages is not a list of {role, content} objects")
        req.messages = msgs
        if tokenizer is not None:
            req.token_ids = tokenizer.chat(msgs)
    if not req.token_ids and tokenizer is not None:
        raise _BadLine("empty prompt")
    if not req.token_ids and fmt == "tokens":
        raise _BadLine("empty prompt")
    return req


def truncate(req: TraceRequest, max_tokens: int) -> TraceRequest:
    """Keep a request's first ``max_tokens`` tokens (in place): a prefix of a prompt is a
    prefix of every prompt that shared it, so shared prefixes stay shared."""
    if req.prompt_tokens <= max_tokens:
        return req
    if req.hash_ids is not None:
        req.length = max_tokens
        del req.hash_ids[-(-max_tokens // req.block_size):]
    else:
        del req.token_ids[max_tokens:]
    return req


def read_trace(path: str, tokenizer: Tokenizer | None, stats: TraceStats,
               progress: bool = False,
               form: TraceFormat = TraceFormat()) -> Iterator[TraceRequest]:
    """Stream the requests of a JSONL trace, one line at a time; bad lines go to ``stats``."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; bytes, to count progress exactly
    except OSError as e:
        raise TraceError(f"cannot read the trace: {e}") from e
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=os.fstat(f.fileno()).st_size, unit="B", unit_scale=True,
                   desc="kvtier size --trace", file=sys.stderr, dynamic_ncols=True)
    try:
        for lineno, raw in enumerate(f, 1):
            if bar is not None:
                bar.update(len(raw))
            text = raw.decode("utf-8", "replace").strip()
            if not text:
                continue
            try:
                req = parse_line(text, tokenizer, form)
            except _BadLine as e:
                stats.bad(lineno, str(e))
                continue
            stats.good(req)
            yield req
    finally:
        f.close()
        if bar is not None:
            bar.close()


def block_tokens(hash_id: int, block_size: int, lo: int = 100, hi: int = 30000) -> list[int]:
    """The tokens ``kvtier bench --trace`` sends for a hash id: ``block_size`` ids in
    [lo, hi), a pure function of the id (string-seeded, so the same in every process), so
    two requests share a prefix exactly when their hash ids do, as the planner assumes."""
    rng = random.Random(f"kvtier-trace-block:{hash_id}:{lo}:{hi}")
    return [rng.randrange(lo, hi) for _ in range(block_size)]


def expand_tokens(req: TraceRequest, lo: int = 100, hi: int = 30000) -> list[int]:
    """A hash-id request as token ids (:func:`block_tokens` per id, cut to its length)."""
    if req.hash_ids is None:
        return req.token_ids
    out: list[int] = []
    for h in req.hash_ids:
        out += block_tokens(h, req.block_size, lo, hi)
    del out[req.length:]
    return out


# ---------------------------------------------------------------------- simulation


def _key(h: bytes) -> int:
    """64 bits of a hash as an int: a quarter of the memory of the bytes object."""
    return int.from_bytes(h[:8], "little")


def hash_id_keys(req: TraceRequest, step: int) -> list[int]:
    """Keys of a hash-id request's prefixes of ``step``, ``2 * step``, ... tokens (its
    full vLLM blocks, or its full chunks), without expanding the tokens.

    A prefix of L tokens is the blocks before the one holding token L and the first
    tokens of that one: its key is the chain of hash ids up to that block (and the line's
    ``cache_salt``) with the offset in it. Two prefixes get one key exactly when their
    tokens are the same, were every id expanded to its own tokens
    (tests/sizing/test_trace_hash_ids.py checks this against :func:`expand_tokens`).
    """
    assert req.hash_ids is not None
    bs = req.block_size
    p = hash(("kvtier-cache-salt", req.cache_salt)) if req.cache_salt else 0
    chain = []
    for h in req.hash_ids:
        p = hash((p, h))
        chain.append(p)
    return [hash((chain[(end - 1) // bs], (end - 1) % bs))
            for end in range(step, req.length + 1, step)]


class GpuPrefixCache:
    """vLLM's prefix cache as a block LRU of ``blocks`` blocks, one request at a time.

    A request hits the longest run of cached blocks from its start (at most up to its
    last token, which vLLM always computes); then all its full blocks are cached. vLLM
    frees a finished request's blocks tail first, so its first block is evicted last:
    blocks are touched in reverse order here for the same effect.
    """

    def __init__(self, blocks: int) -> None:
        self.blocks = max(0, blocks)
        self._lru: OrderedDict[int, None] = OrderedDict()

    def serve(self, keys: list[int], max_blocks: int) -> int:
        """Blocks of this request vLLM's cache already had; then caches all of them."""
        if self.blocks == 0:
            return 0
        hit = 0
        while hit < min(len(keys), max_blocks) and keys[hit] in self._lru:
            hit += 1
        for k in reversed(keys):
            self._lru[k] = None
            self._lru.move_to_end(k)
        while len(self._lru) > self.blocks:
            self._lru.popitem(last=False)
        return hit


class LruStack:
    """Depth of each key in an LRU stack (1 = most recently used), for the ``limit``
    most recent keys; older keys are forgotten, so memory stays bounded.

    Every access gets a new timestamp; a Fenwick tree counts live timestamps, so a
    key's depth is the number of live timestamps at or after its own. Timestamps are
    renumbered when they run out (amortized O(1) per access); the tree grows with the
    keys held, so memory follows the trace's distinct chunks, not ``limit``.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.limit = limit
        self._cap = min(2 * limit + 2, 4096)
        self._tree = array("q", bytes(8 * (self._cap + 1)))
        self._ts: OrderedDict[int, int] = OrderedDict()
        self._next = 1

    def __len__(self) -> int:
        return len(self._ts)

    def _add(self, i: int, delta: int) -> None:
        tree, cap = self._tree, self._cap
        while i <= cap:
            tree[i] += delta
            i += i & -i

    def _prefix(self, i: int) -> int:
        tree, s = self._tree, 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    def depth(self, key: int) -> int | None:
        """Stack depth of ``key`` now, or None if it was never seen (or forgotten)."""
        ts = self._ts.get(key)
        if ts is None:
            return None
        return len(self._ts) - self._prefix(ts - 1)

    def access(self, key: int) -> None:
        """Make ``key`` the most recently used."""
        old = self._ts.pop(key, None)
        if old is not None:
            self._add(old, -1)
        if self._next > self._cap:
            self._compact()
        self._ts[key] = self._next
        self._add(self._next, 1)
        self._next += 1
        if len(self._ts) > self.limit:
            _, ts = self._ts.popitem(last=False)
            self._add(ts, -1)

    def _compact(self) -> None:
        # at least as many free timestamps as live ones after the renumbering
        self._cap = max(self._cap, 2 * len(self._ts) + 2)
        tree = self._tree = array("q", bytes(8 * (self._cap + 1)))
        cap = self._cap
        for i, k in enumerate(self._ts, 1):
            self._ts[k] = i
            tree[i] += 1
            j = i + (i & -i)
            if j <= cap:
                tree[j] += tree[i]
        # the loop above built partial sums only for live positions; finish the rest
        for i in range(len(self._ts) + 1, cap + 1):
            j = i + (i & -i)
            if j <= cap:
                tree[j] += tree[i]
        self._next = len(self._ts) + 1


@dataclass(slots=True)
class Simulation:
    """Totals and the depth histogram of one pass over a trace."""

    block_size: int
    chunk_size: int
    gpu_blocks: int
    max_chunks: int = DEFAULT_MAX_CHUNKS
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0
    #: hit_tokens[d]: prompt tokens a tier of d or more chunks serves beyond vLLM's cache
    #: that a tier of d-1 chunks does not (index 0 unused)
    hit_tokens: array[int] = field(default_factory=lambda: array("q"))
    distinct_chunks: int = 0
    #: full chunks of the longest prompt: below that many slots the model is not exact
    max_request_chunks: int = 0
    _gpu: GpuPrefixCache | None = None
    _stack: LruStack | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.chunk_size % self.block_size:
            raise ValueError("chunk_size must be a multiple of block_size")
        self._gpu = GpuPrefixCache(self.gpu_blocks)
        self._stack = LruStack(self.max_chunks)
        self.hit_tokens = array("q", [0])

    def add(self, req: TraceRequest) -> None:
        """Run one request through vLLM's cache, then through the tier's LRU stack."""
        assert self._gpu is not None and self._stack is not None
        bs, cs = self.block_size, self.chunk_size
        if req.hash_ids is not None:
            n = req.length
            gpu_keys, keys = hash_id_keys(req, bs), hash_id_keys(req, cs)
        else:
            n = len(req.token_ids)
            blocks = token_block_hashes(req.token_ids, bs, req.cache_salt)
            gpu_keys = [_key(h) for h in blocks]
            keys = [_key(h) for h in chunk_block_hashes(blocks, cs // bs)]
        self.prompt_tokens += n
        cap = (n - 1) // bs * bs  # vLLM computes the last prompt token itself
        local = self._gpu.serve(gpu_keys, cap // bs) * bs
        self.gpu_hit_tokens += local
        stack = self._stack
        depths = [stack.depth(k) for k in keys]  # the lookup sees the tier before stores
        deepest = 0
        for c in range(local // cs, len(keys)):
            d = depths[c]
            if c * cs >= cap or d is None:
                break
            deepest = max(deepest, d)
            tokens = min((c + 1) * cs, cap) - max(c * cs, local)
            if tokens > 0:
                while len(self.hit_tokens) <= deepest:
                    self.hit_tokens.extend([0] * max(64, len(self.hit_tokens)))
                self.hit_tokens[deepest] += tokens
        for k in keys:  # every full chunk is then stored or touched, in order
            stack.access(k)
        self.distinct_chunks = max(self.distinct_chunks, len(stack))
        self.max_request_chunks = max(self.max_request_chunks, len(keys))

    def served(self) -> list[int]:
        """served[s]: tokens a tier of s chunks serves beyond vLLM's cache (s = 0..max)."""
        out, total = [0], 0
        for d in range(1, len(self.hit_tokens)):
            total += self.hit_tokens[d]
            out.append(total)
        return out


# ------------------------------------------------------------------------- report


def slot_bytes(kv_bytes_per_token_per_rank: int, chunk_size: int) -> int:
    """Host bytes one chunk takes in one worker's slab (kvtier aligns slots)."""
    n = kv_bytes_per_token_per_rank * chunk_size
    return (n + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


def _sizes(max_chunks: int, points: int = CURVE_POINTS) -> list[int]:
    """Chunk counts from 1 to ``max_chunks``, spaced evenly on a log scale."""
    if max_chunks < 1:
        return []
    out = {1, max_chunks}
    for i in range(points):
        out.add(max(1, round(max_chunks ** (i / (points - 1)))))
    return sorted(out)


def _smallest(served: list[int], need: float) -> int | None:
    """Fewest chunks whose served tokens reach ``need`` (None: never)."""
    lo, hi = 0, len(served) - 1
    if served[hi] < need:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if served[mid] >= need:
            hi = mid
        else:
            lo = mid + 1
    return lo


def report(sim: Simulation, stats: TraceStats, *, path: str, host_slot_bytes: int,
           object_chunk_bytes: int, target: float, host_tier_bytes: int | None,
           gpu_kv_tokens: int, gpu_kv_source: str,
           object_compression: dict[str, Any] | None = None) -> dict[str, Any]:
    """The curves and the recommendation, as ``--json`` prints them.

    ``object_chunk_bytes`` is what one chunk takes in the object tier as stored (after
    ``compression``, described by ``object_compression``: the plan's block of that name);
    host-tier bytes are always raw."""
    served = sim.served()
    total = sim.prompt_tokens
    rate = (lambda t: t / total) if total else (lambda t: 0.0)
    top = len(served) - 1
    # a tier smaller than a prompt's full chunks keeps that prompt's first chunks in the
    # connector (the chunks its own step loads and stores cannot be evicted, the rest are
    # skipped), where the LRU stack keeps its last ones: there the curve is only a model
    longest = sim.max_request_chunks
    host = [{"chunks": s, "bytes": s * host_slot_bytes, "hit_rate": rate(served[s]),
             "below_longest_prompt": s < longest}
            for s in _sizes(top)]
    h_chunks = 0 if host_tier_bytes is None else host_tier_bytes // host_slot_bytes
    h_served = served[min(h_chunks, top)]
    obj = [{"chunks": s, "bytes": s * object_chunk_bytes,
            "hit_rate": rate(served[s] - h_served)}
           for s in _sizes(top) if s > h_chunks]
    need = target * total - sim.gpu_hit_tokens
    host_need = _smallest(served, need)
    obj_need = _smallest(served, need)
    if obj_need is not None and obj_need <= h_chunks:
        obj_need = 0
    dur = None
    if stats.first_timestamp is not None and stats.last_timestamp is not None:
        dur = stats.last_timestamp - stats.first_timestamp
    per_s = (lambda x: x / dur) if dur else (lambda x: None)
    out_tokens = stats.output_tokens if stats.output_known else None
    return {
        "trace": {
            "path": os.path.basename(path),
            "format": stats.format,
            "formats": stats.formats,
            #: tokens per hash id (hash-id traces; None for token, text and chat traces)
            "block_size": (min(stats.block_sizes) if len(stats.block_sizes) == 1
                           else sorted(stats.block_sizes) or None),
            "requests": stats.requests,
            "bad_lines": stats.bad_lines,
            "bad_examples": stats.bad_examples,
            "prompt_tokens": total,
            "output_tokens": out_tokens,
            "duration_s": dur,
            "requests_per_s": per_s(stats.requests),
            "prompt_tokens_per_s": per_s(total),
            "output_tokens_per_s": None if out_tokens is None else per_s(out_tokens),
            "distinct_chunks": sim.distinct_chunks,
            "max_request_chunks": longest,
        },
        "keys": {
            "block_size": sim.block_size, "chunk_size": sim.chunk_size,
            "host_slot_bytes": host_slot_bytes, "object_chunk_bytes": object_chunk_bytes,
            "max_chunks": sim.max_chunks,
            "object_compression": object_compression or {
                "setting": "none", "ratio": 1.0, "ratio_source": "no compression"},
        },
        "gpu_prefix_cache": {
            "tokens": gpu_kv_tokens, "source": gpu_kv_source,
            "hit_rate": rate(sim.gpu_hit_tokens),
        },
        "max_hit_rate": rate(sim.gpu_hit_tokens + served[top]),
        #: from this host-tier size on the curve is exact for requests one at a time
        "host_tier_exact_from_bytes": longest * host_slot_bytes,
        "host_tier": host,
        "object_tier": {"behind_host_bytes": h_chunks * host_slot_bytes, "curve": obj},
        "recommended": {
            "target_hit_rate": target,
            "host_bytes": None if host_need is None else host_need * host_slot_bytes,
            "host_hit_rate": None if host_need is None else rate(served[host_need]),
            "object_bytes": None if obj_need is None else obj_need * object_chunk_bytes,
        },
    }


def _size(n: int | None) -> str:
    if n is None:
        return "unreachable"
    for unit, div in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def _thin(points: list[dict[str, Any]], rows: int = 14) -> list[dict[str, Any]]:
    """At most about ``rows`` points for the text table (the JSON keeps them all)."""
    step = max(1, math.ceil(len(points) / rows))
    out = points[::step]
    return out if not points or out[-1] is points[-1] else [*out, points[-1]]


def _compression_line(c: dict[str, Any] | None) -> list[str]:
    """The object tier's compression, when there is one: setting, ratio and its source."""
    if not c or c["setting"] == "none":
        return []
    return [f"object compression {c['setting']}: stored = {c['ratio']:.4g} x raw "
            f"({c['ratio_source']}); object-tier sizes below are stored bytes"]


def format_report(rep: dict[str, Any]) -> str:
    """The human-readable curves: sizes, hit rates beyond vLLM, and with vLLM's share."""
    t, g, rec = rep["trace"], rep["gpu_prefix_cache"], rep["recommended"]
    lines = [
        f"trace              {t['path']}: {t['requests']} requests, {t['prompt_tokens']} "
        f"prompt tokens, {t['distinct_chunks']} distinct chunks, {t['bad_lines']} bad lines",
    ]
    lines += [f"  bad              {e}" for e in t["bad_examples"]]
    fmt = t.get("format")
    if fmt:
        kind = fmt if fmt != "mixed" else ", ".join(f"{k} {v}" for k, v in t["formats"].items())
        if t.get("block_size"):
            kind += f", {t['block_size']} tokens per hash id"
        lines.append(f"  format           {kind}")
    if t.get("requests_per_s"):
        rate = f"  rate             {t['requests_per_s']:.3g} requests/s over " \
               f"{t['duration_s']:.0f} s, {t['prompt_tokens_per_s']:.4g} prompt tokens/s"
        if t.get("output_tokens_per_s") is not None:
            rate += f", {t['output_tokens_per_s']:.4g} output tokens/s"
        lines.append(rate)
    k = rep["keys"]
    lines += [
        f"chunks             {k['chunk_size']} tokens (blocks of {k['block_size']}); "
        f"{_size(k['host_slot_bytes'])} per worker in the host tier, "
        f"{_size(k['object_chunk_bytes'])} in the object tier",
        *_compression_line(k.get("object_compression")),
        f"vLLM prefix cache  {g['tokens']} tokens ({g['source']}): "
        f"{g['hit_rate'] * 100:.1f} % of prompt tokens",
        f"all reuse          {rep['max_hit_rate'] * 100:.1f} % of prompt tokens come from some "
        f"cache with unbounded tiers",
        "",
        f"{'host tier / worker':>20}  {'beyond vLLM':>11}  {'with vLLM':>9}",
    ]
    for p in _thin(rep["host_tier"]):
        lines.append(f"{_size(p['bytes']):>20}  {p['hit_rate'] * 100:10.1f} %  "
                     f"{(p['hit_rate'] + g['hit_rate']) * 100:8.1f} %"
                     + ("  *" if p.get("below_longest_prompt") else ""))
    if any(p.get("below_longest_prompt") for p in rep["host_tier"]):
        lines.append(f"{'':>20}  * smaller than the longest prompt's chunks "
                     f"({_size(rep['host_tier_exact_from_bytes'])}): kvtier keeps such a "
                     "prompt's first chunks, the model its last; kvtier may serve more")
    ot = rep["object_tier"]
    if ot["curve"]:
        lines += ["", f"{'object tier':>20}  {'beyond host':>11}   (behind a host tier of "
                      f"{_size(ot['behind_host_bytes'])} per worker)"]
        for p in _thin(ot["curve"]):
            lines.append(f"{_size(p['bytes']):>20}  {p['hit_rate'] * 100:10.1f} %")
    lines += [
        "",
        f"target {rec['target_hit_rate'] * 100:.0f} % of prompt tokens from any cache: host tier "
        f"{_size(rec['host_bytes'])} per worker; or object tier {_size(rec['object_bytes'])} "
        f"behind {_size(ot['behind_host_bytes'])}",
    ]
    return "\n".join(lines)


def write_plot(rep: dict[str, Any], path: str) -> None:
    """Hit rate against size for the host tier (per worker) and the object tier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = rep["gpu_prefix_cache"]["hit_rate"] * 100
    target = rep["recommended"]["target_hit_rate"] * 100
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    curves = [("host tier, per worker", rep["host_tier"], gpu),
              ("object tier, behind the host tier", rep["object_tier"]["curve"], None)]
    for ax, (title, pts, base) in zip(axes, curves, strict=True):
        if pts:
            xs = [p["bytes"] / 1024**3 for p in pts]
            ax.plot(xs, [p["hit_rate"] * 100 for p in pts], marker=".", label="beyond vLLM")
            if base is not None:
                ax.plot(xs, [p["hit_rate"] * 100 + base for p in pts], marker=".",
                        label="with vLLM's prefix cache")
                ax.axhline(target, color="grey", ls="--", lw=0.8, label="target")
                exact = rep.get("host_tier_exact_from_bytes", 0) / 1024**3
                if exact > xs[0]:
                    ax.axvspan(xs[0], exact, color="grey", alpha=0.12,
                               label="smaller than the longest prompt (model only)")
            ax.set_xscale("log")
            ax.legend(fontsize=8)
        ax.set_ylim(-2, 102)
        ax.set_xlabel("size (GiB)")
        ax.set_ylabel("prompt tokens served (%)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    t = rep["trace"]
    fig.suptitle(f"kvtier size --trace {t['path']}: {t['requests']} requests, vLLM prefix "
                 f"cache {gpu:.1f} %", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plan_trace(path: str, *, tokenizer: str | None, block_size: int, chunk_size: int,
               gpu_kv_tokens: int, max_chunks: int = DEFAULT_MAX_CHUNKS,
               progress: bool = False,
               on_request: Callable[[TraceRequest], None] | None = None,
               form: TraceFormat = TraceFormat(),
               max_input_tokens: int | None = None,
               ) -> tuple[Simulation, TraceStats]:
    """One streamed pass over a trace file (prompts cut to ``max_input_tokens`` as
    ``kvtier bench --trace`` cuts them). A hash block size that does not fit the chunk
    size is a :class:`TraceError`."""
    stats = TraceStats()
    sim = Simulation(block_size, chunk_size, gpu_kv_tokens // block_size, max_chunks)
    checked: set[int] = set()
    for req in read_trace(path, Tokenizer(tokenizer), stats, progress, form):
        if req.hash_ids is not None and req.block_size not in checked:
            if err := block_size_error(chunk_size, req.block_size):
                raise TraceError(err)
            checked.add(req.block_size)
        if max_input_tokens is not None:
            truncate(req, max_input_tokens)
        sim.add(req)
        if on_request is not None:
            on_request(req)
    return sim, stats
