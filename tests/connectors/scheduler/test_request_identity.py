"""What a chunk's key names besides vLLM's block hash, and which chunks may be shared.

vLLM 0.32 names a LoRA adapter in its block hash by name and path only, and an image
by the id the client gave it (``multi_modal_uuids``) when it gave one. These tests
drive the scheduler side with real vLLM ``Request`` objects (vLLM's own block hasher)
and check that an adapter's weights are in every key of its requests, that what
kvtier cannot name stays out of the object tier (no lookup, no upload, on either
write policy), and that the host tier never serves an old adapter version.
"""

from __future__ import annotations

import itertools
import json
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from kvtier.config import load_config
from kvtier.connectors.scheduler.requests import AdapterFingerprints
from kvtier.connectors.scheduler.side import SchedulerSide
from kvtier.errors import ConfigError
from tests.connectors.scheduler.test_scheduler_side import (
    BS,
    CHUNK,
    answer,
    empty_step,
    make_side,
    report,
    schedule_new,
)

init_none_hash(sha256)
_ids = itertools.count()
REMOTE = {"remote_url": "file:///nonexistent"}


def tokens(seed: int, n: int) -> list[int]:
    return [(i * 7919 + seed * 104729) % 480 + 5 for i in range(n)]


def make_request(
    seed: int,
    n: int,
    *,
    lora: LoRARequest | None = None,
    mm: list[MultiModalFeatureSpec] | None = None,
    salt: str | None = None,
) -> Request:
    return Request(
        f"r{next(_ids)}",
        tokens(seed, n),
        SamplingParams(max_tokens=4),
        None,
        mm_features=mm,
        lora_request=lora,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(BS, sha256),
    )


def image(identifier: str, offset: int, length: int = 64) -> MultiModalFeatureSpec:
    """An image whose hash vLLM took from the client (``multi_modal_uuids``): nothing in
    vLLM's request tells it from a content hash."""
    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=offset, length=length),
    )


def write_adapter(path: Path, version: int) -> None:
    """A PEFT adapter directory: adapter_config.json and a safetensors file whose tensor
    bytes depend on ``version`` (same names, shapes and sizes in every version)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(
        json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "peft_type": "LORA"})
    )
    names = [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
    ]
    header: dict[str, Any] = {}
    off = 0
    for name in names:
        header[name] = {"dtype": "F32", "shape": [8, 64], "data_offsets": [off, off + 2048]}
        off += 2048
    raw = json.dumps(header).encode()
    data = bytes((version * 31 + i) % 251 for i in range(off))
    (path / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def ask(side: SchedulerSide, req: Request, computed: int = 0) -> tuple[int, list[Any]]:
    """get_num_new_matched_tokens until it answers; the object tier misses every fetch.
    Returns the answer and the fetches the lookup sent."""
    fetched: list[Any] = []
    for _ in range(100):
        n, _async = side.get_num_new_matched_tokens(req, computed)
        if n is not None:
            return n, fetched
        meta = empty_step(side)
        ops = [op for run in meta.fetches for op in run]
        fetched += ops
        answer(side, {op.op_id: [False] for op in ops})
    raise AssertionError("the lookup never finished")


def compute(side: SchedulerSide, req: Request) -> tuple[list[Any], list[Any]]:
    """Run ``req`` as a miss: its lookup, then a step computing the whole prompt.
    Returns the lookup's fetches and the step's stores (their block hashes are what
    the workers name objects by)."""
    n, fetched = ask(side, req)
    assert n == 0
    side.update_state_after_alloc(req, None, 0)
    meta = schedule_new(side, req, 0, req.num_tokens)
    report(side, meta)
    side.request_finished(req, [])
    return fetched, meta.stores


def ready_adapter_side(
    tmp_path: Path,
    lora: LoRARequest,
    extra: dict | None = None,
) -> SchedulerSide:
    """A fresh engine's scheduler side that has fingerprinted ``lora`` already."""
    side = make_side(extra={**REMOTE, **(extra or {})})
    side.identity.adapters.version(lora.lora_path)  # the first sight starts it
    assert side.identity.adapters.wait_idle(10)
    return side


