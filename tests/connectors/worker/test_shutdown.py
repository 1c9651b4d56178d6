"""Startup says when vLLM's stop would cut kvtier's flush of queued object-tier writes
short (connectors/worker/shutdown.py), on vLLM's own config types; the engine-level proof that
the advised flags flush them is tests/e2e/test_serve_shutdown.py."""

from __future__ import annotations

import logging

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

from kvtier.config import SHUTDOWN_MARGIN_S, load_config
from kvtier.config import VLLM_WORKER_SHUTDOWN_ENV as WORKER_WINDOW_ENV
from kvtier.connectors.engine_shape import EngineShape
from kvtier.connectors.vllm import KVTierConnector
from kvtier.connectors.worker.shutdown import shutdown_window_warning
from tests.connectors.hybrid_engine import engine_config
from tests.connectors.test_hybrid import FULL, NUM_BLOCKS, attn


def config(model_dir: str, tmp_path, timeout: int, backend: str = "uni", **extra):
    vc = engine_config(model_dir, {"remote_url": f"file://{tmp_path}/kv", **extra})
    vc.shutdown_timeout = timeout
    vc.parallel_config.distributed_executor_backend = backend
    cfg = load_config(vc.kv_transfer_config.kv_connector_extra_config)
    return vc, cfg


def test_the_advised_window_is_the_flush_plus_a_margin(tmp_path) -> None:
    url = f"file://{tmp_path}"
    assert load_config({"remote_url": url}).vllm_shutdown_timeout_s() == 10 + SHUTDOWN_MARGIN_S
    assert (
        load_config({"remote_url": url, "shutdown_flush_s": 2.5}).vllm_shutdown_timeout_s()
        == 3 + SHUTDOWN_MARGIN_S
    )
    assert load_config({}).vllm_shutdown_timeout_s() is None  # host tier only: nothing queued
    assert (
        load_config({"remote_url": url, "write_policy": "none"}).vllm_shutdown_timeout_s() is None
    )


def test_vllms_default_stop_is_named_with_the_flags_to_set(model_dir: str, tmp_path) -> None:
    vc, cfg = config(model_dir, tmp_path, timeout=0)
    msg = shutdown_window_warning(cfg, EngineShape.from_vllm(vc), {})
    assert msg is not None
    assert "--shutdown-timeout is 0" in msg and "--shutdown-timeout 20" in msg, msg
    assert f"{WORKER_WINDOW_ENV}=20" in msg and "terminationGracePeriodSeconds" in msg
    assert WORKER_WINDOW_ENV + " is" not in msg  # one engine process: its window only
    assert (
        shutdown_window_warning(
            cfg, EngineShape.from_vllm(config(model_dir, tmp_path, timeout=20)[0]), {}
        )
        is None
    )


@pytest.mark.parametrize(
    ("env", "short"),
    [
        ({}, True),  # vLLM's own 5 s
        ({WORKER_WINDOW_ENV: "12"}, True),
        ({WORKER_WINDOW_ENV: "20"}, False),
        ({WORKER_WINDOW_ENV: "soon"}, True),  # vLLM itself would refuse it; never trusted
    ],
)
def test_worker_processes_need_their_own_window(model_dir: str, tmp_path, env, short) -> None:
    vc, cfg = config(model_dir, tmp_path, timeout=30, backend="mp")
    msg = shutdown_window_warning(cfg, EngineShape.from_vllm(vc), env)
    assert (msg is not None) == short, msg
    if short:
        assert f"{WORKER_WINDOW_ENV} is" in msg and "--shutdown-timeout is" not in msg, msg


def test_no_warning_where_nothing_is_written(model_dir: str, tmp_path) -> None:
    vc, cfg = config(model_dir, tmp_path, timeout=0, backend="mp", write_policy="none")
    assert shutdown_window_warning(cfg, EngineShape.from_vllm(vc), {}) is None
    vc = engine_config(model_dir)  # host tier only
    assert shutdown_window_warning(load_config({}), EngineShape.from_vllm(vc), {}) is None


def test_the_connector_warns_as_vllm_builds_it(model_dir: str, tmp_path, caplog) -> None:
    vc, _ = config(model_dir, tmp_path, timeout=0, model_fingerprint="build-1")
    kcc = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([attn(0), attn(1)], FULL)],
    )
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        conn = KVTierConnector(vc, KVConnectorRole.SCHEDULER, kcc)
    try:
        lines = [r.getMessage() for r in caplog.records if "--shutdown-timeout" in r.getMessage()]
        assert len(lines) == 1 and "--shutdown-timeout 20" in lines[0], caplog.text
    finally:
        conn.shutdown()
