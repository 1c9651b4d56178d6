"""Encrypted shared tiers, end to end in real vLLM engines (issue 20).

With ``encryption_key_env`` every chunk an engine writes to the object tier is sealed
(AES-256-GCM). Here, for the directory, S3 (moto's server) and Redis (redis-server):

- an engine holding the key, started after the writer exited, hits every chunk from
  the tier, with tokens and logprobs equal to vLLM's own prefix cache serving the same
  1,024 tokens;
- the stored objects hold no 4 KiB window of the plaintext chunk (the chunks an
  unencrypted engine writes for the same prompt), while opening them with the key
  gives exactly that plaintext;
- an engine with another key, or with none, loads nothing and counts ``sealed``;
- a sealed chunk copied to another chunk key's name (as is, or with its header
  rewritten to that name) and one with a single flipped byte are rejected and counted;
- the key appears in no log line, metric series, result or ``kvtier doctor`` output.

Scenarios are trust_write / trust_read of tests/e2e/trust_scenarios.py.
"""

from __future__ import annotations

import base64
import json
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvtier.objects import codec
from kvtier.objects.sealing import Sealer
from kvtier.objects.tiers import FileTier
from tests.e2e.conftest import REPO, VLLM_DEFAULTS_NAMED
from tests.e2e.test_trust import _aws_env, run_logged

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

KEY_VAR = "KVTIER_TEST_ENCRYPTION_KEY"
K1 = secrets.token_bytes(32)
K2 = secrets.token_bytes(32)
#: K1 as the operator writes it (hex), K2 as base64: both forms reach the engine
K1_TEXT, K2_TEXT = K1.hex(), base64.b64encode(K2).decode()
SEEDS = [91, 92, 93, 94]  # P1 genuine; P2 one byte flipped; P3, P4 moved chunks
WINDOW = 4096


def _split(blob: bytes) -> tuple[dict[str, Any], bytes]:
    at = codec.head_length(blob[:8])
    return msgpack.unpackb(blob[8:at], raw=False), blob[at:]


def _frame(header: dict[str, Any], payload: bytes) -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    return codec.MAGIC + len(packed).to_bytes(4, "little") + packed + payload


def _no_window(plain: bytes, stored: bytes) -> bool:
    """No ``WINDOW``-byte run of ``plain`` is in ``stored``: each such run holds an aligned
    half-window block, so checking those blocks covers every offset."""
    half = WINDOW // 2
    return all(plain[i : i + half] not in stored for i in range(0, len(plain) - half + 1, half))


def _assert_key_never_shown(result: dict[str, Any]) -> None:
    forms = [K1_TEXT, K2_TEXT, K1_TEXT.upper()]
    log = result["_log"]
    body = json.dumps({k: v for k, v in result.items() if not k.startswith("_")})
    for form in forms:
        assert form not in log, f"an encryption key is in {result['_log_path']}"
        assert form not in body
    doc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "doctor", result["_log_path"], "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO),
    )
    # exit 1 only for the warnings that name vLLM's defaults (failure policy, stop)
    assert doc.returncode in (0, 1), doc.stderr
    codes = {w["code"] for w in json.loads(doc.stdout)["warnings"]}
    assert codes <= VLLM_DEFAULTS_NAMED, codes
    assert doc.returncode == (1 if codes else 0)
    assert "KVTierConnector" in log
    for form in forms:
        assert form not in doc.stdout + doc.stderr


class Store:
    """Raw access to the objects one tier holds (what a bucket reader sees)."""

    def __init__(self, kind: str, tmp: Path, s3_server: Any, services: Any) -> None:
        self.kind = kind
        if kind == "file":
            self.root = tmp / "kv-sealed"
            self.extra: dict[str, Any] = {"remote_url": f"file://{self.root}"}
            self.env: dict[str, str] = {}
        elif kind == "s3":
            self.bucket = s3_server.create_bucket()
            self.s3 = s3_server.client()
            self.extra = {
                "remote_url": f"s3://{self.bucket}/kv",
                "s3_endpoint_url": s3_server.endpoint_url,
            }
            self.env = _aws_env(s3_server.endpoint_url)
        else:
            server = services.redis()
            self.redis = server.client()
            self.extra = {}
            self.env = {"KVTIER_REMOTE_URL": server.url}

    def get(self, key: str) -> bytes:
        if self.kind == "file":
            return self.path(key).read_bytes()
        if self.kind == "s3":
            return bytes(self.s3.get_object(Bucket=self.bucket, Key=f"kv/{key}")["Body"].read())
        value = self.redis.get(key)
        assert value is not None, key
        return bytes(value)

    def path(self, key: str) -> Path:
        return Path(FileTier(str(self.root), background_sweep=False).path(key))

    def put(self, key: str, blob: bytes) -> None:
        if self.kind == "file":
            self.path(key).write_bytes(blob)
        elif self.kind == "s3":
            self.s3.put_object(Bucket=self.bucket, Key=f"kv/{key}", Body=blob)
        else:
            self.redis.set(key, blob)


