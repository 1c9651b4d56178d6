"""A fingerprint of model weights: chunks computed by other weights must never share keys.

A model's name or path says nothing about the bytes behind it: a fine-tune copied
over ``/models/llama`` keeps the path, tensor names and shapes, and its KV has the
same size and layout as the old model's. The object tier outlives engines and is
shared by replicas, so its keys are derived from the weights themselves.

Reading every byte of a 140 GB checkpoint at startup is not an option. The
fingerprint covers what changes when weights change, at a few reads per tensor:

- every safetensors header (tensor names, dtypes, shapes, offsets) and file size;
- three 64-byte samples of every tensor's data (start, middle, end): a fine-tune,
  a re-quantization or a different seed changes essentially every tensor, so it
  changes the samples;
- other weight files (``.bin``, ``.pt``, ``.gguf``...): size and 16 samples of 4 KiB;
- the JSON configuration next to them (``config.json``, quantization and
  generation configs), but not the tokenizer: the same token ids give the same KV
  whatever text they came from;
- Python files (``modeling_*.py``): with ``--trust-remote-code`` the model's own
  code computes the KV, and a fix to it changes the KV as new weights would.

Two directories with the same files give the same fingerprint wherever they are
mounted, so replicas share chunks; a change of weights or config gives another.
This is a guard against mistakes (a redeploy, a wrong mount), not against an
adversary who crafts weights to collide: those who can write the weights own the
answers anyway.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

__all__ = ["FingerprintError", "weights_fingerprint"]

_SAMPLE = 64
_OTHER_SAMPLES = 16
_OTHER_SAMPLE_BYTES = 4096
#: a safetensors header larger than this is not one (the format caps it at 100 MB)
_MAX_HEADER = 100 * 2**20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".npz")
#: JSON files that do not change what the model computes for given token ids
_SKIP_JSON_PREFIXES = ("tokenizer", "vocab", "special_tokens_map", "added_tokens", "merges")


class FingerprintError(Exception):
    """The directory holds no weights kvtier can read (or one of them is malformed)."""


def weights_fingerprint(model_dir: str | os.PathLike[str]) -> str:
    """Hex digest (32 chars) of the weights and model config under ``model_dir``."""
    root = Path(model_dir)
    if not root.is_dir():
        raise FingerprintError(f"{root} is not a directory")
    h = hashlib.blake2b(digest_size=16, person=b"kvtier-weights")
    n_weights = 0
    for path in _files(root):
        rel = path.relative_to(root).as_posix()
        name = path.name
        if name.endswith(_WEIGHT_SUFFIXES):
            h.update(b"W" + rel.encode() + b"\0")
            if name.endswith(".safetensors"):
                _safetensors(path, h)
            else:
                _sampled(path, h)
            n_weights += 1
        elif name.endswith(".py"):
            h.update(b"P" + rel.encode() + b"\0")
            h.update(path.read_bytes())
        elif (
            name.endswith(".json")
            and path.parent == root
            and not name.startswith(_SKIP_JSON_PREFIXES)
        ):
            h.update(b"J" + rel.encode() + b"\0")
            h.update(path.read_bytes())
    if not n_weights:
        raise FingerprintError(f"no weight files ({', '.join(_WEIGHT_SUFFIXES)}) under {root}")
    return h.hexdigest()


def _files(root: Path) -> Iterator[Path]:
    """Regular files under ``root`` in a fixed order, skipping hidden entries (caches)."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(filenames):
            if not f.startswith("."):
                p = Path(dirpath, f)
                if p.is_file():
                    yield p


def _safetensors(path: Path, h: hashlib.blake2b) -> None:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) != 8:
            raise FingerprintError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER, size - 8):
            raise FingerprintError(f"{path}: safetensors header length {n} is not plausible")
        header = f.read(n)
        try:
            tensors = json.loads(header)
        except ValueError as exc:
            raise FingerprintError(f"{path}: safetensors header is not JSON") from exc
        h.update(struct.pack("<QQ", size, n))
        h.update(header)
        base = 8 + n
        for name in sorted(k for k in tensors if k != "__metadata__"):
            try:
                start, end = (int(x) for x in tensors[name]["data_offsets"])
            except (KeyError, TypeError, ValueError) as exc:
                raise FingerprintError(f"{path}: tensor {name!r} has no data_offsets") from exc
            for off in _sample_offsets(start, end):
                f.seek(base + off)
                h.update(f.read(_SAMPLE))


def _sample_offsets(start: int, end: int) -> list[int]:
    """Start, middle and end of a tensor's bytes ``[start, end)`` (fewer when small)."""
    length = end - start
    if length <= _SAMPLE:
        return [start] if length > 0 else []
    return sorted({start, start + (length - _SAMPLE) // 2, end - _SAMPLE})


def _sampled(path: Path, h: hashlib.blake2b) -> None:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(struct.pack("<Q", size))
        span = max(0, size - _OTHER_SAMPLE_BYTES)
        for i in range(_OTHER_SAMPLES):
            f.seek(span * i // (_OTHER_SAMPLES - 1))
            h.update(f.read(_OTHER_SAMPLE_BYTES))
