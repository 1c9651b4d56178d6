"""A vLLM CPU bug kvtier's tests meet: ``ops.rotary_embedding`` on a strided key.

vLLM's reference CPU MLA backend (taken where AMX is absent) rotates ``k_pe``, a view of
the latent cache row (``[T, 1, 64]``, 576 elements from one token to the next). The CPU
kernel reads that key as if its tokens were 64 apart: it rotates row ``j`` with the
angles of ``positions[9 * j]`` and leaves rows ``j >= T / 9`` unrotated. A token's RoPE
part then depends on its row in the batch, so any split of a prefill (vLLM's own or a
kvtier hit) changes the outputs of an MLA model on such a CPU. Kept here, expected to
fail on the installed vLLM, so that the fix shows as an unexpected pass (strict).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

ROPE, LATENT = 64, 512


def _cos_sin_cache(max_pos: int = 4096) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, ROPE, 2).float() / ROPE))
    freqs = torch.einsum("i,j->ij", torch.arange(max_pos).float(), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(torch.bfloat16)


def _rotated_keys(contiguous: bool, tokens: int = 90) -> torch.Tensor:
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    latent = torch.randn(tokens, LATENT + ROPE, dtype=torch.bfloat16)
    k_pe = latent[..., LATENT:].unsqueeze(1)  # as vLLM's MLA layer slices it
    if contiguous:
        k_pe = k_pe.contiguous()
    q = torch.randn(tokens, 4, ROPE, dtype=torch.bfloat16)
    ops.rotary_embedding(torch.arange(100, 100 + tokens), q, k_pe, ROPE, _cos_sin_cache(), False)
    return k_pe.clone()


def test_the_contiguous_key_is_rotated_at_each_tokens_own_position() -> None:
    """The control: a contiguous key, each row against a rotation done by hand."""
    torch.manual_seed(0)
    latent = torch.randn(90, LATENT + ROPE, dtype=torch.bfloat16)
    k = latent[..., LATENT:].float()
    cache = _cos_sin_cache().float()[100:190]
    cos, sin = cache[:, : ROPE // 2], cache[:, ROPE // 2 :]
    x1, x2 = k[:, 0::2], k[:, 1::2]  # GPT-J style (is_neox False): interleaved pairs
    want = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(1)
    got = _rotated_keys(contiguous=True)[:, 0].float()
    assert torch.allclose(got, want, atol=0.06), (got - want).abs().max()


@pytest.mark.xfail(
    strict=True,
    reason="vLLM CPU: ops.rotary_embedding mis-rotates a "
    "strided key (row j at positions[9*j], rows j >= T/9 unrotated)",
)
def test_a_strided_key_is_rotated_as_its_contiguous_copy() -> None:
    assert torch.equal(_rotated_keys(contiguous=False), _rotated_keys(contiguous=True))
