"""The scheduler side with fakes of vLLM's objects: claims, stores, pins and reports.

The real-engine tests in tests/e2e cover the same paths inside vLLM; these pin
down the arithmetic (block-granular claims, which blocks each op moves) exactly.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.config import load_config
from kvtier.connectors.engine_shape import EngineShape
from kvtier.connectors.metadata import KVTierWorkerMeta
from kvtier.connectors.scheduler.side import SchedulerSide
from kvtier.keys import Namespace

BS, CHUNK = 32, 256
BPC = CHUNK // BS


def make_side(cpu_bytes: str = "4MiB", extra: dict | None = None) -> SchedulerSide:
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BS, cpu_offload_gb=0),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model="/nonexistent/model"),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192),
        offload_config=None,
    )
    # 2 layers x 4 KiB per block -> a 64 KiB slot per chunk
    kv_cache_config = SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(
                kv_cache_spec=SimpleNamespace(page_size_bytes=4096), layer_names=["l0", "l1"]
            )
        ]
    )
    cfg = load_config(
        {"cpu_bytes": cpu_bytes, "cpu_headroom_bytes": 0, **(extra or {})}, environ={}
    )
    ns = Namespace(
        model="m",
        revision=None,
        dtype="bfloat16",
        kv_cache_dtype="auto",
        block_size=BS,
        chunk_size=CHUNK,
        tp_size=1,
    )
    shape = EngineShape.from_vllm(vllm_config, kv_cache_config)  # type: ignore[arg-type]
    side = SchedulerSide(cfg, shape, ns)
    side.bind_kv_cache_manager(FakeManager())
    return side


class FakeManager:
    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return (self.blocks[req_id],)


def request(rid: str, prefix: int, n_tokens: int) -> SimpleNamespace:
    """A request whose block hashes depend on ``prefix`` (same prefix = same hashes)."""
    hashes = [f"{prefix}-{i}".encode().ljust(32, b"\0") for i in range(n_tokens // BS)]
    return SimpleNamespace(
        request_id=rid,
        block_hashes=hashes,
        num_tokens=n_tokens,
        num_prompt_tokens=n_tokens,
        arrival_time=0.0,
    )


def schedule_new(side: SchedulerSide, req, computed: int, n: int, first_block: int = 100):
    side._kv_cache_manager.blocks[req.request_id] = list(
        range(first_block, first_block + -(-req.num_tokens // BS))
    )
    so = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, num_computed_tokens=computed)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={req.request_id: n},
        scheduled_spec_decode_tokens={},
    )
    return side.build_connector_meta(so)


def op_ids(meta) -> list[int]:
    fetches = [op for run in meta.fetches + meta.fetches_now for op in run]
    return [op.op_id for op in meta.loads + meta.stores + fetches + meta.uploads]


def report(side: SchedulerSide, meta, ok: bool = True, results: dict | None = None) -> None:
    """The workers' answer: every op ``ok``, except those ``results`` names."""
    out = KVTierWorkerMeta(
        steps=[meta.step], results={i: [ok] for i in op_ids(meta)} | (results or {})
    )
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=out))


def answer(side: SchedulerSide, results: dict[int, list[bool]]) -> None:
    """Worker results that arrive on their own (an object-tier fetch finishing late)."""
    out = KVTierWorkerMeta(steps=[], results=results)
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=out))


def decode_step(side: SchedulerSide, computed: dict[str, int]):
    """A step that schedules one token for each running request (request id -> tokens
    computed before the step); with none, vLLM's loop while a request waits."""
    so = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(computed), num_computed_tokens=list(computed.values())
        ),
        num_scheduled_tokens=dict.fromkeys(computed, 1),
        scheduled_spec_decode_tokens={},
    )
    return side.build_connector_meta(so)


def empty_step(side: SchedulerSide):
    """A step that schedules nothing (vLLM's loop while a request waits for its lookup)."""
    return decode_step(side, {})


def store_prompt(side: SchedulerSide, req) -> None:
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, None, 0)
    meta = schedule_new(side, req, 0, req.num_tokens)
    report(side, meta)
    side.request_finished(req, [])


def test_stores_every_full_chunk_with_its_blocks() -> None:
    side = make_side()
    req = request("a", 1, 2048 + 40)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, None, 0)
    meta = schedule_new(side, req, 0, req.num_tokens, first_block=100)
    assert len(meta.stores) == 8  # the partial ninth chunk is not stored
    assert meta.stores[2].gpu_blocks == list(range(100 + 2 * BPC, 100 + 3 * BPC))
    assert len({s.slot for s in meta.stores}) == 8
    report(side, meta)
    assert side.index.used_slots == 8 and side.index.total_refs() == 0


