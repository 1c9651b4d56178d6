"""Engine scenarios for tests/e2e/test_trust.py: signing, isolation, outages, latency, soak.

Loaded by tests/e2e/engine.py through ``KVTIER_TEST_SCENARIO_MODULES``. Every
scenario builds one engine, runs its requests and returns one JSON-able dict;
the test decides. Besides vLLM's outputs each one reports what kvtier saw:

- ``totals``: the scheduler side's running counters (hits, errors by kind, ops);
- ``stats``: everything kvtier handed to vLLM's metrics path during the run
  (captured around ``StatsRecorder.take``, which vLLM drains every step):
  counter sums, sample counts / max / min per series, and every series id
  (metric name + label values) that was ever recorded.
"""

from __future__ import annotations

import gc
import itertools
import os
import random
import threading
import time
from typing import Any

from tests.e2e import engine as _engine_mod
from tests.e2e.engine import (
    build_llm,
    index_report,
    kvtier_side,
    register,
    settle,
    shutdown,
    toks,
)

#: prompt length for the signing scenarios: 1,044 tokens = 4 full chunks of 256 plus 20.
#: vLLM's own prefix cache then holds exactly 1,024 tokens of it (32 full blocks, the last
#: token is always computed), the same split a 4-chunk kvtier hit gives, so a hit's output
#: can be compared bit for bit with vLLM's own cached computation.
PROMPT_TOKENS = 1024 + 20

_CAPTURE: dict[str, Any] = {}
_CAPTURE_LOCK = threading.Lock()


def _capture_stats() -> None:
    """Keep a copy of every stats interval vLLM drains (counters, samples, series ids)."""
    from kvtier.stats import StatsRecorder

    if _CAPTURE:
        return
    _CAPTURE.update(counters={}, n={}, max={}, min={}, gauges={}, series=set())
    _CAPTURE.update(slow_sync=[])
    original = StatsRecorder.take
    original_observe = StatsRecorder.observe
    gc_state = {"t": 0.0, "n": 0}

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_state["start"] = time.perf_counter()
        else:
            gc_state["n"] += 1
            gc_state["t"] += time.perf_counter() - gc_state.get("start", time.perf_counter())

    gc.callbacks.append(on_gc)

    original_observe_many = StatsRecorder.observe_many

    def capture_slow(labels, values):
        # (the scheduler buffers its sync samples and records them when stats are taken:
        # the gc figures are as of then)
        if labels == ("sync",):
            with _CAPTURE_LOCK:
                _CAPTURE["slow_sync"].extend(
                    {"s": v, "gc_count": gc_state["n"], "gc_s": gc_state["t"]}
                    for v in values
                    if v > 0.001
                )

    def observe(self, spec, value, labels=()):
        capture_slow(labels, [value])
        return original_observe(self, spec, value, labels)

    def observe_many(self, spec, values, labels=()):
        values = list(values)
        capture_slow(labels, values)
        return original_observe_many(self, spec, values, labels)

    StatsRecorder.observe = observe  # type: ignore[method-assign]
    StatsRecorder.observe_many = observe_many  # type: ignore[method-assign]

    def take(self: StatsRecorder) -> dict[str, Any]:
        data = original(self)
        with _CAPTURE_LOCK:
            for sid, v in data.get("counters", {}).items():
                _CAPTURE["counters"][sid] = _CAPTURE["counters"].get(sid, 0) + v
                _CAPTURE["series"].add(sid)
            for sid, vs in data.get("samples", {}).items():
                if not vs:
                    continue
                _CAPTURE["n"][sid] = _CAPTURE["n"].get(sid, 0) + len(vs)
                _CAPTURE["max"][sid] = max(_CAPTURE["max"].get(sid, float("-inf")), *vs)
                _CAPTURE["min"][sid] = min(_CAPTURE["min"].get(sid, float("inf")), *vs)
                _CAPTURE["series"].add(sid)
            for sid, v in data.get("gauges", {}).items():
                _CAPTURE["gauges"][sid] = v
                _CAPTURE["series"].add(sid)
        return data

    StatsRecorder.take = take  # type: ignore[method-assign]


def _stats() -> dict[str, Any]:
    with _CAPTURE_LOCK:
        out = {k: dict(v) for k, v in _CAPTURE.items() if k not in ("series", "slow_sync")}
        out["slow_sync"] = list(_CAPTURE.get("slow_sync", ()))
        out["series"] = sorted(_CAPTURE.get("series", ()))
    return out


