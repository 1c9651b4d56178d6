"""kvtier's config is checked as vLLM builds its ``VllmConfig`` (issue 48, item 6), in a
fresh interpreter as in ``vllm serve``: vLLM 0.32 imports the connector module from
``VllmConfig.__post_init__``, and the import finds that config and validates it, so a
bad value stops startup there rather than in every engine process after the model loads.
(tests/e2e/test_startup_plan.py runs the same through vLLM's real OpenAI server.)"""

from __future__ import annotations

import json
import re
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


def run_build(model_dir: str, extra: dict, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-c", BUILD, model_dir, json.dumps(extra)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **env},
    )


def build(model_dir: str, extra: dict, **env: str) -> str:
    out = run_build(model_dir, extra, **env)
    lines = [line for line in out.stdout.splitlines() if line.startswith(("REFUSED", "BUILT"))]
    assert lines, out.stdout[-3000:] + out.stderr[-3000:]
    return lines[-1]


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"chunk_size": 48}, "chunk_size"),  # no multiple of the 32-token blocks
        ({"cpu_bytes": str(2**59)}, "cpu_bytes"),  # past any host: the plan refuses it
        ({"encryption_key_env": None}, "encryption_key_env"),
    ],
)
def test_building_the_engine_config_refuses_a_bad_kvtier_value(
    model_dir: str, extra: dict, key: str
) -> None:
    got = build(model_dir, extra)
    assert got.startswith("REFUSED") and f"kvtier config '{key}'" in got, got


def test_a_good_config_builds_and_the_module_is_loaded(model_dir: str) -> None:
    assert build(model_dir, {"cpu_bytes": "64MiB", "chunk_size": 256}) == "BUILT True"


def test_a_misspelt_key_is_one_error_line_from_kvtier_before_vllms_traceback(
    model_dir: str, tmp_path
) -> None:
    """vLLM's OpenAI server shows kvtier's ConfigError only inside pydantic's
    ValidationError, at the end of some 40 lines of traceback; kvtier logs it first, in
    vLLM's log format, as one line with the nearest key. The server stops at its config
    build, before any engine starts; ``kvtier doctor`` names that line as the cause."""
    import os

    ktc = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"cpu_byte": "8GiB"},
    }
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
            "--port",
            "1",
            "--max-model-len",
            "2048",
            "--block-size",
            "32",
            "--kv-transfer-config",
            json.dumps(ktc),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    log = out.stdout + out.stderr
    assert out.returncode != 0, log[-3000:]
    typo = "kvtier config: unknown key 'cpu_byte': did you mean 'cpu_bytes'?"
    ours = [line for line in out.stdout.splitlines() if line.endswith(typo)]
    assert len(ours) == 1 and re.search(r"\(APIServer pid=\d+\) ERROR \d\d-\d\d ", ours[0]), log
    assert "Traceback" not in out.stdout and "Traceback" in out.stderr  # vLLM's, after it
    path = tmp_path / "server.log"
    path.write_text(log)
    doctor = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "doctor", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert doctor.returncode == 3, doctor.stdout + doctor.stderr
    assert doctor.stdout.splitlines()[0] == f"the server did not start: {typo}"