# ---- LoRA ---------------------------------------------------------------------------
def test_adapter_weights_are_in_every_object_key(tmp_path: Path) -> None:
    """v1 and v2 of one adapter (one name, one path): vLLM's block hashes are the same,
    the keys the workers name objects by are not; the same files give the same keys
    in another engine (replicas still share)."""
    path = tmp_path / "adapter"
    lora = LoRARequest("ad", 1, str(path))
    write_adapter(path, 1)
    side_v1 = ready_adapter_side(tmp_path, lora)
    req_v1 = make_request(1, 1024, lora=lora)
    _, stores_v1 = compute(side_v1, req_v1)
    assert len(stores_v1) == 4 and all(op.upload_op_id is not None for op in stores_v1)

    replica = ready_adapter_side(tmp_path, lora)
    _, stores_replica = compute(replica, make_request(1, 1024, lora=lora))
    assert [op.block_hash for op in stores_replica] == [op.block_hash for op in stores_v1]

    write_adapter(path, 2)  # retrained in place
    side_v2 = ready_adapter_side(tmp_path, lora)
    req_v2 = make_request(1, 1024, lora=lora)
    assert req_v2.block_hashes == req_v1.block_hashes  # vLLM names the adapter only
    fetched, stores_v2 = compute(side_v2, req_v2)
    v1_keys = {op.block_hash for op in stores_v1}
    assert not v1_keys & {op.block_hash for op in fetched}  # never asks for v1's objects
    assert not v1_keys & {op.block_hash for op in stores_v2}
    assert len(fetched) == 4 and all(op.upload_op_id is not None for op in stores_v2)
    # requests without an adapter keep vLLM's hash as their key
    plain = make_request(1, 1024)
    _, stores_plain = compute(side_v2, plain)
    last_blocks = plain.block_hashes[CHUNK // BS - 1 :: CHUNK // BS][:4]
    assert [op.block_hash for op in stores_plain] == last_blocks


def test_adapter_rewritten_under_a_running_engine_is_never_served_old(tmp_path: Path) -> None:
    """Within one engine: after the adapter's files changed, the v1 chunks in the host
    tier are not offered, and the adapter's chunks stay out of the object tier (vLLM
    may still compute with the version it loaded)."""
    path = tmp_path / "adapter"
    lora = LoRARequest("ad", 1, str(path))
    write_adapter(path, 1)
    side = ready_adapter_side(tmp_path, lora)
    compute(side, make_request(1, 1024, lora=lora))
    again = make_request(1, 1024, lora=lora)
    assert ask(side, again)[0] == 1024 - BS  # v1 is a host hit while v1 is on disk
    side.request_finished(again, [])

    write_adapter(path, 2)
    req = make_request(1, 1024, lora=lora)
    n, fetched = ask(side, req)
    assert n == 0 and fetched == []  # not served v1, not looked up
    side.update_state_after_alloc(req, None, 0)
    meta = schedule_new(side, req, 0, req.num_tokens)
    assert len(meta.stores) == 4 and all(op.upload_op_id is None for op in meta.stores)
    report(side, meta)
    side.request_finished(req, [])
    assert side.totals["host_only_lora_changed"] == 1
    # the v2 chunks are host hits of this engine (as vLLM's own prefix cache would be)
    assert ask(side, make_request(1, 1024, lora=lora))[0] == 1024 - BS


@pytest.mark.parametrize("lora_path", ["org/hub-adapter", "missing-dir"])
def test_adapter_kvtier_cannot_read_is_never_shared(tmp_path: Path, lora_path: str) -> None:
    path = str(tmp_path / lora_path) if lora_path == "missing-dir" else lora_path
    lora = LoRARequest("ad", 1, path)
    side = make_side(extra=REMOTE)
    fetched, stores = compute(side, make_request(1, 1024, lora=lora))
    assert fetched == [] and len(stores) == 4
    assert all(op.upload_op_id is None for op in stores)
    assert side.totals["host_only_lora_unreadable"] == 1


def test_adapter_without_weight_files_is_never_shared(tmp_path: Path) -> None:
    path = tmp_path / "adapter"
    path.mkdir()
    (path / "adapter_config.json").write_text("{}")
    lora = LoRARequest("ad", 1, str(path))
    side = ready_adapter_side(tmp_path, lora)
    fetched, stores = compute(side, make_request(1, 1024, lora=lora))
    assert fetched == [] and all(op.upload_op_id is None for op in stores)
    assert side.totals["host_only_lora_unreadable"] == 1


def test_adapter_fingerprint_never_blocks_the_scheduler(tmp_path: Path) -> None:
    """The first sight of an adapter starts its fingerprint on a background thread; the
    request does not wait and is not shared; later ones are, from the cache, and the
    weights are read once per version."""
    path = tmp_path / "adapter"
    write_adapter(path, 1)
    gate = threading.Event()
    calls: list[str] = []

    def slow_fingerprint(p: str) -> str:
        calls.append(p)
        gate.wait(10)
        return "fp-" + str(len(calls))

    fps = AdapterFingerprints(remote=True, fingerprint=slow_fingerprint)
    t0 = time.perf_counter()
    first = fps.version(str(path))
    assert time.perf_counter() - t0 < 0.5
    assert not first.shared and first.reason == "lora_pending"
    assert fps.version(str(path)).reason == "lora_pending"  # not started twice
    gate.set()
    assert fps.wait_idle(10)
    ready = [fps.version(str(path)) for _ in range(50)]
    assert all(v.shared and v.tag == ready[0].tag for v in ready)
    assert len(calls) == 1
    assert ready[0].tag != first.tag  # the pending request's host keys are its own


def test_adapter_files_changing_while_fingerprinted_are_not_trusted(tmp_path: Path) -> None:
    path = tmp_path / "adapter"
    write_adapter(path, 1)

    def racing_fingerprint(p: str) -> str:
        write_adapter(path, 2)  # the files change while they are read
        return "mixed"

    fps = AdapterFingerprints(remote=True, fingerprint=racing_fingerprint, background=False)
    first = fps.version(str(path))
    assert not first.shared
    assert fps.version(str(path)).reason == "lora_changed"


def test_request_with_pending_fingerprint_is_host_only(tmp_path: Path) -> None:
    path = tmp_path / "adapter"
    write_adapter(path, 1)
    lora = LoRARequest("ad", 1, str(path))
    side = make_side(extra=REMOTE)
    gate = threading.Event()
    side.identity.adapters._fingerprint = lambda p: (gate.wait(10), "fp")[1]
    fetched, stores = compute(side, make_request(1, 1024, lora=lora))
    assert fetched == [] and all(op.upload_op_id is None for op in stores)
    assert side.totals["host_only_lora_pending"] == 1
    gate.set()
    assert side.identity.adapters.wait_idle(10)
    fetched, stores = compute(side, make_request(2, 1024, lora=lora))
    assert len(fetched) == 4 and all(op.upload_op_id is not None for op in stores)


# ---- client-named multimodal inputs ---------------------------------------------------
def test_client_named_image_chunks_stay_host_only() -> None:
    """Image at token 300: chunk 0 (tokens 0..255) does not depend on it and is shared;
    chunks 1.. are neither uploaded nor looked up."""
    side = make_side(extra=REMOTE)
    fetched, stores = compute(side, make_request(1, 1024, mm=[image("cat", 300)]))
    assert [op.upload_op_id is not None for op in stores] == [True, False, False, False]
    assert len(fetched) == 1  # chunk 0's lookup only
    assert side.totals["host_only_multimodal"] == 1

    other = make_side(extra=REMOTE)  # another replica: looks up chunk 0 only
    n, fetched = ask(other, make_request(1, 1024, mm=[image("cat", 300)]))
    assert n == 0 and len(fetched) == 1
    # the host tier still serves them within the engine (as vLLM's own prefix cache does)
    assert ask(side, make_request(1, 1024, mm=[image("cat", 300)]))[0] == 1024 - BS


@pytest.mark.parametrize("how", ["cache_salt", "trusted"])
def test_image_chunks_are_shared_with_a_salt_or_trusted_ids(how: str) -> None:
    extra = {**REMOTE, "trust_multimodal_ids": True} if how == "trusted" else REMOTE
    side = make_side(extra=extra)
    salt = "tenant-a" if how == "cache_salt" else None
    fetched, stores = compute(side, make_request(1, 1024, mm=[image("cat", 300)], salt=salt))
    assert [op.upload_op_id is not None for op in stores] == [True] * 4
    assert len(fetched) == 4  # one run: every chunk may be read
    assert side.totals["host_only_multimodal"] == 0


def test_write_back_never_uploads_host_only_chunks() -> None:
    """write_back uploads a chunk as it leaves the host tier: not a host-only one."""
    side = make_side(cpu_bytes="256KiB", extra={**REMOTE, "write_policy": "write_back"})
    uploads: list[Any] = []
    for seed in range(6):  # 4 slots, 4 chunks per prompt: every prompt evicts
        req = make_request(seed, 1024, mm=[image(f"img{seed}", 0)])
        n, _ = ask(side, req)
        side.update_state_after_alloc(req, None, 0)
        meta = schedule_new(side, req, 0, req.num_tokens)
        uploads += meta.uploads
        report(side, meta)
        side.request_finished(req, [])
        meta = empty_step(side)
        uploads += meta.uploads
        report(side, meta)
    assert side.index.evictions > 0 or side.totals["evictions"] > 0
    assert uploads == [] and side.totals["write_back"] == 0
    # a text prompt's chunks still go up under the same pressure
    for seed in range(6, 9):
        req = make_request(seed, 1024)
        ask(side, req)
        side.update_state_after_alloc(req, None, 0)
        meta = schedule_new(side, req, 0, req.num_tokens)
        report(side, meta)
        side.request_finished(req, [])
        meta = empty_step(side)
        report(side, meta)
    assert side.totals["write_back"] > 0


def test_trust_multimodal_ids_config() -> None:
    assert load_config({}, environ={}).trust_multimodal_ids is False
    assert load_config({"trust_multimodal_ids": True}, environ={}).trust_multimodal_ids
    env = {"KVTIER_TRUST_MULTIMODAL_IDS": "false"}
    assert not load_config({"trust_multimodal_ids": True}, environ=env).trust_multimodal_ids
    for bad in ("yes", 1, None, "maybe"):
        with pytest.raises(ConfigError, match="trust_multimodal_ids"):
            load_config({"trust_multimodal_ids": bad}, environ={})


# ---- prompts mixing token ids and embeddings --------------------------------------------
def test_mixed_token_and_embedding_prompts_stay_host_only() -> None:
    """vLLM hashes a mixed prompt's token ids (0 where an embedding is used) and its
    embeddings tensor (zeros where a token id is used), not which of the two each
    position uses: token 0 and a zero embedding row hash alike, compute differently."""
    import torch

    ids = tokens(1, 1024)
    ids[5] = 0
    embeds = torch.zeros(1024, 16)
    embeds[600:700] = 1.0  # an embedding part; both requests agree on it
    mask_a = [not 600 <= i < 700 for i in range(1024)]  # position 5: token 0
    mask_b = list(mask_a)
    mask_b[5] = False  # position 5: the (zero) embedding row

    def mixed(mask: list[bool]) -> Request:
        return Request(
            f"r{next(_ids)}",
            ids,
            SamplingParams(max_tokens=4),
            None,
            prompt_embeds=embeds,
            prompt_is_token_ids=mask,
            block_hasher=get_request_block_hasher(BS, sha256),
        )

    a, b = mixed(mask_a), mixed(mask_b)
    assert a.block_hashes == b.block_hashes  # vLLM cannot tell them apart
    side = make_side(extra=REMOTE)
    fetched, stores = compute(side, a)
    assert fetched == [] and len(stores) == 4
    assert all(op.upload_op_id is None for op in stores)  # a never reaches the tier
    replica = make_side(extra=REMOTE)
    assert ask(replica, b) == (0, [])  # and b never asks it
    assert side.totals["host_only_mixed_embeds"] == 1
    assert replica.totals["host_only_mixed_embeds"] == 1
    # prompts of embeddings alone are hashed by content and still shared
    plain = Request(
        f"r{next(_ids)}",
        None,
        SamplingParams(max_tokens=4),
        None,
        prompt_embeds=embeds + 2.0,
        block_hasher=get_request_block_hasher(BS, sha256),
    )
    fetched, stores = compute(side, plain)
    assert len(fetched) == 4 and all(op.upload_op_id is not None for op in stores)


def test_adapter_directory_with_a_link_loop_is_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "adapter"
    write_adapter(path, 1)
    (path / "sub").mkdir()
    (path / "sub" / "loop").symlink_to(path)
    fps = AdapterFingerprints(remote=True, background=False)
    t0 = time.perf_counter()
    version = fps.version(str(path))
    assert time.perf_counter() - t0 < 5
    assert not version.shared and version.reason == "lora_unreadable"


# ---- may_load_async (vLLM >= 0.34) agrees with the lookup ----------------------------
def test_may_load_async_follows_an_adapters_keys(tmp_path: Path) -> None:
    """A LoRA request's chunks are in the host tier under its tagged keys: once they are,
    it says no, as the lookup then sends no fetch (vLLM's raw hash is never a key)."""
    path = tmp_path / "adapter"
    lora = LoRARequest("ad", 1, str(path))
    write_adapter(path, 1)
    side = ready_adapter_side(tmp_path, lora)
    first = make_request(1, 1024 + 10, lora=lora)
    assert side.may_load_async(first)
    compute(side, first)
    again = make_request(1, 1024 + 10, lora=lora)
    predicted = side.may_load_async(again)
    n, fetched = ask(side, again)
    assert n == 1024 and fetched == [] and predicted is False


def test_may_load_async_says_no_for_chunks_that_stay_host_only(tmp_path: Path) -> None:
    """An adapter kvtier cannot read keeps its chunks out of the object tier: no early
    start, since its lookup sends nothing; a client-named image past chunk 0 looks up
    chunk 0 alone, which the host tier then holds."""
    side = make_side(extra=REMOTE)
    lora = LoRARequest("ad", 1, str(tmp_path / "missing-dir"))
    req = make_request(1, 1024 + 10, lora=lora)
    predicted = side.may_load_async(req)
    n, fetched = ask(side, req)
    assert (predicted, n, fetched) == (False, 0, [])

    side = make_side(extra=REMOTE)
    compute(side, make_request(2, 1024 + 10, mm=[image("cat", 300)]))
    req = make_request(2, 1024 + 10, mm=[image("cat", 300)])
    predicted = side.may_load_async(req)
    n, fetched = ask(side, req)
    assert fetched == [] and predicted is False