def test_stores_wait_until_vllm_marks_block_hashes_publishable() -> None:
    """Newer vLLM hashes EAGLE blocks before their KV is final; only publishable ones key."""
    side = make_side()
    req = request("a", 1, 2048)
    req.num_publishable_block_hashes = 3 * BPC + 2
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, None, 0)
    meta = schedule_new(side, req, 0, req.num_tokens, first_block=100)
    assert len(meta.stores) == 3
    report(side, meta)
    req.num_publishable_block_hashes = len(req.block_hashes)
    meta = decode_step(side, {"a": 2048})
    assert [op.gpu_blocks[0] for op in meta.stores] == [100 + c * BPC for c in range(3, 8)]


def test_claims_at_block_granularity_up_to_the_last_token() -> None:
    side = make_side()
    store_prompt(side, request("a", 1, 2048))
    b = request("b", 1, 2048)
    # a fully stored 2,048-token prompt loads 2,016 tokens: vLLM computes the last block
    assert side.get_num_new_matched_tokens(b, 0) == (2016, False)
    side._kv_cache_manager.blocks["b"] = list(range(500, 564))
    side.update_state_after_alloc(b, None, 2016)
    assert side.index.total_refs() == 8  # every chunk pinned until its load is reported
    meta = schedule_new(side, b, 2016, 32, first_block=500)
    assert len(meta.loads) == 8
    last = meta.loads[-1]
    assert last.first == 0 and last.gpu_blocks == list(range(500 + 56, 500 + 63))
    assert meta.stores == []  # already in the host tier
    report(side, meta)
    assert side.index.total_refs() == 0
    assert side.totals["hit_tokens_host"] == 2016
    assert side.get_external_cache_hit_sources(b, 2016)


def test_claim_starts_after_vllms_own_prefix_hit() -> None:
    side = make_side()
    store_prompt(side, request("a", 1, 2048))
    b = request("b", 1, 2048)
    n, is_async = side.get_num_new_matched_tokens(b, 1056)  # mid-chunk local hit
    assert (n, is_async) == (2016 - 1056, False)
    side._kv_cache_manager.blocks["b"] = list(range(64))
    side.update_state_after_alloc(b, None, n)
    meta = schedule_new(side, b, 2016, 32, first_block=0)
    # chunk 4 covers tokens 1024..1280: only its blocks 1..7 are loaded
    assert meta.loads[0].first == 1 and meta.loads[0].gpu_blocks == list(range(33, 40))
    assert sum(len(op.gpu_blocks) for op in meta.loads) * BS == n
    assert side.totals["lookup_tokens"] == 2016 * 2 - 1056 - 0


def test_failed_store_is_rolled_back_and_never_a_hit() -> None:
    side = make_side()
    req = request("a", 7, 1024)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, None, 0)
    meta = schedule_new(side, req, 0, 1024)
    report(side, meta, ok=False)
    assert side.index.used_slots == 0
    assert side.get_num_new_matched_tokens(request("b", 7, 1024), 0) == (0, False)


def test_different_prefix_is_a_miss_and_abort_leaks_nothing() -> None:
    side = make_side()
    store_prompt(side, request("a", 1, 1024))
    other = request("b", 2, 1024)
    assert side.get_num_new_matched_tokens(other, 0) == (0, False)
    side.request_finished(other, [])  # aborted before it was scheduled
    assert side.open_requests() == 0 and side.pending_ops() == 0


@pytest.mark.parametrize("tokens", [31, 32, 33, 255, 256, 257])
def test_short_prompts_claim_nothing_they_cannot_load(tokens: int) -> None:
    side = make_side()
    store_prompt(side, request("a", 3, 512))
    n, _ = side.get_num_new_matched_tokens(request("b", 3, tokens), 0)
    # a chunk is keyed once it is full; then every block before the last token loads
    assert n == ((tokens - 1) // BS * BS if tokens >= CHUNK else 0)


def test_stores_with_every_slot_busy_are_skipped_and_counted() -> None:
    """A host tier of 2 slots, 4 chunks computed in one step: 2 stores, 2 counted skips."""
    from kvtier import metrics
    from kvtier.stats import series_id

    side = make_side(cpu_bytes="128KiB")  # two 64 KiB slots
    req = request("a", 1, 4 * CHUNK + 8)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, None, 0)
    side.stats.take()
    meta = schedule_new(side, req, 0, req.num_tokens)
    assert len(meta.stores) == 2  # both slots are now STORING, nothing evictable
    assert side.totals["stores_skipped"] == 2
    counters = side.stats.take()["counters"]
    assert counters[series_id(metrics.STORES_SKIPPED)] == 2
    report(side, meta)
    assert side.index.used_slots == 2 and side.index.total_refs() == 0


