"""kvtier's config is checked as vLLM builds its ``VllmConfig`` (issue 48, item 6), in a
fresh interpreter as in ``vllm serve``: vLLM 0.32 imports the connector module from
``VllmConfig.__post_init__``, and the import finds that config and validates it, so a
bad value stops startup there rather than in every engine process after the model loads.
(tests/e2e/test_startup_plan.py runs the same through vLLM's real OpenAI server.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

BUILD = """
import json, sys
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
extra = json.loads(sys.argv[2])
ktc = KVTransferConfig(kv_connector="KVTierConnector",
                       kv_connector_module_path="kvtier.connectors.vllm",
                       kv_role="kv_both", kv_connector_extra_config=extra)
model = ModelConfig(model=sys.argv[1], dtype="bfloat16", skip_tokenizer_init=True,
                    max_model_len=2048)
try:
    VllmConfig(model_config=model, cache_config=CacheConfig(block_size=32),
               kv_transfer_config=ktc)
except ValueError as e:
    print("REFUSED", type(e).__name__, str(e).replace(chr(10), " "))
else:
    print("BUILT", "kvtier.connectors.vllm" in sys.modules)
"""


def build(model_dir: str, extra: dict, **env: str) -> str:
    import os

    out = subprocess.run([sys.executable, "-c", BUILD, model_dir, json.dumps(extra)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **env})  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if line.startswith(("REFUSED", "BUILT"))]
    assert lines, out.stdout[-3000:] + out.stderr[-3000:]
    return lines[-1]


@pytest.mark.parametrize(
    ("extra", "key"),
    [({"chunk_size": 48}, "chunk_size"),  # no multiple of the 32-token blocks
     ({"cpu_bytes": str(2**59)}, "cpu_bytes"),  # past any host: the plan refuses it
     ({"encryption_key_env": None}, "encryption_key_env")],
)
def test_building_the_engine_config_refuses_a_bad_kvtier_value(
    model_dir: str, extra: dict, key: str
) -> None:
    got = build(model_dir, extra)
    assert got.startswith("REFUSED") and f"kvtier config '{key}'" in got, got


def test_a_good_config_builds_and_the_module_is_loaded(model_dir: str) -> None:
    assert build(model_dir, {"cpu_bytes": "64MiB", "chunk_size": 256}) == "BUILT True"
