"""The canary's comparison and trust state machine (kvtier.canary), without an engine."""

from __future__ import annotations

import math

import pytest
import torch

from kvtier import canary
from kvtier.canary import GenerationTrust, Trust, combine, compare_chunk, layer_error


def _chunk(seed: int, dtype: torch.dtype = torch.bfloat16, layers: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 16, 4, 8, generator=g).to(dtype) for _ in range(layers)]


def test_same_kv_matches_and_rounding_noise_stays_far_below_the_tolerance() -> None:
    a = _chunk(0)
    assert compare_chunk(a, [t.clone() for t in a]).errors == (0.0,) * 4
    # what another batch shape does: the same values through other float rounding
    noisy = [(t.float() * (1 + 1e-3 * torch.randn_like(t.float()))).to(t.dtype) for t in a]
    cmp = compare_chunk(a, noisy)
    assert cmp.matches and cmp.result == canary.MATCH
    assert cmp.worst < canary.TOLERANCE / 5


def test_other_weights_kv_is_a_mismatch_naming_the_layer() -> None:
    a, b = _chunk(0), _chunk(1)
    cmp = compare_chunk(a, b)
    assert cmp.result == canary.MISMATCH and min(cmp.errors) > 0.5
    one_layer = [t.clone() for t in a]
    one_layer[2] = b[2]
    cmp = compare_chunk(a, one_layer)
    assert not cmp.matches and cmp.worst_layer == 2 and cmp.errors[0] == 0.0


def test_the_error_is_relative_to_the_layers_range() -> None:
    """Scale-free: the same relative change errs the same at any magnitude, and a small
    element's relative change does not blow up the error."""
    a = torch.tensor([[1.0, 100.0]])
    assert layer_error(a * 1.01, a) == pytest.approx(0.01, rel=1e-3)
    assert layer_error(a * 1.01e-3, a * 1e-3) == pytest.approx(0.01, rel=1e-3)
    assert layer_error(torch.tensor([[1e-6, 100.0]]), torch.tensor([[2e-6, 100.0]])) < 1e-7


@pytest.mark.parametrize("case", ["nan", "inf", "shape", "zeros", "layers"])
def test_anything_odd_is_never_a_match(case: str) -> None:
    a = _chunk(0, torch.float32)
    b = [t.clone() for t in a]
    if case == "nan":
        b[1][0, 0, 0, 0] = math.nan
    elif case == "inf":
        a[3][0, 0, 0, 0] = math.inf
    elif case == "shape":
        b[0] = b[0][:, :8]
    elif case == "zeros":
        b[2] = torch.zeros_like(b[2])
    else:
        b = b[:3]
    assert not compare_chunk(a, b).matches


def test_fp8_kv_and_its_rounding_compare_as_float() -> None:
    """An fp8 KV cache compares in float32; fp8 rounding (1/16 of an element) matches."""
    a = _chunk(0, torch.float32)
    rounded = [t.to(torch.float8_e4m3fn) for t in a]
    assert compare_chunk(a, rounded).matches
    assert not compare_chunk(rounded, [t.to(torch.float8_e4m3fn) for t in _chunk(1)]).matches


def test_first_writer_is_trusted_at_once_else_its_checks_decide() -> None:
    fresh = GenerationTrust()
    assert fresh.state is Trust.UNKNOWN and not fresh.trusted and fresh.wants_check()
    assert fresh.checks_wanted() == 4, "the default budget: 1024 tokens, 4 chunks of 256"
    assert fresh.first_writer(True) is Trust.TRUSTED and fresh.trusted
    assert not fresh.wants_check()  # nothing more to check at rate 0

    t = GenerationTrust(check_tokens=256)  # a budget of one chunk: its match decides
    assert t.first_writer(False) is Trust.CHECKING and not t.trusted
    t.began()
    assert not t.wants_check(), "no more checks in flight than the budget needs"
    assert t.checked(canary.ABSENT) is Trust.CHECKING and t.wants_check()
    t.began()
    assert t.checked(canary.ERROR) is Trust.CHECKING
    t.began()
    assert t.checked(canary.MATCH) is Trust.TRUSTED and t.trusted


def test_an_untrusted_generation_is_trusted_only_once_the_budget_matched() -> None:
    """One matching chunk is thin evidence: checks run several at once, up to the chunks
    the budget still needs; absent and failed checks free their place; trusted at the
    budget's last match."""
    t = GenerationTrust(check_tokens=1024, chunk_tokens=256)
    t.first_writer(False)
    assert t.check_chunks == 4 and t.checks_wanted() == 4
    for _ in range(3):
        t.began()
    assert t.checks_wanted() == 1
    assert t.checked(canary.MATCH) is Trust.CHECKING and t.matched == 256
    assert t.checks_wanted() == 1, "3 chunks left, 2 in flight"
    assert t.checked(canary.ABSENT) is Trust.CHECKING and t.matched == 256
    assert t.checked(canary.ERROR) is Trust.CHECKING and t.checks_wanted() == 3
    for _ in range(3):
        t.began()
    assert not t.wants_check()
    assert t.checked(canary.MATCH) is Trust.CHECKING
    assert t.checked(canary.MATCH) is Trust.CHECKING and t.matched == 768
    assert t.checked(canary.MATCH) is Trust.TRUSTED and t.matched == 1024
    assert t.checks_wanted() == 0 and t.checks_wanted(sampled=True) == 1


