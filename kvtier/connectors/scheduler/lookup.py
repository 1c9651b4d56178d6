"""The object-tier lookup of one request: a state machine driven by vLLM's re-asks.

A lookup is a read. The first time a request's prompt reaches past what the host
tier holds, :meth:`RemoteLookups.advance` claims host slots for the rest of its
full chunks and queues their fetches as one run (the workers read the first chunk
alone, the rest once it was found, none after a miss). vLLM asks again each step;
the answer is "wait" until the stored prefix is known: every chunk up to the first
one that failed or is missing has been reported. The scheduler never waits on the
network and never asks the object tier anything itself.

States: no lookup -> in flight (``Lookup``, chunks FETCHING) -> done (the request
then loads what landed, from the host tier, like any host hit). A lookup past
``lookup_timeout_ms`` is done, counted as a timeout; its fetches still settle.

With a :class:`~.one_step_lookups.LocalProbe` (a directory tier on a local filesystem, where vLLM
recomputes what fails to load) a lookup is answered in its first step instead: the
probe finds the stored prefix, its chunks are claimed, and the answer counts them at
once (``RequestState.fetching_now``). When vLLM allocates that answer the lookup is
done and the workers read the run before the step's loads (``StepPlan.fetches_now``);
when it does not (no room yet), the run goes out as a plain lookup's and vLLM's next
ask waits for it like any other.
Chunks a request may not share (``RequestState.shared_chunks``: a LoRA adapter kvtier
could not fingerprint, client-named images) are never looked up.

Priced lookups (``load_policy: cost``, :mod:`kvtier.costs`): before a lookup claims
anything it prices its chunks against recomputing them, asks the tier only for the
leading chunks that shorten the request's predicted time to first token (the rest are
counted in ``kvtier:loads_declined_tokens``), and stops waiting at the fetch's deadline
(``Lookup.deadline_s``, counted in ``kvtier:fetch_deadline_missed``): the request goes on
with the chunks that landed, the late ones still land in the host tier. Every run's
reports (through the ledger) and every engine step (:attr:`RemoteLookups.steps`) feed the
estimates, whatever the policy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvtier import metrics
from kvtier.config import format_size
from kvtier.costs import FetchTimes, PrefillCosts, StepTimes, TierCosts, price_load
from kvtier.host.index import ChunkIndex, State
from kvtier.ops import FetchOp, OpKind
from kvtier.stats import StatsRecorder
from kvtier.whatif.objects import ObjectGhostTiers

from .ledger import OpLedger
from .one_step_lookups import LocalProbe
from .requests import ChunkKeys, Lookup, RequestState, loadable_chunks

logger = logging.getLogger("kvtier.scheduler")

#: at most one warning per this many seconds that the object tier is slower than prefill
SLOW_TIER_LOG_S = 300.0
#: that warning (``kvtier doctor`` reads it from a log: tier-slower-than-prefill)
SLOW_TIER_MSG = (
    "kvtier: the object tier reads %s/s (%.0f ms to a first chunk) and this engine "
    "computes a token in %.1f us: loading its chunks is slower than computing them "
    "(break-even about %s/s at load_margin %g), so lookups there are declined "
    "(kvtier:loads_declined_tokens_total; load_policy, load_margin)"
)


class RemoteLookups:
    def __init__(
        self,
        index: ChunkIndex,
        ledger: OpLedger,
        keys: ChunkKeys,
        stats: StatsRecorder,
        *,
        chunk_size: int,
        slot_bytes: int,
        timeout_s: float,
        world_size: int = 1,
        load_policy: str = "always",
        load_margin: float = 1.0,
    ) -> None:
        self.index = index
        self.ledger = ledger
        self.keys = keys
        self.stats = stats
        self.chunk_size = chunk_size
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self._runs: list[list[FetchOp]] = []
        self._runs_now: list[list[FetchOp]] = []
        #: priced one-step lookups' deadlines, by their run's first op id
        self._now_deadlines: dict[int, float] = {}
        #: the least deadline of the runs the last take_runs_now read in its step (0: none)
        self.now_deadline_s = 0.0
        #: answers lookups in their own step (:mod:`.one_step_lookups`); None: lookups are reads
        self.probe: LocalProbe | None = None
        #: what an object tier of another size would serve (kvtier.whatif.objects)
        self.ghosts: ObjectGhostTiers | None = None
        #: the clock of lookups, deadlines and cost samples (tests give their own)
        self.clock: Callable[[], float] = time.monotonic
        #: "cost": lookups priced against recomputing (kvtier.costs); "always": not
        self.priced = load_policy == "cost"
        self.margin = load_margin
        #: bytes one chunk's fetch reads, every worker's part together
        self.chunk_bytes = slot_bytes * world_size
        #: the object tier's reads and this engine's prefill as lookups see them
        self.tier_costs = TierCosts()
        self.fetch_times = FetchTimes(self.tier_costs)
        self.prefill = PrefillCosts(chunk_size)
        #: engine steps from plan to report (SchedulerSide feeds it): the prefill's samples
        self.steps = StepTimes(self.prefill)
        ledger.fetch_settled = self._fetch_settled
        #: when the last "slower than prefill" warning was logged (None: never)
        self._slow_logged: float | None = None

    def take_runs(self) -> list[list[FetchOp]]:
        """The fetch runs queued since the last call, one per lookup (for the metadata)."""
        runs, self._runs = self._runs, []
        return runs

    def take_runs_now(self, loaded: set[int]) -> tuple[list[list[FetchOp]], list[list[FetchOp]]]:
        """The runs of one-step lookups queued since the last call, split: the fetches
        whose chunks the step loads (``loaded``: their op ids), which the workers read
        before those loads, and the rest, answers vLLM did not allocate, read as any
        lookup's are (they must not hold up the step)."""
        now: list[list[FetchOp]] = []
        later: list[list[FetchOp]] = []
        deadlines: list[float] = []
        for run in self._runs_now:
            k = 0
            while k < len(run) and run[k].op_id in loaded:
                k += 1
            now += [run[:k]] if k else []
            later += [run[k:]] if k < len(run) else []
            deadline = self._now_deadlines.get(run[0].op_id) if run else None
            if k and deadline is not None:
                deadlines.append(deadline)
        self._runs_now = []
        self._now_deadlines = {}
        self.now_deadline_s = min(deadlines, default=0.0)
        return now, later

    def wants(self, st: RequestState, end_chunk: int, cap: int) -> bool:
        """True when chunks the host tier lacks could still come from the object tier."""
        if st.lookup is not None and st.lookup.done:
            return False
        return end_chunk < self._shared_end(st, cap)

    def advance(self, st: RequestState, first: int, cap: int) -> bool:
        """Advance this request's lookup from chunk ``first``; True while it should wait.

        Chunks another request is fetching are waited on, not fetched twice.
        """
        now = self.clock()
        lk = st.lookup
        if lk is None:
            lk = st.lookup = Lookup(started=now, first_chunk=first)
            if self.ghosts is not None:
                lk.whatif_end = self.ghosts.lookup(
                    st.chunk_hashes, first, self._shared_end(st, cap)
                )
            if self.probe is not None:
                # answered now; done once vLLM allocates the answer (SchedulerSide), else
                # a lookup in flight like any other: its fetches go out as a plain run
                self._claim_stored(st, lk, first, cap, self.probe)
                if not lk.chunks:
                    self.finish(st)
                return False
            self._start_fetches(st, lk, first, cap)
            if not lk.chunks:
                self.finish(st)
                return False
            return True
        waited = now - lk.started
        if waited > self.timeout_s:
            self.stats.inc(metrics.ERRORS, 1, ("timeout",))
            self.fetch_times.cut(lk.fetch_ops, now)
            self.finish(st)
            return False
        for entry in lk.chunks:
            held = self.index.get(entry.key)
            if held is None or (held is not entry and held.state is not State.STORING):
                break  # missing, failed or evicted: the usable prefix ends here
            if held.state in (State.FETCHING, State.STORING):
                if lk.deadline_s is not None and waited > lk.deadline_s:
                    if lk.late_step is None or self.steps.last <= lk.late_step:
                        # a chunk that landed in time is reported a step later: wait for
                        # the reports of the step after the deadline was seen
                        if lk.late_step is None:
                            lk.late_step = self.steps.last
                        return True
                    # past its deadline: go on with what landed (the rest still lands in
                    # the host tier, for the next request)
                    self.stats.inc(metrics.FETCH_DEADLINE_MISSED, 1, ("remote",))
                    self.fetch_times.cut(lk.fetch_ops, now)
                    break
                # (a store, maybe one that superseded this fetch, settles within a step)
                return True
        self.finish(st)
        return False

    def finish(self, st: RequestState) -> None:
        lk = st.lookup
        if lk is None or lk.done:
            return
        lk.done = True
        waited = self.clock() - lk.started
        self.stats.observe(metrics.LOOKUP_DELAY, waited, ("async",))
        if lk.predicted_s is not None:  # the cost model against what happened
            self.stats.observe(
                metrics.PRICED_FETCH_SECONDS, lk.predicted_s, ("remote", "predicted")
            )
            self.stats.observe(metrics.PRICED_FETCH_SECONDS, waited, ("remote", "measured"))

    def export_costs(self) -> None:
        """The estimates as gauges (0 until measured)."""
        now = self.clock()
        bps = self.tier_costs.bytes_per_second(now)
        self.stats.set(metrics.TIER_READ_BPS, bps or 0.0, ("remote",))
        self.stats.set(metrics.PREFILL_SPT, self.prefill.seconds_per_token(now) or 0.0)

    def _fetch_settled(self, op_id: int, ok: bool) -> None:
        self.fetch_times.settled(op_id, ok, self.clock())

    def _price(self, st: RequestState, lk: Lookup, first: int, end: int, cap: int) -> int:
        """Priced lookups: the end of the chunks from ``first`` worth asking the tier for
        (``end`` under ``load_policy: always``), the lookup's deadline set, declined
        tokens counted. A chunk the host tier holds or is fetching already costs no read."""
        if not self.priced or end <= first:
            return end
        key, size = self.keys.key, self.chunk_size
        chunks = [
            (
                0 if self.index.get(key(st, c)) is not None else self.chunk_bytes,
                max(0, min((c + 1) * size, cap) - max(c * size, st.local_hit)),
            )
            for c in range(first, end)
        ]
        price = price_load(
            chunks, tier=self.tier_costs, prefill=self.prefill, margin=self.margin, now=self.clock()
        )
        lk.deadline_s = price.deadline_s
        lk.predicted_s = price.predicted_s if price.load else None
        if price.declined_tokens:
            lk.declined_from = first + price.load
        if price.declined_tokens and price.reason is not None:
            self.stats.inc(metrics.LOADS_DECLINED, price.declined_tokens, ("remote", price.reason))
            if price.reason == "slower_than_prefill":
                self._warn_slow()
        return first + price.load

    def _warn_slow(self) -> None:
        """Say, at most every SLOW_TIER_LOG_S, that the tier is slower than prefill and
        what it would take: an operator sees hits stop without a word otherwise."""
        now = self.clock()
        if self._slow_logged is not None and now - self._slow_logged < SLOW_TIER_LOG_S:
            return
        self._slow_logged = now
        bps = self.tier_costs.bytes_per_second(now) or 0.0
        latency = self.tier_costs.latency.value(now) or 0.0
        spt = self.prefill.seconds_per_token(now) or 0.0
        even = self.chunk_bytes / self.chunk_size / (spt * self.margin) if spt else 0.0
        logger.warning(
            SLOW_TIER_MSG,
            format_size(int(bps)),
            latency * 1e3,
            spt * 1e6,
            format_size(int(even)),
            self.margin,
        )

    def count_whatif(self, st: RequestState, computed: int, loaded: int, cap: int) -> None:
        """After vLLM allocated ``loaded`` tokens from ``computed`` on: the object-tier tokens
        each ghost would have served, as the real tier counts ``hit_tokens{tier="remote"}``
        (tokens of chunks that came from the object tier). Those the host tier held
        already, fetched for an earlier request, count as measured; past the first chunk
        this request's lookup asked for, the ghost's run replaces what the real tier served
        (all of it fetched by the lookup, or waited on). Counted once per lookup."""
        ghosts = self.ghosts
        if ghosts is None:
            return
        remote = st.hit_sources.get("remote", 0)
        lk = st.lookup
        if lk is None or lk.whatif_end is None:
            ghosts.count([remote] * len(ghosts.scales))
            return
        lo = max(computed, lk.first_chunk * self.chunk_size)
        from_lookup = min(remote, max(0, computed + loaded - lo))
        held = remote - from_lookup
        ghosts.count_run(lk.whatif_end, held=held, lo=lo, cap=cap, chunk_size=self.chunk_size)
        lk.whatif_end = None

    def _shared_end(self, st: RequestState, cap: int) -> int:
        """End of the chunks a lookup may ask the object tier for: the loadable ones the
        request may share (``RequestState.shared_chunks``: the rest stay host-only)."""
        return min(loadable_chunks(st, cap, self.chunk_size), st.shared_chunks)

    def _claim_stored(
        self, st: RequestState, lk: Lookup, first: int, cap: int, probe: LocalProbe
    ) -> None:
        """One-step lookup: claim slots for the chunks from ``first`` on that every worker
        has stored, up to one the host tier is storing or fetching already (it cannot be
        loaded in this step), and queue their fetches as a run read before the loads."""
        self._keep_host_part(st, first)
        stored = probe.stored_run(st.chunk_hashes[first : self._shared_end(st, cap)])
        end = self._price(st, lk, first, first + stored, cap)
        run: list[FetchOp] = []
        for c in range(first, end):
            entry = self.index.begin(self.keys.key(st, c), State.FETCHING, tenant=st.tenant)
            if entry is None:  # held by another op, or every slot is busy
                break
            op_id = self.ledger.add(OpKind.FETCH, entry, nbytes=self.slot_bytes)
            run.append(FetchOp(op_id, entry.slot, st.chunk_hashes[c]))
            lk.chunks.append(entry)
            st.fetching_now[c] = op_id
        if run:
            self._runs_now.append(run)
            if lk.deadline_s is not None:  # the workers' reads before the loads end there
                self._now_deadlines[run[0].op_id] = lk.deadline_s

    def _keep_host_part(self, st: RequestState, first: int) -> None:
        """The host tier's part of this prompt stays: claims after it must not evict it."""
        key = self.keys.key
        for c in range(st.local_hit // self.chunk_size, first):
            if self.index.is_ready(key(st, c)):
                self.index.touch(key(st, c))

    def _start_fetches(self, st: RequestState, lk: Lookup, first: int, cap: int) -> None:
        """Claim slots for chunks ``first``.. and queue their fetches as one run."""
        key = self.keys.key
        self._keep_host_part(st, first)
        run: list[FetchOp] = []
        for c in range(first, self._price(st, lk, first, self._shared_end(st, cap), cap)):
            entry = self.index.get(key(st, c))
            if entry is None:
                entry = self.index.begin(key(st, c), State.FETCHING, tenant=st.tenant)
                if entry is None:  # every slot is busy: fetch what fits
                    break
                op_id = self.ledger.add(OpKind.FETCH, entry, nbytes=self.slot_bytes)
                run.append(FetchOp(op_id, entry.slot, st.chunk_hashes[c]))
            lk.chunks.append(entry)
        if run:
            self._runs.append(run)
            lk.fetch_ops = [op.op_id for op in run]
            self.fetch_times.started([(op.op_id, self.chunk_bytes) for op in run], lk.started)
