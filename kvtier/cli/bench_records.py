"""What the bench client (:mod:`kvtier.cli.bench`) hands its report
(:mod:`kvtier.cli.bench_report`): each request's result and the prompt-token scale.
Both modules import these from here, and neither imports the other's caller."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RequestResult", "TokenScale"]


@dataclass(frozen=True, slots=True)
class TokenScale:
    """Tokens of a prompt = ``lead`` (BOS + :data:`kvtier.cli.bench.LEAD_WORD`) +
    ``per_word`` x other words."""

    per_word: float = 1.0
    lead: float = 1.0


@dataclass(slots=True)
class RequestResult:
    """What one streamed completion did, as the client saw it."""

    session: int
    turn: int
    start_s: float
    ok: bool = False
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    text: str = ""
    prompt: str = ""
    #: trace replay: when the trace says it was due (s since the start), None otherwise
    due_s: float | None = None
