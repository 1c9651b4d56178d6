"""``may_load_async`` (vLLM >= 0.34): which requests may start their lookup while the batch is full.

vLLM asks it as a request enters the waiting queues; with ``--max-num-inflight-kv-loads``
a yes puts the request where ``get_num_new_matched_tokens`` is asked even while the
running batch is full, so kvtier's object-tier fetches start early. The answer must be
cheap and must match what the lookup then does: yes exactly when it goes to the object
tier (configured, reading, the host tier lacking the prompt's last loadable chunk).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from faketier import FakeTier, make_rio

from kvtier.config import load_config
from kvtier.connectors.metadata import KVTierWorkerMeta
from kvtier.connectors.worker.side import WorkerSide
from kvtier.keys import Namespace
from kvtier.objects.health import ConstantBackoff
from tests.connectors.scheduler.test_scheduler_side import (
    BS,
    CHUNK,
    empty_step,
    make_side,
    remote_side,
    report,
    request,
    schedule_new,
)


def worker_report(side, reads_down_s: float) -> None:
    out = KVTierWorkerMeta(steps=[], results={}, reads_down_s=reads_down_s)
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=out))


def host_holds(side, prefix: int, n_chunks: int) -> None:
    """The host tier holds the first ``n_chunks`` chunks of prompts of ``prefix``: a
    request of that prefix looked up (nothing in the object tier), computed, stored."""
    if n_chunks == 0:
        return
    req = request(f"fill-{prefix}-{n_chunks}", prefix, n_chunks * CHUNK + 10)
    if side.get_num_new_matched_tokens(req, 0) == (None, False):
        report(side, empty_step(side), ok=False)  # the object tier has none of it
        side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, None, 0)
    report(side, schedule_new(side, req, 0, req.num_tokens))
    side.request_finished(req, [])


def test_without_an_object_tier_no_request_may_load_async() -> None:
    side = make_side()
    assert not side.may_load_async(request("a", 1, 4 * CHUNK + 10))


@pytest.mark.parametrize("n_chunks", [4, 5])
@pytest.mark.parametrize("held", [0, 1, 3, 4])
def test_the_answer_is_exactly_whether_the_lookup_goes_to_the_object_tier(
    n_chunks: int,
    held: int,
) -> None:
    """For every host-tier state of a prompt (none, part, all of its chunks), may_load_async
    says yes exactly when the lookup that follows queues object-tier fetches."""
    side = remote_side()
    host_holds(side, 1, held)
    req = request("a", 1, n_chunks * CHUNK + 10)
    predicted = side.may_load_async(req)
    answer = side.get_num_new_matched_tokens(req, 0)
    fetched = [op for run in empty_step(side).fetches for op in run]
    assert predicted == bool(fetched), (held, n_chunks, answer)
    assert predicted == (held < n_chunks)


@pytest.mark.parametrize("tokens", [CHUNK - 1, CHUNK, CHUNK + 1])
def test_a_prompt_the_lookup_cannot_load_from_says_no(tokens: int) -> None:
    """A prompt without a full chunk, or whose only chunk ends at its last token (vLLM
    computes that token itself), says what the lookup does."""
    side = remote_side()
    req = request("a", 1, tokens)
    predicted = side.may_load_async(req)
    side.get_num_new_matched_tokens(req, 0)
    assert predicted == bool(empty_step(side).fetches), tokens


def test_no_while_the_workers_reads_fail_fast_and_yes_once_they_are_back() -> None:
    side = remote_side()
    req = request("a", 1, 4 * CHUNK + 10)
    assert side.may_load_async(req)
    worker_report(side, reads_down_s=30.0)
    assert not side.may_load_async(req)
    worker_report(side, reads_down_s=0.0)  # a read reached the tier again
    assert side.may_load_async(req)
    worker_report(side, reads_down_s=0.02)
    assert not side.may_load_async(req)
    time.sleep(0.03)  # the backoff ran out: the workers read again, so may the lookup
    assert side.may_load_async(req)


def test_the_lookup_itself_is_unchanged_while_reads_fail_fast() -> None:
    """Only the early start is withheld: vLLM < 0.34 (no hook) and a request that reaches
    the lookup anyway see the same lookup as before."""
    side = remote_side()
    worker_report(side, reads_down_s=30.0)
    req = request("a", 1, 4 * CHUNK + 10)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    assert len(empty_step(side).fetches) == 1


def test_no_again_once_the_requests_lookup_finished() -> None:
    """A preempted request re-enters the waiting queue: its lookup is over, the host tier
    has what it found, no second lookup goes out."""
    side = remote_side()
    req = request("a", 1, 4 * CHUNK + 10)
    assert side.may_load_async(req)
    side.get_num_new_matched_tokens(req, 0)
    report(side, empty_step(side), ok=False)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert not side.may_load_async(req)
    side.get_num_new_matched_tokens(req, 0)
    assert empty_step(side).fetches == []


def test_the_answer_hashes_nothing_and_probes_one_key(monkeypatch: pytest.MonkeyPatch) -> None:
    side = remote_side()
    req = request("a", 1, 64 * CHUNK + 10)
    probes: list[bytes] = []
    real = side.index.is_ready
    monkeypatch.setattr(side.index, "is_ready", lambda k: probes.append(k) or real(k))
    assert side.may_load_async(req)
    assert probes == [req.block_hashes[64 * (CHUNK // BS) - 1]]
    assert "a" not in side._reqs, "asking creates no request state"


def test_workers_report_how_long_their_reads_fail_fast_and_the_longest_counts() -> None:
    cfg = load_config({"cpu_bytes": "1MiB", "remote_url": "file:///nonexistent"}, environ={})
    ns = Namespace("m", None, "bfloat16", "auto", BS, CHUNK, 1)
    worker = WorkerSide(cfg, ns, 8)
    assert worker.build_worker_meta().reads_down_s == 0.0  # no tier opened yet
    worker.remote = make_rio(FakeTier(), backoff=ConstantBackoff(5.0))
    health = worker.remote.health
    assert worker.reads_down_s() == 0.0
    health.failed(False, OSError("unreachable"))
    down = worker.reads_down_s()
    assert 4.0 < down <= 5.0
    health.failed(True, OSError("writes only"))  # a write failure leaves reads up
    health.succeeded(False)
    assert worker.reads_down_s() == 0.0
    health.failed(False, OSError("unreachable"))
    worker.remote.close()
    worker.remote = None  # what the step's report carries is that figure
    worker.reads_down_s = lambda: 3.0  # type: ignore[method-assign]
    assert worker.build_worker_meta().reads_down_s == 3.0
    merged = KVTierWorkerMeta(reads_down_s=0.0).aggregate(KVTierWorkerMeta(reads_down_s=2.5))
    assert isinstance(merged, KVTierWorkerMeta) and merged.reads_down_s == 2.5
