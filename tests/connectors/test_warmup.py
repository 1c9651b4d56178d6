"""Warm-up (``warmup: true``, issue 61): a starting worker reads its generation's hot list
from the manifest and the hottest chunks into its slab, within the budget and the timeout,
over a real directory tier (and a real Redis and S3 for one case); the scheduler holds
them until the engine trusts the generation (the canary rule) and then serves them as host
hits (connectors/worker/warmup.py)."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from copyfakes import make_caches

from kvtier import metrics
from kvtier.canary import MATCH, Trust
from kvtier.config import load_config
from kvtier.connectors.metadata import KVTierMetadata, StoreOp, UploadOp, WarmReport, WorkerKeys
from kvtier.connectors.scheduler.side import SchedulerSide
from kvtier.connectors.worker import side as worker_mod
from kvtier.connectors.worker import warmup
from kvtier.errors import TierUnavailable
from kvtier.host.index import ChunkIndex
from kvtier.hotset import HotList
from kvtier.keys import Namespace
from kvtier.objects import manifest
from kvtier.objects.remote import RemoteIO
from kvtier.objects.tiers import FileTier, open_tier
from kvtier.stats import series_id

NUM_BLOCKS, BS, BPC = 40, 32, 4
KV_FIRST = (2, NUM_BLOCKS, BS, 4, 16)  # 2 layers: a 64 KiB slot


def key(c: str) -> bytes:
    return c.encode() * 32


def _worker(
    tmp_path: Path,
    seed: int = 0,
    tier_cls: type[FileTier] = FileTier,
    url: str | None = None,
    **extra: Any,
) -> worker_mod.WorkerSide:
    """A worker on the directory tier at ``tmp_path`` (``url``: the tier of that URL)."""
    cfg = load_config(
        {
            "cpu_bytes": "4MiB",
            "chunk_size": BPC * BS,
            "remote_url": url or f"file://{tmp_path}",
            **extra,
        },
        environ={},
    )
    ns = Namespace("", None, "bfloat16", "auto", BS, BPC * BS, 1, fingerprint="f" * 32, label="m")

    def remote(c: Any) -> RemoteIO:
        tier = open_tier(cfg) if url else tier_cls(str(tmp_path), background_sweep=False)
        return RemoteIO(tier, threads=2, queue_depth=8, timeout_s=5, signer=None)

    w = worker_mod.WorkerSide(cfg, ns, NUM_BLOCKS, remote)
    w.register_kv_caches(make_caches(KV_FIRST, layers=2, seed=seed), rank=0, stage=0)
    return w


def _stop(w: worker_mod.WorkerSide) -> None:
    """Shut down, its manifest's last write over (it is joined for 2 s only at shutdown)."""
    if w.manifests is not None:
        w.manifests.close(timeout_s=60)
        w.manifests = None
    w.shutdown()


def _step(w: worker_mod.WorkerSide, step: int, **ops: Any) -> None:
    assert w.slab is not None
    meta = KVTierMetadata(step=step, host_bytes=w.slab.nbytes, trusted=True, **ops)
    w.start_load_kv(meta)
    w.wait_for_save(meta)


def _slot(w: worker_mod.WorkerSide, slot: int) -> bytes:
    assert w.slab is not None
    return bytes(w.slab.slot_memoryview(slot))


def _serving_engine(
    tmp_path: Path, hot: list[tuple[str, float]], url: str | None = None
) -> dict[str, bytes]:
    """An engine that stored and uploaded chunks a, b, c, d and stopped; then the fleet's hot
    list (``hot``: key letter and heat) in its generation's manifest. Returns each chunk's
    bytes."""
    w = _worker(tmp_path, url=url, canary_first_hit=False)
    letters = "abcd"
    _step(
        w,
        1,
        stores=[
            StoreOp(i + 1, i, [4 * i + j for j in range(4)], key(x)) for i, x in enumerate(letters)
        ],
    )
    _step(w, 2, uploads=[UploadOp(10 + i, i, key(x)) for i, x in enumerate(letters)])
    assert w.remote is not None and w.remote.flush(5.0) == 0
    chunks = {x: _slot(w, i) for i, x in enumerate(letters)}
    ns = w.namespace
    _stop(w)  # its manifest writer stopped: the list below is the stored one
    tier = (
        open_tier(load_config({"remote_url": url}, environ={}))
        if url
        else FileTier(str(tmp_path), background_sweep=False)
    )
    listed = HotList(time.time(), tuple((key(x), h) for x, h in hot))
    manifest.write_manifest(tier, manifest.Manifest.of(ns, time.time(), hot=listed), None)
    return chunks


