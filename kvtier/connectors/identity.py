"""What a chunk key says about the engine: the model's identity and KV layout.

The host tier lives and dies with one engine, so the model's name is enough there.
The object tier outlives engines and is shared by replicas: its keys carry a
fingerprint of the weights (:mod:`kvtier.fingerprint`), where they were loaded from
(the files, or random values), and every setting that changes what they compute, and
startup refuses the settings under which chunks from another process could be wrong
for this one. Each worker's keys also name its layers and their KV dtypes
(``Namespace.layers``). Weights replaced while the engine runs (a reload, a weight
transfer, any ``collective_rpc``) are followed: :mod:`kvtier.connectors.scheduler.weights` tells
the scheduler side, which drops the host tier and gives the object keys a new identity
of their own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.fingerprint import FingerprintError, weights_fingerprint
from kvtier.keys import Namespace

from .engine_shape import EngineShape

logger = logging.getLogger("kvtier")


def namespace_for(cfg: KVTierConfig, shape: EngineShape, *, read_weights: bool = True) -> Namespace:
    """Everything besides the prefix that makes KV bytes incompatible.

    With an object tier the model is named by its fingerprint, not its path: the same
    weights mounted at two paths share chunks, new weights at the same path do not.
    ``read_weights=False`` leaves the fingerprint out, for a worker built before vLLM
    has loaded (or downloaded) the weights; its keys are made after that.
    """
    name, revision, fingerprint = shape.model, shape.revision, ""
    if cfg.remote_url:
        check_shareable(cfg, shape)
        name, revision = "", None
        if read_weights:
            fingerprint = model_identity(cfg, shape)
    return Namespace(
        model=name,
        revision=revision,
        dtype=shape.dtype,
        kv_cache_dtype=shape.kv_cache_dtype,
        block_size=shape.kv_block_size(),
        chunk_size=cfg.chunk_size,
        tp_size=shape.tp_size,
        pp_size=shape.pp_size,
        namespace=cfg.namespace,
        fingerprint=fingerprint,
        replicated_kv=shape.use_mla,
        label=shape.served_name,
    )


def check_shareable(cfg: KVTierConfig, shape: EngineShape) -> None:
    """Refuse an object tier where chunks of other processes cannot be trusted to match.

    - A non-cryptographic block hash (``xxhash``): with a shared seed, prompts can be
      crafted whose blocks collide with another tenant's; without one, every process
      hashes differently and nothing is ever shared.
    - KV scales computed per replica (``--calculate-kv-scales`` with an fp8 KV cache):
      the same prefix gives other bytes in every replica, and a chunk quantized with
      another replica's scales reads back as wrong values.
    """
    algo = shape.prefix_hash_algo
    if algo.startswith("xxhash"):
        raise ConfigError(
            "remote_url",
            cfg.remote_url,
            f"an object tier needs a collision-resistant block hash, and vLLM runs with "
            f"--prefix-caching-hash-algo {algo}: use sha256 or sha256_cbor, or drop remote_url",
        )
    if shape.calculate_kv_scales and shape.kv_cache_dtype != "auto":
        raise ConfigError(
            "remote_url",
            cfg.remote_url,
            "an object tier cannot be shared when each replica computes its own KV scales "
            "(--calculate-kv-scales): load the scales from the checkpoint, or drop remote_url",
        )


def check_parallel(shape: EngineShape) -> None:
    """Refuse context parallelism: with ``--decode-context-parallel-size`` or
    ``--prefill-context-parallel-size`` above 1, each rank holds another share of a
    block's tokens, which kvtier's slots and keys (TP rank and pipeline stage) do not
    name. Loading one share into another rank's blocks would be wrong KV."""
    sizes = {
        "decode_context_parallel_size": shape.decode_context_parallel_size,
        "prefill_context_parallel_size": shape.prefill_context_parallel_size,
    }
    for flag, size in sizes.items():
        if size > 1:
            raise ConfigError(
                "kv_connector",
                "KVTierConnector",
                f"kvtier does not support context parallelism, and vLLM runs with "
                f"--{flag.replace('_', '-')} {size}: run without it, or without kvtier",
            )


