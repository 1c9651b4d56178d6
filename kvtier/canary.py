"""Hits checked against the model: whether a generation's stored KV is this engine's KV.

Checksums, signatures and the identity in every key protect a chunk against corruption,
forgery and the weight changes kvtier can see, not against a *wrong name*: a pinned
``model_fingerprint`` that was not bumped when the weights changed, weights that reach
vLLM some way kvtier cannot fingerprint, a kernel or layout change. Then a chunk that
passes every check is the KV of other weights. The canary catches that by comparing
what vLLM computed for a prefix with what the tier holds under its name.

Two pure parts, no vLLM (the connector wires them, :mod:`kvtier.connectors.scheduler.canary`):

- :func:`compare_chunk`: the metric. Per layer, the largest absolute difference between
  the computed and the stored KV, divided by the largest magnitude of the stored layer
  (so it is scale-free and never divides by a tiny element); a chunk matches when every
  layer's error is at most :data:`TOLERANCE`. Same weights in another batch shape differ
  by float rounding (about 1e-2 of the layer's range in bf16, far less in fp32); other
  weights differ by the layer's whole range (about 1 and above).
- :class:`GenerationTrust`: one engine's trust in its generation (UNKNOWN until the
  workers said whether this engine's claim of it won, then TRUSTED as its first writer,
  or CHECKING until computed chunks of ``canary_check_tokens`` tokens in all matched the
  stored ones, or REFUSED after a mismatch), and the sample of later hits recomputed
  (``canary_rate``). One chunk is thin evidence: weights that differ only on some tokens
  (an added token's embedding row, a LoRA on a few modules) can match on one chunk and
  not on the next.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.metrics import CANARY_RESULTS

#: largest per-layer error (max |computed - stored| / max |stored|) that still matches:
#: the same weights in other batch shapes stay below 0.05 on the CPU build (bf16 and fp32,
#: measured: see the report in the README), other weights are above 0.5; fp8 KV caches and
#: ``compression: fp8`` round each element by at most 1/16 of its own magnitude, also below
TOLERANCE = 0.1

#: what a check can find (the ``outcome`` label of ``kvtier:canary_checks``): the stored chunk
#: matched or did not; "absent": the tier does not hold it (nothing to compare, keep
#: waiting for a hit); "error": it could not be read or verified, or the computed chunk
#: was not stored (try again on another chunk)
MATCH, MISMATCH, ABSENT, ERROR = CANARY_RESULTS
RESULTS = CANARY_RESULTS
#: a checking engine whose checks found the stored chunk absent for this many requests in a
#: row (a request's first checked chunk counts: its other chunks are absent with it, a
#: prompt no engine stored) tries to claim its generation afresh
#: (:func:`kvtier.objects.manifest.reclaim_generation`: won only if the generation holds no
#: chunk and no engine that trusts it is alive)
RECLAIM_AFTER = 3
#: ``canary_check_tokens``' default: 4 chunks of the default 256-token ``chunk_size``
CHECK_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class Comparison:
    """Per-layer errors of a computed chunk against the stored one."""

    errors: tuple[float, ...]
    tolerance: float = TOLERANCE

    @property
    def worst_layer(self) -> int:
        """The layer with the largest error (-1 for a chunk of no layers)."""
        if not self.errors:
            return -1
        return max(range(len(self.errors)), key=lambda i: _order(self.errors[i]))

    @property
    def worst(self) -> float:
        return self.errors[self.worst_layer] if self.errors else 0.0

    @property
    def matches(self) -> bool:
        return all(not math.isnan(e) and e <= self.tolerance for e in self.errors)

    @property
    def result(self) -> str:
        return MATCH if self.matches else MISMATCH


def _order(e: float) -> float:
    return math.inf if math.isnan(e) else e


def layer_error(computed: torch.Tensor, stored: torch.Tensor) -> float:
    """max |computed - stored| / max |stored| over one layer (as float32). A layer whose
    stored values are all zero errs by the computed layer's largest magnitude; a shape
    mismatch or a non-finite value anywhere is an infinite error (never a match)."""
    if computed.shape != stored.shape:
        return math.inf
    a = computed.to(torch.float32)
    b = stored.to(torch.float32)
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return math.inf
    if a.numel() == 0:
        return 0.0
    diff = float((a - b).abs().max())
    scale = float(b.abs().max())
    if scale == 0.0:
        return diff if diff == 0.0 else math.inf
    return diff / scale


def compare_chunk(
    computed: Sequence[torch.Tensor],
    stored: Sequence[torch.Tensor],
    tolerance: float = TOLERANCE,
) -> Comparison:
    """Compare a chunk's KV layer by layer (one tensor per layer, K and V together as the
    slot holds them). A different number of layers is a mismatch."""
    if len(computed) != len(stored):
        return Comparison((math.inf,), tolerance)
    return Comparison(
        tuple(layer_error(a, b) for a, b in zip(computed, stored, strict=True)), tolerance
    )


class Trust(enum.Enum):
    #: the workers have not said yet whether the tier holds this generation
    UNKNOWN = "unknown"
    #: the tier holds it: nothing is loaded or stored until computed chunks of the check
    #: budget matched (or the generation, holding no chunk and no live trusted engine, was
    #: claimed afresh)
    CHECKING = "checking"
    TRUSTED = "trusted"
    #: a computed chunk differed from the stored one: never loaded from or stored into
    #: (the connector then forks: a generation of the engine's own, trusted at once)
    REFUSED = "refused"


class GenerationTrust:
    """One engine's trust in the generation its object keys name.

    ``first_hit``: check before trusting (``canary_first_hit``; off, the generation is
    trusted at once). ``check_tokens``: the tokens whose computed chunks (of
    ``chunk_tokens`` each) must match before an untrusted generation is trusted
    (``canary_check_tokens``). ``rate``: the fraction of later requests recomputed and
    checked (``canary_rate``). While untrusted, every stored chunk is a candidate and
    several checks may be in flight, never more than the budget still needs
    (:meth:`checks_wanted`): the matches can never pass the budget, and each check costs
    one object-tier read. A sampled request of a trusted generation is one check, one at
    a time.
    """

    def __init__(
        self,
        *,
        first_hit: bool = True,
        rate: float = 0.0,
        check_tokens: int = CHECK_TOKENS,
        chunk_tokens: int = 256,
        draw: Callable[[], float] = random.random,
    ) -> None:
        if check_tokens < 1 or chunk_tokens < 1:
            raise ValueError(
                f"check_tokens {check_tokens} and chunk_tokens {chunk_tokens} must be >= 1"
            )
        self.state = Trust.UNKNOWN if first_hit else Trust.TRUSTED
        self.rate = rate
        self.check_tokens = check_tokens
        self.chunk_tokens = chunk_tokens
        self._draw = draw
        self.in_flight = 0
        #: tokens of the chunks matched while untrusted (trusted at ``check_tokens``)
        self.matched = 0
        #: the last mismatch's comparison (for the log and tests)
        self.last: Comparison | None = None

    @property
    def trusted(self) -> bool:
        """Loads from and stores into the generation are allowed."""
        return self.state is Trust.TRUSTED

    def first_writer(self, fresh: bool) -> Trust:
        """The workers' answer: this engine's claim of the generation won (``fresh``: it
        writes it first, its own KV is the generation's; of engines starting at once
        exactly one wins, :func:`kvtier.objects.manifest.claim_generation`) or it did not
        (the generation was there, or another engine claimed it first). Said at startup,
        and later by a checking engine whose re-claim of a generation holding no chunk
        and no live trusted engine won (:func:`~kvtier.objects.manifest.reclaim_generation`):
        with nothing stored there is nothing to check against, and no one's KV to poison."""
        if self.state is Trust.UNKNOWN:
            self.state = Trust.TRUSTED if fresh else Trust.CHECKING
        elif self.state is Trust.CHECKING and fresh:
            self.state = Trust.TRUSTED
        return self.state

    def new_generation(self) -> None:
        """The engine's keys now name a generation only it can know (a weight change's
        fresh salt): its first writer by construction."""
        self.state = Trust.TRUSTED
        self.in_flight = 0
        self.matched = 0

    @property
    def check_chunks(self) -> int:
        """Chunks of matches the budget takes (``check_tokens`` rounded up to chunks)."""
        return -(-self.check_tokens // self.chunk_tokens)

    def checks_wanted(self, sampled: bool = False) -> int:
        """How many chunks just computed may be checked now: while untrusted, the chunks
        the budget still needs less the checks in flight (an absent or failed check frees
        its place for another chunk); once trusted, one for a sampled request when no
        check is in flight; never once refused."""
        if self.state is Trust.REFUSED:
            return 0
        if self.state in (Trust.UNKNOWN, Trust.CHECKING):
            left = -(-max(0, self.check_tokens - self.matched) // self.chunk_tokens)
            return max(0, left - self.in_flight)
        return 1 if sampled and not self.in_flight else 0

    def wants_check(self, sampled: bool = False) -> bool:
        """Whether a chunk just computed should be checked (:meth:`checks_wanted`)."""
        return self.checks_wanted(sampled) > 0

    def sample(self) -> bool:
        """Whether a request of a trusted generation is recomputed and checked."""
        return self.state is Trust.TRUSTED and self.rate > 0.0 and self._draw() < self.rate

    def began(self) -> None:
        self.in_flight += 1

    def checked(self, result: str, comparison: Comparison | None = None) -> Trust:
        """A check's result (one of :data:`RESULTS`); returns the state after it. A match
        counts its chunk's tokens, and trusts an untrusted generation once they reach
        ``check_tokens``; a mismatch refuses it for good, whatever matched before; an
        absent chunk or an error changes nothing (the next computed chunk is checked)."""
        self.in_flight = max(0, self.in_flight - 1)
        if result == MISMATCH:
            self.state = Trust.REFUSED
            self.last = comparison
        elif result == MATCH and self.state in (Trust.UNKNOWN, Trust.CHECKING):
            self.matched += self.chunk_tokens
            if self.matched >= self.check_tokens:
                self.state = Trust.TRUSTED
        return self.state


def combine(results: Sequence[str]) -> str:
    """One check's result from every worker's (each compares its own part of the chunk):
    any mismatch is a mismatch; else a match only if every worker matched; else absent if
    any worker found nothing; else an error."""
    if MISMATCH in results:
        return MISMATCH
    if results and all(r == MATCH for r in results):
        return MATCH
    if ABSENT in results:
        return ABSENT
    return ERROR
