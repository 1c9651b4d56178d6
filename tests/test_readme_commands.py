"""The shell blocks the README marks ``<!-- ci: run -->`` run as written, and do what the
README says they do.

Why (issue 48): a new user copies the README's commands, and every one that failed as
written (`vllm serve` on the CPU build, `pip install kvtier` where kvtier is not published,
a `kvtier size` example that printed "fits NO") was a user stopped in their first hour. The
marked blocks are executed here, in CI, the way a user would type them:

- substituted are only what a test must own: ``MODEL`` (and ``/models/<name>``) become a
  tiny random-weight Llama built locally (kvtier.cli.tinymodel: nothing downloaded), port
  8000 a free port, ``/tmp/kvtier-cache`` a directory of the test's own;
- the install blocks run in a copy of the checkout and a fresh virtual environment whose
  heavy dependencies (torch, vLLM) are those of ``.venv``, reached through a ``.pth`` line,
  so pip resolves against them instead of downloading them again; kvtier itself is built
  and installed into the fresh environment, and must import from there;
- the CPU server block runs as a real server: a prompt is computed, the server is stopped
  with Ctrl-C's signal, started again by the same block, and the same request must be
  counted as a hit from the directory tier on ``/metrics``;
- ``make demo`` runs as written (it is what a user runs first), with make told that
  ``.venv`` is built (``-o``): this test runs inside ``.venv``, which ``make test`` has
  just refreshed, and reinstalling it under the running test would replace the packages it
  uses;
- ``make test`` is never run: this test is part of the suite it runs, so running it here
  would run the suite again, this test included, without end.

The chart's README may mark blocks too: its install blocks run with the README's, in the
fresh environment; its other blocks, and any block of the README no rule below recognises,
run in a copy of the checkout with the same substitutions and must exit 0.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "deploy" / "helm").glob("*/README.md"))]
MARK = "<!-- ci: run -->"
VENV = Path(sys.prefix)
#: the reason `make test` is never run from here (see the module's docstring)
RECURSES = "make test"
TIMEOUT = 900
#: the Makefile's mark that .venv is installed (make's target for it)
STAMP = ".venv/.kvtier-installed"


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the fence's line, 1-based
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def kind(self) -> str:
        """Which rule runs it."""
        t = self.text
        if re.search(r"^\s*make test\b", t, re.M):
            return "make-test"
        if re.search(r"^\s*make demo\b", t, re.M):
            return "demo"
        if re.search(r"\bpip3? (install|wheel)\b", t):  # never into the running .venv
            return "install"
        if "vllm.entrypoints.openai.api_server" in t or re.search(r"\bvllm serve\b", t):
            return "server"
        if "/reset_prefix_cache" in t:
            return "host-hit"
        if "/v1/completions" in t:
            return "request"
        if re.search(r"^\s*kvtier size\b", t, re.M):
            return "size"
        return "other"


def marked_blocks(page: Path) -> list[Block]:
    """The fenced blocks right after a ``<!-- ci: run -->`` line."""
    lines = page.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        fence = lines[i + 1] if i + 1 < len(lines) else ""
        m = re.match(r"^(```+|~~~+)\s*(\w*)\s*$", fence)
        assert m, f"{page}:{i + 1}: {MARK} is not followed by a fenced block"
        assert m.group(2) in ("bash", "sh", "shell", ""), f"{page}:{i + 2}: not a shell block"
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith(m.group(1)))
        blocks.append(Block(page, i + 2, "\n".join(lines[i + 2 : end]) + "\n"))
    return blocks


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in marked_blocks(page)]


def readme_block(kind: str) -> list[Block]:
    found = [b for b in marked_blocks(README) if b.kind() == kind]
    assert found, f"README.md marks no {kind} block for CI to run"
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Subst:
    """What a test must own in a block; nothing else is changed."""

    model: str
    port: int
    cache: Path

    def apply(self, text: str) -> str:
        text = re.sub(r"\bMODEL\b", self.model, text)
        text = re.sub(r"(?<![\w.-])/models/[\w.-]+", self.model, text)
        text = re.sub(r"(localhost:|127\.0\.0\.1:|--port )8000\b", rf"\g<1>{self.port}", text)
        return text.replace("/tmp/kvtier-cache", str(self.cache))


def shell_env(extra_path: list[Path] | None = None) -> dict[str, str]:
    """A user's shell with the venv activated (and helm, where CI keeps it)."""
    path = [*(extra_path or []), VENV / "bin", ROOT / ".tools"]
    env = {**os.environ, "VIRTUAL_ENV": str(VENV)}
    env["PATH"] = os.pathsep.join([*(str(p) for p in path), env.get("PATH", "")])
    env.pop("PYTHONPATH", None)
    return env