def _engine(model: str, extra: dict[str, Any], **kw: Any):
    _capture_stats()
    return build_llm(model, extra, **kw)


def gen(
    llm,
    prompts: list[list[int]],
    max_tokens: int = 8,
    salt: str | None = None,
    logprobs: int = 3,
) -> list[dict[str, Any]]:
    """Like engine.generate, plus each request's finish reason (a failed request shows)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=logprobs)
    outs = llm.generate(_engine_mod.token_prompts(prompts, salt), sp, use_tqdm=False)
    res = []
    for o in outs:
        comp = o.outputs[0]
        lps = [
            sorted((int(k), round(v.logprob, 4)) for k, v in d.items())
            for d in (comp.logprobs or [])
        ]
        res.append(
            {
                "tokens": list(comp.token_ids),
                "logprobs": lps,
                "cached": o.num_cached_tokens or 0,
                "finish": comp.finish_reason,
            }
        )
    return res


def compare(got: dict[str, Any], ref: dict[str, Any], tol: float = 0.05) -> str:
    """``"same"`` when the tokens are equal and every shared top logprob is within ``tol``;
    ``"tie"`` when they part at a step where, in both runs, the two picks may be within
    ``tol`` of each other (a near-tie that bf16 noise from another batch composition may
    flip; nothing after it can be compared); else ``"differ"``.

    A pick missing from a run's top-k list has a logprob at most the list's lowest, so
    the gap to it is known only from below: a three-way near-tie can put the other run's
    pick just outside the list."""
    for i, (a, b) in enumerate(zip(got["tokens"], ref["tokens"], strict=True)):
        da = {int(t): lp for t, lp in got["logprobs"][i]}
        db = {int(t): lp for t, lp in ref["logprobs"][i]}
        if a != b:
            if a in da and b in db and _may_tie(da, a, b, tol) and _may_tie(db, b, a, tol):
                return "tie"
            return "differ"
        if any(abs(da[t] - db[t]) > tol for t in set(da) & set(db)):
            return "differ"
    return "same"


def _may_tie(top: dict[int, float], pick: int, other: int, tol: float) -> bool:
    """Whether ``other`` may be within ``tol`` of this run's ``pick`` (``top``: the run's
    top-k logprobs at that step)."""
    return top[pick] - top.get(other, min(top.values())) <= tol


def _record_object_keys(llm) -> dict[str, list[str]]:
    """request id -> the object-tier keys (rank 0) of its full chunks, kept at finish."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvtier.keys import KeySpace

    side = kvtier_side(llm)
    keys: dict[str, list[str]] = {}
    original = side.request_finished

    def request_finished(request, block_ids):
        st = side._reqs.get(request.request_id)
        if st is not None:
            side.keys.refresh(st)
            # the worker's namespace: its keys also name its layers (Namespace.layers)
            worker = get_kv_transfer_group()._worker
            rank0 = KeySpace.worker(worker.namespace, 0, 0)
            keys[request.request_id] = [rank0.key(h) for h in st.chunk_hashes]
        return original(request, block_ids)

    side.request_finished = request_finished
    return keys


def _past_write_backoff(llm, timeout_s: float = 60.0) -> None:
    """Run empty steps until the object tier's writes no longer fail fast: the last
    uploads of the killed round can fail late on a loaded machine, and a backoff they
    start would drop the next round's uploads (as it should) before the tier is tried."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()._worker
    writes = worker.remote.queue.health.writes
    end = time.time() + timeout_s
    while writes.is_down and time.time() < end:
        settle(llm, 0.2)


def _remote_counters(llm) -> dict[str, int]:
    """Object-tier op counters of this engine: the worker's fetches and uploads (the
    worker runs in this process: uniproc executor; the scheduler asks the tier nothing)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()._worker
    return worker.remote.counters() if worker is not None and worker.remote else {}


