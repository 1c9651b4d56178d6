"""What a hit costs against the prefill it replaces: loads priced, fetches given a deadline.

A hit is worth loading only if its bytes arrive before vLLM would have computed the same
tokens. On a GPU a 2,048-token prefill of an 8B model takes tens of milliseconds while
its 256 MiB of KV take seconds from S3 at 100 MB/s; on a throttled bucket or a busy
network the same happens anywhere. So every object-tier lookup is priced (``load_policy:
cost``): from live estimates of the tier's reads and of this engine's prefill, it asks
only for the leading chunks that shorten the request's predicted time to first token, and
gives that fetch a deadline past which the request goes on with what landed.

The estimates (:class:`TierCosts`, :class:`PrefillCosts`) are medians over a window of
recent samples (:class:`WindowedMedian`): one outlier cannot swing them, and samples
older than :data:`MAX_AGE_S` drop out, so a tier that recovers is measured again.

The prior (nothing measured yet, or every sample aged out): a tier without
:data:`MIN_SAMPLES` samples of latency and of throughput is loaded whole, as ``load_policy:
always`` does, so a fresh engine on a fast tier hits at once (its first fetches measure
the tier), its fetch cut at the recompute it replaces once the prefill is measured;
without a measured prefill there is no deadline but ``lookup_timeout_ms``. Host-tier chunks are
always loaded (they are never priced: copying host memory is faster than any prefill).

Nothing here imports vLLM or knows a request: the scheduler side
(kvtier.connectors.scheduler.lookup) feeds samples and asks :func:`price_load`. Clocks are
passed in (``now``), never read.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvtier.metrics import DECLINE_REASONS

#: samples each estimate keeps (the median of the last 16: one or two outliers move it
#: by at most a rank or two)
WINDOW = 16
#: samples an estimate needs before it is used (before that: the prior)
MIN_SAMPLES = 3
#: seconds after which a sample no longer counts; a tier whose loads were all declined is
#: unmeasured again after this long, loaded whole once, and so measured afresh
MAX_AGE_S = 120.0
#: a measured tier's fetch is cut at this many times its predicted time: a tier that stops
#: sending mid-transfer costs a small share of the prefill, not a whole one ...
STALL_FACTOR = 2.0
#: ... but never before this share of the recompute it replaces, nor before
#: :data:`STALL_MIN_STEPS` engine steps (the median step: a fast tier's read that a few
#: busy steps delay is not cut; a cut is a partial hit, its late chunks still land in the
#: host tier)
STALL_FLOOR = 0.1
STALL_MIN_STEPS = 4
#: a prefill step's marginal cost (its time less a step's fixed cost) is counted as at
#: least this share of its whole time: a fixed cost measured on busy decode steps must not
#: make recomputing look free
MIN_MARGINAL_SHARE = 0.5


class WindowedMedian:
    """The median of the last :data:`WINDOW` samples younger than :data:`MAX_AGE_S`."""

    __slots__ = ("_samples", "max_age_s", "min_samples")

    def __init__(
        self, window: int = WINDOW, *, min_samples: int = MIN_SAMPLES, max_age_s: float = MAX_AGE_S
    ) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self.min_samples = min_samples
        self.max_age_s = max_age_s

    def add(self, value: float, now: float) -> None:
        self._samples.append((now, value))

    def count(self, now: float) -> int:
        """Samples that still count at ``now``."""
        return sum(1 for t, _ in self._samples if now - t <= self.max_age_s)

    def value(self, now: float) -> float | None:
        """The median of the samples that count, or None with fewer than ``min_samples``."""
        live = [v for t, v in self._samples if now - t <= self.max_age_s]
        if len(live) < self.min_samples:
            return None
        return statistics.median(live)


class TierCosts:
    """One tier's reads as a request waiting for them sees them: a per-request latency
    (to a run's first report) and a throughput (bytes/s of the rest), each a windowed
    median; and the bytes of fetches in flight, which a new fetch queues behind."""

    def __init__(self, *, max_age_s: float = MAX_AGE_S) -> None:
        self.latency = WindowedMedian(max_age_s=max_age_s)
        self.throughput = WindowedMedian(max_age_s=max_age_s)
        #: how long runs that landed took, plan to last chunk: what a stall of a tier too
        #: fast to have a throughput is measured against (a run of misses is not in it)
        self.landed = WindowedMedian(max_age_s=max_age_s)
        #: op id -> (when planned, bytes): fetches not reported yet, oldest first
        self._inflight: dict[int, tuple[float, int]] = {}
        self._inflight_bytes = 0
        #: fetches of runs cut at their deadline, not reported yet (:meth:`stalled`)
        self._stuck: set[int] = set()

    def observe(self, *, latency_s: float | None, nbytes: int, seconds: float, now: float) -> None:
        """One run's reads: ``latency_s`` to its first report (None: not measured), and
        ``nbytes`` read in ``seconds`` after that latency."""
        if latency_s is not None:
            self.latency.add(max(0.0, latency_s), now)
        if nbytes > 0:  # (an interval of no time counts as 1 ms)
            self.throughput.add(nbytes / max(seconds, 1e-3), now)

    def bytes_per_second(self, now: float) -> float | None:
        return self.throughput.value(now)

    def measured(self, now: float) -> bool:
        return self.latency.value(now) is not None and self.throughput.value(now) is not None

    def fetch_seconds(self, nbytes: int, now: float, *, queued: bool = True) -> float | None:
        """Predicted seconds until ``nbytes`` of a new run landed (its latency, the bytes
        in flight ahead of it with ``queued``, its own bytes); None while unmeasured."""
        latency, bps = self.latency.value(now), self.throughput.value(now)
        if latency is None or bps is None:
            return None
        ahead = self.inflight_bytes(now) if queued else 0
        return latency + (ahead + nbytes) / bps

    # ---- fetches in flight ------------------------------------------------------------
    def planned(self, op_id: int, nbytes: int, now: float) -> None:
        self._inflight[op_id] = (now, nbytes)
        self._inflight_bytes += nbytes

    def settled(self, op_id: int) -> None:
        self._stuck.discard(op_id)
        held = self._inflight.pop(op_id, None)
        if held is not None:
            self._inflight_bytes -= held[1]

    def stuck(self, op_ids: Iterable[int]) -> None:
        """These fetches, in flight, passed their deadline (their run was cut)."""
        self._stuck.update(op_id for op_id in op_ids if op_id in self._inflight)

    def stalled(self, now: float) -> bool:
        """True while a fetch cut at its deadline has not been reported: the tier stopped
        sending (or its reads queue behind one that did), and a new fetch would wait
        behind it for a time no estimate knows. Until it settles (or ages out after
        ``max_age_s``), lookups there are declined ("queued")."""
        self.inflight_bytes(now)  # (ages out the oldest)
        return bool(self._stuck)

    def inflight_bytes(self, now: float) -> int:
        """Bytes of fetches in flight; one older than ``max_age_s`` (a read stuck in its
        backend call, never reported) no longer counts."""
        age = self.latency.max_age_s
        while self._inflight:
            op_id = next(iter(self._inflight))
            if now - self._inflight[op_id][0] <= age:
                break
            self.settled(op_id)
        return self._inflight_bytes


class PrefillCosts:
    """This engine's compute, from what its steps took (plan to report): a step costs a
    fixed part plus a part per token, and only the per-token part is what a load saves (a
    hit's request still takes a step, for the tokens past its last whole chunk).

    Steps of fewer than ``min_tokens`` tokens (a hit's last step, decode steps) measure the
    fixed part, a windowed median of their seconds; steps of at least ``min_tokens`` measure
    the per-token part, the median of (seconds less the fixed part) over tokens (a decode
    step's token costs far more than a prefill's: it would make every load look cheap). Every
    step, empty ones too, measures :attr:`step`, how often the scheduler sees reports."""

    def __init__(self, min_tokens: int, *, max_age_s: float = MAX_AGE_S) -> None:
        self.min_tokens = max(1, min_tokens)
        self.max_age_s = max_age_s
        #: (when, seconds, tokens) of the last prefill steps
        self._prefills: deque[tuple[float, float, int]] = deque(maxlen=WINDOW)
        #: seconds of steps with fewer tokens than a chunk (and more than none)
        self.fixed = WindowedMedian(max_age_s=max_age_s)
        #: seconds of every step, empty ones too
        self.step = WindowedMedian(max_age_s=max_age_s)

    def observe_step(self, seconds: float, tokens: int, now: float) -> None:
        if seconds <= 0:
            return
        self.step.add(seconds, now)
        if tokens >= self.min_tokens:
            self._prefills.append((now, seconds, tokens))
        elif tokens > 0:
            self.fixed.add(seconds, now)

    def fixed_seconds(self, now: float) -> float:
        """A step's fixed cost (0 until measured)."""
        return self.fixed.value(now) or 0.0

    def step_seconds(self, now: float) -> float | None:
        """The median step, plan to report (None: fewer than MIN_SAMPLES steps)."""
        return self.step.value(now)

    def seconds_per_token(self, now: float) -> float | None:
        """What one more prefill token costs (None: fewer than MIN_SAMPLES prefill steps)."""
        live = [(s, t) for when, s, t in self._prefills if now - when <= self.max_age_s]
        if len(live) < MIN_SAMPLES:
            return None
        fixed = self.fixed_seconds(now)
        return statistics.median(max(s - fixed, MIN_MARGINAL_SHARE * s) / t for s, t in live)


class StepTimes:
    """Engine steps from the scheduler's plan to the workers' report: the time each took,
    with the tokens it scheduled, fed to a :class:`PrefillCosts`. At most ``keep`` steps
    wait for their report (one never reported is forgotten)."""

    def __init__(self, prefill: PrefillCosts, keep: int = 64) -> None:
        self.prefill = prefill
        self.keep = keep
        self._began: dict[int, tuple[float, int]] = {}
        #: the last step planned (a lookup past its deadline waits for a later one)
        self.last = 0

    def began(self, step: int, tokens: int, now: float) -> None:
        self.last = step
        self._began[step] = (now, tokens)
        if len(self._began) > self.keep:
            del self._began[next(iter(self._began))]

    def reported(self, step: int, now: float) -> None:
        began = self._began.pop(step, None)
        if began is not None:
            self.prefill.observe_step(now - began[0], began[1], now)


@dataclass(slots=True)
class _Run:
    started: float
    ops: dict[int, int]  # op id -> bytes, not reported yet
    first: float | None = None  # when its first report came
    last_ok: float | None = None
    ok_bytes: int = 0
    first_ok_bytes: int = 0


@dataclass(slots=True)
class FetchTimes:
    """Runs of fetches from plan to report, turned into samples of a :class:`TierCosts`.
    A run whose reports came over several steps: the throughput is the bytes that landed
    after its first report over the time they took, the latency the time to that first
    report less that chunk's own read. A run reported at once, and a run of misses:
    latency only (less its bytes' time at the throughput known). A run cut at its
    deadline: a bound of both (:meth:`cut`). A tier so fast that every run is reported at
    once keeps no throughput: it stays at the prior, loaded whole."""

    tier: TierCosts
    _runs: dict[int, _Run] = field(default_factory=dict)  # run id (its first op id) -> run
    _run_of: dict[int, int] = field(default_factory=dict)  # op id -> run id

    def started(self, ops: Sequence[tuple[int, int]], now: float) -> None:
        """A run of fetches planned at ``now``: ``(op id, bytes)`` each, in order."""
        if not ops:
            return
        rid = ops[0][0]
        self._runs[rid] = _Run(now, dict(ops))
        for op_id, nbytes in ops:
            self._run_of[op_id] = rid
            self.tier.planned(op_id, nbytes, now)

    def settled(self, op_id: int, ok: bool, now: float) -> None:
        """An op's report (any op: those of no run are ignored)."""
        rid = self._run_of.pop(op_id, None)
        if rid is None:
            return
        self.tier.settled(op_id)
        run = self._runs.get(rid)
        if run is None:
            return
        nbytes = run.ops.pop(op_id, 0)
        if run.first is None:
            run.first = now
            run.first_ok_bytes = nbytes if ok else 0
        if ok:
            run.ok_bytes += nbytes
            run.last_ok = now
        if not run.ops:
            del self._runs[rid]
            self._sample(run, now)

    def cut(self, op_ids: Sequence[int], now: float) -> None:
        """A lookup stopped waiting (its deadline) with these ops unreported: the run's
        bytes so far plus the next chunk's would have needed more than the time waited,
        a bound that pulls the throughput down (and, with no report at all, the latency was
        at least the time waited); its late reports are not sampled."""
        for op_id in op_ids:
            rid = self._run_of.get(op_id)
            run = self._runs.pop(rid, None) if rid is not None else None
            if run is None:
                continue
            self.tier.stuck(run.ops)
            nxt = next(iter(run.ops.values()), 0)
            # no report yet: the latency was at least the time waited (a stalled tier is
            # measured so, not left unmeasured and loaded whole again)
            first = run.first if run.first is not None else now
            self.tier.observe(
                latency_s=first - run.started,
                nbytes=run.ok_bytes + nxt,
                seconds=now - run.started,
                now=now,
            )
            return

    def _sample(self, run: _Run, now: float) -> None:
        assert run.first is not None
        to_first = run.first - run.started
        if run.last_ok is None:  # nothing landed: the tier answered "absent" (latency only)
            self.tier.observe(latency_s=to_first, nbytes=0, seconds=0.0, now=now)
            return
        self.tier.landed.add(run.last_ok - run.started, now)
        rest = run.ok_bytes - run.first_ok_bytes
        if rest > 0 and run.last_ok > run.first:
            # reports over several steps: the bytes after the first report over their time,
            # and the latency is the time to the first report less that chunk's own read
            bps = rest / (run.last_ok - run.first)
            latency = to_first - run.first_ok_bytes / bps
            self.tier.observe(
                latency_s=latency, nbytes=rest, seconds=run.last_ok - run.first, now=now
            )
            return
        # one report (or one chunk): no split between latency and bytes. The time is mostly
        # the engine steps before the report, a cost per lookup, not per byte: it counts as
        # latency (less the bytes' time at the throughput known), and says nothing of the
        # throughput (counted as bytes/s, one step's lag over one chunk would make every
        # longer prompt look slow)
        known = self.tier.bytes_per_second(now)
        took = run.last_ok - run.started
        self.tier.observe(
            latency_s=took - (run.ok_bytes / known if known else 0.0),
            nbytes=0,
            seconds=0.0,
            now=now,
        )


@dataclass(frozen=True, slots=True)
class Price:
    """What a lookup asks the tier for: the first ``load`` chunks; ``deadline_s`` after
    it starts the request goes on with what landed (None: ``lookup_timeout_ms`` alone)."""

    load: int
    deadline_s: float | None
    #: predicted seconds until the loaded chunks landed (None: unmeasured)
    predicted_s: float | None = None
    #: tokens of the chunks not asked for, and why (one of DECLINE_REASONS)
    declined_tokens: int = 0
    reason: str | None = None

    def __post_init__(self) -> None:
        assert self.reason is None or self.reason in DECLINE_REASONS


def price_load(
    chunks: Sequence[tuple[int, int]],
    *,
    tier: TierCosts,
    prefill: PrefillCosts,
    margin: float,
    now: float,
) -> Price:
    """How many leading ``chunks`` (``(bytes to read, tokens)`` each, in prompt order; 0
    bytes: already held) to load, and the fetch's deadline.

    The prefix chosen minimises the predicted time to first token: the fetch of what is
    loaded (the tier's latency, the bytes in flight ahead, its own bytes) plus the prefill
    of the rest, the prefill counted ``margin`` times (1.0: load when no slower than
    recomputing; above 1 loads more). Ties load more. The prefill counted is its part per
    token (:meth:`PrefillCosts.seconds_per_token`): a step's fixed cost is paid either way.
    The deadline is :data:`STALL_FACTOR` times the predicted fetch, no sooner than
    :data:`STALL_FLOOR` times the recompute of the loaded tokens (``margin`` times it) and
    :data:`STALL_MIN_STEPS` engine steps, no later than that whole recompute (the lookup
    waits a step past it, for that step's reports):
    a measured tier that stalls mid-transfer costs a fraction of the prefill, never
    ``lookup_timeout_ms``. Unmeasured tier: every chunk is loaded, cut by the same rule
    with the time its runs took to land as the prediction (a tier so fast that they land
    by their first report has no throughput), else, nothing landed yet, at the whole
    recompute; unmeasured prefill: every chunk, no deadline (the prior). While a fetch cut
    at its deadline is still out (:meth:`TierCosts.stalled`), no chunk that needs a read
    is asked for (declined as "queued").
    """
    n = len(chunks)
    spt = prefill.seconds_per_token(now)
    if spt is None:
        return Price(n, None)
    if tier.stalled(now):
        # a fetch cut at its deadline still out: a new one would queue behind it. Only
        # the leading chunks that need no read are loaded (bounded by their recompute)
        held = next((k for k, (b, _) in enumerate(chunks) if b), n)
        if held < n:
            loaded = sum(t for _, t in chunks[:held])
            declined = sum(t for _, t in chunks[held:])
            return Price(held, margin * spt * loaded if held else None, 0.0, declined, "queued")
    # (the prefill's steps are steps: measured with it)
    least = STALL_MIN_STEPS * (prefill.step_seconds(now) or 0.0)
    if not tier.measured(now):
        recompute = margin * spt * sum(t for _, t in chunks)
        # a tier whose runs all landed by their first report has no throughput: the time
        # its runs took to land is what a stall is measured against
        landed = tier.landed.value(now)
        cut = recompute if landed is None else _stall_cut(landed, recompute, least)
        return Price(n, cut)
    best, best_fetch = _best_prefix(chunks, tier, spt, margin, now, queued=True)
    loaded_tokens = sum(t for _, t in chunks[:best])
    declined = sum(t for _, t in chunks[best:])
    reason = None
    if declined:
        unqueued = _best_prefix(chunks, tier, spt, margin, now, queued=False)[0]
        reason = "queued" if unqueued > best else "slower_than_prefill"
    if not best:
        return Price(0, None, 0.0, declined, reason)
    cut = _stall_cut(best_fetch, margin * spt * loaded_tokens, least)
    return Price(best, cut, best_fetch, declined, reason)


def _stall_cut(predicted_s: float, recompute_s: float, least_s: float) -> float:
    """When a fetch predicted to take ``predicted_s`` is given up: :data:`STALL_FACTOR`
    times that, no sooner than :data:`STALL_FLOOR` times the recompute it replaces and
    ``least_s`` (a few engine steps), no later than the whole recompute."""
    floor = max(STALL_FLOOR * recompute_s, least_s)
    return min(recompute_s, max(STALL_FACTOR * predicted_s, floor))


def _best_prefix(
    chunks: Sequence[tuple[int, int]],
    tier: TierCosts,
    spt: float,
    margin: float,
    now: float,
    *,
    queued: bool,
) -> tuple[int, float]:
    """(k, fetch seconds) of the prefix whose fetch less ``margin`` times its recompute is
    least (the prefill of the rest is the same for every k but for that). The estimates are
    read once: a lookup of a long prompt prices each of its chunks in a few operations."""
    latency, bps = tier.latency.value(now), tier.throughput.value(now)
    assert latency is not None and bps is not None  # measured: the caller checked
    start = latency + (tier.inflight_bytes(now) if queued else 0) / bps
    best, best_cost, best_fetch = 0, 0.0, 0.0
    nbytes = tokens = 0
    for k, (b, t) in enumerate(chunks, 1):
        nbytes += b
        tokens += t
        fetch = start + nbytes / bps if nbytes else 0.0
        cost = fetch - margin * spt * tokens
        if cost <= best_cost:
            best, best_cost, best_fetch = k, cost, fetch
    return best, best_fetch
