"""What kvtier refuses of a deployment, checked the same way by the connector at startup
and by ``kvtier size`` before it plans anything.

``kvtier size`` used to plan what the engine then refused: a Mamba/SSM hybrid (Jamba),
a tensor-parallel size the KV heads do not split into, a chunk size that is no multiple
of the block size, an object-tier URL of an unknown scheme; and it refused the size
strings the config key takes. Here the settings go through the connector's own
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

#: why a model with Mamba/SSM (or linear-attention) layers is refused
SSM_REASON = (
    "recurrent state (Mamba/SSM) held once per request rather than per token, which "
    "kvtier's chunks of tokens cannot store or restore"
)
#: why a model without attention layers is refused
ATTENTION_FREE_REASON = "it has no KV cache (an attention-free model): there is nothing to store"


def model_refused(model: str, reason: str) -> ConfigError:
    """The error that refuses ``model`` at startup (and in ``kvtier size``), naming why."""
    return ConfigError(
        "model", model,
        f"kvtier cannot serve this model: {reason}; serve it without kvtier's connector",
    )  # fmt: skip


def check_model_shape(shape: ModelShape, model: str) -> None:
    """Refuse, from its ``config.json``, a model whose KV cache the connector refuses:
    no attention layer at all, or Mamba/SSM / linear-attention layers (hybrid SSM models
    such as Jamba, Bamba, Zamba or Qwen3-Next: vLLM gives them a Mamba state group)."""
    kinds = set(shape.layer_kinds)
    if not kinds - {NONE}:
        raise model_refused(model, ATTENTION_FREE_REASON)
    if NONE in kinds:
        n = sum(1 for k in shape.layer_kinds if k == NONE)
        raise model_refused(
            model, f"{n} of its {shape.num_layers} layers are Mamba/SSM layers, with {SSM_REASON}"
        )


def check_tensor_parallel(shape: ModelShape, tp: int) -> None:
    """vLLM's own refusals of a tensor-parallel size, so that no plan is printed for an
    engine that cannot start: the attention heads must split evenly over the ranks, and
    the KV heads either split evenly or (TP above them) be replicated a whole number of
    times. MLA keeps one latent per token on every rank and splits no KV head."""
    if tp < 1:
        raise ConfigError("tensor_parallel_size", tp, "at least 1")
    if shape.num_heads % tp:
        raise ConfigError(
            "tensor_parallel_size", tp,
            f"a divisor of the model's {shape.num_heads} attention heads (vLLM refuses "
            "to start otherwise)",
        )  # fmt: skip
    kv = shape.num_kv_heads
    if shape.is_mla or kv <= 0:
        return
    if (tp <= kv and kv % tp) or (tp > kv and tp % kv):
        raise ConfigError(
            "tensor_parallel_size", tp,
            f"a divisor or a multiple of the model's {kv} KV heads (vLLM refuses to start "
            "otherwise)",
        )  # fmt: skip


def check_deployment(
    extra: Mapping[str, Any],
    *,
    shape: ModelShape,
    model: str,
    tp: int = 1,
    block_size: int = 16,
    environ: Mapping[str, str] | None = None,
) -> KVTierConfig:
    """Everything kvtier refuses of this deployment before it runs: the settings as the
    connector reads them (``extra`` is ``kv_connector_extra_config``), chunks against
    vLLM's blocks, the model's layers and the tensor-parallel size. The first refusal is
    a ConfigError naming the key; returns the config."""
    cfg = load_config(extra, environ={} if environ is None else environ)
    if block_size < 1:
        raise ConfigError("block_size", block_size, "a positive number of tokens")
    cfg.check_block_size(block_size)
    check_model_shape(shape, model)
    check_tensor_parallel(shape, tp)
    return cfg


__all__ = [
    "ATTENTION_FREE_REASON", "SSM_REASON", "check_deployment", "check_model_shape",
    "check_tensor_parallel", "model_refused",
]  # fmt: skip