def write_back_side(cpu_bytes: str) -> SchedulerSide:
    extra = {"remote_url": "file:///nonexistent", "write_policy": "write_back"}
    return make_side(cpu_bytes, extra)


def run_prompt(side: SchedulerSide, req, first_block: int):
    """Look up, schedule and finish one prompt as vLLM does; the metadata of the step that
    computed it, with the uploads of the steps that ran while its lookup waited."""
    uploads = []
    while side.get_num_new_matched_tokens(req, 0) == (None, False):
        meta = empty_step(side)  # the object tier holds nothing: every fetch fails
        report(side, meta, results={op.op_id: [False] for run in meta.fetches for op in run})
        uploads += meta.uploads
    side.update_state_after_alloc(req, None, 0)
    meta = schedule_new(side, req, 0, req.num_tokens, first_block=first_block)
    report(side, meta)
    side.request_finished(req, [])
    meta.uploads = uploads + meta.uploads
    return meta


def test_write_back_keeps_the_newest_prompt_whole_and_uploads_what_it_evicts() -> None:
    """A host tier of 12 slots, prompts of 4 chunks: every prompt is stored whole (the
    oldest chunks were uploaded ahead of time and are evicted at once), the chunks that
    leave were all uploaded first, and nothing is left pinned."""
    side = write_back_side("768KiB")  # 12 slots of 64 KiB
    assert side.index.num_slots == 12 and side.write_back.clean_reserve == 6
    uploaded: set[bytes] = set()
    stored: list[bytes] = []
    for i in range(10):
        req = request(f"r{i}", 100 + i, 4 * CHUNK)
        meta = run_prompt(side, req, first_block=100 + 20 * i)
        assert len(meta.stores) == 4, (i, side.totals)  # never skipped
        stored += [op.block_hash for op in meta.stores]
        uploaded |= {op.block_hash for op in meta.uploads}
        if i == 0:
            assert not uploaded, "a tier with room enough uploads nothing ahead of time"
        # the newest prompt is a full hit
        again = request(f"again{i}", 100 + i, 4 * CHUNK)
        assert side.get_num_new_matched_tokens(again, 0)[0] == 4 * CHUNK - BS
        side.request_finished(again, [])
    evicted = [
        h for h in stored if not any(e.block_hash == h for e in side.index._entries.values())
    ]
    assert len(evicted) == 40 - 12
    assert set(evicted) <= uploaded, "a chunk left the host tier without being uploaded"
    assert side.totals["stores_skipped"] == 0
    assert side.index.total_refs() == 0
    side.index.check()


def remote_side(cpu_bytes: str = "4MiB") -> SchedulerSide:
    return make_side(cpu_bytes, {"remote_url": "file:///nonexistent", "write_policy": "none"})


def test_a_lookup_is_one_run_of_fetches_and_stops_at_the_first_miss() -> None:
    """No existence check: the lookup claims slots for the prompt's chunks and sends their
    fetches as one ordered run; the hit is the prefix up to the first failed chunk, whose
    slot (and those behind it) are freed, and nothing stays pinned."""
    side = remote_side()
    req = request("a", 1, 4 * CHUNK + 10)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    meta = empty_step(side)
    assert len(meta.fetches) == 1
    run = meta.fetches[0]
    assert [op.block_hash for op in run] == side._reqs["a"].chunk_hashes[:4]
    assert len({op.slot for op in run}) == 4
    assert side.get_num_new_matched_tokens(req, 0) == (None, False), "fetches not reported"
    # chunk 2 is missing: chunk 3 was fetched anyway (in flight before the miss was known)
    report(side, meta, results={run[2].op_id: [False]})
    assert side.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, False)
    assert side.index.used_slots == 3  # 0, 1 and the orphan 3 are ready; 2's slot is free
    assert side.index.is_ready(side._reqs["a"].chunk_hashes[3])
    assert side.pending_ops() == 0 and side.index.total_refs() == 0
    assert empty_step(side).fetches == [], "a finished lookup fetches nothing more"


def test_a_lookup_waits_only_for_the_prefix() -> None:
    """Once chunk 0 failed, the answer is known (no hit) while chunks 1-3 are in flight."""
    side = remote_side()
    req = request("a", 1, 4 * CHUNK + 10)
    side.get_num_new_matched_tokens(req, 0)
    run = empty_step(side).fetches[0]
    answer(side, {run[0].op_id: [False]})
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)


def test_a_prefix_being_fetched_for_another_request_is_waited_on_not_fetched_again() -> None:
    side = remote_side()
    a, b = request("a", 1, 4 * CHUNK + 10), request("b", 1, 4 * CHUNK + 10)
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)
    meta = empty_step(side)
    assert side.get_num_new_matched_tokens(b, 0) == (None, False)
    assert empty_step(side).fetches == [], "b's chunks are a's fetches"
    report(side, meta)
    assert side.get_num_new_matched_tokens(b, 0) == (4 * CHUNK, False)
    assert side.get_num_new_matched_tokens(a, 0) == (4 * CHUNK, False)


