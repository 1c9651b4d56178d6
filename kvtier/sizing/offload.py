"""vLLM weight offload, replayed without torch: which tensors move and what host RAM they take.

Mirrors ``vllm/model_executor/offloader/{base,uva,prefetch}.py`` (0.32/0.33):

* backend ``auto`` picks prefetch when ``offload_group_size > 0``, else UVA
  when ``cpu_offload_gb > 0``; the UVA budget is ``int(cpu_offload_gb * 1024**3)``
  (GiB, whatever the flag's name says).
* UVA walks decoder layers in order and each layer's parameters in
  declaration order, checking the budget *before* each tensor, so the last
  tensor taken may overshoot it. A selector ``p`` matches a parameter when
  ``f".{p}."`` is in ``f".{name}."`` with ``name`` relative to one decoder layer.
* prefetch moves the last ``offload_num_in_group`` layers of every
  ``offload_group_size`` and keeps ``offload_prefetch_step`` GPU copies of each
  distinct offloaded parameter in a static buffer pool.
* pinned host copies go through PyTorch's caching host allocator, which
  rounds every allocation up to a power of two; with
  ``VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY=1`` the copy is exact.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvtier.sizing.weights import Weights, WeightTensor

PIN_ENV = "VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY"
GiB = 1024**3


def next_pow2(n: int) -> int:
    """What the caching host allocator really reserves for an ``n``-byte pinned tensor."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def pin_disabled_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Read the variable exactly as vLLM's envs.py does: ``bool(int(os.getenv(VAR, "0")))``.

    A value ``int()`` cannot parse makes vLLM itself fail, so it raises here too.
    """
    env = os.environ if environ is None else environ
    value = env.get(PIN_ENV, "0")
    try:
        return bool(int(value))
    except ValueError:
        raise ValueError(
            f"{PIN_ENV}={value!r}: vLLM reads it with int() and would fail; use 0 or 1"
        ) from None


def resolve_pin(disable_pin_memory: bool | None, environ: Mapping[str, str] | None = None) -> bool:
    """True when offloaded weights are pinned (and so rounded up)."""
    if disable_pin_memory is not None:
        return not disable_pin_memory
    return not pin_disabled_from_env(environ)


def selector_matches(selector: str, name: str) -> bool:
    """vLLM's literal segment match: ``.{selector}.`` inside ``.{name}.``."""
    return f".{selector}." in f".{name}."


def host_bytes(tensors: Iterable[WeightTensor], pin: bool) -> int:
    """Host RAM the offloaded tensors (one TP rank's shards) really take."""
    return sum(next_pow2(t.rank_bytes) if pin else t.rank_bytes for t in tensors)


@dataclass(frozen=True, slots=True)
class OffloadResult:
    """What one TP rank's offloader does with the weights."""

    backend: str  # "none", "uva" or "prefetch"
    tensors: tuple[WeightTensor, ...]
    #: bytes that leave the GPU (exact tensor sizes, what vLLM logs)
    gpu_bytes: int
    #: bytes of host RAM the copies occupy (power-of-two rounded when pinned)
    host_bytes: int
    #: prefetch only: static GPU buffers the prefetch step keeps resident
    buffer_pool_bytes: int = 0
    #: UVA only: the budget in bytes, as vLLM computes it
    budget_bytes: int = 0
    #: selectors that matched no parameter of any decoder layer
    unmatched_selectors: tuple[str, ...] = ()
    layers_touched: int = 0

    @property
    def gpu_saved_bytes(self) -> int:
        return self.gpu_bytes - self.buffer_pool_bytes


def select_backend(offload_backend: str, cpu_offload_gb: float, offload_group_size: int) -> str:
    """vLLM's ``create_offloader`` choice."""
    if offload_backend == "auto":
        if offload_group_size > 0:
            return "prefetch"
        return "uva" if cpu_offload_gb > 0 else "none"
    return offload_backend


def _unmatched(weights: Weights, selectors: Iterable[str]) -> tuple[str, ...]:
    names = {t.name for layer in weights.layers for t in layer}
    return tuple(sorted(p for p in selectors if not any(selector_matches(p, n) for n in names)))


def uva_offload(
    weights: Weights, cpu_offload_gb: float, params: Iterable[str] = (), *, pin: bool = True
) -> OffloadResult:
    """Replay ``UVAOffloader._maybe_offload_to_cpu`` over the decoder layers."""
    budget = int(cpu_offload_gb * GiB)
    selectors = set(params)
    taken: list[WeightTensor] = []
    used = 0
    layers = 0
    for layer in weights.layers:
        if used >= budget:
            break
        took = False
        for t in layer:
            if used >= budget:
                break
            if selectors and not any(selector_matches(p, t.name) for p in selectors):
                continue
            taken.append(t)
            used += t.rank_bytes
            took = True
        layers += took
    return OffloadResult(
        backend="uva",
        tensors=tuple(taken),
        gpu_bytes=used,
        host_bytes=host_bytes(taken, pin),
        budget_bytes=budget,
        unmatched_selectors=_unmatched(weights, selectors),
        layers_touched=layers,
    )


def prefetch_offload(
    weights: Weights,
    group_size: int,
    num_in_group: int = 1,
    prefetch_step: int = 1,
    params: Iterable[str] = (),
    *,
    pin: bool = True,
) -> OffloadResult:
    """Replay ``PrefetchOffloader.wrap_modules`` and its ``StaticBufferPool``."""
    if group_size <= 0:
        raise ValueError("prefetch offload needs offload_group_size > 0")
    if num_in_group > group_size:
        raise ValueError(
            f"offload_num_in_group ({num_in_group}) must be <= offload_group_size ({group_size})"
        )
    if prefetch_step < 1:
        raise ValueError(f"offload_prefetch_step ({prefetch_step}) must be >= 1")
    selectors = set(params)
    taken: list[WeightTensor] = []
    unique: dict[tuple[str, int], int] = {}
    layers = 0
    for idx, layer in enumerate(weights.layers):
        if idx % group_size < group_size - num_in_group:
            continue
        chosen = [
            t for t in layer if not selectors or any(selector_matches(p, t.name) for p in selectors)
        ]
        if not chosen:
            continue
        layers += 1
        taken.extend(chosen)
        for t in chosen:
            unique.setdefault((t.name, t.rank_numel), t.rank_bytes)
    pool = sum(unique.values()) * prefetch_step if taken else 0
    return OffloadResult(
        backend="prefetch",
        tensors=tuple(taken),
        gpu_bytes=sum(t.rank_bytes for t in taken),
        host_bytes=host_bytes(taken, pin),
        buffer_pool_bytes=pool,
        unmatched_selectors=_unmatched(weights, selectors),
        layers_touched=layers,
    )


def no_offload() -> OffloadResult:
    return OffloadResult(backend="none", tensors=(), gpu_bytes=0, host_bytes=0)
