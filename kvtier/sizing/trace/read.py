"""Reading a request trace for ``kvtier size --trace``: one JSON object a line, as
token ids, a text prompt, chat messages or Mooncake/Bailian hash ids, streamed with
its bad lines counted (:func:`read_trace`), and hash ids expanded to the tokens
``kvtier bench --trace`` sends for them.

Every length a line gives is bounded before anything is built from it: the line itself
(:data:`MAX_LINE_BYTES`), its prompt however it is given (token ids, the tokens of a text
or chat prompt, ``input_length``, or ``hash_ids`` times the block size when the line has
no ``input_length``: :data:`MAX_INPUT_LENGTH`) and its ``output_length``. A line over a
bound is a bad line, counted in :attr:`TraceStats.over_cap` as well: a few bytes of hash
ids must not become a hundred million tokens to key or send."""

from __future__ import annotations

import json
import math
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


class TraceError(Exception):
    """The trace cannot be read at all (missing file, no tokenizer for text prompts)."""


#: the trace formats ``--trace-format`` names; ``auto`` tells them apart line by line
TRACE_FORMATS = ("auto", "tokens", "text", "messages", "mooncake", "bailian")
#: tokens per hash id when ``--trace-block-size`` is not given: Mooncake's FAST'25 traces
#: hash 512-token blocks, the Qwen/Bailian traces 16-token blocks
HASH_BLOCK_SIZE = {"mooncake": 512, "bailian": 16}
#: the fields that tell a Bailian line from a Mooncake one (both have ``hash_ids``)
BAILIAN_FIELDS = ("chat_id", "parent_chat_id", "turn")
#: hash ids are chained through Python's int hash, exact below this bound (2**61 - 1)
MAX_HASH_ID = 2**61 - 2
#: longest prompt a line may have, in tokens, however it is given (token ids, a text or
#: chat prompt, ``input_length``, or hash ids x block size): longer than any model's
#: context; a hash-id line's keys are made from it, not read from the line
MAX_INPUT_LENGTH = 2**24
MAX_TRACE_BLOCK_SIZE = 2**20
#: longest line read, in bytes: a longer one is skipped unread (a bad line), so one line
#: without a newline cannot hold the whole file in memory
MAX_LINE_BYTES = 2**28


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
    return (
        f"--chunk-size {chunk_size} and the trace's {trace_block_size}-token hash blocks: "
        "one must be a multiple of the other (a chunk is a run of whole trace blocks, or "
        "a trace block whole chunks); the trace says nothing of which tokens two blocks "
        "with different ids share, so a chunk cannot straddle a block boundary"
    )


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
    #: bad lines dropped for a length over a bound (prompt, output or line bytes)
    over_cap: int = 0
    #: the earliest and latest timestamps (a trace's lines need not be in time order)
    min_timestamp: float | None = None
    max_timestamp: float | None = None

    def bad(self, lineno: int, reason: str, over_cap: bool = False) -> None:
        self.bad_lines += 1
        self.over_cap += over_cap
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
            ts = req.timestamp
            self.min_timestamp = ts if self.min_timestamp is None else min(self.min_timestamp, ts)
            self.max_timestamp = ts if self.max_timestamp is None else max(self.max_timestamp, ts)

    @property
    def format(self) -> str | None:
        """The trace's format; "mixed" when its lines differ."""
        if not self.formats:
            return None
        return next(iter(self.formats)) if len(self.formats) == 1 else "mixed"


class _BadLine(ValueError):
    pass


class _OverCap(_BadLine):
    """A bad line whose prompt, output or bytes are over a bound (counted apart)."""


def _prompt_cap(n: int, what: str) -> None:
    """Refuse a prompt of ``n`` tokens over :data:`MAX_INPUT_LENGTH` before it is built."""
    if n > MAX_INPUT_LENGTH:
        raise _OverCap(
            f"{what} is {n} tokens, over the {MAX_INPUT_LENGTH}-token bound on one prompt"
        )


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
    if isinstance(v, list):
        _prompt_cap(len(v), "prompt_token_ids")
    if not isinstance(v, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in v
    ):
        raise _BadLine("prompt_token_ids is not a list of integers in [0, 2**63)")
    return v


