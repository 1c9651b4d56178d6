"""The planner's KV cache groups of a hybrid model, against vLLM's own page sizes and
kvtier's own slot (tests/connectors/test_hma.py builds it as vLLM does)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sizing_helpers import model
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from kvtier.host.layout import sliding_blocks as kvtier_sliding_blocks
from kvtier.sizing.memory_plan import PlanInputs, make_plan
from kvtier.sizing.model import shape_from_config, sliding_blocks
from kvtier.sizing.table import format_plan
from tests.connectors.test_hma import HybridEngine, attn

BS, CHUNK, WINDOW = 16, 64, 32
#: Gemma 2 style: even layers slide over 32 tokens, odd ones attend to everything
TINY_GEMMA2 = {
    "model_type": "gemma2",
    "architectures": ["Gemma2ForCausalLM"],
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "vocab_size": 100,
    "sliding_window": WINDOW,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 4096,
}


@pytest.fixture
def gemma_dir(tmp_path: Path) -> str:
    (tmp_path / "gemma").mkdir()
    (tmp_path / "gemma" / "config.json").write_text(json.dumps(TINY_GEMMA2))
    return str(tmp_path / "gemma")


@pytest.fixture
def engine_dir(tmp_path: Path) -> str:
    """A config vLLM's ModelConfig takes for the engine's scheduler (nothing runs)."""
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
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path / "engine")


def test_each_group_costs_what_vllms_spec_pages_say_and_kvtier_stores(
    gemma_dir: str, engine_dir: str
) -> None:
    p = make_plan(PlanInputs(model=gemma_dir, chunk_size=CHUNK, block_size=BS))
    full, sliding = p["kv_groups"]
    spec = {"block_size": BS, "num_kv_heads": 2, "head_size": 8, "dtype": torch.bfloat16}
    full_spec = FullAttentionSpec(**spec)  # type: ignore[arg-type]
    swa_spec = SlidingWindowSpec(**spec, sliding_window=WINDOW)  # type: ignore[arg-type]
    assert (full["kind"], full["layers"], full["window"]) == ("full", 2, None)
    assert (sliding["kind"], sliding["layers"], sliding["window"]) == ("sliding", 2, WINDOW)
    # bytes per block of each group: vLLM's page of each of its layers
    assert full["page_bytes"] == 2 * full_spec.page_size_bytes
    assert sliding["page_bytes"] == 2 * swa_spec.page_size_bytes
    assert full["bytes_per_token"] * BS == full["page_bytes"]
    # what kvtier stores of a chunk: every full block, the sliding group's last 2 of 4
    assert (full["stored_blocks_per_chunk"], sliding["stored_blocks_per_chunk"]) == (4, 2)
    assert p["host_chunk_bytes_per_rank"] == 4 * full["page_bytes"] + 2 * sliding["page_bytes"]
    # ... which is the slot kvtier's scheduler side sizes for these groups in vLLM
    layer_specs = {attn(i): swa_spec if i % 2 == 0 else full_spec for i in range(4)}
    eng = HybridEngine(engine_dir, layer_specs)  # type: ignore[arg-type]
    assert eng.side.slot_bytes == p["host_slot_bytes"]
    # a sliding layer does not cost the GPU the whole context, nor the object tier
    assert p["session_kv_bytes_per_rank"] == (
        full["bytes_per_token"] * p["context"] + sliding["bytes_per_token"] * WINDOW
    )
    assert p["object_kv_bytes_per_token"] * CHUNK == p["host_chunk_bytes_per_rank"]
    text = format_plan(p)
    assert "sliding group" in text and "2 layers, window 32," in text
    assert "kvtier stores 2 of 4 blocks" in text


def test_one_kind_of_layer_is_one_group_stored_whole() -> None:
    for name, kind in (("llama3-8b", "full"), ("mistral-7b-v0.1", "sliding")):
        p = make_plan(PlanInputs(model=model(name)))
        (group,) = p["kv_groups"]
        assert group["kind"] == kind and group["stored_blocks_per_chunk"] == 16
        assert p["host_chunk_bytes_per_rank"] == p["kv_bytes_per_token_per_rank"] * 256


def test_the_planner_stores_the_blocks_kvtier_stores() -> None:
    for window in (1, 15, 16, 17, 31, 32, 33, 100, 4096):
        for bpc in (1, 4, 16):
            assert sliding_blocks(window, 16, bpc) == kvtier_sliding_blocks(window, 16, bpc)


def test_gemma2_9b_prints_its_groups() -> None:
    shape = shape_from_config(json.loads((Path(model("gemma2-9b")) / "config.json").read_text()))
    groups = shape.kv_groups(chunk_size=256, block_size=16)
    assert [(g["kind"], g["layers"]) for g in groups] == [("full", 21), ("sliding", 21)]
    assert groups[1]["stored_blocks_per_chunk"] == 16  # its 4096-token window > a chunk
