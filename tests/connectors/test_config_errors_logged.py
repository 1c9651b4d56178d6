"""Where vLLM meets kvtier, a config mistake is logged by kvtier itself, one ERROR line each,
before vLLM wraps the exception ("The operator's first hour, round 2", item 1): the import
vLLM 0.32 makes while it builds its config, and the connector's own start in each process.
(tests/connectors/test_startup_check.py runs the first through vLLM in a fresh interpreter.)
"""

from __future__ import annotations

import logging

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from kvtier.config import load_config
from kvtier.connectors import vllm as facade
from kvtier.connectors.vllm import KVTierConnector
from kvtier.errors import ConfigError
from tests.connectors.hybrid_engine import BS, engine_config

TYPO = "kvtier config: unknown key 'cpu_byte': did you mean 'cpu_bytes'?"


def error_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_check_vllm_runs_while_building_its_config_logs_the_error(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuses() -> None:
        load_config({"cpu_byte": "8GiB"}, environ={})

    monkeypatch.setattr(facade, "check_config_being_built", refuses)
    caplog.set_level(logging.INFO, logger="kvtier")
    with pytest.raises(ConfigError):
        facade.check_config_at_import()
    assert error_lines(caplog) == [("kvtier", TYPO)]


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_the_connector_logs_a_refused_config_before_raising(
    model_dir: str, caplog: pytest.LogCaptureFixture, role: KVConnectorRole
) -> None:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    kcc = KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(4)], spec)
        ],
    )
    vc = engine_config(model_dir, {"cpu_byte": "8GiB"})
    caplog.set_level(logging.INFO, logger="kvtier")
    with pytest.raises(ConfigError) as err:
        KVTierConnector(vc, role, kcc)
    assert str(err.value) == TYPO
    assert error_lines(caplog) == [("kvtier", TYPO)]
