"""AVX2-only CPU paths on a CPU that has more: with ``KVTIER_TEST_CPU_ISA=avx2``, every
Python process started with this folder on ``PYTHONPATH`` (the test run, its engines and
their tensor-parallel workers) is told by torch that the CPU has no AMX, no AVX-512 and
no AVX512-BF16. vLLM's CPU build reads these to pick its MLA backend, its block sizes
and a hybrid model's SSM state dtype, so an AMX host runs the branches an AVX2 host
takes (``make test-avx2-paths``). vLLM's compiled kernels still use what the CPU has."""

import os

if os.environ.get("KVTIER_TEST_CPU_ISA") == "avx2":
    import torch

    def _no() -> bool:
        return False

    for _name in (
        "_is_amx_tile_supported",
        "_is_amx_fp16_supported",
        "_is_avx512_supported",
        "_is_avx512_bf16_supported",
        "_is_avx512_vnni_supported",
    ):
        if hasattr(torch.cpu, _name):
            setattr(torch.cpu, _name, _no)
