"""Object-tier keys name the weights and the settings that change their KV, not a path."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.cli.tinymodel import build_tiny_llama
from kvtier.config import load_config
from kvtier.connectors.engine_shape import EngineShape
from kvtier.connectors.identity import namespace_for
from kvtier.errors import ConfigError


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weights")
    a = build_tiny_llama(root / "a", layers=2, hidden=64, heads=2, kv_heads=1, seed=0)
    b = build_tiny_llama(root / "b", layers=2, hidden=64, heads=2, kv_heads=1, seed=1)
    a2 = root / "mounted" / "a"
    shutil.copytree(a, a2)
    return {"a": a, "b": b, "a_elsewhere": a2}


def vllm_config(model: Path | str, **over) -> SimpleNamespace:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model) if Path(str(model)).is_dir() else None
    m = SimpleNamespace(
        model=str(model),
        revision=None,
        dtype="torch.bfloat16",
        hf_config=hf,
        quantization=None,
        max_model_len=4096,
        override_attention_dtype=None,
    )
    cache = SimpleNamespace(
        cache_dtype="auto",
        block_size=16,
        prefix_caching_hash_algo="sha256",
        calculate_kv_scales=False,
    )
    par = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
    for k, v in over.items():
        for part in (m, cache, par):
            if hasattr(part, k):
                setattr(part, k, v)
    return SimpleNamespace(model_config=m, cache_config=cache, parallel_config=par)


REMOTE = {"remote_url": "file:///tmp/kvtier-identity-test"}


def digest(model, extra=REMOTE, **over) -> bytes:
    cfg = load_config(extra, environ={})
    return namespace_for(cfg, EngineShape.from_vllm(vllm_config(model, **over))).digest(0, 0)


def test_same_weights_at_two_paths_share_keys(models) -> None:
    # transformers records each path in hf_config._name_or_path: not part of the key
    assert digest(models["a"]) == digest(models["a_elsewhere"])


def test_new_weights_at_the_same_path_change_keys(models, tmp_path: Path) -> None:
    """A fine-tune redeployed over /models: same path, names, shapes; other weights."""
    path = tmp_path / "models"
    shutil.copytree(models["a"], path)
    before = digest(path)
    shutil.rmtree(path)
    shutil.copytree(models["b"], path)
    assert digest(path) != before


def test_settings_that_change_the_math_change_keys(models) -> None:
    base = digest(models["a"])
    rope = vllm_config(models["a"])
    rope.model_config.hf_config.rope_scaling = {"rope_type": "linear", "factor": 2.0}
    cfg = load_config(REMOTE, environ={})
    # hf_overrides land in hf_config
    assert namespace_for(cfg, EngineShape.from_vllm(rope)).digest(0, 0) != base
    assert digest(models["a"], quantization="fp8") != base
    assert digest(models["a"], max_model_len=2048) != base
    assert digest(models["a"], cache_dtype="fp8_e4m3") != base


def test_host_tier_only_keys_by_name_and_reads_no_weights(tmp_path: Path) -> None:
    # no object tier: nothing outlives the engine, so nothing is fingerprinted
    ns = namespace_for(
        load_config({}, environ={}), EngineShape.from_vllm(vllm_config(tmp_path / "not-there"))
    )
    assert ns.fingerprint == "" and ns.model == str(tmp_path / "not-there")


def test_explicit_model_fingerprint_replaces_reading_the_weights(tmp_path: Path) -> None:
    extra = {**REMOTE, "model_fingerprint": "build-2026-12-01"}
    one = digest("s3-streamed/model", extra)
    assert one == digest("another/name", extra)
    assert one != digest("s3-streamed/model", {**extra, "model_fingerprint": "build-2"})


def test_unreadable_weights_stop_startup_naming_model_fingerprint(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model_fingerprint") as e:
        digest("nobody/not-downloaded-model")
    assert "set model_fingerprint" in str(e.value)


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_weak_block_hash_with_an_object_tier_stops_startup(models, algo: str) -> None:
    with pytest.raises(ConfigError, match="remote_url.*sha256") as e:
        digest(models["a"], prefix_caching_hash_algo=algo)
    assert algo in str(e.value)
    # the host tier lives in one process: any hash vLLM accepts is fine there
    digest(models["a"], {}, prefix_caching_hash_algo=algo)


def test_per_replica_kv_scales_with_an_object_tier_stop_startup(models) -> None:
    with pytest.raises(ConfigError, match="calculate-kv-scales"):
        digest(models["a"], cache_dtype="fp8", calculate_kv_scales=True)
    digest(models["a"], cache_dtype="fp8", calculate_kv_scales=True, extra={})


def test_hub_model_in_the_local_cache_is_fingerprinted(models, tmp_path, monkeypatch) -> None:
    """A hub id: the weights vLLM downloaded into the Hugging Face cache are read."""
    import huggingface_hub

    def snapshot(repo_id, revision=None, local_files_only=False):
        assert local_files_only, "kvtier never downloads"
        return str(models["a"]) if repo_id == "org/model" else None

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    hub = vllm_config(models["a"])
    hub.model_config.model = "org/model"
    cfg = load_config(REMOTE, environ={})
    assert namespace_for(cfg, EngineShape.from_vllm(hub)).digest(0, 0) == digest(models["a"])


@pytest.mark.parametrize("flag", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallel_engines_are_refused_at_startup(flag: str) -> None:
    """Each rank would hold another share of a block's tokens under the same key."""
    from kvtier.connectors.identity import check_parallel

    cfg = vllm_config("/models/m")
    check_parallel(EngineShape.from_vllm(cfg))  # the default: one share
    setattr(cfg.parallel_config, flag, 2)
    with pytest.raises(ConfigError, match=f"--{flag.replace('_', '-')} 2") as e:
        check_parallel(EngineShape.from_vllm(cfg))
    assert e.value.key == "kv_connector"


