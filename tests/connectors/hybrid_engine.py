"""The engine config the hybrid-model tests build vLLM's scheduler from, over the
``model_dir`` fixture (tests/connectors/conftest.py), with kvtier as the KV connector."""

from __future__ import annotations

from typing import Any

from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

BS, CHUNK = 16, 64


def kvtier_extra(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"cpu_bytes": 1 << 22, "cpu_headroom_bytes": 0, "chunk_size": CHUNK, **(extra or {})}


def engine_config(model_dir: str, extra: dict[str, Any] | None = None) -> VllmConfig:
    ktc = KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier.connectors.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=kvtier_extra(extra),
    )
    vc = VllmConfig(
        model_config=ModelConfig(
            model=model_dir, dtype="bfloat16", seed=0, skip_tokenizer_init=True, max_model_len=2048
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=1024,
            max_model_len=2048,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BS, cache_dtype="auto", enable_prefix_caching=True),
        kv_transfer_config=ktc,
    )
    vc.cache_config.kv_cache_layout = "LBNHC"  # what the engine core resolves first
    return vc
