"""Run a real vLLM engine (CPU build) with kvtier in a fresh process.

vLLM wants ``LLM(...)`` under ``if __name__ == "__main__"`` and one engine per
process, so every end-to-end scenario runs this file as a script:
``python tests/e2e/engine.py SCENARIO JSON_ARGS``. The scenario prints one line
``RESULT {json}`` that the test reads. The engine core runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so a scenario can look inside kvtier's
scheduler side (ref counts, slots) after the run.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

KVCACHE_GIB = "1"


def toks(seed: int, n: int) -> list[int]:
    """Deterministic token ids inside the tiny tokenizer's vocabulary."""
    return [((i * 7919 + seed * 104729 + seed * seed) % 480) + 5 for i in range(n)]


def ktc(extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM's kv_transfer_config for kvtier with ``extra``. Scenarios that do not name
    ``canary_first_hit`` run with it off, as kvtier did before the canary: an engine reading
    what another stored then loads from its first prompt on (tests/e2e/test_canary.py)."""
    from kvtier.sizing.emit import connector_config

    return connector_config({"canary_first_hit": False, **extra})


def build_llm(model: str, extra: dict[str, Any] | None, **kw: Any):
    from vllm import LLM

    args: dict[str, Any] = dict(
        model=model,
        enforce_eager=True,
        block_size=32,
        max_model_len=4096,
        seed=0,
    )
    if extra is not None:
        args["kv_transfer_config"] = ktc(extra)
    args.update(kw)
    return LLM(**args)


def generate(
    llm,
    prompts: list[list[int]],
    max_tokens: int = 8,
    salt: str | None = None,
    ignore_eos: bool = False,
):
    """Greedy outputs; ``ignore_eos``: all ``max_tokens`` of them (a random-weight model
    may greedily pick its end-of-sequence token, on one CPU and not on another)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=3, ignore_eos=ignore_eos)
    outs = llm.generate(token_prompts(prompts, salt), sp, use_tqdm=False)
    return [summary(o) for o in outs]


def token_prompts(prompts: list[list[int]], salt: str | None = None) -> list[Any]:
    """vLLM token prompts, with a ``cache_salt`` when given."""
    from vllm.inputs import TokensPrompt

    items = []
    for p in prompts:
        tp = TokensPrompt(prompt_token_ids=p)
        if salt is not None:
            tp["cache_salt"] = salt
        items.append(tp)
    return items


def summary(o) -> dict[str, Any]:
    """Output tokens, top logprobs (rounded) and cached-token count of one request."""
    comp = o.outputs[0]
    lps = [
        sorted((int(k), round(v.logprob, 4)) for k, v in d.items()) for d in (comp.logprobs or [])
    ]
    return {"tokens": list(comp.token_ids), "logprobs": lps, "cached": o.num_cached_tokens or 0}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]


def kvtier_side(llm):
    """The scheduler side of the connector (engine core in-process)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler


def index_report(llm) -> dict[str, Any]:
    side = kvtier_side(llm)
    idx = side.index
    try:
        idx.check()
        invariants = True
    except AssertionError as exc:
        invariants = str(exc)
    for ghosts in (side.ghosts, side.lookups.ghosts):
        if ghosts is not None:
            ghosts.drain()  # the what-if events their thread has not applied yet
    return {
        "refs": idx.total_refs(),
        "invariants": invariants,
        "pending_ops": side.pending_ops(),
        "open_requests": side.open_requests(),
        "used_slots": idx.used_slots,
        "num_slots": idx.num_slots,
        "totals": dict(side.totals),
    }


def settle(llm, seconds: float = 0.0) -> None:
    """Let the engine run empty steps so worker reports (uploads, fetches) arrive."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    deadline = time.time() + seconds
    while True:
        llm.generate(
            [TokensPrompt(prompt_token_ids=[7, 8, 9])], SamplingParams(max_tokens=1), use_tqdm=False
        )
        if time.time() >= deadline and kvtier_side(llm).pending_ops() == 0:
            return
        if time.time() > deadline + 30:
            return
        time.sleep(0.05)


