"""`kvtier size --emit helm-values` beside the operator's own values file, with real helm.

Helm merges several ``-f`` files key by key but replaces a list whole: when the planner
wrote ``vllm.extraArgs``, ``helm install -f my-values.yaml -f sizing.yaml`` (the README's
order) silently dropped the operator's own flags, and the other order dropped the
planner's. The planner now writes ``vllm.sizingArgs``, which the chart places before
``vllm.extraArgs``; both orders render every flag.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from kvtier.sizing.memory_plan import parse_k8s_quantity
from tests.deploy.test_helm import CHART, MODELS, find_helm, kvtier_size, vllm_container

pytestmark = pytest.mark.integration

PLAN = [
    "--model",
    str(MODELS / "llama3-8b"),
    "--gpu-memory",
    "80",
    "--warm-sessions",
    "400",
    "--tp",
    "2",
    "--remote-url",
    "s3://kv-cache/llama3",
]

#: the chart README's own values file (section 3), plus the signing key an object tier needs
MY_VALUES = {
    "image": {"repository": "registry.example.com/kvtier", "tag": "0.1.0"},
    "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
    "vllm": {"extraArgs": ["--max-model-len", "8192", "--enable-prefix-caching"]},
    "kvtier": {"hmac": {"existingSecret": "kvtier-hmac-3a8f"}},
}


def template(*files: Path) -> list[dict]:
    """``helm template`` with these ``-f`` files in this order."""
    args = [find_helm(), "template", "llama3", str(CHART), "--namespace", "llm"]
    for f in files:
        args += ["-f", str(f)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    d = tmp_path_factory.mktemp("values")
    mine, sizing = d / "my-values.yaml", d / "sizing.yaml"
    mine.write_text(yaml.safe_dump(MY_VALUES))
    emitted = kvtier_size(*PLAN, "--emit", "helm-values")
    sizing.write_text(emitted)
    return mine, sizing, emitted


@pytest.mark.parametrize("order", ["readme", "reversed"])
def test_both_files_flags_reach_vllm_in_either_order(files, order):
    mine, sizing, emitted = files
    sized = yaml.safe_load(emitted)
    assert "extraArgs" not in sized["vllm"], "the planner must not own the operator's list"
    c = vllm_container(template(*((mine, sizing) if order == "readme" else (sizing, mine))))
    args = c["args"]
    # the planner's flags, then the operator's, both whole and in their own order
    tail = sized["vllm"]["sizingArgs"] + MY_VALUES["vllm"]["extraArgs"]
    assert args[-len(tail) :] == tail, args
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2  # from the planner's --tp
    assert c["image"] == "registry.example.com/kvtier:0.1.0"


def test_operator_flag_wins_a_clash_and_tp_is_read_from_either_list(tmp_path):
    """vLLM takes the last of a repeated flag: extraArgs comes last, and the chart's own
    reading of a flag (GPU count, workers in the memory check) agrees with it."""
    sizing = tmp_path / "sizing.yaml"
    sizing.write_text(kvtier_size(*PLAN, "--emit", "helm-values"))
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        yaml.safe_dump(
            {
                **MY_VALUES,
                "vllm": {"extraArgs": ["--gpu-memory-utilization", "0.8"]},
            }
        )
    )
    c = vllm_container(template(mine, sizing))
    i = len(c["args"]) - 1 - c["args"][::-1].index("--gpu-memory-utilization")
    assert c["args"][i + 1] == "0.8"
    # a credential in sizingArgs is refused like one in extraArgs
    leak = tmp_path / "leak.yaml"
    leak.write_text(yaml.safe_dump({"vllm": {"sizingArgs": ["--x", "redis://:hunter2@r:6379"]}}))
    out = subprocess.run(
        [find_helm(), "template", "r", str(CHART), "-f", str(mine), "-f", str(leak)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "vllm.sizingArgs[1]" in out.stderr, out.stderr


def test_emitted_memory_limit_says_where_it_comes_from(files):
    """A limit of hundreds of GiB is emitted with the sum behind it and what lowers it."""
    _, _, emitted = files
    sized = yaml.safe_load(emitted)
    mem = sized["resources"]["limits"]["memory"]
    assert parse_k8s_quantity(mem) > 300 * 2**30  # the README's example: hundreds of GiB
    block = emitted[emitted.index("resources:") : emitted.index("  limits:")]
    comments = [ln.strip() for ln in block.splitlines()[1:]]
    assert comments and all(ln.startswith("#") for ln in comments), block
    text = " ".join(comments)
    assert f"{mem} = 2 worker(s) x (kvtier.cpuBytes" in text and "headroom 4.00 GiB" in text
    assert "400 warm sessions" in text and "--warm-sessions" in text and "--cpu-bytes" in text
