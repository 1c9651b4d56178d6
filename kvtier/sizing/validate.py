"""What kvtier refuses of a deployment, checked the same way by the connector at startup
and by ``kvtier size`` before it plans anything.

``kvtier size`` used to plan what the engine then refused: a tensor-parallel size the KV
heads do not split into, a chunk size that is no multiple of the block size (for a hybrid
model with recurrent state: of the larger block vLLM raises it to), an object-tier URL of
an unknown scheme; and it refused the size strings the config key takes.
Here the settings go through the connector's own
:func:`~kvtier.config.load_config` and :meth:`~kvtier.config.KVTierConfig.check_block_size`,
and the model's layers through the refusals the connector makes of vLLM's KV cache groups
(:func:`kvtier.connectors.vllm.check_kv_cache_groups` builds its error with
:func:`model_refused` and these reasons). The standard library only: ``kvtier size``
never loads torch or vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.config import KVTierConfig, load_config
from kvtier.errors import ConfigError
from kvtier.sizing.model import NONE, ModelShape

#: why a model with Mamba/SSM (or linear-attention) layers is refused where its state
#: cannot be stored (the connector's words for a state group it does not take)
SSM_REASON = (
    "recurrent state (Mamba/SSM) held once per request rather than per token, which "
    "kvtier's chunks of tokens cannot store or restore"
)
#: the state kinds ``kvtier size`` sizes (one state per state layer per chunk)
SIZED_STATE = (
    "kvtier sizes and stores Mamba1 (Jamba), Mamba2 (Granite-4.0-H, Bamba, Nemotron-H), "
    "gated delta-net (Qwen3-Next, Qwen3.5) and short-conv (LFM2) state"
)
#: why a model without attention layers is refused
ATTENTION_FREE_REASON = "it has no KV cache (an attention-free model): there is nothing to store"


def model_refused(model: str, reason: str) -> ConfigError:
    """The error that refuses ``model`` at startup (and in ``kvtier size``), naming why."""
    return ConfigError(
        "model",
        model,
        f"kvtier cannot serve this model: {reason}; serve it without kvtier's connector",
    )


def check_model_shape(shape: ModelShape, model: str) -> None:
    """Refuse, from its ``config.json``, a model whose KV cache the connector refuses:
    no attention layer at all, or recurrent-state layers whose state kvtier cannot size
    (named by their layer type: Falcon-H1's parallel Mamba, Zamba2, KDA, lightning
    attention...). Hybrids whose state it sizes (:mod:`kvtier.sizing.state`) pass: vLLM
    gives them a Mamba state group, one state per layer per chunk for kvtier."""
    kinds = set(shape.layer_kinds)
    if not kinds - {NONE}:
        raise model_refused(model, ATTENTION_FREE_REASON)
    if shape.unsized_state:
        raise model_refused(
            model,
            f"its {shape.unsized_state} hold a recurrent state of a kind kvtier "
            f"cannot size or store ({SIZED_STATE})",
        )


def check_tensor_parallel(shape: ModelShape, tp: int) -> None:
    """vLLM's own refusals of a tensor-parallel size, so that no plan is printed for an
    engine that cannot start: the attention heads must split evenly over the ranks, and
    the KV heads either split evenly or (TP above them) be replicated a whole number of
    times. MLA keeps one latent per token on every rank and splits no KV head."""
    if tp < 1:
        raise ConfigError("tensor_parallel_size", tp, "at least 1")
    if shape.state is not None:
        shape.state_spec(tp)  # vLLM divides the state's heads and channels too
    if shape.num_heads % tp:
        raise ConfigError(
            "tensor_parallel_size",
            tp,
            f"a divisor of the model's {shape.num_heads} attention heads (vLLM refuses "
            "to start otherwise)",
        )
    kv = shape.num_kv_heads
    if shape.is_mla or kv <= 0:
        return
    if (tp <= kv and kv % tp) or (tp > kv and tp % kv):
        raise ConfigError(
            "tensor_parallel_size",
            tp,
            f"a divisor or a multiple of the model's {kv} KV heads (vLLM refuses to start "
            "otherwise)",
        )


def check_deployment(
    extra: Mapping[str, Any],
    *,
    shape: ModelShape,
    model: str,
    tp: int = 1,
    block_size: int = 16,
    environ: Mapping[str, str] | None = None,
    kv_cache_dtype: str = "auto",
    mamba_cache_dtype: str = "auto",
    mamba_ssm_cache_dtype: str = "auto",
    cpu_build: bool = False,
) -> KVTierConfig:
    """Everything kvtier refuses of this deployment before it runs: the settings as the
    connector reads them (``extra`` is ``kv_connector_extra_config``), chunks against
    vLLM's blocks, the model's layers and the tensor-parallel size. The first refusal is
    a ConfigError naming the key; returns the config.

    A hybrid model with state runs with a larger block than ``block_size`` (vLLM raises
    it until an attention page holds a state page), and chunks must line up with that
    one: the refusal names the chunk sizes that do."""
    cfg = load_config(extra, environ={} if environ is None else environ)
    if block_size < 1:
        raise ConfigError("block_size", block_size, "a positive number of tokens")
    cfg.check_block_size(block_size)
    check_model_shape(shape, model)
    check_tensor_parallel(shape, tp)
    spec, engine_block = shape.engine_state(
        block_size,
        kv_cache_dtype,
        tp,
        mamba_cache_dtype=mamba_cache_dtype,
        mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
        cpu_build=cpu_build,
    )
    if cfg.chunk_size % engine_block:
        raise ConfigError(
            "chunk_size",
            cfg.chunk_size,
            f"a multiple of the {engine_block}-token block vLLM runs this hybrid model with "
            f"(it raises --block-size {block_size} until one attention page holds one "
            f"{spec.bytes_per_layer if spec else 0}-byte state page): e.g. "
            f"{engine_block * -(-cfg.chunk_size // engine_block)}, with --block-size "
            f"{engine_block} given to vLLM and kvtier size alike",
        )
    return cfg


__all__ = [
    "ATTENTION_FREE_REASON",
    "SIZED_STATE",
    "SSM_REASON",
    "check_deployment",
    "check_model_shape",
    "check_tensor_parallel",
    "model_refused",
]
