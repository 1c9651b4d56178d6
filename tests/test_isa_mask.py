"""tests/isa_mask: the AVX2-only paths forced where a CPU has more (``make test``'s
second pass over the ``isa`` tests on AVX-512/AMX hosts). Checked on any host: a masked
process, and the engines' workers it starts, see no AMX, AVX-512 or AVX512-BF16."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

MASK = Path(__file__).parent / "isa_mask"
ASK = (
    "import json, torch; print(json.dumps([torch.cpu._is_amx_tile_supported(), "
    "torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported()]))"
)


def _ask(isa: str | None) -> list[bool]:
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_TEST_CPU_ISA"}
    env["PYTHONPATH"] = os.pathsep.join([str(MASK), env.get("PYTHONPATH", "")])
    if isa is not None:
        env["KVTIER_TEST_CPU_ISA"] = isa
    out = subprocess.run(
        [sys.executable, "-c", ASK],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_mask_hides_amx_and_avx512_and_only_when_asked() -> None:
    import torch

    assert _ask("avx2") == [False, False, False]
    real = [
        torch.cpu._is_amx_tile_supported(),
        torch.cpu._is_avx512_supported(),
        torch.cpu._is_avx512_bf16_supported(),
    ]
    if os.environ.get("KVTIER_TEST_CPU_ISA") != "avx2":  # (this run itself is not masked)
        assert _ask(None) == real


def test_the_planner_follows_the_mask() -> None:
    """A hybrid model's SSM state dtype on vLLM's CPU build, as the masked engine gets it."""
    code = (
        "import torch; from kvtier.sizing.model import host_has_avx512_bf16; "
        "print(host_has_avx512_bf16())"
    )
    env = {
        **os.environ,
        "KVTIER_TEST_CPU_ISA": "avx2",
        "PYTHONPATH": os.pathsep.join([str(MASK), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip().splitlines()[-1] == "False"
