"""``kvtier demo``'s driver without vLLM: a fake engine process in place of the real one
(tests/cli/test_demo.py runs the real engines). What a newcomer met (issue 62): minutes of
silence while engines start, a fixed "~30 s" claim, a 249 MB temporary directory left
behind, and shutdown tracebacks at Ctrl-C."""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvtier.cli import demo

ROW = {
    "doc": 0,
    "q": 0,
    "prompt_tokens": 1600,
    "kvtier_tokens": 0,
    "host_tokens": 0,
    "remote_tokens": 0,
    "vllm_tokens": 0,
    "reset": True,
    "missed": {},
    "ttft_s": 0.5,
}

#: a stand-in for ``python -m kvtier.cli.demo SPEC``: the stage lines and the RESULT line
#: the driver reads, or (``hang``) a start that never ends and, at Ctrl-C, a shutdown
#: traceback on stderr as vLLM's engine prints one
FAKE_ENGINE = textwrap.dedent("""
    import json, os, sys, time
    spec = json.loads(sys.argv[1])
    mode = os.environ["FAKE_ENGINE_MODE"]
    print("STAGE ready", flush=True)
    if mode == "fail":
        print("vLLM: out of memory", file=sys.stderr)
        sys.exit(3)
    if mode == "hang":
        with open(os.environ["FAKE_ENGINE_STARTED"], "w") as f:
            f.write(str(os.getpid()))
        try:
            time.sleep(600)
        except KeyboardInterrupt:
            raise RuntimeError("EngineDeadError: all workers exited gracefully") from None
    print("STAGE warm 0.25", flush=True)
    print("vLLM chatter on stdout", flush=True)
    rows = []
    for q in range(spec["questions"]):
        for d in range(spec["docs"]):
            print(f"STAGE request {len(rows) + 1} {spec['questions'] * spec['docs']}")
            hit = 1536 if q else 0
            rows.append({**ROW, "doc": d, "q": q, "kvtier_tokens": hit,
                         "host_tokens": hit if spec["phase"] == 1 else 0,
                         "remote_tokens": hit if spec["phase"] == 2 else 0,
                         "ttft_s": 0.05 if hit else 0.5,
                         **({"canary": {"match": 4, "mismatch": 0}}
                            if spec["phase"] == 2 else {})})
    print("STAGE stopping", flush=True)
    print("RESULT " + json.dumps(rows), flush=True)
""")


@pytest.fixture
def fake_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The driver runs the fake engine and skips building the model (torch); mkdtemp
    makes the demo's temporary directory under ``tmp_path/tmp``."""
    script = tmp_path / "fake_engine.py"
    script.write_text(f"ROW = {ROW!r}\n" + FAKE_ENGINE)
    monkeypatch.setattr(
        demo, "_engine_command", lambda spec: [sys.executable, str(script), json.dumps(spec)]
    )
    import kvtier.cli.tinymodel as tinymodel

    monkeypatch.setattr(tinymodel, "build_tiny_llama", lambda path, **kw: Path(path))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    return tmp_path / "tmp"


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"workdir": None, "docs": 2, "questions": 2, "small": True, **kw})