def test_a_lookup_keeps_the_host_part_of_its_prompt() -> None:
    """A full host tier: the claims for the remote part evict other prompts' chunks,
    never the chunks this prompt is about to load from the host tier."""
    side = remote_side("512KiB")  # 8 slots
    old = request("old", 2, 4 * CHUNK)
    mine = request("mine", 1, 8 * CHUNK + 10)
    # the first 4 chunks of `mine` in the host tier, older than `old`'s
    first_half = request("half", 1, 4 * CHUNK + 10)
    for r in (first_half, old):
        side.get_num_new_matched_tokens(r, 0)
        report(side, empty_step(side), ok=False)
        side.get_num_new_matched_tokens(r, 0)
        side.update_state_after_alloc(r, None, 0)
        report(side, schedule_new(side, r, 0, r.num_tokens))
        side.request_finished(r, [])
    assert side.index.used_slots == 8
    assert side.get_num_new_matched_tokens(mine, 0) == (None, False)
    meta = empty_step(side)
    assert len(meta.fetches[0]) == 4  # chunks 4-7
    report(side, meta)
    assert side.get_num_new_matched_tokens(mine, 0) == (8 * CHUNK, False)


def test_chunks_still_being_fetched_behind_a_miss_are_stored_at_once() -> None:
    """Chunk 0 misses and the lookup ends while chunks 1-3 are in flight; the request is
    computed at once and stores all four in that step, into other slots than the fetches'
    (tests/connectors/scheduler/test_store_then_hit.py: the request may have no later step)."""
    side = remote_side()
    req = request("a", 1, 4 * CHUNK + 10)
    side.get_num_new_matched_tokens(req, 0)
    run = empty_step(side).fetches[0]
    answer(side, {run[0].op_id: [False]})
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, None, 0)
    meta = schedule_new(side, req, 0, req.num_tokens)
    assert [op.block_hash for op in meta.stores] == side._reqs["a"].chunk_hashes[:4]
    report(side, meta)
    assert side.index.used_slots == 7, "the fetches' slots are held until they report"
    answer(side, {op.op_id: [False] for op in run[1:]})
    assert decode_step(side, {"a": req.num_tokens}).stores == []
    assert side.index.used_slots == 4 and side.pending_ops() == 0


def test_lookups_and_stores_hash_nothing_and_decode_steps_refresh_nothing(monkeypatch) -> None:
    """The cost of a lookup grows with what it finds, not with the prompt: the index is
    keyed by vLLM's own hash of each chunk's last block (the very object the request
    holds), so a 32k-token miss and its 128 stores make no hash; decode steps that
    complete no chunk refresh nothing."""
    import kvtier.keys as keys_mod

    made = []
    real = keys_mod.chunk_key
    monkeypatch.setattr(keys_mod, "chunk_key", lambda ns, h: (made.append(h), real(ns, h))[1])
    side = make_side("64MiB")
    req = request("long", 7, 32768 + 10)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, None, 0)
    meta = schedule_new(side, req, 0, req.num_tokens)
    assert len(meta.stores) == 128
    report(side, meta)
    assert made == [], "the scheduler made object keys"
    for c in (0, 127):
        last_block = req.block_hashes[(c + 1) * BPC - 1]
        entry = side.index.get(last_block)
        assert entry is not None and entry.key is last_block and entry.block_hash is last_block
    calls = []
    monkeypatch.setattr(side.keys, "refresh", lambda st: calls.append(st))
    for step in range(1, 20):
        assert decode_step(side, {"long": req.num_tokens + step}).stores == []
    assert calls == [], "a decode step that completes no chunk refreshed keys"


def test_every_lookup_call_is_one_sync_delay_sample_when_stats_are_taken() -> None:
    """The hook buffers its own latency (a list append) and hands it over with the
    stats: one sample per call, none lost and none counted twice."""
    from kvtier import metrics
    from kvtier.stats import series_id

    side = make_side()
    store_prompt(side, request("a", 3, 512))
    side.get_stats()
    for i in range(5):
        side.get_num_new_matched_tokens(request(f"b{i}", 3 + i % 2, 512), 0)
    sid = series_id(metrics.LOOKUP_DELAY, ("sync",))
    samples = side.get_stats()["samples"][sid]
    assert len(samples) == 5 and all(0 <= s < 1 for s in samples), samples
    side.get_num_new_matched_tokens(request("c", 3, 512), 0)
    assert len(side.get_stats()["samples"][sid]) == 1
    assert sid not in side.get_stats()["samples"]
