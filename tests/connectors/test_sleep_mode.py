"""Sleep mode (vLLM >= 0.33): which configurations may sleep, and the worker's hooks.

vLLM 0.33 asks ``supports_sleep_mode`` before it starts with ``enable_sleep_mode``,
calls ``reset_cache`` when it pauses for sleep, ``unregister_kv_caches`` before it
unmaps the KV cache and ``restore_kv_caches`` after it mapped it back. The CPU
build in ``.venv`` (0.32) has no sleep mode, so the hooks are driven here the way
0.33's ``gpu_worker.sleep``/``wake_up`` call them; tests/connectors/
test_vllm_conformance.py checks their names and signatures against 0.33's base.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtier.connectors.metadata import KVTierMetadata
from kvtier.connectors.vllm import KVTierConnector
from kvtier.host.index import ChunkIndex, State
from kvtier.ops import LoadOp, StoreOp, UploadOp


def ktc(extra: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(kv_connector_extra_config=extra)


def test_host_tier_only_supports_sleep_mode() -> None:
    assert KVTierConnector.supports_sleep_mode(ktc({"cpu_bytes": "1GiB"})) is True  # type: ignore[arg-type]
    assert KVTierConnector.supports_sleep_mode(ktc({})) is True  # type: ignore[arg-type]


@pytest.mark.parametrize("url", ["file:///var/kv", "s3://bucket/p", "redis://127.0.0.1:6379/0"])
def test_an_object_tier_refuses_sleep_mode(url: str) -> None:
    """Weights replaced while asleep would be named by the old fingerprint in a shared tier."""
    assert KVTierConnector.supports_sleep_mode(ktc({"remote_url": url})) is False  # type: ignore[arg-type]


def test_an_object_tier_from_the_environment_refuses_sleep_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVTIER_REMOTE_URL", "file:///var/kv")
    assert KVTierConnector.supports_sleep_mode(ktc({})) is False  # type: ignore[arg-type]


class FakeWorker:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def begin_step(self, meta: KVTierMetadata) -> None:
        self.steps.append(meta.step)


def worker_connector(kv: dict[str, torch.Tensor]) -> tuple[KVTierConnector, FakeWorker]:
    """The worker role's facade, past register_kv_caches (as vLLM leaves it)."""
    conn = KVTierConnector.__new__(KVTierConnector)
    worker = FakeWorker()
    conn._worker, conn._scheduler = worker, None  # type: ignore[assignment]
    conn._connector_metadata = None
    conn._asleep = False
    conn._kv_caches = kv
    conn._kv_ptrs = {name: t.data_ptr() for name, t in kv.items()}
    return conn, worker


def test_asleep_a_step_that_copies_kv_fails_loudly_and_host_only_work_goes_on() -> None:
    kv = {"l0": torch.zeros(4, 8), "l1": torch.zeros(4, 8)}
    conn, worker = worker_connector(kv)
    conn.unregister_kv_caches()
    conn.unregister_kv_caches()  # idempotent
    with pytest.raises(RuntimeError, match="sleep mode"):
        conn.bind_connector_metadata(KVTierMetadata(step=1, loads=[LoadOp(1, 0, 0, [3])]))
    with pytest.raises(RuntimeError, match="sleep mode"):
        conn.bind_connector_metadata(KVTierMetadata(step=2, stores=[StoreOp(2, 0, [3], b"h")]))
    # uploads and fetches read and write kvtier's own host slab only
    conn.bind_connector_metadata(KVTierMetadata(step=3, uploads=[UploadOp(3, 0, b"h")]))
    conn.restore_kv_caches()
    conn.restore_kv_caches()  # idempotent
    conn.bind_connector_metadata(KVTierMetadata(step=4, loads=[LoadOp(4, 0, 0, [3])]))
    assert worker.steps == [3, 4]


def test_a_kv_cache_that_moved_across_sleep_stops_the_engine() -> None:
    kv = {"l0": torch.zeros(4, 8)}
    conn, _worker = worker_connector(kv)
    conn.unregister_kv_caches()
    kv["l0"] = torch.zeros(4, 8)  # not where it was registered
    with pytest.raises(RuntimeError, match="moved across sleep mode"):
        conn.restore_kv_caches()


def test_restore_without_sleep_is_a_no_op() -> None:
    kv = {"l0": torch.zeros(4, 8)}
    conn, worker = worker_connector(kv)
    kv["l0"] = torch.zeros(4, 8)
    conn.restore_kv_caches()  # vLLM only restores after an unregister
    conn.bind_connector_metadata(KVTierMetadata(step=1, loads=[LoadOp(1, 0, 0, [3])]))
    assert worker.steps == [1]


def test_the_reset_before_sleep_leaves_nothing_to_serve_after_it() -> None:
    """Sleep first resets the connector: a chunk being stored or loaded at that moment is
    not a hit after wake-up either (the weights may have changed meanwhile)."""
    idx = ChunkIndex(3)
    for key in ("idle", "loading", "storing"):
        idx.begin(key, State.STORING)
    idx.commit("idle", True)
    idx.commit("loading", True)
    idx.pin("loading")
    idx.clear()  # SchedulerSide.reset_cache
    idx.commit("storing", True)  # the store in flight lands after the reset
    idx.unpin("loading")
    assert not any(idx.is_ready(k) for k in ("idle", "loading", "storing"))
    assert idx.free_slots == 3
