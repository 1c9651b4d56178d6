"""``compression: auto``: which form uploads are stored in, from timed reads."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from kit import collect, kv_like

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.objects import compress
from kvtier.objects.compress import (
    MIN_READS,
    SAMPLE_EVERY,
    AutoCompressor,
    Compressor,
    Fp8Compressor,
    decompress_into,
)

MIB = 2**20


def chunk(n: int = 65536, seed: int = 0) -> memoryview:
    """``n`` bytes of KV-like bf16 (they compress)."""
    return memoryview(kv_like(n // 2, seed))


def forms(z: AutoCompressor, uploads: int) -> list[bool]:
    """For each of ``uploads`` uploads: stored compressed?"""
    data = chunk()
    return [z.compress_chunk(data, "bfloat16") is not None for _ in range(uploads)]


def reads(
    z: AutoCompressor, raw_ms_per_mib: float, z_ms_per_mib: float, n: int = MIN_READS
) -> None:
    for _ in range(n):
        z.observe_read(4 * MIB, raw_ms_per_mib * 4e-3, compressed=False)
        z.observe_read(4 * MIB, z_ms_per_mib * 4e-3, compressed=True)


def test_stores_nothing_compressed_until_reads_say_it_pays() -> None:
    """Before any read is timed every upload is raw (never slower than ``none``); one in
    SAMPLE_EVERY is compressed and decompressed to measure the ratio, and stored raw."""
    z = AutoCompressor()
    assert sum(forms(z, 4 * SAMPLE_EVERY)) == 0
    assert z._ratio is not None and z._ratio < 0.9 and z._decompress is not None
    raw, comp = z.costs()
    assert raw is None and comp is None  # nothing read: nothing to predict from


def test_a_thin_link_predicts_compression_from_raw_reads_and_the_sample() -> None:
    """Raw reads at 50 ms/MiB (a slow link) and a sample: a compressed read is predicted
    faster, so uploads are compressed, but for one in SAMPLE_EVERY kept raw."""
    z = AutoCompressor()
    forms(z, 1)  # the first upload is a sample
    for _ in range(MIN_READS):
        z.observe_read(4 * MIB, 0.2, compressed=False)
    assert z.compressing
    raw, comp = z.costs()
    assert raw is not None and comp is not None and comp < raw * 0.95
    got = forms(z, 2 * SAMPLE_EVERY)
    assert sum(got) == 2 * SAMPLE_EVERY - 2


def test_fast_raw_reads_keep_uploads_raw() -> None:
    """Raw reads faster than the sample's decompression alone: never compressed."""
    z = AutoCompressor()
    forms(z, 1)
    assert z._decompress is not None
    fast = z._decompress * 0.5  # per raw byte: faster than decompressing
    for _ in range(10):
        z.observe_read(4 * MIB, fast * 4 * MIB, compressed=False)
    assert not z.compressing
    assert sum(forms(z, 2 * SAMPLE_EVERY)) == 0


def test_measured_compressed_reads_override_the_prediction() -> None:
    z = AutoCompressor()
    reads(z, raw_ms_per_mib=10.0, z_ms_per_mib=4.0)  # measured both: compressed pays
    assert z.compressing
    # the link got fast (or decompression slow): the averages follow, and so does the choice
    reads(z, raw_ms_per_mib=0.5, z_ms_per_mib=0.8, n=12)
    assert not z.compressing
    z2 = AutoCompressor()
    reads(z2, raw_ms_per_mib=1.0, z_ms_per_mib=0.97)  # 3 % faster: within the margin
    assert not z2.compressing
    reads(z2, raw_ms_per_mib=1.0, z_ms_per_mib=0.5, n=6)
    assert z2.compressing


def test_needs_raw_reads_before_choosing() -> None:
    z = AutoCompressor()
    for _ in range(10):  # only compressed reads: nothing to compare with
        z.observe_read(4 * MIB, 1e-3, compressed=True)
    assert not z.compressing


def test_costs_are_per_raw_byte_and_bad_samples_are_ignored() -> None:
    z = AutoCompressor()
    z.observe_read(0, 1.0, compressed=False)
    z.observe_read(MIB, -1.0, compressed=False)
    assert z.costs() == (None, None)
    z.observe_read(2 * MIB, 2e-3, compressed=False)
    raw, comp = z.costs()
    assert raw == pytest.approx(1e-3 / MIB) and comp is None


