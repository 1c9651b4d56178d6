"""Fixtures shared by the connector tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    """A directory vLLM's ModelConfig accepts (a config.json; nothing runs the model)."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.fixture(autouse=True)
def canary_first_hit_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The connector tests drive the sides with fake workers, which send vLLM's handshake
    (whether the tier held the generation) only where a test says so: they run with the
    first-hit canary off (``canary_first_hit: false``, as kvtier did before it). The
    canary's own tests (test_canary.py) override this fixture with one that keeps it on."""
    from kvtier.config import KVTierConfig

    monkeypatch.setitem(KVTierConfig.__init__.__kwdefaults__, "canary_first_hit", False)


@pytest.fixture(params=["file", "s3", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty object tier of each kind the canary's claims race on: a directory, a moto
    S3 server's bucket, a real redis-server (tests/connectors/worker/test_canary_claim.py,
    test_canary_reclaim.py)."""
    if request.param == "file":
        return f"file://{tmp_path}/kv"
    if request.param == "s3":
        return str(request.getfixturevalue("s3_bucket").url)
    request.getfixturevalue("redis_server").flush()
    return str(request.getfixturevalue("redis_url"))


@pytest.fixture(autouse=True)
def load_policy_always(monkeypatch: pytest.MonkeyPatch) -> None:
    """The connector tests drive the scheduler with fake steps a few microseconds long, which
    would measure a prefill of microseconds and give priced lookups (``load_policy: cost``,
    kvtier.costs) deadlines that a slow test machine misses: they run with ``load_policy:
    always`` unless they ask for ``cost`` (tests/connectors/test_load_pricing.py)."""
    from kvtier.config import KVTierConfig

    monkeypatch.setitem(KVTierConfig.__init__.__kwdefaults__, "load_policy", "always")