# ---- scenarios -------------------------------------------------------------------------------
def shared_prefix(model: str, extra: dict[str, Any]) -> dict[str, Any]:
    """A = S+U1, B = S+U2 (S = 1,024 tokens): with kvtier serving S after a flush of
    vLLM's prefix cache, B's output must equal B's when vLLM's own cache served S.

    Each comparison keeps the split between cached and computed tokens the same,
    so the two computations are the same arithmetic and must agree bit for bit.
    """
    llm = build_llm(model, extra)
    s, u1, u2 = toks(1, 1024), toks(2, 257), toks(3, 200)
    a = generate(llm, [s + u1])[0]
    a_ref = generate(llm, [s + u1])[0]  # vLLM's own cache serves 1,280 tokens
    b_ref = generate(llm, [s + u2])[0]  # vLLM's own cache serves S
    llm.reset_prefix_cache()
    before = dict(kvtier_side(llm).totals)
    b = generate(llm, [s + u2])[0]
    after = dict(kvtier_side(llm).totals)
    llm.reset_prefix_cache()
    a2 = generate(llm, [s + u1])[0]
    return {
        "a": a,
        "a_ref": a_ref,
        "b_ref": b_ref,
        "b": b,
        "a2": a2,
        "b_hit_tokens": after["hit_tokens_host"] - before["hit_tokens_host"],
        "b_lookup_tokens": after["lookup_tokens"] - before["lookup_tokens"],
        "index": index_report(llm),
    }


def max_logprob_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest difference between the top logprobs of two outputs (inf if tokens differ)."""
    if a["tokens"] != b["tokens"]:
        return float("inf")
    return near_tie_diff(a, b)  # (no token differs: the top logprobs' largest difference)


def near_tie_diff(got: dict[str, Any], ref: dict[str, Any]) -> float:
    """How far ``got`` strays from ``ref`` where a near tie may flip a greedy token: the
    largest difference of a top logprob both list, at every position up to and including
    the first where their tokens differ; at that position also the gap in ``ref`` between
    its token and ``got``'s (a flip is legitimate only across a gap of bf16 rounding).
    Past it the two continue from other tokens and are not compared. inf where ``got``'s
    token is not among ``ref``'s top logprobs there."""
    diff = 0.0
    for i, (la, lb) in enumerate(zip(got["logprobs"], ref["logprobs"], strict=True)):
        da, db = dict(la), dict(lb)
        for tok in set(da) & set(db):
            diff = max(diff, abs(da[tok] - db[tok]))
        mine, theirs = got["tokens"][i], ref["tokens"][i]
        if mine != theirs:
            if mine not in db or theirs not in db:
                return float("inf")
            return max(diff, db[theirs] - db[mine])
    return diff


