"""A fork server for end-to-end engines: import vLLM once, fork a fresh child per scenario.

Every scenario runs in its own process, as vLLM wants (one engine per process). Importing
vLLM alone costs about 13 s of CPU on a small CI machine, and the suite starts some 150
engines; that import was a third of the e2e run. The server imports vLLM's modules (no
engine, no threads of its own) and forks a child per request. The child is what
``python tests/e2e/engine.py SCENARIO ARGS`` would be, with the request's environment and
working directory, minus the import.

``run_engine`` sends a request here only when the request's environment differs from the
server's in variables that are read after import (``import_time_keys`` says which are
not); anything else runs as a fresh process, as before. ``KVTIER_TEST_FORK_SERVER=0``
turns the server off.

Protocol, one Unix-socket connection per request: the client sends one JSON line
``{"argv", "env", "cwd", "stdout", "stderr"}``; the server answers ``{"pid": N}`` at
once and ``{"rc": N}`` when the child has exited. The child leads its own process group,
so a timeout kills its workers with it. The server exits when its stdin closes (the test
process ended), killing what it still runs.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import re
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any

ENGINE = Path(__file__).with_name("engine.py")
#: variables read while Python, torch, transformers or vLLM import (interpreter, loader,
#: thread pools, ISA masks, logging set-up): a request that changes one gets a fresh process
IMPORT_TIME = re.compile(
    r"PYTHON.*|LD_.*|OMP_.*|KMP_.*|MKL_.*|ATEN_.*|TORCH_.*|HF_.*|TRANSFORMERS_.*"
    r"|VLLM_LOGGING_.*|VLLM_CONFIGURE_LOGGING|VLLM_TARGET_DEVICE|KVTIER_TEST_CPU_ISA"
    r"|KVTIER_TEST_FORK_SERVER"
)


#: imported by the server beside vLLM's entry points (see _preload)
PRELOAD = (
    "kvtier.connectors.vllm",
    "kvtier.objects.remote",
    "tests.e2e.engine",
    "compressed_tensors",
    "cryptography.hazmat.primitives.ciphers.aead",
    "torch.distributed.tensor.experimental",
    "vllm.entrypoints.anthropic.protocol",
    "vllm.entrypoints.launchers.cli_args",
    "vllm.model_executor.models.llama",
    "vllm.v1.attention.backends.cpu_attn",
)


def import_time_keys(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """The variables that differ between two environments and are read at import."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and IMPORT_TIME.fullmatch(k))


# ---------------------------------------------------------------------------- client


class ForkServer:
    """The test process's handle on one server (per pytest worker, started on first use)."""

    def __init__(self, env: dict[str, str], cwd: str) -> None:
        self.env = dict(env)
        self.cwd = cwd
        self._dir = tempfile.mkdtemp(prefix="kvtier-forkserver-")
        self.socket_path = os.path.join(self._dir, "s")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__)), self.socket_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=cwd,
            text=True,
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("READY"):
                break
        else:
            raise RuntimeError(f"the e2e fork server did not start (exit {self.proc.wait()})")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
        """Run ``engine.py *argv`` in a forked child; (exit code, stdout, stderr)."""
        out_fd, out_path = tempfile.mkstemp(dir=self._dir, suffix=".out")
        err_fd, err_path = tempfile.mkstemp(dir=self._dir, suffix=".err")
        os.close(out_fd)
        os.close(err_fd)
        request = {
            "argv": argv,
            "env": env,
            "cwd": self.cwd,
            "stdout": out_path,
            "stderr": err_path,
        }
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(self.socket_path)
                conn.sendall((json.dumps(request) + "\n").encode())
                reader = conn.makefile("r")
                pid = json.loads(reader.readline())["pid"]
                conn.settimeout(timeout)
                try:
                    line = reader.readline()
                except TimeoutError:
                    _kill_group(pid)
                    raise subprocess.TimeoutExpired(argv, timeout) from None
                if not line:
                    raise RuntimeError("the e2e fork server went away during a scenario")
                rc = json.loads(line)["rc"]
            return (
                rc,
                Path(out_path).read_text(errors="replace"),
                Path(err_path).read_text(errors="replace"),
            )
        finally:
            for p in (out_path, err_path):
                Path(p).unlink(missing_ok=True)

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_lock = threading.Lock()
_server: ForkServer | None = None


def shared(env: dict[str, str], cwd: str) -> ForkServer | None:
    """This process's server, started with ``env`` on first use; None where it is off or
    cannot start (run_engine then starts a fresh process)."""
    global _server
    if env.get("KVTIER_TEST_FORK_SERVER", "1") == "0":
        return None
    with _lock:
        if _server is None or not _server.alive():
            try:
                _server = ForkServer(env, cwd)
                atexit.register(_server.close)
            except (OSError, RuntimeError) as e:
                print(f"e2e fork server unavailable ({e}); fresh processes", file=sys.stderr)
                return None
        return _server


# ---------------------------------------------------------------------------- server


def _preload() -> None:
    """What every scenario imports first; nothing here may start a thread or an engine."""
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401
    from vllm.v1.worker import cpu_model_runner, cpu_worker  # noqa: F401

    # what building a Llama engine with kvtier imports after those: about 1 s of CPU that
    # each of the ~150 engines paid again (none of them starts a thread or reads the env)
    for name in PRELOAD:
        importlib.import_module(name)
    # and hashes of torch's and Triton's sources (vLLM's few compiled helpers key their
    # caches on them), computed once per process
    from torch._inductor.codecache import torch_key

    torch_key()
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # no Triton: nothing keys on it
        return
    triton_key()


def _child(request: dict[str, Any], sockets: list[socket.socket], fds: list[int]) -> None:
    """In the forked child: become ``python engine.py ARGV`` with the request's env."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for sock in sockets:
            sock.close()
        for fd in fds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_TRUNC)
            os.dup2(target, fd)
            os.close(target)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = [str(ENGINE), *request["argv"]]
        runpy.run_path(str(ENGINE), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve(socket_path: str) -> None:
    _preload()
    # the imports' millions of objects go to the permanent generation: the children's
    # gc.collect() calls (vLLM makes several per engine, at load and at shutdown) then scan
    # only what the child made, not vLLM's whole module heap again: 2-4 s an engine
    gc.collect()
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waiting: dict[int, socket.socket] = {}
    print("READY", flush=True)
    stdin = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([listener, wake_r, stdin], [], [])
        if stdin in ready and not os.read(stdin, 4096):
            for pid in waiting:
                _kill_group(pid)
            return
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 4096):
                        break
                except BlockingIOError:
                    break
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(
                        (json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n").encode()
                    )
                except OSError:
                    pass
                conn.close()
        if listener in ready:
            conn, _ = listener.accept()
            try:
                request = json.loads(conn.makefile("r").readline())
            except (OSError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                _child(request, [listener, conn, *waiting.values()], [wake_r, wake_w])
            waiting[pid] = conn
            conn.sendall((json.dumps({"pid": pid}) + "\n").encode())


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    serve(sys.argv[1])