def test_the_choice_is_logged_when_it_changes(caplog: pytest.LogCaptureFixture) -> None:
    z = AutoCompressor()
    with caplog.at_level(logging.INFO, logger="kvtier.compression"):
        reads(z, raw_ms_per_mib=10.0, z_ms_per_mib=4.0)
        reads(z, raw_ms_per_mib=10.0, z_ms_per_mib=4.0)  # no change: no second line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "storing chunks compressed" in lines[0]
    assert "10.00 ms/MiB raw" in lines[0] and "measured" in lines[0]


def test_a_compressed_upload_is_the_lossless_stream() -> None:
    z = AutoCompressor()
    reads(z, raw_ms_per_mib=10.0, z_ms_per_mib=4.0)
    data = chunk()
    assert z.compress_chunk(data, "bfloat16") is None  # one in SAMPLE_EVERY stays raw
    got = z.compress_chunk(data, "bfloat16")
    assert got is not None
    form, stream, secs = got
    assert form == Compressor.form and len(stream) < data.nbytes and secs >= 0
    out = memoryview(bytearray(data.nbytes))
    decompress_into(form, memoryview(stream), out)
    assert out == data


def test_from_config_builds_each_setting() -> None:
    assert compress.from_config(load_config({})) is None
    assert type(compress.from_config(load_config({"compression": "lossless"}))) is Compressor
    assert isinstance(compress.from_config(load_config({"compression": "auto"})), AutoCompressor)
    assert isinstance(compress.from_config(load_config({"compression": "fp8"})), Fp8Compressor)


def test_auto_without_blosc2_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compress, "_blosc2", lambda: None)
    with pytest.raises(ConfigError, match="compression.*auto"):
        compress.from_config(load_config({"compression": "auto"}))


def test_reads_go_straight_into_the_slot_while_uploads_are_raw() -> None:
    """While auto stores raw, most objects are raw: a read goes into the slot first (one
    read); while it compresses, or under lossless/fp8, objects are read whole."""
    z = AutoCompressor()
    assert z.reads_raw_first
    reads(z, raw_ms_per_mib=10.0, z_ms_per_mib=4.0)
    assert not z.reads_raw_first
    assert not Compressor().reads_raw_first and not Fp8Compressor().reads_raw_first


def test_remote_io_times_its_reads_for_auto_and_reads_every_form(tmp_path: Path) -> None:
    """Through RemoteIO on a real directory tier: auto (made to compress one upload in
    16, as it does behind a link where raw reads are slow) has every read timed into the
    form it was stored in, and every chunk comes back exact (raw ones straight into the
    slot, the compressed one read whole on its second try)."""
    from kvtier.objects.remote import RemoteIO
    from kvtier.objects.tiers import FileTier

    z = AutoCompressor()
    z._compressing = True  # so that upload 1 of every 16 is raw: reverse the forms below
    rio = RemoteIO(
        FileTier(str(tmp_path / "o")),
        threads=4,
        queue_depth=64,
        timeout_s=20.0,
        signer=None,
        compressor=z,
    )
    n = SAMPLE_EVERY
    chunks = [bytes(chunk(1 << 15, seed)) for seed in range(n)]
    try:
        for i, c in enumerate(chunks):
            rio.submit_put(i, f"k{i}", memoryview(c), dtype="bfloat16", shape=[len(c) // 2])
        assert rio.flush(20.0) == 0
        rio.poll()
        slots = [memoryview(bytearray(1 << 15)) for _ in range(n)]
        for i, slot in enumerate(slots):
            rio.submit_get_into(100 + i, f"k{i}", slot, dtype="bfloat16", shape=[1 << 14])
        got = collect(rio, n).values()
        assert all(r.ok for r in got)
        assert [bytes(s) for s in slots] == chunks
        assert z._reads == [1, n - 1]
        raw, comp = z.costs()
        assert raw is not None and comp is not None and raw > 0 and comp > 0
        stored = {d: v[1] for d, v in rio.take_compression().items()}
        assert stored["write"] < n * (1 << 15)  # one was stored compressed
    finally:
        rio.close()
