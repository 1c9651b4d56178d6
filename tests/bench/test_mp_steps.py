"""``bench/mp_steps.py`` without an engine: the events each process writes, read back into
per-request phases and the table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import mp_steps  # noqa: E402


def test_serve_loads_kvtiers_connector_from_the_module() -> None:
    """``--serve`` names this module as the connector's module path: vLLM's factory gets
    kvtier's class from it by name; any other name is an AttributeError, as for a module."""
    from kvtier.connectors.vllm import KVTierConnector

    assert mp_steps.KVTierConnector is KVTierConnector
    with pytest.raises(AttributeError):
        mp_steps.NoSuchConnector  # noqa: B018


def _restart_hit(t0: float) -> list[str]:
    """A restart hit as the three processes log it: two steps answered "ask again" (the
    second handed to the worker 4 ms late), the answer, a step with 3.2 ms of copies."""
    return [
        f"{t0:.6f} begin restart",
        f"{t0 + 0.002:.6f} get_num_new_matched_tokens 0.2 ask-again",
        f"{t0 + 0.0021:.6f} build_connector_meta 0.03 ",
        f"{t0 + 0.0031:.6f} bind_connector_metadata 0.5 ",
        f"{t0 + 0.004:.6f} get_num_new_matched_tokens 0.1 ask-again",
        f"{t0 + 0.0041:.6f} build_connector_meta 0.01 ",
        f"{t0 + 0.0081:.6f} bind_connector_metadata 0.0 ",
        f"{t0 + 0.015:.6f} get_num_new_matched_tokens 0.01 2016",
        f"{t0 + 0.0152:.6f} build_connector_meta 0.02 ",
        f"{t0 + 0.0200:.6f} start_load_kv 3.2 ",
        f"{t0 + 0.050:.6f} end restart",
    ]


def test_a_restart_hit_is_split_at_the_lookups_answer(tmp_path: Path) -> None:
    lines = _restart_hit(100.0)
    # the bench process, the engine core and the worker each write a file of their own
    (tmp_path / "1.log").write_text("\n".join(lines[i] for i in (0, 10)) + "\n")
    (tmp_path / "2.log").write_text("\n".join(lines[i] for i in (1, 2, 4, 5, 7, 8)) + "\n")
    (tmp_path / "3.log").write_text("\n".join(lines[i] for i in (3, 6, 9)) + "\n")
    engine = [
        "101.000000 begin engine",
        "101.002000 get_num_new_matched_tokens 0.05 0",
        "101.003000 start_load_kv 0.01 ",
        "101.031000 end engine",
    ]
    (tmp_path / "1.log").open("a").write("\n".join(engine) + "\n")
    [hit, own] = mp_steps.split_requests(mp_steps.read_events(str(tmp_path)))
    assert hit["kind"] == 1.0 and own["kind"] == 0.0
    assert hit["first lookup"] == pytest.approx(2.0, abs=1e-3)
    assert own["first lookup"] == pytest.approx(2.0, abs=1e-3)
    assert hit["answer"] == pytest.approx(15.0, abs=1e-3)
    assert hit["steps before answer"] == 2
    # built at 4.1 ms, bound at 8.1 ms (its 0.0 ms call ended then)
    assert hit["slowest hand-off before answer"] == pytest.approx(4.0, abs=1e-3)
    assert hit["copies"] == pytest.approx(3.2)
    assert hit["ttft"] == pytest.approx(50.0, abs=1e-3)
    assert own["ttft"] == pytest.approx(31.0, abs=1e-3) and own["steps before answer"] == 0
    table = mp_steps.summary([hit, own])
    assert "median of 1" in table
    ttft_row = next(ln for ln in table.splitlines() if ln.startswith("time to first token"))
    assert ttft_row.split()[-2:] == ["50.0", "31.0"]
    first_row = next(ln for ln in table.splitlines() if "first lookup" in ln)
    assert first_row.split()[-2:] == ["2.0", "2.0"]


def test_a_request_whose_lookup_never_answered_is_left_out(tmp_path: Path) -> None:
    lines = _restart_hit(100.0)
    kept = [ln for ln in lines if " 2016" not in ln]  # no answer: the lookup gave up
    (tmp_path / "1.log").write_text("\n".join(kept) + "\n")
    assert mp_steps.split_requests(mp_steps.read_events(str(tmp_path))) == []
    assert mp_steps.summary([]).splitlines()[-1].split()[-2:] == ["-", "-"]


def test_the_timeline_is_the_nth_restart_hits_calls(tmp_path: Path) -> None:
    lines = _restart_hit(100.0) + _restart_hit(200.0)
    (tmp_path / "1.log").write_text("\n".join(lines) + "\n")
    events = mp_steps.read_events(str(tmp_path))
    out = mp_steps.timeline(events, 2).splitlines()
    assert out[0].startswith("restart hit 2:")
    rows = [ln.split() for ln in out[1:]]
    assert rows[0] == ["2.00", "get_num_new_matched_tokens", "0.2", "ask-again"]
    assert rows[-1][:2] == ["50.00", "end"] and len(rows) == len(lines) // 2 - 1
    assert mp_steps.timeline(events, 3) == ""  # only two were timed