def eviction(model: str, extra: dict[str, Any], n_prompts: int = 5) -> dict[str, Any]:
    """A host tier smaller than the working set: outputs stay exact, nothing leaks."""
    llm = build_llm(model, extra)
    prompts = [toks(10 + i, 1024 + 40) for i in range(n_prompts)]
    cold = []
    for p in prompts:  # reference: computed with nothing to load
        llm.reset_prefix_cache()
        cold.append(generate(llm, [p])[0])
    warm = []
    for p in prompts + prompts:  # cyclic over more chunks than slots: LRU evicts, misses
        for _ in range(2):  # ... and the same prompt right again: hits
            llm.reset_prefix_cache()
            warm.append(generate(llm, [p])[0])
    settle(llm)
    return {
        "tokens_identical": all(
            w["tokens"] == cold[(i // 2) % n_prompts]["tokens"] for i, w in enumerate(warm)
        ),
        "max_logprob_diff": max(
            max_logprob_diff(w, cold[(i // 2) % n_prompts]) for i, w in enumerate(warm)
        ),
        "cold_cached": [c["cached"] for c in cold],
        "warm_cached": [w["cached"] for w in warm],
        "index": index_report(llm),
    }


def cycled_pool(model: str, extra: dict[str, Any], n_prompts: int = 6) -> dict[str, Any]:
    """Host-tier hits loaded into a cycled device pool's blocks, which vLLM hands out in
    descending runs (it frees a request's blocks in reverse order and hands out the last
    freed first): the CPU copier copies them as slices. Outputs stay those computed with
    nothing loaded."""
    import kvtier.host.transfer as transfer

    shapes: dict[str, int] = {}
    real = transfer.block_runs

    def counting(blocks):  # type: ignore[no-untyped-def]
        runs = real(blocks)
        kind = (
            "index copy"
            if runs is None
            else "descending"
            if any(r.descending for r in runs)
            else "ascending"
        )
        shapes[kind] = shapes.get(kind, 0) + 1
        return runs

    transfer.block_runs = counting
    # every copy checked where it landed: a chunk's blocks in vLLM's KV cache, read with
    # an index copy, are its slot's bytes after a load or a store (a tiny random model's
    # outputs barely move when a chunk's blocks are swapped: one bf16 step)
    checked = {"copies": 0, "wrong": 0}
    copy_jobs = transfer.CpuCopier._copy_jobs

    def checking(copier, jobs, to_host):  # type: ignore[no-untyped-def]
        import torch

        times = copy_jobs(copier, jobs, to_host)
        for job in jobs:
            first, count = transfer.job_range(job)
            idx = torch.tensor(job.gpu_blocks, dtype=torch.long)
            for li, kv in enumerate(copier.kv):
                dim = copier.layout.layers[li].block_dim
                slot = copier.slab.layer_view(job.slot, li).narrow(dim, first, count)
                checked["wrong"] += not torch.equal(kv.index_select(dim, idx), slot)
            checked["copies"] += 1
        return times

    transfer.CpuCopier._copy_jobs = checking
    # 128 blocks (4,096 tokens) of device KV cache: the prompts below need more, so the
    # pool cycles (the CPU build sizes its cache from VLLM_CPU_KVCACHE_SPACE otherwise)
    llm = build_llm(model, extra, num_gpu_blocks_override=128, max_model_len=2048)
    prompts = [toks(40 + i, 1024 + 40) for i in range(n_prompts)]
    cold = [generate(llm, [p])[0] for p in prompts]  # computed (nothing stored yet), stored
    stores = dict(shapes)
    shapes.clear()
    # vLLM's own cache emptied once (without reordering its pool): then only kvtier has
    # the prompts, loaded into blocks of a pool that has cycled
    llm.reset_prefix_cache()
    warm = [generate(llm, [p])[0] for p in prompts]
    settle(llm)
    pairs = list(zip(warm, cold, strict=True))
    return {
        "tokens_identical": all(w["tokens"] == c["tokens"] for w, c in pairs),
        "max_logprob_diff": max(max_logprob_diff(w, c) for w, c in pairs),
        "cold_cached": [c["cached"] for c in cold],
        "warm_cached": [w["cached"] for w in warm],
        "store_copies": stores,
        "load_copies": shapes,
        "copies_checked": checked,
        "index": index_report(llm),
    }


def start_only(model: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Start an engine and report how startup ended (config errors must stop it)."""
    try:
        llm = build_llm(model, extra)
    except Exception as exc:  # noqa: BLE001 - the test inspects the error
        chain = []
        e: BaseException | None = exc
        while e is not None:
            chain.append(f"{type(e).__name__}: {e}")
            e = e.__cause__ or e.__context__
        return {"started": False, "error": "\n".join(chain), "tb": traceback.format_exc()}
    out = generate(llm, [toks(1, 300)])[0]
    return {"started": True, "out": out}


def shutdown(llm) -> None:
    """Shut the engine down the way vLLM does at exit (the connector flushes uploads)."""
    llm.llm_engine.engine_core.shutdown()


def remote_writer(model: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Engine 1: serve A = S+U1 and B = S+U2 (vLLM's own cache serves S for B), exit.
    ``a_ref``: A again, 1,280 tokens from vLLM's own cache, the split of a reader that loads
    A's five chunks (a full prefill is other arithmetic: on some CPUs, AMX's, its last
    token's logprobs differ in the last bits)."""
    llm = build_llm(model, extra)
    s, u1, u2 = toks(1, 1024), toks(2, 257), toks(3, 200)
    a = generate(llm, [s + u1])[0]
    a_ref = generate(llm, [s + u1])[0]  # vLLM's own cache serves 1,280 tokens
    b_ref = generate(llm, [s + u2])[0]
    report = index_report(llm)
    shutdown(llm)  # queued uploads are flushed here, not waited for above
    return {"a": a, "a_ref": a_ref, "b_ref": b_ref, "index": report}


def remote_reader(model: str, extra: dict[str, Any], a_first: bool = False) -> dict[str, Any]:
    """Engine 2, a new process with an empty host tier: B = S+U2 and A again."""
    llm = build_llm(model, extra)
    s, u1, u2 = toks(1, 1024), toks(2, 257), toks(3, 200)
    if a_first:
        a = generate(llm, [s + u1])[0]
        llm.reset_prefix_cache()
        b = generate(llm, [s + u2])[0]
    else:
        b = generate(llm, [s + u2])[0]
        llm.reset_prefix_cache()
        a = generate(llm, [s + u1])[0]
    settle(llm)
    return {"b": b, "a": a, "index": index_report(llm)}


def one_step_reader(
    model: str, extra: dict[str, Any], policy: str = "recompute", spoil: list[str] | None = None
) -> dict[str, Any]:
    """Engine 2 of :func:`remote_writer` under vLLM's ``kv_load_failure_policy``: B = S+U2,
    then A. ``spoil``: chunk files flipped after the engine started (after its lookup's
    ``stat`` could have seen them whole, before the read)."""
    from pathlib import Path

    llm = build_llm(
        model,
        None,
        kv_transfer_config={
            **ktc(extra),
            "kv_load_failure_policy": policy,
        },
    )
    for name in spoil or ():
        data = bytearray(Path(name).read_bytes())
        data[-100] ^= 0xFF
        Path(name).write_bytes(bytes(data))
    s, u1, u2 = toks(1, 1024), toks(2, 257), toks(3, 200)
    side = kvtier_side(llm)
    asked = record_probe(side)
    b = generate(llm, [s + u2])[0]
    llm.reset_prefix_cache()
    a = generate(llm, [s + u1])[0]
    settle(llm)
    return {
        "b": b,
        "a": a,
        "index": index_report(llm),
        "one_step": side.lookups.probe is not None,
        "b_objects": asked[0] if asked else [],
    }


def record_probe(side) -> list[list[str]]:
    """The object files each one-step lookup asks about, in the prompt's chunk order (none
    without a probe): a test spoils S's third chunk by name, not by upload order, which
    parallel uploads do not keep."""
    asked: list[list[str]] = []
    probe = side.lookups.probe
    if probe is None:
        return asked
    exists = probe.tier.exists

    def recording(keys):
        asked.append([probe.tier.path(k) for k in keys])
        return exists(keys)

    probe.tier.exists = recording
    return asked


def replica(model: str, extra: dict[str, Any], role: str, marker: str) -> dict[str, Any]:
    """Two engines up at the same time sharing one tier: the writer computes a
    prefix, the reader (already running) then hits it."""
    llm = build_llm(model, extra)
    p = toks(21, 1024 + 50)
    if role == "writer":
        out = generate(llm, [p])[0]
        settle(llm)  # uploads reported back
        with open(marker, "w") as f:
            f.write("done")
        deadline = time.time() + 300
        while not os.path.exists(marker + ".read") and time.time() < deadline:
            time.sleep(0.2)  # stay up while the other replica reads
        return {"out": out, "index": index_report(llm)}
    deadline = time.time() + 300
    while not os.path.exists(marker) and time.time() < deadline:
        time.sleep(0.2)
    out = generate(llm, [p])[0]
    with open(marker + ".read", "w") as f:
        f.write("done")
    return {"out": out, "index": index_report(llm)}


def prompts_run(
    model: str,
    extra: dict[str, Any],
    seeds: list[int],
    repeats: int = 2,
    pause_file: str | None = None,
    settle_between: bool = False,
) -> dict[str, Any]:
    """Run each prompt ``repeats`` times with vLLM's prefix cache flushed in between.

    With ``settle_between``, the worker's reports (uploads above all) arrive before each
    next prompt, so what a prompt finds does not depend on how fast the tiers were.

    With ``pause_file``, after the first round the scenario writes ``pause_file``
    and waits for ``pause_file + ".go"`` (the test kills or restarts a service).
    """
    llm = build_llm(model, extra)
    prompts = [toks(s, 1024 + 40) for s in seeds]
    rounds = []
    for r in range(repeats):
        outs = []
        for i, p in enumerate(prompts):
            if settle_between and (i or r):  # (an engine whose first request was
                settle(llm)  # settle's 3-token prompt died of SIGILL on a CPU with AMX)
            llm.reset_prefix_cache()
            outs.append(generate(llm, [p])[0])
        rounds.append(outs)
        if pause_file and r == 0:
            with open(pause_file, "w") as f:
                f.write("paused")
            deadline = time.time() + 120
            while not os.path.exists(pause_file + ".go") and time.time() < deadline:
                time.sleep(0.1)
            settle(llm, 2.0)
    settle(llm)
    return {"rounds": rounds, "index": index_report(llm)}


def _wait_file(path: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not os.path.exists(path) and time.time() < deadline:
        time.sleep(0.05)


def outage(
    model: str, extra: dict[str, Any], seeds: list[int], signal_dir: str, concurrent: bool = False
) -> dict[str, Any]:
    """Rounds of requests around an object-tier outage driven by the test:

    round 1 (tier up) -> "killme" -> [test kills the tier] -> round 2 (tier down)
    -> "restartme" -> [test restarts it] -> round 3 (uploads again) -> round 4 (hits).
    With ``concurrent`` each round submits all prompts at once.
    """
    llm = build_llm(model, extra)
    prompts = [toks(s, 1024 + 40) for s in seeds]

    def round_() -> list[dict[str, Any]]:
        llm.reset_prefix_cache()
        if concurrent:
            return generate(llm, prompts)
        outs = []
        for p in prompts:
            llm.reset_prefix_cache()
            outs.append(generate(llm, [p])[0])
        return outs

    rounds = [round_()]
    settle(llm)
    open(os.path.join(signal_dir, "killme"), "w").close()
    _wait_file(os.path.join(signal_dir, "killed"))
    rounds.append(round_())
    open(os.path.join(signal_dir, "restartme"), "w").close()
    _wait_file(os.path.join(signal_dir, "restarted"))
    settle(llm, 6.0)  # past the backoff: the tier is tried again
    before = kvtier_side(llm).totals["hit_tokens_remote"]
    rounds.append(round_())
    settle(llm)
    rounds.append(round_())
    after = kvtier_side(llm).totals["hit_tokens_remote"]
    settle(llm)
    return {
        "rounds": rounds,
        "remote_hits_after_restart": after - before,
        "index": index_report(llm),
    }


def preempt_abort(model: str, extra: dict[str, Any]) -> dict[str, Any]:
    """A device cache too small for the batch (vLLM preempts and resumes requests) and
    requests aborted mid-prefill/decode: outputs stay right, no slot or pin leaks."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # float32: batched and one-at-a-time runs then agree to the last printed digit
    # (in bf16 vLLM's own batched outputs drift from single runs, kvtier or not)
    llm = build_llm(
        model,
        extra,
        num_gpu_blocks_override=72,
        max_num_seqs=4,
        max_model_len=2048,
        dtype="float32",
    )
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    preempted = []
    orig_preempt = sched._preempt_request

    def counting_preempt(request, *a, **kw):
        preempted.append(request.request_id)
        return orig_preempt(request, *a, **kw)

    sched._preempt_request = counting_preempt
    prompts = [toks(60 + i, 1024 + 20 * i) for i in range(4)]
    alone = []
    for p in prompts:  # reference: one at a time, nothing preempted
        llm.reset_prefix_cache()
        alone.append(generate(llm, [p], max_tokens=160, ignore_eos=True)[0])
    llm.reset_prefix_cache()
    together = generate(llm, prompts, max_tokens=160, ignore_eos=True)  # 4 x 1,250 > 72 blocks
    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=64, temperature=0)
    for i in range(3):  # start requests and abort them part-way
        rid = f"abort-{i}"
        engine.add_request(rid, TokensPrompt(prompt_token_ids=toks(80 + i, 1100)), sp)
        for _ in range(2 + i):
            engine.step()
        engine.abort_request([rid])
    while engine.has_unfinished_requests():
        engine.step()
    settle(llm)
    return {
        "tokens_identical": all(
            a["tokens"] == t["tokens"] for a, t in zip(alone, together, strict=True)
        ),
        "max_logprob_diff": max(
            max_logprob_diff(a, t) for a, t in zip(alone, together, strict=True)
        ),
        "preemptions": len(preempted),
        "index": index_report(llm),
    }


SCENARIOS = {
    f.__name__: f
    for f in (
        shared_prefix,
        eviction,
        cycled_pool,
        start_only,
        remote_writer,
        remote_reader,
        one_step_reader,
        replica,
        prompts_run,
        outage,
        preempt_abort,
    )
}


def register(fn):
    """Other test modules add scenarios by importing this module and decorating. Also into
    the running script's table: when engine.py runs as ``__main__`` and a scenario module
    was imported under the package name first, that is a second copy of this module
    whose SCENARIOS dict main() never reads."""
    SCENARIOS[fn.__name__] = fn
    table = getattr(sys.modules.get("__main__"), "SCENARIOS", None)
    if isinstance(table, dict) and table is not SCENARIOS:
        table[fn.__name__] = fn
    return fn


def main() -> None:
    name, args = sys.argv[1], json.loads(sys.argv[2])
    # scenario modules import tests.e2e.engine: let them register into this module
    sys.modules.setdefault("tests.e2e.engine", sys.modules[__name__])
    extra_modules = os.environ.get("KVTIER_TEST_SCENARIO_MODULES", "")
    for mod in filter(None, extra_modules.split(",")):
        __import__(mod)
    result = SCENARIOS[name](**args)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # skip vLLM's slow interpreter teardown


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    main()
