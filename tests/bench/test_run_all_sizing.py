"""``bench/run_all.py`` sizes each kvtier row's host tier from the memory free when the row
starts, so no row is refused by kvtier's startup check on a busy 24 GiB machine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import run_all  # noqa: E402

from kvtier.errors import ConfigError  # noqa: E402
from kvtier.sizing.autosize import resolve_cpu_bytes  # noqa: E402

GiB = 2**30


def _row_extra(monkeypatch, tmp_path: Path, available: int) -> dict:
    """The kvtier config a host-tier row gets while ``available`` bytes are free."""
    monkeypatch.setattr(run_all, "mem_available_bytes", lambda: available)
    args = argparse.Namespace(
        model_shape="bench", no_install=True, kv_load_failure_policy="recompute"
    )
    cfg = next(c for c in run_all.CONFIGS if c.name == "kvtier-host")
    with run_all.Setup(cfg, tmp_path, args, run_all.PLANS["full"]) as st:
        assert st.kv_transfer is not None
        assert st.kv_transfer["kv_load_failure_policy"] == "recompute"
        return dict(st.kv_transfer["kv_connector_extra_config"])


def _kvtier_accepts(extra: dict, available_at_check: int) -> int:
    return resolve_cpu_bytes(
        extra["cpu_bytes"],
        headroom_bytes=extra["cpu_headroom_bytes"],
        mem_available_bytes=available_at_check,
    )


@pytest.mark.parametrize("free_gib", [4.57, 3.5, 20.0])
def test_a_row_fits_what_the_machine_has_free(monkeypatch, tmp_path, free_gib: float) -> None:
    """4.57 GiB free is what the Redis row met when kvtier refused its 1 GiB host tier;
    with the server's own memory taken, kvtier's check accepts the planned size, which
    still holds every chunk the workloads send (at most HOST_TIER_MAX on an idle box)."""
    available = int(free_gib * GiB)
    extra = _row_extra(monkeypatch, tmp_path, available)
    need = run_all.working_set_bytes(run_all.PLANS["full"], run_all.SHAPES["bench"])
    assert need <= extra["cpu_bytes"] <= run_all.HOST_TIER_MAX
    assert _kvtier_accepts(extra, available - run_all.ENGINE_BYTES) == extra["cpu_bytes"]
    if free_gib >= 8:
        assert extra["cpu_bytes"] == run_all.HOST_TIER_MAX
        assert extra["cpu_headroom_bytes"] == run_all.HEADROOM


def test_a_fixed_gib_would_have_been_refused() -> None:
    """The fixed plan (1 GiB + 1 GiB headroom) at 3.5 GiB free: kvtier refuses it."""
    with pytest.raises(ConfigError, match="cpu_bytes"):
        resolve_cpu_bytes(
            "1GiB", headroom_bytes=GiB, mem_available_bytes=int(3.5 * GiB) - run_all.ENGINE_BYTES
        )


def test_short_of_the_working_set_the_row_keeps_its_hit_rows(monkeypatch, tmp_path) -> None:
    """Too little for every chunk: the host tier shrinks to what is there, down to four
    repeated prompts' worth; below that the row says why it cannot run, before starting."""
    floor = 4 * run_all.PROMPT_TOKENS * run_all.kv_bytes_per_token(run_all.SHAPES["bench"])
    available = run_all.ENGINE_BYTES + run_all.HEADROOM_MIN + floor + 2**20
    extra = _row_extra(monkeypatch, tmp_path, available)
    assert (
        floor
        <= extra["cpu_bytes"]
        < run_all.working_set_bytes(run_all.PLANS["full"], run_all.SHAPES["bench"])
    )
    assert extra["cpu_headroom_bytes"] == run_all.HEADROOM_MIN
    with pytest.raises(run_all.Unavailable, match="GiB of host memory available"):
        _row_extra(monkeypatch, tmp_path, available - 2 * 2**20)


@pytest.mark.parametrize(("name", "stop"), [("kvtier-file", "20"), ("kvtier-host", None)])
def test_rows_with_an_object_tier_stop_vllm_as_kvtier_advises(tmp_path, name, stop) -> None:
    """make bench's servers are stopped between the store and the restart hit: with vLLM's
    defaults the chunks still queued would be lost (connectors/worker/shutdown.py)."""
    args = argparse.Namespace(
        model_shape="bench", no_install=True, kv_load_failure_policy="recompute"
    )
    cfg = next(c for c in run_all.CONFIGS if c.name == name)
    with run_all.Setup(cfg, tmp_path, args, run_all.PLANS["full"]) as st:
        if stop is None:
            assert st.vllm_args == [] and "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS" not in st.env
        else:
            assert st.vllm_args == ["--shutdown-timeout", stop]
            assert st.env["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] == stop