def test_a_run_reports_estimates_and_removes_its_temporary_directory(
    fake_engine: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FAKE_ENGINE_MODE", "ok")
    assert demo.run(_args()) == 0
    out, err = capsys.readouterr()
    assert "TTFT saved by a hit" in out and "tokens served by kvtier    3072 (32%)" in out
    assert "~30 s" not in err
    # engine 1's start and first tokens give the estimate of the rest, said once
    assert err.count("the rest of the demo takes about") == 1
    assert "ran its first 200 tokens in 0.2 s" in err
    assert "[kvtier demo] done in" in err and "the rest after engine 1's start took" in err
    assert list(fake_engine.iterdir()) == [], "the temporary directory is left behind"


def test_a_given_workdir_is_kept_with_the_engines_logs(
    fake_engine: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("FAKE_ENGINE_MODE", "ok")
    assert demo.run(_args(workdir=str(tmp_path / "keep"))) == 0
    assert {p.name for p in (tmp_path / "keep").iterdir()} >= {"engine-1.log", "engine-2.log"}


def test_a_failed_engine_shows_its_log_and_the_directory_still_goes(
    fake_engine: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FAKE_ENGINE_MODE", "fail")
    assert demo.run(_args()) == 1
    err = capsys.readouterr().err
    assert "vLLM: out of memory" in err and "engine 1 failed (exit 3)" in err
    assert list(fake_engine.iterdir()) == []


DRIVER = textwrap.dedent("""
    import json, sys, tempfile
    from pathlib import Path
    from kvtier.cli import demo, main, tinymodel
    script, tmp = sys.argv[1], sys.argv[2]
    demo._engine_command = lambda spec: [sys.executable, script, json.dumps(spec)]
    tinymodel.build_tiny_llama = lambda path, **kw: Path(path)
    tempfile.tempdir = tmp
    raise SystemExit(main.main(["demo", "--small"]))
""")


def _as_a_shell_starts_it() -> None:
    """SIGINT as a terminal's shell leaves it: default, unblocked. A child inherits a
    blocked mask and an ignored SIGINT across exec; under `-n 2` both variants below once
    waited out their 120 s with the driver never interrupted (this test process's SIGINT
    state, left by something else that ran in it, is the suspect)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("to", ["group", "driver"])
def test_ctrl_c_stops_the_engine_quietly_and_cleans_up(tmp_path: Path, to: str) -> None:
    """Ctrl-C at a terminal signals the whole process group (driver and engine); ``kill
    -INT`` the driver alone. Either way: exit 130, one line, no traceback (the engine's
    shutdown noise stays in its log), the engine gone, the directory removed."""
    script = tmp_path / "fake_engine.py"
    script.write_text(f"ROW = {ROW!r}\n" + FAKE_ENGINE)
    (tmp_path / "tmp").mkdir()
    started = tmp_path / "started"
    env = dict(os.environ, FAKE_ENGINE_MODE="hang", FAKE_ENGINE_STARTED=str(started))
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(script), str(tmp_path / "tmp")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_as_a_shell_starts_it,
    )
    try:
        deadline = time.monotonic() + 120  # a bound on waiting, not an assertion on time
        while not (started.exists() and started.read_text()) and proc.poll() is None:
            assert time.monotonic() < deadline, "the fake engine never started"
            time.sleep(0.05)
        engine_pid = int(started.read_text())
        if to == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == demo.INTERRUPTED, err
    assert "Traceback" not in err and "EngineDeadError" not in err, err
    assert "[kvtier demo] stopped (Ctrl-C);" in err and "removed" in err
    assert list((tmp_path / "tmp").iterdir()) == []
    assert not Path(f"/proc/{engine_pid}").exists(), "the engine outlived the driver"


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_off_a_terminal_is_a_line_every_interval() -> None:
    clock, out = _Clock(), io.StringIO()
    p = demo.Progress(out, tty=False, every=10, clock=clock)
    p.label, p.since, p.last = "engine 1: starting vLLM", clock.now, clock.now
    for _ in range(50):  # 25 s in ticks of 0.5 s
        clock.now += 0.5
        p.tick()
    assert out.getvalue().splitlines() == [
        "[kvtier demo] engine 1: starting vLLM ... 10 s",
        "[kvtier demo] engine 1: starting vLLM ... 20 s",
    ]


def test_progress_on_a_terminal_redraws_one_line_and_says_over_it() -> None:
    clock, out = _Clock(), io.StringIO()
    p = demo.Progress(out, tty=True, clock=clock)
    p.label, p.since = "engine 2: request 1 of 3", clock.now
    clock.now += 95
    p.tick()
    p.say("hello")
    text = out.getvalue()
    assert text.startswith("\r\033[K[kvtier demo] engine 2: request 1 of 3 ")
    assert "1 min 40 s" in text and "\n" not in text.split("\r\033[K")[1]
    assert text.endswith("\r\033[K[kvtier demo] hello\n")


def test_engine_1_start_and_warm_up_give_the_estimate() -> None:
    clock, out = _Clock(), io.StringIO()
    p = demo.Progress(out, tty=False, clock=clock)
    spec = {"phase": 1, "docs": 3, "questions": 3}
    p.since = clock.now
    clock.now += 80
    p.engine_line(spec, ["ready"])
    p.engine_line(spec, ["warm", "2.0"])
    p.close()
    assert p.started_s == 80
    assert p.estimate == demo.estimate_rest(80, 2.0, 3, 3)
    assert f"about {demo.duration(p.estimate)}" in out.getvalue()
    assert "engine 1 started in 80 s" in out.getvalue()


def test_the_estimate_counts_engine_2s_start_and_every_request() -> None:
    base = demo.estimate_rest(0, 1.0, 3, 3)
    assert demo.estimate_rest(60, 1.0, 3, 3) == base + 60  # engine 2 starts as engine 1 did
    assert demo.estimate_rest(0, 2.0, 3, 3) > base  # a slower machine prefills slower
    assert demo.estimate_rest(0, 1.0, 3, 4) > base and demo.estimate_rest(0, 1.0, 4, 3) > base


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.4, "0 s"), (44.6, "45 s"), (89, "89 s"), (120, "2 min"), (190, "3 min 10 s"), (-3, "0 s")],
)
def test_durations_read_as_estimates(seconds: float, text: str) -> None:
    assert demo.duration(seconds) == text
