"""vLLM's offline ``LLM`` with kvtier, in the benchmark's own process: the tiny model
sized for the prompts, the engine, one timed request, and prompts that share nothing.

vLLM is imported inside the functions, so a script sets its environment
(``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_KVCACHE_SPACE``) before the first engine.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32
CHUNK_TOKENS = 256


def prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids of prompt ``seed`` (480 distinct prompts; see :func:`seeds`)."""
    return [((i * 7919 + seed * 104729 + seed * seed) % 480) + 5 for i in range(n)]


def seeds(start: int, count: int, avoid: tuple[int, ...] = (999,)) -> list[int]:
    """``count`` seeds from ``start`` whose prompts differ from each other and from
    ``avoid``'s (prompt has 480 distinct prompts; seeds 1 and 6 give the same one)."""
    seen = {prompt(a, 1)[0] for a in avoid}
    out, seed = [], start
    while len(out) < count:
        first = prompt(seed, 1)[0]
        if first not in seen:
            seen.add(first)
            out.append(seed)
        seed += 1
    return out


def timed_request(llm: Any, tokens: list[int]) -> tuple[float, int]:
    """One greedy request for one token: (time to first token in seconds, cached tokens)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0)
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], sp, use_tqdm=False)[0]
    return time.perf_counter() - t0, out.num_cached_tokens or 0


def kv_bytes_per_token(layers: int, hidden: int, heads: int = 16, kv_heads: int = 8) -> int:
    """KV bytes per token of :func:`tiny_model`'s Llama (bf16: K and V, every layer)."""
    return 2 * layers * kv_heads * (hidden // heads) * 2


def tiny_model(
    lengths: list[int],
    layers: int,
    hidden: int,
    model_dir: str | None = None,
    heads: int = 16,
    kv_heads: int = 8,
) -> tuple[Path, int]:
    """The tiny Llama (built once per directory) whose positions cover the longest prompt
    of ``lengths`` and its output token, and the engine's ``max_model_len`` for it."""
    from kvtier.cli.tinymodel import build_tiny_llama

    max_len = max(4096, max(lengths) + 64)
    # the model's positions must cover the prompt and its output token: 8,192 by default
    positions = 8192 if max_len <= 8192 else 1 << (max_len - 1).bit_length()
    default_dir = "kvtier-bench-model" + ("" if positions == 8192 else f"-{positions}")
    model = build_tiny_llama(
        model_dir or os.path.join(tempfile.gettempdir(), default_dir),
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        max_positions=positions,
    )
    return model, max_len


def kvtier_llm(
    model: Path,
    max_len: int,
    extra: dict[str, Any],
    *,
    in_process: bool = False,
    failure_policy: str = "recompute",
) -> Any:
    """An ``LLM`` with kvtier (1 GiB host tier, 256-token chunks, ``extra`` on top);
    ``in_process``: the scheduler, the worker and kvtier's I/O threads all in this process
    (what a profile of them needs); ``failure_policy``: vLLM's ``kv_load_failure_policy``
    (``recompute``, as docs/configuration.md advises: a local directory tier's lookups then answer
    in their own step)."""
    from vllm import LLM

    ktc = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.connectors.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes": "1GiB",
            "cpu_headroom_bytes": "1GiB",
            "chunk_size": CHUNK_TOKENS,
            # the benches time the load path: with the first-hit canary on, a restarted
            # engine's first hit is computed and checked instead (one chunk's prefill per
            # engine start, not a hit's cost)
            "canary_first_hit": False,
            **extra,
        },
        "kv_load_failure_policy": failure_policy,
    }
    inproc = {"distributed_executor_backend": "uni"} if in_process else {}
    return LLM(
        model=str(model),
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=max_len,
        seed=0,
        kv_transfer_config=ktc,
        **inproc,
    )