def test_a_starting_worker_reads_the_hottest_chunks_into_its_slab(
    tmp_path: Path, caplog: Any, monkeypatch: Any
) -> None:
    chunks = _serving_engine(tmp_path, [("c", 9.0), ("z", 8.0), ("a", 5.0), ("b", 1.0)])
    monkeypatch.setattr(warmup, "LOG_EVERY_S", 0.0)  # progress at every poll
    with caplog.at_level(logging.INFO, logger="kvtier"):
        w = _worker(tmp_path, seed=1, warmup=True)
    report = w.warm
    assert report is not None and report.outcome == "done" and report.planned == 4
    # hottest first, slot i the i-th planned; "z" is not in the tier (a miss, slot 1 unused)
    assert report.chunks == ((key("c"), 0), (key("a"), 2), (key("b"), 3))
    assert report.busy == () and report.host_bytes == 4 * 2**20
    assert report.nbytes >= 3 * len(chunks["a"])
    for x, slot in (("c", 0), ("a", 2), ("b", 3)):
        assert _slot(w, slot) == chunks[x], x
    assert "warm-up done: 3 of 4 chunks" in caplog.text
    assert "1 not in the tier" in caplog.text
    assert re.search(r"warm-up: \d of 4 chunks \(\d+%\), ", caplog.text), caplog.text
    w.shutdown()


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_a_starting_worker_warms_from_a_real_redis_or_s3(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The same warm start over a real redis-server and a real S3 endpoint on loopback."""
    url = request.getfixturevalue("redis_url" if kind == "redis" else "s3_bucket")
    url = url if isinstance(url, str) else url.url
    chunks = _serving_engine(tmp_path, [("d", 9.0), ("b", 5.0), ("z", 4.0)], url=url)
    w = _worker(tmp_path, seed=1, url=url, warmup=True)
    report = w.warm
    assert report is not None and report.outcome == "done" and report.planned == 3
    assert report.chunks == ((key("d"), 0), (key("b"), 1))
    for x, slot in (("d", 0), ("b", 1)):
        assert _slot(w, slot) == chunks[x], x
    w.shutdown()


def test_warm_up_stays_within_warmup_bytes(tmp_path: Path) -> None:
    _serving_engine(tmp_path, [("d", 9.0), ("c", 8.0), ("b", 5.0), ("a", 1.0)])
    w = _worker(tmp_path, warmup=True, warmup_bytes="128KiB")  # two 64 KiB slots
    assert w.warm is not None
    assert w.warm.chunks == ((key("d"), 0), (key("c"), 1)) and w.warm.planned == 2
    w.shutdown()


def test_a_warm_up_past_its_timeout_starts_the_engine_with_what_landed(tmp_path: Path) -> None:
    _serving_engine(tmp_path, [("a", 9.0), ("b", 8.0)])
    w = _worker(tmp_path, warmup=True, warmup_timeout_s=0)
    assert w.warm is not None and w.warm.outcome == "timeout" and w.warm.chunks == ()
    w.shutdown()


def test_a_timeout_near_vllms_own_wait_for_the_engine_is_warned_about(
    tmp_path: Path, caplog: Any, monkeypatch: Any
) -> None:
    monkeypatch.setenv("VLLM_ENGINE_READY_TIMEOUT_S", "100")
    with caplog.at_level(logging.INFO, logger="kvtier"):
        w = _worker(tmp_path, warmup=True, warmup_timeout_s=50)
    assert "VLLM_ENGINE_READY_TIMEOUT_S 100 s" in caplog.text
    w.shutdown()


def test_a_bad_manifest_or_no_hot_list_is_a_cold_start_never_an_error(
    tmp_path: Path, caplog: Any
) -> None:
    w = _worker(tmp_path, warmup=True)  # an empty tier: this engine claims the generation
    assert w.warm is not None and w.warm.chunks == () and w.warm.outcome == "cold"
    gen = w.namespace.generation()
    _stop(w)
    FileTier(str(tmp_path), background_sweep=False).put(
        manifest.manifest_key(gen), [b"not a manifest"]
    )
    with caplog.at_level(logging.INFO, logger="kvtier"):  # (checking: it writes no manifest)
        w = _worker(tmp_path, warmup=True, canary_first_hit=True)
    assert w.warm is not None and w.warm.chunks == ()
    assert "warm-up could not read generation" in caplog.text, caplog.records
    w.shutdown()


class DownTier(FileTier):
    """A tier that does not answer."""

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        raise TierUnavailable("connection refused")


class SlowTier(FileTier):
    """A tier whose chunk reads take 2 s each."""

    def read_into_hashed(self, *args: Any, **kw: Any) -> Any:
        time.sleep(2.0)
        return super().read_into_hashed(*args, **kw)


def test_a_tier_that_is_down_is_a_cold_start(tmp_path: Path, caplog: Any) -> None:
    _serving_engine(tmp_path, [("a", 9.0)])
    with caplog.at_level(logging.INFO, logger="kvtier"):
        w = _worker(tmp_path, tier_cls=DownTier, warmup=True)
    assert w.warm is not None and w.warm.chunks == () and w.warm.outcome == "cold"
    assert "connection refused): the engine starts cold" in caplog.text
    w.shutdown()


def test_reads_still_running_at_the_timeout_keep_their_slots(tmp_path: Path) -> None:
    """Two read threads, each 2 s a chunk, a 0.5 s budget: nothing landed, and the two reads
    begun are still writing their slots when warm-up ends (the scheduler keeps those slots
    out of use); the engine starts anyway, within the timeout and the settle time."""
    _serving_engine(tmp_path, [("a", 9.0), ("b", 8.0), ("c", 7.0)])
    t0 = time.monotonic()
    w = _worker(tmp_path, tier_cls=SlowTier, warmup=True, warmup_timeout_s=0.5)
    assert time.monotonic() - t0 < 0.5 + warmup.SETTLE_S + 1.5
    assert w.warm is not None and w.warm.outcome == "timeout" and w.warm.chunks == ()
    assert len(w.warm.busy) == 2 and set(w.warm.busy) <= {0, 1, 2}, w.warm
    w.shutdown()


def test_the_index_holds_reserved_slots_out_of_use_until_adopted_or_released() -> None:
    index = ChunkIndex(4)
    assert index.reserve([2, 0, 9]) == [2, 0], "slot 9 does not exist: not taken"
    assert index.free_slots == 2
    index.check()
    entry = index.adopt(key("a"), 2)
    assert entry is not None and entry.slot == 2 and index.is_ready(key("a"))
    assert entry.remote and entry.warmed and not entry.fetched
    assert index.adopt(key("a"), 0) is None, "present already"
    assert index.adopt(key("b"), 3) is None, "slot 3 was not reserved"
    index.release(0)
    index.release(3)  # not reserved: nothing happens
    assert index.free_slots == 3
    index.check()


def test_late_warm_up_reads_are_no_ones_results(tmp_path: Path) -> None:
    w = _worker(tmp_path)
    from kvtier.ops import OpKind, OpResult

    w._remote_result(OpResult(-3, OpKind.FETCH, True))
    assert w.build_worker_meta().results == {}
    w.shutdown()


# ---- the scheduler: held until trusted -------------------------------------------------------


def _side(tmp_path: Path, **extra: Any) -> SchedulerSide:
    """A scheduler side with the first-hit canary on, unless ``extra`` says otherwise."""
    from tests.connectors.scheduler.test_scheduler_side import make_side

    return make_side(
        "4MiB",
        {"remote_url": f"file://{tmp_path}", "warmup": True, "canary_first_hit": True, **extra},
    )


def _prompt(n: int = 2) -> tuple[SimpleNamespace, list[bytes]]:
    from tests.connectors.scheduler.test_scheduler_side import BPC as SBPC
    from tests.connectors.scheduler.test_scheduler_side import CHUNK, request

    req = request("w", 7, n * CHUNK + 10)
    return req, [req.block_hashes[(c + 1) * SBPC - 1] for c in range(n)]


def _hand_shake(
    side: SchedulerSide, chunks: list[bytes], *, fresh: bool | None = None, **report: Any
) -> None:
    warm = WarmReport(
        chunks=tuple((k, i) for i, k in enumerate(chunks)),
        nbytes=1000,
        seconds=1.5,
        planned=len(chunks),
        host_bytes=side.host_bytes,
        outcome="done",
        **report,
    )
    side.set_worker_keys([WorkerKeys(side.namespace, 0, 0, fresh_generation=fresh, warm=warm)])


def test_with_the_canary_off_warmed_chunks_are_host_hits_at_once(tmp_path: Path) -> None:
    from tests.connectors.scheduler.test_scheduler_side import CHUNK, schedule_new

    side = _side(tmp_path, canary_first_hit=False)
    req, chunks = _prompt()
    _hand_shake(side, chunks)
    assert side.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, False)
    side._kv_cache_manager.blocks[req.request_id] = list(range(100, 120))
    side.update_state_after_alloc(req, None, 2 * CHUNK)
    assert side._reqs["w"].hit_sources == {"host": 2 * CHUNK}, "a host hit, not a fetch"
    meta = schedule_new(side, req, 2 * CHUNK, 10)
    assert [op.slot for op in meta.loads] == [0, 1]
    data = side.get_stats()
    assert data["counters"][series_id(metrics.WARMUP_HIT_TOKENS)] == 2 * CHUNK
    assert data["counters"][series_id(metrics.WARMUP_BYTES)] == 1000
    assert data["gauges"][series_id(metrics.WARMUP_SECONDS)] == 1.5
    entry = side.index.get(chunks[0])
    assert entry is not None and entry.remote and entry.warmed, "never uploaded again"
    side.index.check()


def test_warmed_chunks_of_an_unchecked_generation_wait_for_its_checks(tmp_path: Path) -> None:
    """The canary rule: a generation this engine has not checked is not loaded from, warm
    or not; once its own chunks matched the stored ones, the warmed ones are hits."""
    from tests.connectors.scheduler.test_scheduler_side import CHUNK

    side = _side(tmp_path)
    req, chunks = _prompt()
    _hand_shake(side, chunks, fresh=False)
    assert side.canary.trust.state is Trust.CHECKING
    assert side.warm.held == {chunks[0]: 0, chunks[1]: 1}
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.request_finished(req, [])
    assert side.index.free_slots == side.index.num_slots - 2, "their slots are kept"
    side.index.check()
    trust = side.canary.trust
    while trust.state is not Trust.TRUSTED:
        trust.checked(MATCH)
    side._trust_changed(trust.state)  # as CanaryChecks tells it
    assert side.warm.held == {} and side.warm.adopted == 2
    req, _ = _prompt()
    assert side.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, False)
    side.index.check()


def test_a_refused_or_unchecked_trust_drops_the_warmed_chunks(tmp_path: Path) -> None:
    side = _side(tmp_path)
    _req, chunks = _prompt()
    _hand_shake(side, chunks, fresh=False)
    side._trust_changed(side.canary.trust.checked("mismatch"))  # the engine forks
    assert side.warm.held == {} and side.index.free_slots == side.index.num_slots
    side.index.check()
    # trusted without a check of its chunks (a generation re-claimed as empty): dropped
    side = _side(tmp_path)
    _hand_shake(side, chunks, fresh=False)
    side.canary.first_writer(True)
    assert side.canary.trusted and side.warm.held == {} and side.warm.adopted == 0
    assert side.index.get(chunks[0]) is None
    side.index.check()


def test_a_weight_change_or_a_reset_drops_held_chunks(tmp_path: Path) -> None:
    side = _side(tmp_path)
    _req, chunks = _prompt()
    _hand_shake(side, chunks, fresh=False)
    side.weights_changed("reload_weights")  # trusted now (its own generation): not adopted
    assert side.warm.held == {} and side.warm.adopted == 0
    assert side.index.get(chunks[0]) is None
    side = _side(tmp_path)
    _hand_shake(side, chunks, fresh=False)
    side.reset_cache()
    assert side.warm.held == {} and side.index.free_slots == side.index.num_slots


def test_only_chunks_every_worker_read_into_the_same_slot_are_taken(tmp_path: Path) -> None:
    from tests.connectors.scheduler.test_scheduler_side import make_side

    side = make_side(
        "4MiB", {"remote_url": f"file://{tmp_path}", "warmup": True, "canary_first_hit": False}
    )
    side.world_size = side.warm.world_size = 2
    _req, chunks = _prompt(3)
    a = WarmReport(
        chunks=((chunks[0], 0), (chunks[1], 1), (chunks[2], 2)),
        busy=(5,),
        host_bytes=side.host_bytes,
    )
    b = WarmReport(chunks=((chunks[0], 0), (chunks[2], 1)), host_bytes=side.host_bytes)
    side.set_worker_keys(
        [WorkerKeys(side.namespace, 0, 0, warm=a), WorkerKeys(side.namespace, 1, 0, warm=b)]
    )
    assert side.index.get(chunks[0]) is not None
    assert side.index.get(chunks[1]) is None and side.index.get(chunks[2]) is None
    # slot 5: a read may still write it: never handed out
    assert side.index.free_slots == side.index.num_slots - 2
    side.index.check()


def test_the_slab_a_worker_read_into_must_be_the_one_the_scheduler_sized(tmp_path: Path) -> None:
    side = _side(tmp_path, canary_first_hit=False)
    _req, chunks = _prompt()
    _hand_shake(side, chunks[:1])
    assert side.index.get(chunks[0]) is not None
    side = _side(tmp_path, canary_first_hit=False)
    warm = WarmReport(chunks=((chunks[0], 0),), host_bytes=side.host_bytes // 2)
    side.set_worker_keys([WorkerKeys(side.namespace, 0, 0, warm=warm)])
    assert side.index.get(chunks[0]) is None and side.index.free_slots == side.index.num_slots