def test_a_budget_between_chunks_takes_the_next_whole_chunk() -> None:
    t = GenerationTrust(check_tokens=300, chunk_tokens=256)
    t.first_writer(False)
    assert t.check_chunks == 2 and t.checks_wanted() == 2
    t.began()
    assert t.checked(canary.MATCH) is Trust.CHECKING, "256 of 300 tokens"
    t.began()
    assert t.checked(canary.MATCH) is Trust.TRUSTED
    with pytest.raises(ValueError, match="check_tokens"):
        GenerationTrust(check_tokens=0)


def test_a_mismatch_after_matches_refuses_and_a_sample_is_one_check() -> None:
    t = GenerationTrust(check_tokens=1024, chunk_tokens=256)
    t.first_writer(False)
    for _ in range(4):
        t.began()
    assert t.checked(canary.MATCH) is Trust.CHECKING
    assert t.checked(canary.MATCH) is Trust.CHECKING
    assert t.checked(canary.MISMATCH) is Trust.REFUSED, "two matches first change nothing"
    assert t.checked(canary.MATCH) is Trust.REFUSED and t.checks_wanted() == 0
    s = GenerationTrust(first_hit=False, rate=1.0)
    assert s.checks_wanted() == 0 and s.checks_wanted(sampled=True) == 1
    s.began()
    assert s.checks_wanted(sampled=True) == 0, "one sampled check at a time"


def test_a_later_fresh_answer_trusts_a_checking_generation_never_a_refused_one() -> None:
    """A checking engine whose re-claim of a generation holding no chunk won is told
    fresh again (kvtier.objects.manifest.reclaim_generation): it writes the generation
    first now. A refused generation stays refused."""
    t = GenerationTrust()
    t.first_writer(False)
    assert t.first_writer(True) is Trust.TRUSTED and t.trusted
    r = GenerationTrust()
    r.first_writer(False)
    r.began()
    r.checked(canary.MISMATCH)
    assert r.first_writer(True) is Trust.REFUSED and not r.trusted


def test_a_mismatch_refuses_for_good() -> None:
    t = GenerationTrust()
    t.first_writer(False)
    t.began()
    assert t.checked(canary.MISMATCH) is Trust.REFUSED
    assert not t.trusted and not t.wants_check() and not t.wants_check(sampled=True)
    assert t.checked(canary.MATCH) is Trust.REFUSED  # a late match changes nothing
    # a sampled check of a trusted generation refuses it too
    s = GenerationTrust(first_hit=False, rate=1.0)
    assert s.trusted and s.sample() and s.wants_check(sampled=True)
    s.began()
    assert s.checked(canary.MISMATCH) is Trust.REFUSED and not s.sample()


def test_canary_rate_samples_that_fraction_and_first_hit_false_trusts_at_once() -> None:
    draws = iter([0.5, 0.0005, 0.2, 0.0009, 0.9])
    t = GenerationTrust(first_hit=False, rate=0.001, draw=lambda: next(draws))
    assert t.trusted
    assert [t.sample() for _ in range(5)] == [False, True, False, True, False]
    assert not GenerationTrust(rate=1.0).sample(), "an untrusted generation is not sampled"
    assert not GenerationTrust(first_hit=False).sample(), "rate 0: never"


def test_a_weight_change_makes_a_generation_only_this_engine_has() -> None:
    t = GenerationTrust()
    t.first_writer(False)
    t.began()
    t.new_generation()
    assert t.trusted and t.in_flight == 0


def test_workers_results_combine() -> None:
    assert combine(["match", "match"]) == "match"
    assert combine(["match", "mismatch"]) == "mismatch"
    assert combine(["match", "absent"]) == "absent"
    assert combine(["error", "absent"]) == "absent"
    assert combine(["match", "error"]) == "error"
    assert combine([]) == "error"


def test_a_chunk_computed_with_another_kv_dtype_under_the_same_name_is_caught() -> None:
    """An engine with an fp8 KV cache stored the chunk under a name that (wrongly) is also
    a bf16 engine's: the same bytes read as this engine's bf16 layers are a mismatch."""
    computed = _chunk(0, torch.bfloat16)
    fp8_bytes = [t.float().to(torch.float8_e4m3fn).repeat(2, 1, 1, 1) for t in computed]
    as_bf16 = [
        raw.view(torch.bfloat16).view(t.shape) for raw, t in zip(fp8_bytes, computed, strict=True)
    ]
    assert not compare_chunk(computed, as_bf16).matches


def test_canary_check_tokens_is_a_setting_of_at_least_one_token() -> None:
    from kvtier.config import load_config
    from kvtier.errors import ConfigError

    assert load_config({}, environ={}).canary_check_tokens == canary.CHECK_TOKENS == 1024
    assert load_config({"canary_check_tokens": 512}, environ={}).canary_check_tokens == 512
    env = {"KVTIER_CANARY_CHECK_TOKENS": "300"}
    assert load_config({}, environ=env).canary_check_tokens == 300
    for bad in (0, -1, 1.5, "many", True, None):
        with pytest.raises(ConfigError, match="canary_check_tokens.*an integer >= 1"):
            load_config({"canary_check_tokens": bad}, environ={})