@pytest.fixture(scope="module")
def plaintext_run(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An unencrypted engine writing the same prompts: the plaintext of every chunk."""
    tmp = tmp_path_factory.mktemp("plain")
    extra = {"cpu_bytes": "64MiB", "remote_url": f"file://{tmp / 'kv'}"}
    w = run_logged("trust_write", tmp / "logs", model=tiny_model, extra=extra, seeds=SEEDS)
    tier = FileTier(str(tmp / "kv"), background_sweep=False)
    blobs = {k: Path(tier.path(k)).read_bytes() for keys in w["object_keys"] for k in keys}
    chunks = {k: bytes(codec.decode(b, key=k)) for k, b in blobs.items()}
    return {"run": w, "chunks": chunks, "blobs": blobs}


@pytest.mark.parametrize("kind", ["file", "s3", "redis"])
def test_sealed_chunks_hit_after_a_restart_and_hide_the_plaintext(
    kind: str,
    tiny_model: str,
    plaintext_run: dict[str, Any],
    s3_server,
    services,
    tmp_path: Path,
) -> None:
    store = Store(kind, tmp_path, s3_server, services)
    logs = tmp_path / "logs"
    extra = {"cpu_bytes": "64MiB", "encryption_key_env": KEY_VAR, **store.extra}
    k1 = {**store.env, KEY_VAR: K1_TEXT}
    w = run_logged("trust_write", logs, env=k1, model=tiny_model, extra=extra, seeds=SEEDS[:1])
    (keys,) = w["object_keys"]
    assert keys == plaintext_run["run"]["object_keys"][0], "the same prompt, the same chunk keys"
    assert w["remote"]["ops_upload"] == 4 and w["remote"].get("errors_tier", 0) == 0, w["remote"]
    opener = codec.Signer(sealer=Sealer(K1))
    for key in keys:
        blob = store.get(key)
        header, _ = _split(blob)
        assert {"kid", "nonce", "tag"} <= set(header) and not {"crc", "xxh"} & set(header), header
        plain = plaintext_run["chunks"][key]
        assert _no_window(plain, blob), f"{kind}: a 4 KiB window of the plaintext is stored"
        # the comparison can fail: the key opens the object to exactly that plaintext
        assert bytes(codec.decode(blob, key=key, signer=opener)) == plain
        assert not _no_window(plain, plaintext_run["blobs"][key]), "unencrypted, it shows"

    read_extra = {**extra, "write_policy": "none"}
    r = run_logged("trust_read", logs, env=k1, model=tiny_model, extra=read_extra, seeds=SEEDS[:1])
    (out,) = r["outs"]
    ref = w["ref"][0]
    assert out["cached"] == 1024, r["_log"][-3000:]
    assert out["tokens"] == ref["tokens"] and out["logprobs"] == ref["logprobs"]
    totals = r["index"]["totals"]
    assert totals["hit_tokens_remote"] == 1024 and totals["fetch_ok"] == 4, totals
    assert not any(k.startswith("error_") and v for k, v in totals.items()), totals
    for result in (w, r):
        _assert_key_never_shown(result)


def test_other_keys_no_key_moved_and_tampered_chunks_load_nothing(
    tiny_model: str, s3_server, services, tmp_path: Path
) -> None:
    store = Store("file", tmp_path, s3_server, services)
    logs = tmp_path / "logs"
    extra = {"cpu_bytes": "64MiB", "encryption_key_env": KEY_VAR, **store.extra}
    w = run_logged(
        "trust_write", logs, env={KEY_VAR: K1_TEXT}, model=tiny_model, extra=extra, seeds=SEEDS
    )
    p1, p2, p3, p4 = w["object_keys"]
    assert all(len(k) == 4 for k in (p1, p2, p3, p4))
    read_extra = {**extra, "write_policy": "none"}

    # another key (given as base64), and no key at all: each prompt's first chunk is
    # fetched, refused unopened, counted as "sealed"; behind it, the chunks the read
    # threads reached meanwhile (on a local directory the rest are queued once a stat
    # found the first) are read and refused too, the rest never asked for
    for env, no_key in (({KEY_VAR: K2_TEXT}, False), ({}, True)):
        ex = {k: v for k, v in read_extra.items() if not (no_key and k == "encryption_key_env")}
        r = run_logged("trust_read", logs, env=env, model=tiny_model, extra=ex, seeds=SEEDS)
        for out, cold in zip(r["outs"], w["cold"], strict=True):
            assert out["cached"] == 0, "an engine without K1 loaded a sealed chunk"
            assert out["tokens"] == cold["tokens"] and out["logprobs"] == cold["logprobs"]
        totals = r["index"]["totals"]
        assert totals["hit_tokens_remote"] == 0 and totals["fetch_ok"] == 0, totals
        sealed = totals.get("error_sealed", 0)
        assert 4 <= sealed, totals  # at least each prompt's first
        assert r["stats"]["counters"].get("kvtier:errors|sealed") == sealed, r["stats"]["counters"]
        assert r["remote"]["errors_sealed"] == sealed
        assert sealed + r["remote"]["gets_skipped"] == 16  # each chunk refused or not asked
        _assert_key_never_shown(r)

    # P2: one byte of its first chunk's ciphertext flipped. P3: P1's first chunk copied
    # under P3's first name with the header rewritten to claim it. P4: the same copy as is.
    blob = bytearray(store.get(p2[0]))
    blob[len(blob) // 2] ^= 0x01
    store.put(p2[0], bytes(blob))
    genuine = store.get(p1[0])
    header, payload = _split(genuine)
    header["key"] = p3[0]
    store.put(p3[0], _frame(header, payload))
    store.put(p4[0], genuine)
    r = run_logged(
        "trust_read", logs, env={KEY_VAR: K1_TEXT}, model=tiny_model, extra=read_extra, seeds=SEEDS
    )
    outs = r["outs"]
    assert outs[0]["cached"] == 1024, r["_log"][-3000:]
    ref = w["ref"][0]
    assert outs[0]["tokens"] == ref["tokens"] and outs[0]["logprobs"] == ref["logprobs"]
    for out, cold in zip(outs[1:], w["cold"][1:], strict=True):
        assert out["cached"] == 0, "a tampered or moved chunk was loaded"
        assert out["tokens"] == cold["tokens"] and out["logprobs"] == cold["logprobs"]
    totals = r["index"]["totals"]
    # P1's four chunks, and of P2-P4's genuine later chunks those the read threads reached
    # while their first was read and refused (never loaded: behind a miss)
    assert totals["hit_tokens_remote"] == 1024 and 4 <= totals["fetch_ok"] <= 4 + 3 * 3, totals
    assert totals.get("error_signature", 0) == 2, totals  # the flipped byte, the rewritten header
    assert totals.get("error_wrong_key", 0) == 1, totals  # the copy as is names P1's key
    assert totals.get("error_sealed", 0) == 0, totals
    _assert_key_never_shown(w)
    _assert_key_never_shown(r)


@pytest.mark.parametrize("bad", ["short", "unset"])
def test_a_bad_or_missing_key_stops_the_engine_at_startup(
    bad: str, tiny_model: str, tmp_path: Path
) -> None:
    """A key that is not 256 bits (here 63 hex digits), or a variable that is not set,
    stops the engine with a ConfigError naming the setting; the key is in no log line."""
    logs = tmp_path / "logs"
    extra = {
        "cpu_bytes": "64MiB",
        "encryption_key_env": KEY_VAR,
        "remote_url": f"file://{tmp_path / 'kv'}",
    }
    env = {KEY_VAR: K1_TEXT[:-1]} if bad == "short" else {}
    with pytest.raises(AssertionError, match="ended without a result"):
        run_logged(
            "trust_read", logs, env=env, model=tiny_model, extra=extra, seeds=SEEDS[:1], timeout=300
        )
    (log_path,) = logs.glob("*.log")
    log = log_path.read_text()
    assert "kvtier config 'encryption_key_env'" in log, log[-4000:]
    want = "64 hex characters" if bad == "short" else "must be set, non-empty"
    assert want in log, log[-4000:]
    assert K1_TEXT[:-1] not in log and K1_TEXT[:-1].upper() not in log
    doc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "doctor", str(log_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO),
    )
    assert K1_TEXT[:-1] not in doc.stdout + doc.stderr
    assert "encryption_key_env" in doc.stdout + doc.stderr, doc.stdout[-3000:]