def run(
    text: str, cwd: Path, env: dict[str, str], timeout: float = TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """A block in bash, stopping at its first failing command (a user would see it)."""
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", text],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def ok(done: subprocess.CompletedProcess[str], block: Block) -> str:
    assert done.returncode == 0, (
        f"{block.where} exited {done.returncode}:\n{block.text}\n"
        f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
    )
    return done.stdout


def checkout_copy(dest: Path) -> Path:
    """The checkout's files as a clone would have them (tracked and new, never ignored)."""
    names = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvtier.cli.tinymodel import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny4"))


# ----------------------------------------------------------------- the marks themselves
def test_the_readme_marks_what_a_user_runs() -> None:
    """Each command a user runs first is marked, so CI cannot stop running it unnoticed."""
    kinds = [b.kind() for b in marked_blocks(README)]
    for kind in ("install", "server", "request", "host-hit", "size", "demo", "make-test"):
        assert kind in kinds, f"README.md has no marked {kind} block"
    assert all(b.text.strip() for b in all_blocks())


def test_marks_are_read_as_written(tmp_path: Path) -> None:
    page = tmp_path / "README.md"
    page.write_text(
        "# x\n\n<!-- ci: run -->\n```bash\nmake demo\n```\n\n```bash\nnot marked\n```\n"
        "<!-- ci: run -->\n```\nkvtier size --model MODEL\ncurl localhost:8000/metrics\n```\n"
    )
    blocks = marked_blocks(page)
    assert [(b.line, b.text) for b in blocks] == [
        (4, "make demo\n"),
        (12, "kvtier size --model MODEL\ncurl localhost:8000/metrics\n"),
    ]
    assert [b.kind() for b in blocks] == ["demo", "size"]
    s = Subst("/m/tiny", 4321, tmp_path / "c")
    assert s.apply(blocks[1].text) == "kvtier size --model /m/tiny\ncurl localhost:4321/metrics\n"
    assert (
        s.apply('"file:///tmp/kvtier-cache", MODELS, --port 8000')
        == f'"file://{tmp_path}/c", MODELS, --port 4321'
    )
    page.write_text("<!-- ci: run -->\nplain text\n")
    with pytest.raises(AssertionError, match="not followed by a fenced block"):
        marked_blocks(page)


# ----------------------------------------------------------------- running them
@pytest.mark.e2e
def test_install_from_a_checkout_and_from_a_wheel(tmp_path: Path) -> None:
    """`pip install '.[cpu]'` and the wheel's two commands, in a fresh environment."""
    src = checkout_copy(tmp_path / "kvtier")
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    # pip itself, and .venv's packages behind the fresh environment's own
    site = next((env_dir / "lib").glob("python3*/site-packages"))
    ours = next((VENV / "lib").glob("python3*/site-packages"))
    (site / "zz-kvtier-test-deps.pth").write_text(f"{ours}\n")
    env = shell_env([env_dir / "bin"])
    env["VIRTUAL_ENV"] = str(env_dir)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    (env_dir / "bin" / "pip").write_text(
        f'#!/bin/sh\nexec {env_dir / "bin" / "python"} -m pip "$@"\n'
    )
    (env_dir / "bin" / "pip").chmod(0o755)
    readme_block("install")
    for block in [b for b in all_blocks() if b.kind() == "install"]:  # the chart's too
        ok(run(block.text, src, env), block)
    assert list((src / "dist").glob("kvtier-*.whl")), "the wheel block built no wheel"
    where = subprocess.run(
        [env_dir / "bin" / "python", "-c", "import kvtier, sys; print(kvtier.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=tmp_path,
    ).stdout.strip()
    assert where.startswith(str(env_dir)), f"kvtier imported from {where}, not the install"
    helped = subprocess.run(
        [env_dir / "bin" / "kvtier", "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert helped.returncode == 0 and "kvtier size" not in helped.stderr, helped.stderr
    assert "size" in helped.stdout and "demo" in helped.stdout


@pytest.mark.e2e
def test_size_examples_plan(tiny_model: str, tmp_path: Path) -> None:
    """`kvtier size` prints a plan that fits, and the JSON to paste."""
    s = Subst(tiny_model, free_port(), tmp_path / "cache")
    for block in readme_block("size"):
        out = ok(run(s.apply(block.text), tmp_path, shell_env()), block)
        assert re.search(r"^\s*fits\s+yes$", out, re.M), out
        if "--emit kv-transfer-config" in block.text:
            config = json.loads(out[out.index("{\n") :])
            assert config["kv_connector_module_path"] == "kvtier.connectors.vllm", config


class Server:
    """The README's server block, started as a user starts it and stopped with Ctrl-C."""

    def __init__(self, block: Block, s: Subst, log: Path) -> None:
        self.block, self.s, self.log = block, s, log

    def __enter__(self) -> Server:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                ["bash", "-e", "-c", self.s.apply(self.block.text)],
                cwd=self.log.parent,
                env=shell_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 600
        url = f"http://127.0.0.1:{self.s.port}/health"
        while True:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"{self.block.where}: the server exited {self.proc.returncode}:\n"
                    f"{self.log.read_text(errors='replace')[-6000:]}"
                )
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(
                    f"{self.block.where}: not healthy in 600 s:\n"
                    f"{self.log.read_text(errors='replace')[-6000:]}"
                )
            time.sleep(1)

    def stop(self) -> None:
        """Ctrl-C: SIGINT to the foreground process group; SIGKILL if it does not stop."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def __exit__(self, *exc: object) -> None:
        self.stop()


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


@pytest.mark.e2e
def test_cpu_server_serves_and_restart_hits(tiny_model: str, tmp_path: Path) -> None:
    """The CPU build's server block and the request block, twice with a restart between
    (the first time also the host-hit block: vLLM's own cache emptied, kvtier's host tier
    serves the document again); the restarted server checks the first document against
    the model (the canary: its
    first 4 chunks, ``canary_check_tokens``' 1024 tokens; the document has about 4,200
    with the tiny model's tokenizer) and reads the second back from the directory tier."""
    (server,) = readme_block("server")
    (request,) = readme_block("request")
    s = Subst(tiny_model, free_port(), tmp_path / "kvtier-cache")
    log = tmp_path / "server.log"

    def ask() -> str:
        out = ok(run(s.apply(request.text), tmp_path, shell_env(), timeout=300), request)
        assert '"choices"' in out, out[-2000:]  # the completion
        assert "kvtier:lookup_tokens_total" in out, out[-2000:]  # the metrics grep
        return out

    (host_hit,) = readme_block("host-hit")
    with Server(server, s, log):
        first = ask()
        # vLLM's own cache emptied (the server block's dev mode), document 1 again: kvtier's
        # host tier serves its full chunks
        again = ok(run(s.apply(host_hit.text), tmp_path, shell_env(), timeout=300), host_hit)
    assert metric(first, "kvtier:lookup_tokens_total") > 0, first
    assert metric(first, "kvtier:hit_tokens_total") == 0, first
    assert '"choices"' in again, again[-2000:]
    assert metric(again, "kvtier:hit_tokens_total", tier="host") >= 1024, again
    stored = [p for p in s.cache.rglob("*") if p.is_file()]
    assert stored, f"nothing in the directory tier after the stop:\n{log.read_text()[-4000:]}"

    with Server(server, s, log):
        second = ask()
    assert metric(second, "kvtier:canary_checks_total", outcome="match") == 4, second
    assert metric(second, "kvtier:canary_checks_total", outcome="mismatch") == 0, second
    assert metric(second, "kvtier:hit_tokens_total", tier="remote") >= 256, second


@pytest.mark.e2e
def test_make_demo_runs(tmp_path: Path) -> None:
    (block,) = readme_block("demo")
    # .venv is built (by `make test`, which runs this): make is told so (`-o`), so that it
    # never reinstalls .venv under this test; where .venv is current, as in CI, that changes
    # nothing. (make does not read -o from MAKEFLAGS, hence the function.)
    as_built = f'make() {{ command make -o {STAMP} "$@"; }}\n'
    out = ok(run(as_built + block.text, ROOT, shell_env()), block)
    assert "TTFT saved by a hit" in out and "tokens served by kvtier" in out, out[-3000:]


def test_make_test_is_marked_but_not_run() -> None:
    """It is a command the README promises (and CI runs it: it is what runs this file);
    running it from here would recurse, so it is only checked to be there as written."""
    (block,) = readme_block("make-test")
    assert block.text.split("#")[0].strip() == RECURSES


@pytest.mark.e2e
def test_other_marked_blocks_exit_zero(tiny_model: str, tmp_path: Path) -> None:
    """Blocks the rules above do not know (the chart README may mark its own) run in a copy
    of the checkout with the same substitutions, and must succeed."""
    others = [
        b
        for b in all_blocks()
        if b.kind() == "other" or (b.page != README and b.kind() != "install")
    ]
    if not others:
        return
    src = checkout_copy(tmp_path / "kvtier")
    s = Subst(tiny_model, free_port(), tmp_path / "kvtier-cache")
    for block in others:
        ok(run(s.apply(block.text), src, shell_env(), timeout=600), block)
