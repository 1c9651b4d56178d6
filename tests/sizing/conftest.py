"""Fixtures for the planner tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from sizing_helpers import TINY_LLAMA, tiny_llama_tensors, write_model


@pytest.fixture
def tiny_llama(tmp_path: Path) -> str:
    """A 2-layer fp16 Llama checkpoint (one safetensors file) written by the test."""
    return write_model(tmp_path / "tiny-llama", TINY_LLAMA, tiny_llama_tensors())