def _count(obj: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    v = obj.get(name)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        bad = _OverCap if isinstance(v, int) and not isinstance(v, bool) and v > hi else _BadLine
        raise bad(f"{name} is not an integer in [{lo}, {hi}]")
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


def _hash_line(
    obj: dict[str, Any], flavour: str, form: TraceFormat, salt: str | None
) -> TraceRequest:
    """A Mooncake or Bailian line: ``hash_ids`` of ``block_size``-token blocks."""
    bs = form.hash_block_size(flavour)
    ids = obj.get("hash_ids")
    if isinstance(ids, list):  # at least one token an id, whatever input_length says
        _prompt_cap(len(ids), "the prompt of hash_ids (a token an id at least)")
    if (
        not isinstance(ids, list)
        or not ids
        or not all(
            isinstance(h, int) and not isinstance(h, bool) and 0 <= h <= MAX_HASH_ID for h in ids
        )
    ):
        raise _BadLine(f"hash_ids is not a non-empty list of integers in [0, {MAX_HASH_ID}]")
    n = _count(obj, "input_length", 1, MAX_INPUT_LENGTH)
    if n is None:
        n = len(ids) * bs  # no length: whole blocks, under the same bound as input_length
        _prompt_cap(n, f"the prompt (no input_length: {len(ids)} hash_ids x {bs} tokens)")
    if -(-n // bs) != len(ids):
        raise _BadLine(
            f"input_length {n} is {-(-n // bs)} blocks of {bs} tokens but the line "
            f"has {len(ids)} hash_ids (is the trace block size {bs}? "
            "--trace-block-size)"
        )
    out = _count(obj, "output_length", 0, MAX_INPUT_LENGTH)
    ts = _timestamp(obj.get("timestamp"))
    if ts is not None and flavour == "mooncake" and not isinstance(obj["timestamp"], str):
        ts /= 1000.0  # Mooncake's timestamps are milliseconds (an ISO 8601 time is a time)
    return TraceRequest([], salt, ts, ids, n, bs, out, flavour)


def parse_line(
    line: str, tokenizer: Tokenizer | None, form: TraceFormat = TraceFormat()
) -> TraceRequest:
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
        if (
            not isinstance(msgs, list)
            or not msgs
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs)
        ):
            raise _BadLine("messages is not a list of {role, content} objects")
        req.messages = msgs
        if tokenizer is not None:
            req.token_ids = tokenizer.chat(msgs)
    _prompt_cap(len(req.token_ids), "the prompt as tokenized")
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
        del req.hash_ids[-(-max_tokens // req.block_size) :]
    else:
        del req.token_ids[max_tokens:]
    return req


def _lines(f: Any, limit: int | None = None) -> Iterator[tuple[bytes | None, int]]:
    """The lines of a binary file with their sizes in bytes; a line longer than ``limit``
    (default :data:`MAX_LINE_BYTES`) is read past in pieces and given as None."""
    limit = MAX_LINE_BYTES if limit is None else limit
    while raw := f.readline(limit + 1):
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield raw, len(raw)
            continue
        size = len(raw)
        del raw
        while (piece := f.readline(1 << 20)) and not piece.endswith(b"\n"):
            size += len(piece)
        yield None, size + len(piece)


def read_trace(
    path: str,
    tokenizer: Tokenizer | None,
    stats: TraceStats,
    progress: bool = False,
    form: TraceFormat = TraceFormat(),
) -> Iterator[TraceRequest]:
    """Stream the requests of a JSONL trace, one line at a time; bad lines go to ``stats``."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; bytes, to count progress exactly
    except OSError as e:
        raise TraceError(f"cannot read the trace: {e}") from e
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=os.fstat(f.fileno()).st_size,
            unit="B",
            unit_scale=True,
            desc="kvtier size --trace",
            file=sys.stderr,
            dynamic_ncols=True,
        )
    try:
        for lineno, (raw, size) in enumerate(_lines(f), 1):
            if bar is not None:
                bar.update(size)
            if raw is None:
                stats.bad(lineno, f"line of more than {MAX_LINE_BYTES} bytes skipped", True)
                continue
            text = raw.decode("utf-8", "replace").strip()
            if not text:
                continue
            try:
                req = parse_line(text, tokenizer, form)
            except _BadLine as e:
                stats.bad(lineno, str(e), isinstance(e, _OverCap))
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
    two requests share a prefix exactly when their hash ids do, as the planner assumes.
    Fewer tokens are a prefix of more: a partial last block needs only its own."""
    rng = random.Random(f"kvtier-trace-block:{hash_id}:{lo}:{hi}")
    return [rng.randrange(lo, hi) for _ in range(block_size)]


def expand_tokens(req: TraceRequest, lo: int = 100, hi: int = 30000) -> list[int]:
    """A hash-id request as token ids (:func:`block_tokens` per id, cut to its length)."""
    if req.hash_ids is None:
        return req.token_ids
    out: list[int] = []
    bs, last = req.block_size, len(req.hash_ids) - 1
    for i, h in enumerate(req.hash_ids):
        out += block_tokens(h, bs if i < last else req.length - last * bs, lo, hi)
    return out