def test_workers_on_node_divides_the_ranks_over_the_nodes() -> None:
    """``io_threads: auto`` shares a host's CPUs among the engine's workers on it."""
    from kvtier.connectors.identity import workers_on_node

    cfg = vllm_config("/models/m")
    assert workers_on_node(EngineShape.from_vllm(cfg)) == 1
    cfg.parallel_config.tensor_parallel_size = 8
    assert workers_on_node(EngineShape.from_vllm(cfg)) == 8
    cfg.parallel_config.pipeline_parallel_size = 2
    cfg.parallel_config.nnodes = 2
    assert workers_on_node(EngineShape.from_vllm(cfg)) == 8


# ---- where the weights come from (--load-format) -------------------------------------------
def loaded(model, load_format: str, extra=REMOTE) -> bytes:
    cfg = vllm_config(model)
    cfg.load_config = SimpleNamespace(load_format=load_format)
    return namespace_for(load_config(extra, environ={}), EngineShape.from_vllm(cfg)).digest(0, 0)


def test_random_weights_never_share_keys_with_the_files_weights(models, tmp_path) -> None:
    """``--load-format dummy`` on the real model's directory: random values, other keys,
    even when the operator named the weights (model_fingerprint names the files')."""
    real = loaded(models["a"], "auto")
    assert real == loaded(models["a"], "safetensors") == digest(models["a"])
    assert loaded(models["a"], "dummy") != real
    named = {**REMOTE, "model_fingerprint": "build-7"}
    assert loaded(models["a"], "dummy", named) != loaded(models["a"], "auto", named)
    # a directory with the config alone (no weights to read) is enough for random weights
    bare = tmp_path / "config-only"
    bare.mkdir()
    shutil.copy(models["a"] / "config.json", bare / "config.json")
    assert loaded(bare, "dummy") != real


def test_weights_from_elsewhere_need_model_fingerprint_and_share_with_no_files_engine(
    models,
) -> None:
    """tensorizer, a peer's or a cache's weights: not the files kvtier fingerprints."""
    with pytest.raises(ConfigError, match="model_fingerprint") as e:
        loaded(models["a"], "tensorizer")
    assert "--load-format tensorizer" in str(e.value)
    named = {**REMOTE, "model_fingerprint": "build-7"}
    assert loaded(models["a"], "tensorizer", named) != loaded(models["a"], "auto", named)
    # the host tier alone reads no weights and names none
    loaded(models["a"], "tensorizer", {})


def test_a_drafters_own_weights_are_part_of_the_identity(models, tmp_path) -> None:
    """EAGLE heads or a draft model: their attention layers' KV is in the chunks too."""

    def with_draft(draft, extra=REMOTE) -> bytes:
        cfg = vllm_config(models["a"])
        cfg.speculative_config = SimpleNamespace(
            draft_model_config=None
            if draft is None
            else SimpleNamespace(model=str(draft), revision=None)
        )
        shape = EngineShape.from_vllm(cfg)
        return namespace_for(load_config(extra, environ={}), shape).digest(0, 0)

    base = digest(models["a"])
    assert with_draft(None) == base
    assert with_draft(models["a"]) == base  # MTP: the target's own directory
    assert with_draft(models["b"]) != base
    moved = tmp_path / "drafts" / "b"
    shutil.copytree(models["b"], moved)
    assert with_draft(moved) == with_draft(models["b"])  # the drafter's weights, not path
    with pytest.raises(ConfigError, match="model_fingerprint"):
        with_draft("nobody/not-downloaded-drafter")
    with_draft("nobody/not-downloaded-drafter", {**REMOTE, "model_fingerprint": "build-7"})
