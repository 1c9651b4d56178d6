"""The output comparison the trust tests rely on: a near-tie flip is not a mismatch, a
real difference is (cases taken from soak runs on vLLM's CPU build)."""

from __future__ import annotations

from tests.e2e.trust_scenarios import compare


def _out(tokens: list[int], steps: list[list[tuple[int, float]]]) -> dict:
    return {"tokens": tokens, "logprobs": [sorted(s) for s in steps]}


def test_same_tokens_and_logprobs_are_same() -> None:
    a = _out([5, 7], [[(5, -1.0), (6, -2.0)], [(7, -0.5), (8, -3.0)]])
    assert compare(a, a) == "same"


def test_a_logprob_moved_past_tol_differs() -> None:
    a = _out([5], [[(5, -1.0), (6, -2.0)]])
    b = _out([5], [[(5, -1.2), (6, -2.0)]])
    assert compare(a, b) == "differ"


def test_two_way_near_tie_flip_is_a_tie() -> None:
    a = _out([114, 439], [[(114, -2.853)], [(439, -4.3107), (1552, -4.3107)]])
    b = _out([114, 1552], [[(114, -2.853)], [(853, -4.341), (1552, -4.3098)]])
    # the reference's list lacks 439, but its lowest listed logprob is within tol
    assert compare(a, b) == "tie"


def test_three_way_near_tie_with_the_pick_outside_the_other_list_is_a_tie() -> None:
    a = _out([1373, 1790], [[(1373, -4.2)], [(692, -4.708), (1790, -4.6924)]])
    b = _out([1373, 461], [[(1373, -4.2)], [(461, -4.6927), (692, -4.7239)]])
    assert compare(a, b) == "tie"


def test_a_clear_winner_replaced_is_a_difference() -> None:
    # the reference's pick led by a full nat: another token winning is wrong KV, not noise
    a = _out([9], [[(9, -1.0), (3, -1.01)]])
    b = _out([3], [[(3, -0.2), (9, -1.2)]])
    assert compare(a, b) == "differ"
    c = _out([9], [[(9, -1.0), (4, -2.5)]])  # the other's pick is not even listed
    d = _out([3], [[(3, -0.2), (8, -1.0)]])
    assert compare(c, d) == "differ"
