"""``bench/restart_ab.py`` without an engine: the connector classes the servers load from
it (the real ones, their worker calls timed), the prompts, the per-hit worker time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import restart_ab  # noqa: E402


def test_the_servers_load_the_real_connectors_with_their_worker_calls_timed(
    tmp_path, monkeypatch
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    from kvtier.connectors.vllm import KVTierConnector

    kv, ex = restart_ab.KVTierConnector, restart_ab.ExampleConnector
    assert issubclass(kv, KVTierConnector) and kv.__name__ == "KVTierConnector"
    assert issubclass(ex, ExampleConnector) and ex.__name__ == "ExampleConnector"
    assert kv.start_load_kv is not KVTierConnector.start_load_kv
    assert ex.save_kv_layer is ExampleConnector.save_kv_layer  # only what loads is timed
    with pytest.raises(AttributeError):
        restart_ab.NoSuchConnector  # noqa: B018

    class Fake:
        def start_load_kv(self, ctx: object) -> str:
            return "loaded"

    log = tmp_path / "calls"
    monkeypatch.setenv(restart_ab._LOG_VAR, str(log))
    timed = restart_ab._timed(Fake, ("start_load_kv",))
    assert timed().start_load_kv(None) == "loaded"
    name, ms = log.read_text().split()
    assert name == "start_load_kv" and float(ms) >= 0


def test_prompts_are_distinct_and_share_no_first_block() -> None:
    ps = restart_ab.prompts(8, 2048)
    assert len(ps) == 8 and all(len(p) == 2048 for p in ps)
    assert len({tuple(p[:32]) for p in ps}) == 8


def test_worker_time_is_summed_per_step_and_idle_steps_left_out(tmp_path) -> None:
    log = tmp_path / "calls"
    log.write_text("bind_connector_metadata 3.9\nstart_load_kv 2.3\n"
                   "bind_connector_metadata 0.05\nstart_load_kv 0.02\n"
                   "start_load_kv 5.7\n")  # fmt: skip
    assert restart_ab.worker_ms(log) == pytest.approx([6.2, 5.7])