# ---- signing ----------------------------------------------------------------------------
@register
def trust_write(model: str, extra: dict[str, Any], seeds: list[int]) -> dict[str, Any]:
    """The key-holding writer: each prompt cold (computed, stored, uploaded signed), then
    again with vLLM's own prefix cache serving its first 1,024 tokens (the reference a
    4-chunk kvtier hit must equal bit for bit). Reports each prompt's object keys."""
    llm = _engine(model, extra)
    keys = _record_object_keys(llm)
    prompts = [toks(s, PROMPT_TOKENS) for s in seeds]
    cold, ref, object_keys = [], [], []
    for p in prompts:
        llm.reset_prefix_cache()
        before = set(keys)
        cold.append(gen(llm, [p])[0])
        object_keys.append([k for rid, ks in keys.items() if rid not in before for k in ks])
        ref.append(gen(llm, [p])[0])
    settle(llm)
    report = index_report(llm)
    remote = _remote_counters(llm)
    shutdown(llm)  # flushes the write-through queue
    return {
        "cold": cold,
        "ref": ref,
        "object_keys": object_keys,
        "index": report,
        "remote": remote,
        "stats": _stats(),
    }


@register
def trust_read(model: str, extra: dict[str, Any], seeds: list[int]) -> dict[str, Any]:
    """A fresh engine (empty host tier): each prompt once, vLLM's prefix cache flushed."""
    llm = _engine(model, extra)
    outs = []
    for s in seeds:
        llm.reset_prefix_cache()
        outs.append(gen(llm, [toks(s, PROMPT_TOKENS)])[0])
    settle(llm)
    return {
        "outs": outs,
        "index": index_report(llm),
        "remote": _remote_counters(llm),
        "stats": _stats(),
    }


# ---- isolation: cache_salt, model, KV dtype ----------------------------------------------
@register
def salt_check(model: str, extra: dict[str, Any], seed: int) -> dict[str, Any]:
    """One prompt under salts a, b, none; vLLM's prefix cache flushed before every run,
    so only kvtier can serve a prefix. ``ref_a`` is the salt-a prompt with vLLM's own
    cache serving 1,024 tokens (the split a kvtier hit gives)."""
    llm = _engine(model, extra)
    p = toks(seed, PROMPT_TOKENS)
    side = kvtier_side(llm)
    runs: dict[str, dict[str, Any]] = {}

    def run(name: str, salt: str | None, reset: bool = True) -> None:
        if reset:
            llm.reset_prefix_cache()
        before = side.totals["hit_tokens_host"]
        out = gen(llm, [p], salt=salt)[0]
        out["kvtier_hit"] = side.totals["hit_tokens_host"] - before
        runs[name] = out

    run("a_cold", "salt-a")
    run("ref_a", "salt-a", reset=False)
    run("b", "salt-b")
    run("none", None)
    run("a_again", "salt-a")
    run("b_again", "salt-b")
    settle(llm)
    report = index_report(llm)
    shutdown(llm)
    return {"runs": runs, "index": report, "stats": _stats()}


