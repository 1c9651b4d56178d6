"""kvtier.fingerprint: other weights, another fingerprint; the same weights anywhere, the same."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvtier.fingerprint import FingerprintError, weights_fingerprint


def _model(path: Path, seed: int = 0, config: dict | None = None, scale: float = 1.0) -> Path:
    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "model.layers.0.self_attn.k_proj.weight": torch.randn(64, 32, generator=g) * scale,
        "model.layers.0.self_attn.v_proj.weight": torch.randn(64, 32, generator=g) * scale,
        "model.norm.weight": torch.ones(32),
    }
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config or {"hidden_size": 32}))
    (path / "tokenizer.json").write_text('{"model": "bpe"}')
    return path


def test_same_files_at_another_path_give_the_same_fingerprint(tmp_path: Path) -> None:
    a = _model(tmp_path / "a")
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    assert weights_fingerprint(a) == weights_fingerprint(b)
    assert len(weights_fingerprint(a)) == 32


def test_a_fine_tune_with_the_same_shapes_gets_another(tmp_path: Path) -> None:
    a = _model(tmp_path / "a", seed=0)
    b = _model(tmp_path / "b", seed=1)  # same names, dtypes, shapes, sizes
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size
    assert weights_fingerprint(a) != weights_fingerprint(b)


def test_one_changed_byte_in_a_sampled_place_changes_it(tmp_path: Path) -> None:
    a = _model(tmp_path / "a")
    before = weights_fingerprint(a)
    f = a / "model.safetensors"
    raw = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8 + n] ^= 0x01  # first byte of the first tensor's data
    f.write_bytes(bytes(raw))
    assert weights_fingerprint(a) != before


def test_config_changes_count_and_the_tokenizer_does_not(tmp_path: Path) -> None:
    a = _model(tmp_path / "a")
    base = weights_fingerprint(a)
    (a / "tokenizer.json").write_text('{"model": "unigram"}')
    assert weights_fingerprint(a) == base
    (a / "config.json").write_text(json.dumps({"hidden_size": 32, "rope_scaling": {"factor": 2}}))
    assert weights_fingerprint(a) != base


def test_hidden_directories_are_ignored_and_other_weight_files_count(tmp_path: Path) -> None:
    a = _model(tmp_path / "a")
    base = weights_fingerprint(a)
    (a / ".cache").mkdir()
    (a / ".cache" / "x.safetensors").write_bytes(b"junk")
    assert weights_fingerprint(a) == base
    (a / "extra.bin").write_bytes(bytes(range(256)) * 100)
    with_bin = weights_fingerprint(a)
    assert with_bin != base
    (a / "extra.bin").write_bytes(bytes(range(256)) * 99 + bytes(reversed(range(256))))
    assert weights_fingerprint(a) != with_bin


@pytest.mark.parametrize(
    "content",
    [b"", b"\x01\x00", struct.pack("<Q", 2**40) + b"{}", struct.pack("<Q", 4) + b"nope"],
    ids=["empty", "short", "huge-header", "not-json"],
)
def test_a_malformed_safetensors_file_is_an_error_not_a_fingerprint(
    tmp_path: Path, content: bytes
) -> None:
    a = _model(tmp_path / "a")
    (a / "model.safetensors").write_bytes(content)
    with pytest.raises(FingerprintError, match="model.safetensors"):
        weights_fingerprint(a)


def test_no_weights_or_no_directory_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FingerprintError, match="no weight files"):
        weights_fingerprint(tmp_path)
    with pytest.raises(FingerprintError, match="not a directory"):
        weights_fingerprint(tmp_path / "missing")


def test_the_models_own_code_counts(tmp_path: Path) -> None:
    """``--trust-remote-code``: the model directory's Python computes the KV."""
    a = _model(tmp_path / "a")
    (a / "modeling_tiny.py").write_text("def rope(x):\n    return x * 1.0\n")
    base = weights_fingerprint(a)
    (a / "modeling_tiny.py").write_text("def rope(x):\n    return x * 0.5\n")
    assert weights_fingerprint(a) != base
