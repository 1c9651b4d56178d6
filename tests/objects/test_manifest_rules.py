"""A generation manifest is untrusted input: ``kvtier store`` and the engines read
whatever the shared tier holds. One with NaN, Infinity, absurd times, deep nesting or a
field of the wrong type is a bad manifest (a CodecError), never a crash: ``kvtier store
usage`` reports it and goes on, and the manifest refresh thread outlives anything."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli.main import main
from kvtier.errors import CodecError, TierUnavailable
from kvtier.keys import Namespace
from kvtier.objects import codec, manifest
from kvtier.objects.manifest import MANIFEST_DTYPE, Manifest, ManifestWriter, manifest_key
from kvtier.objects.tiers import FileTier

NS = Namespace("", None, "bfloat16", "auto", 32, 128, 1, fingerprint="f" * 32, label="m")


def _fields(gen: str = "0123456789abcdef") -> dict[str, Any]:
    return json.loads(Manifest.of(NS, 1000.0).to_bytes()) | {"id": gen}


def _forge(tier: FileTier, gen: str, payload: bytes) -> None:
    key = manifest_key(gen)
    tier.put(
        key, codec.encode(key, payload, dtype=MANIFEST_DTYPE, shape=[len(payload)], signer=None)
    )


def _json_with(**raw: str) -> bytes:
    """A manifest's JSON with some values written verbatim (NaN is no JSON value)."""
    text = json.dumps(_fields())
    for name, value in raw.items():
        text = text.replace(f'"{name}": {json.dumps(_fields()[name])}', f'"{name}": {value}')
    return text.encode()


DEEP = b'{"id": ' + b"[" * 20000 + b"]" * 20000 + b"}"
BAD = {
    "nan": _json_with(last_seen="NaN"),
    "infinity": _json_with(first_seen="Infinity"),
    "minus-infinity": _json_with(last_seen="-Infinity"),
    "overflow": _json_with(last_seen="1e400"),
    "year-30000": _json_with(last_seen="1e12"),
    "negative-time": _json_with(first_seen="-5"),
    "deep": DEEP,
    "deep-in-a-field": _json_with(host="[" * 20000 + "]" * 20000),
    "str-for-int": _json_with(tp_size='"2"'),
    "bool-for-int": _json_with(chunk_size="true"),
    "negative-size": _json_with(tp_size="-1"),
    "huge-int": _json_with(pp_size="1" + "0" * 40),
    "list-for-str": _json_with(model='["a"]'),
    "not-an-object": b"[1, 2]",
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_manifest_with_nan_infinity_deep_nesting_or_wrong_types_is_refused(case: str) -> None:
    with pytest.raises(CodecError):
        Manifest.from_bytes(BAD[case])


def test_a_good_manifest_still_reads() -> None:
    m = Manifest.of(NS, 1000.0)
    assert Manifest.from_bytes(m.to_bytes()) == m
    assert Manifest.from_bytes(json.dumps(_fields() | {"tp_size": 2}).encode()).tp_size == 2


def test_store_usage_reports_a_forged_manifest_and_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, NaN or Infinity crashed ``kvtier store usage`` on printing the time, and
    deep nesting raised RecursionError out of the listing."""
    with FileTier(str(tmp_path)) as tier:
        assert manifest.claim_generation(tier, NS, None)
        forged = {}
        for i, case in enumerate(sorted(BAD)):
            gen = f"{i:016x}"
            payload = BAD[case].replace(b'"0123456789abcdef"', json.dumps(gen).encode())
            _forge(tier, gen, payload)
            forged[gen] = case
    rc = main(["store", "usage", f"file://{tmp_path}"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert NS.generation() in out
    for gen in forged:
        assert f"manifest of {gen} does not verify" in out, (forged[gen], out)


class _Flaky(FileTier):
    """A directory whose manifest writes fail with ``errors`` in turn, then work."""

    def __init__(self, root: str, errors: list[BaseException]) -> None:
        super().__init__(root)
        self.errors = errors

    def put(self, key: str, parts: Any) -> None:
        if self.errors:
            raise self.errors.pop(0)
        super().put(key, parts)


def test_the_refresh_thread_outlives_any_exception(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, only TierError was caught: a RecursionError (a forged, deeply nested
    manifest read back for its first_seen) or any bug ended the thread, and the engine's
    manifest went stale while it lived. Now each new kind of failure is logged once and
    the next refresh tries again."""
    caplog.set_level(logging.WARNING, logger="kvtier.manifest")
    boom = [
        RecursionError("deep"),
        ValueError("odd"),
        ValueError("odd"),
        ValueError("odd"),
        TierUnavailable("down"),
    ]
    tier = _Flaky(str(tmp_path), [])
    _forge(tier, NS.generation(), DEEP)
    tier.errors = boom
    writer = ManifestWriter(tier, None, lambda: NS, interval_s=0.02).start()
    try:

        def stored() -> Manifest | None:
            try:
                return manifest.read_manifest(tier, NS.generation(), None)
            except CodecError:
                return None  # still the forged one

        deadline = time.monotonic() + 10
        while (m := stored()) is None or boom:
            assert time.monotonic() < deadline, "the thread stopped refreshing"
            time.sleep(0.02)
        assert writer._thread.is_alive()
        assert m.id == NS.generation()
        odd = [
            r
            for r in caplog.records
            if "odd" in r.getMessage() or (r.exc_info and "odd" in str(r.exc_info[1]))
        ]
        assert len(odd) == 1, "logged once"
        assert any(
            "deep" in r.getMessage() or (r.exc_info and "deep" in str(r.exc_info[1]))
            for r in caplog.records
        )
    finally:
        writer.close()
        tier.close()


def test_the_thread_outlives_a_namespace_that_raises(tmp_path: Path) -> None:
    calls = {"n": 0}
    lock = threading.Lock()

    def namespace() -> Namespace:
        with lock:
            calls["n"] += 1
            if calls["n"] in (2, 3):
                raise RuntimeError("a bug")
        return NS

    with FileTier(str(tmp_path)) as tier:
        writer = ManifestWriter(tier, None, namespace, interval_s=0.02).start()
        try:
            time.sleep(0.5)
            assert writer._thread.is_alive() and calls["n"] > 5
        finally:
            writer.close()