@register
def foreign_read(
    model: str,
    extra: dict[str, Any],
    seed: int,
    salts: list[str | None],
    engine_kw: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Another model or KV dtype reads a tier that holds this prompt's chunks."""
    llm = _engine(model, extra, **(engine_kw or {}))
    side = kvtier_side(llm)
    p = toks(seed, PROMPT_TOKENS)
    outs = []
    for salt in salts:
        llm.reset_prefix_cache()
        outs.append(gen(llm, [p], salt=salt)[0])
    settle(llm)
    report = index_report(llm)
    remote = _remote_counters(llm)
    ns = side.namespace
    shutdown(llm)
    return {
        "outs": outs,
        "index": report,
        "remote": remote,
        "stats": _stats(),
        "namespace": {
            "model": ns.model,
            "dtype": ns.dtype,
            "kv_cache_dtype": ns.kv_cache_dtype,
            "fingerprint": ns.fingerprint,
        },
    }


# ---- object store killed mid-run ---------------------------------------------------------
def _wait_file(path: str, timeout: float = 120) -> bool:
    deadline = time.time() + timeout
    while not os.path.exists(path) and time.time() < deadline:
        time.sleep(0.02)
    return os.path.exists(path)


@register
def outage_concurrent(
    model: str, extra: dict[str, Any], seeds: list[int], signal_dir: str, kill_at_step: int = 3
) -> dict[str, Any]:
    """Rounds of all prompts submitted at once, both of vLLM's prefix cache and kvtier's
    host tier emptied before each, so every hit must come from the object tier:

    1: tier up, cold (computed, uploaded) -> 2: the test kills the tier at the
    ``kill_at_step``-th engine step of this round, while its lookups and fetches are in
    flight -> "restartme" -> [test restarts it, empty] -> 3: uploads again -> 4: hits.
    In float32, as the soak: bf16 decode steps of other batch compositions round apart
    on CPUs with AMX, wider than the tie tolerance.
    """
    llm = _engine(model, extra, dtype="float32")
    side = kvtier_side(llm)
    prompts = [toks(s, 1024 + 40) for s in seeds]
    state = {"armed": False, "steps": 0, "killed_at": None}
    original = side.build_connector_meta

    def build_connector_meta(so):
        if state["armed"]:
            state["steps"] += 1
            if state["steps"] == kill_at_step:
                state["killed_at"] = {
                    "step": state["steps"],
                    "open_requests": side.open_requests(),
                    "pending_ops": side.pending_ops(),
                    "totals": dict(side.totals),
                }
                open(os.path.join(signal_dir, "killme"), "w").close()
                _wait_file(os.path.join(signal_dir, "killed"), 60)
                state["armed"] = False
        return original(so)

    side.build_connector_meta = build_connector_meta

    remote_hits: list[int] = []
    marks: list[tuple[dict[str, int], dict[str, int]]] = []  # counters as each round began

    def round_() -> list[dict[str, Any]]:
        llm.reset_prefix_cache(reset_connector=True)
        assert side.index.used_slots == 0, "the host tier was not emptied"
        before = side.totals["hit_tokens_remote"]
        marks.append((dict(side.totals), _remote_counters(llm)))
        outs = gen(llm, prompts)
        remote_hits.append(side.totals["hit_tokens_remote"] - before)
        return outs

    rounds = [round_()]
    settle(llm)
    state["armed"] = True
    rounds.append(round_())
    after_kill = dict(side.totals)
    open(os.path.join(signal_dir, "restartme"), "w").close()
    _wait_file(os.path.join(signal_dir, "restarted"))
    settle(llm, 6.0)  # past the backoff: the tier is tried again
    _past_write_backoff(llm)
    rounds.append(round_())
    settle(llm)
    rounds.append(round_())
    settle(llm)
    return {
        "rounds": rounds,
        "killed_at": state["killed_at"],
        "after_kill": after_kill,
        "remote_hits": remote_hits,
        "per_round": _deltas([*marks, (dict(side.totals), _remote_counters(llm))]),
        "index": index_report(llm),
        "remote": _remote_counters(llm),
        "stats": _stats(),
    }


def _deltas(marks: list[tuple[dict[str, int], dict[str, int]]]) -> list[dict[str, Any]]:
    """What changed between consecutive marks (totals, object-tier counters), nonzero only."""
    out = []
    for (t0, r0), (t1, r1) in itertools.pairwise(marks):
        out.append(
            {
                "totals": {k: v - t0.get(k, 0) for k, v in t1.items() if v != t0.get(k, 0)},
                "remote": {k: v - r0.get(k, 0) for k, v in r1.items() if v != r0.get(k, 0)},
            }
        )
    return out


# ---- latency -----------------------------------------------------------------------------
@register
def slow_tier(model: str, extra: dict[str, Any], seeds: list[int]) -> dict[str, Any]:
    """Write prompts through a slow object tier, drop the host tier, read them back.

    Every call of the scheduler hook is timed by kvtier itself (the ``sync`` samples of
    ``kvtier:lookup_delay_seconds``); the capture keeps all of them.
    In float32, as the soak (bf16 decode steps of other batch compositions round apart
    on CPUs with AMX).
    """
    llm = _engine(model, extra, dtype="float32")
    side = kvtier_side(llm)
    prompts = [toks(s, PROMPT_TOKENS) for s in seeds]
    cold, ref = [], []
    for p in prompts:
        llm.reset_prefix_cache()
        cold.append(gen(llm, [p])[0])
        ref.append(gen(llm, [p])[0])
    t0 = time.monotonic()
    settle(llm)  # until every upload through the slow link is reported
    upload_wait = time.monotonic() - t0
    writes = dict(_stats())
    llm.reset_prefix_cache(reset_connector=True)  # host tier emptied: only the object tier
    assert side.index.used_slots == 0, "the host tier was not emptied"
    calls = {"none": 0, "claimed": 0}
    original = side.get_num_new_matched_tokens

    def get_num_new_matched_tokens(request, num_computed_tokens):
        n, is_async = original(request, num_computed_tokens)
        calls["none" if n is None else "claimed"] += 1
        return n, is_async

    side.get_num_new_matched_tokens = get_num_new_matched_tokens
    hits_before = side.totals["hit_tokens_remote"]
    t1 = time.monotonic()
    warm = gen(llm, prompts)  # all at once: their lookups overlap
    warm_s = time.monotonic() - t1
    hits = side.totals["hit_tokens_remote"] - hits_before
    settle(llm)
    return {
        "cold": cold,
        "ref": ref,
        "warm": warm,
        "remote_hit_tokens": hits,
        "calls": calls,
        "upload_wait_s": upload_wait,
        "warm_s": warm_s,
        "stats_after_writes": writes,
        "stats": _stats(),
        "index": index_report(llm),
        "remote": _remote_counters(llm),
    }


# ---- soak --------------------------------------------------------------------------------
def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _live_kvtier_objects() -> int:
    """Objects of kvtier's own classes alive now (index entries, request states, ops...)."""
    return sum(
        1 for o in gc.get_objects() if type(o).__module__.startswith(("kvtier.", "tests.e2e.trust"))
    )


@register
def soak(
    model: str,
    extra: dict[str, Any],
    n_requests: int,
    batch: int,
    n_prefixes: int,
    n_suffixes: int,
    prefix_tokens: int,
    suffix_tokens: int,
) -> dict[str, Any]:
    """Shared-prefix traffic: ``n_requests`` prompts prefix_i + suffix_j drawn at random
    (fixed seed), ``batch`` per generate call, vLLM's prefix cache flushed before each
    batch so prefixes come from kvtier's host tier (smaller than the working set) or are
    computed again. Outputs are compared with the first output of each distinct prompt,
    in float32: bf16 logits are quantised to 1/32 at this model's logprobs (about -4),
    and AMX's bf16 matmuls round a decode step of one batch composition 2-3 such steps
    away from another's, wider than any tie tolerance that still tells wrong KV apart."""
    llm = _engine(model, extra, max_num_seqs=batch, dtype="float32")
    side = kvtier_side(llm) if extra is not None else None
    rng = random.Random(1234)
    prefixes = [toks(100 + i, prefix_tokens) for i in range(n_prefixes)]
    suffixes = [toks(900 + j, suffix_tokens) for j in range(n_suffixes)]
    first: dict[tuple[int, int], dict[str, Any]] = {}
    mismatches: list[dict[str, Any]] = []
    ties = 0
    failed = 0
    done = 0
    rss: list[int] = []
    live: list[int] = []
    cached_total = 0
    t0 = time.monotonic()
    while done < n_requests:
        n = min(batch, n_requests - done)
        picks = [(rng.randrange(n_prefixes), rng.randrange(n_suffixes)) for _ in range(n)]
        llm.reset_prefix_cache()
        prompts = [prefixes[i] + suffixes[j] for i, j in picks]
        outs = gen(llm, prompts, max_tokens=2, logprobs=5)
        for pick, o in zip(picks, outs, strict=True):
            if o["finish"] not in ("length", "stop") or len(o["tokens"]) != 2:
                failed += 1
            cached_total += o["cached"]
            ref = first.setdefault(pick, o)
            verdict = compare(o, ref)
            if verdict == "tie":
                ties += 1
            elif verdict != "same":
                mismatches.append({"pick": list(pick), "got": o, "first": ref})
        done += n
        gc.collect()
        rss.append(_rss())
        live.append(_live_kvtier_objects())
    elapsed = time.monotonic() - t0
    if side is None:  # a baseline without kvtier, for comparing memory
        return {"requests": done, "failed": failed, "rss": rss, "elapsed_s": elapsed}
    settle(llm)
    structures = {
        "reqs": len(side._reqs),
        "pending": len(side.ledger),
        "ttft_by_step": len(side._ttft_by_step),
        "loads": len(side.plan.loads),
        "fetches": len(side.lookups._runs),
        "uploads": len(side.plan.uploads),
    }
    return {
        "requests": done,
        "failed": failed,
        "distinct": len(first),
        "mismatches": mismatches[:10],
        "n_mismatches": len(mismatches),
        "ties": ties,
        "cached_tokens": cached_total,
        "rss": rss,
        "live_kvtier_objects": live,
        "elapsed_s": elapsed,
        "structures": structures,
        "index": index_report(llm),
        "stats": _stats(),
    }