def workers_on_node(shape: EngineShape) -> int:
    """This engine's workers on one host (its tensor- and pipeline-parallel ranks over
    its nodes): they share the host's CPUs, which ``io_threads: auto`` divides."""
    return max(1, shape.world_size // max(1, shape.nnodes))


#: vLLM load formats that read the weights from the model's own files, the files
#: :func:`kvtier.fingerprint.weights_fingerprint` reads (local or streamed)
FILE_LOAD_FORMATS = frozenset(
    {
        "auto",
        "hf",
        "safetensors",
        "pt",
        "npcache",
        "fastsafetensors",
        "instanttensor",
        "mistral",
        "sharded_state",
        "runai_streamer",
        "runai_streamer_sharded",
    }
)
#: load formats that fill the weights with random values instead of the files'
RANDOM_LOAD_FORMATS = frozenset({"dummy"})
#: names random weights in this process: vLLM draws them per device type and version,
#: so no other process can be trusted to hold the same ones
_RANDOM_WEIGHTS = os.urandom(16).hex()


def load_source(cfg: KVTierConfig, shape: EngineShape) -> str:
    """Where the weights come from, as part of the model identity: ``"files"`` (the model's
    weight files, which the fingerprint reads), ``"dummy"`` (random values: a benchmark
    engine must never fill a tier under the real weights' keys, nor share with another
    process, whose random values may differ), or another loader's name (tensorizer, a
    peer, a cache: the weights do not come from the files the fingerprint read, so such an
    engine needs ``model_fingerprint`` and never shares with a file-loaded one)."""
    fmt = shape.load_format
    if fmt in FILE_LOAD_FORMATS:
        return "files"
    if fmt in RANDOM_LOAD_FORMATS:
        return fmt
    if not cfg.model_fingerprint:
        raise ConfigError(
            "model_fingerprint",
            None,
            f"vLLM loads the weights with --load-format {fmt}, not from the model's files "
            "that kvtier fingerprints, and an object tier must never hand one model's KV to "
            "another: set model_fingerprint to a string that changes whenever those weights "
            "do, or drop remote_url",
        )
    return f"loader:{fmt}"


def model_identity(cfg: KVTierConfig, shape: EngineShape) -> str:
    """Digest of the weights (or ``cfg.model_fingerprint``), where they were loaded from
    (:func:`load_source`: the files, or random values) and of the settings that change
    what they compute: the model config after ``hf_overrides`` (rope scaling...), the
    quantization method and the context length (rope variants pick factors by it); and
    of a speculative drafter's own weights, whose layers' KV the chunks hold too
    (``model_fingerprint``, when set, must name those as well)."""
    source = load_source(cfg, shape)
    if source in RANDOM_LOAD_FORMATS:
        weights = f"random:{_RANDOM_WEIGHTS}"  # the files are not read: nothing to share
    else:
        weights = cfg.model_fingerprint or _weights(shape.model, shape.revision)
    settings: dict[str, Any] = {
        "weights": weights,
        "load": source,
        "hf_config": shape.hf_config_dict,
        "quantization": shape.quantization,
        "max_model_len": shape.max_model_len,
        "attention_dtype": shape.attention_dtype,
    }
    if shape.draft_model is not None and not cfg.model_fingerprint:
        # a drafter's attention layers (EAGLE, a draft model) keep KV in the same chunks
        settings["draft"] = _weights(shape.draft_model, shape.draft_revision)
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def _weights(path: str, revision: str | None) -> str:
    """Fingerprint of the model's local files: its directory, or the Hugging Face cache's
    snapshot of a hub id (vLLM downloaded it before the connector starts)."""
    try:
        return weights_fingerprint(path)
    except FingerprintError as local_error:
        snapshot = _hub_snapshot(path, revision)
        if snapshot is not None:
            try:
                return weights_fingerprint(snapshot)
            except FingerprintError:
                pass
        raise ConfigError(
            "model_fingerprint",
            None,
            f"kvtier cannot fingerprint the weights of {path!r} ({local_error}), and an "
            "object tier must never hand one model's KV to another: set model_fingerprint "
            "to a string that changes whenever the weights do (a build id, a checksum)",
        ) from None


def _hub_snapshot(repo_id: str, revision: str | None) -> str | None:
    """The local snapshot directory of a hub model, or None when there is none."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, revision=revision, local_files_only=True)
    except Exception:  # not a hub id, not downloaded, or no huggingface_hub
        return None
