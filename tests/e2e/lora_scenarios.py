"""Engine scenarios for tests/e2e/test_lora_identity.py: LoRA adapters and chunk keys.

Loaded by tests/e2e/engine.py through ``KVTIER_TEST_SCENARIO_MODULES``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tests.e2e.engine import build_llm, index_report, kvtier_side, register, settle, summary, toks

#: 4 full chunks of 256 and 20 tokens vLLM always computes itself
PROMPT_TOKENS = 1024 + 20


def write_lora_adapter(path: str | os.PathLike[str], base_model: str, seed: int) -> None:
    """A PEFT LoRA adapter (rank 8 on q_proj and v_proj) for the tiny 4-layer Llama of
    tests/e2e/conftest.py; the same names, shapes and file size for every ``seed``."""
    import torch
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(4):
        for module, (n_in, n_out) in {"q_proj": (256, 256), "v_proj": (256, 128)}.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[prefix + ".lora_A.weight"] = (torch.randn(8, n_in, generator=gen) * 0.1).to(
                torch.bfloat16
            )
            tensors[prefix + ".lora_B.weight"] = (torch.randn(n_out, 8, generator=gen) * 0.1).to(
                torch.bfloat16
            )
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "r": 8,
                "lora_alpha": 16,
                "target_modules": ["q_proj", "v_proj"],
                "peft_type": "LORA",
                "bias": "none",
                "base_model_name_or_path": base_model,
            }
        )
    )


@register
def lora_prompts(
    model: str, extra: dict[str, Any] | None, adapters: list[list[Any]]
) -> dict[str, Any]:
    """One prompt per adapter ``[name, id, path]``, in order, each with vLLM's prefix cache
    flushed first. With kvtier, its fingerprints of the adapters are awaited before
    (an adapter's first request is host-only while kvtier reads it)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = build_llm(model, extra, enable_lora=True, max_lora_rank=8, max_loras=2)
    if extra is not None:
        fps = kvtier_side(llm).identity.adapters
        for _name, _id, path in adapters:
            fps.version(path)
        assert fps.wait_idle(60), "adapter fingerprints did not finish"
    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=3)
    prompt = [TokensPrompt(prompt_token_ids=toks(41, PROMPT_TOKENS))]
    outs: list[dict[str, Any]] = []
    hits: list[int] = []
    for name, lora_id, path in adapters:
        llm.reset_prefix_cache()
        before = dict(kvtier_side(llm).totals) if extra is not None else {}
        o = llm.generate(prompt, sp, lora_request=LoRARequest(name, lora_id, path), use_tqdm=False)[
            0
        ]
        outs.append(summary(o))
        if extra is not None:
            after = kvtier_side(llm).totals
            hits.append(after["hit_tokens_remote"] - before.get("hit_tokens_remote", 0))
    result: dict[str, Any] = {"outs": outs, "remote_hits": hits}
    if extra is not None:
        settle(llm)
        result["index"] = index_report(llm)
    return result
