"""Build a small Llama model on disk with random weights — no downloads.

The demo, the benchmarks and the end-to-end tests run a real vLLM engine on a
model built here: a ``LlamaConfig`` with random weights and a byte-level BPE
tokenizer trained on a few lines of text. The weights come from a fixed seed,
so every process that builds the same shape gets the same model.
torch and transformers are imported inside the function so that the
``kvtier`` CLI stays fast. It ships in the wheel because ``kvtier demo`` builds its
model with it; the benchmarks and tests import it from here too.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

_CORPUS = [
    "kvtier keeps the KV cache of long shared prompts in host memory and an object store.",
    "The quick brown fox jumps over the lazy dog while the scheduler plans the next step.",
    "System prompts, agent histories and retrieved documents are reused across requests.",
    "Prefill is expensive; loading cached keys and values is cheap when the link is fast.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?-_()[]{}'\"",
]


def build_tiny_llama(
    path: str | os.PathLike[str],
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_size: int = 2048,
    max_positions: int = 8192,
    seed: int = 0,
) -> Path:
    """Write a random-weight Llama and its tokenizer to ``path`` (idempotent)."""
    out = Path(path)
    marker = out / "kvtier-model.json"
    spec = {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "vocab_size": vocab_size,
        "max_positions": max_positions,
        "seed": seed,
    }
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    # transformers' annotations disagree with what it takes (torch_dtype in a config's
    # kwargs) and leave its constructors untyped: read it as untyped
    tf: Any = importlib.import_module("transformers")

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)

    config = tf.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        initializer_range=0.08,
    )
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps(spec))
    return out
