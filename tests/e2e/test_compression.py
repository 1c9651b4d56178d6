"""Lossless compression of the object tier in real vLLM engines.

An engine with ``compression: lossless`` writes every chunk of a 1,024-token prefix to a
directory tier compressed; a second engine, started after the first exited, hits all of
them from there, and its greedy tokens and logprobs are those of vLLM's own prefix cache
serving the same tokens (scenarios remote_writer / remote_reader of tests/e2e/engine.py);
so are those of a third engine with ``compression: auto``.
"""

from __future__ import annotations

import struct
from pathlib import Path

import msgpack
import pytest
from kit import chunk_files

from tests.e2e.conftest import run_engine

pytestmark = [pytest.mark.e2e]


def test_lossless_restart_hit_is_bit_exact(tiny_model: str, tmp_path: Path) -> None:
    extra = {
        "cpu_bytes": "64MiB",
        "remote_url": f"file://{tmp_path / 'kv'}",
        "compression": "lossless",
    }
    w = run_engine("remote_writer", model=tiny_model, extra=extra)
    assert w["b_ref"]["cached"] == 1024
    files = chunk_files(tmp_path / "kv")
    assert len(files) >= 4
    for f in files:
        blob = f.read_bytes()
        (hlen,) = struct.unpack_from("<I", blob, 4)
        header = msgpack.unpackb(blob[8 : 8 + hlen])
        assert header["z"] == "blosc2" and header["len"] == len(blob) - 8 - hlen
    # engine 2 reads them with lossless; engine 3 with auto, which reads each chunk into its
    # slot first as if raw (auto stores raw until its reads say otherwise), finds it
    # shorter and reads it whole: a tier holding another engine's forms is read exactly
    for setting in ("lossless", "auto"):
        r = run_engine("remote_reader", model=tiny_model, extra={**extra, "compression": setting})
        # it starts with an empty host tier: the prefix can only come from the object tier
        assert r["b"]["cached"] >= 1024, (setting, r["_log"][-3000:])
        assert r["b"]["tokens"] == w["b_ref"]["tokens"]
        assert r["b"]["logprobs"] == w["b_ref"]["logprobs"]
        assert r["a"]["tokens"] == w["a"]["tokens"]
        totals = r["index"]["totals"]
        assert totals["hit_tokens_remote"] >= 1024 and totals["fetch_ok"] >= 4
        assert not [k for k, v in totals.items() if k.startswith("error_") and v], setting
