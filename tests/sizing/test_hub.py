"""``kvtier size --model org/name``: config.json and the safetensors index through the real
huggingface_hub client, from a hub cache the test lays out (the hub's documented layout:
models--org--name/refs/main, blobs/, snapshots/<commit>/ links), or from a loopback
"hub" (HF_ENDPOINT) that answers as huggingface.co does: files with the headers the client
caches by, EntryNotFound, RepoNotFound, GatedRepo."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sizing_helpers import model

from kvtier.sizing import hub
from kvtier.sizing.memory_plan import PlanInputs, make_plan
from kvtier.sizing.weights import load_weights

pytest.importorskip("huggingface_hub")

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "meta-llama/Meta-Llama-3-8B"
LLAMA3_8B_BYTES = 16_060_522_496  # the real repository's index: metadata.total_size


def lay_out_cache(cache: Path, repo: str, files: dict[str, str]) -> Path:
    """``files`` as the hub client caches them: content under blobs/, linked from the
    snapshot of ``COMMIT``, which refs/main names. Returns the snapshot directory."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / COMMIT
    (root / "refs").mkdir(parents=True)
    (root / "blobs").mkdir()
    snap.mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    for i, (name, text) in enumerate(sorted(files.items())):
        blob = root / "blobs" / f"{i:040x}"
        blob.write_text(text)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    return snap


def index_json(total: int) -> str:
    return json.dumps(
        {
            "metadata": {"total_size": total},
            "weight_map": {"lm_head.weight": "model-00004-of-00004.safetensors"},
        }
    )


def kvtier(tmp_path: Path, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The real command in a process of its own: the hub client reads HF_* at import."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    clean.update({"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1", **env})
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", *argv],
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    config = Path(model("llama3-8b"), "config.json").read_text()
    lay_out_cache(
        tmp_path / "hub",
        REPO,
        {"config.json": config, "model.safetensors.index.json": index_json(LLAMA3_8B_BYTES)},
    )
    return tmp_path / "hub"


def test_a_hub_id_is_read_from_the_hub_cache_offline(tmp_path, cache):
    out = kvtier(
        tmp_path,
        "size",
        "--model",
        REPO,
        "--gpu-memory",
        "24",
        "--json",
        HF_HUB_CACHE=str(cache),
        HF_HUB_OFFLINE="1",
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    local = json.loads(
        kvtier(
            tmp_path, "size", "--model", model("llama3-8b"), "--gpu-memory", "24", "--json"
        ).stdout
    )
    assert plan["model"] == REPO
    assert plan["kv_bytes_per_token"] == local["kv_bytes_per_token"] == 131_072
    assert plan["gpu_kv_tokens"] == local["gpu_kv_tokens"]
    # the shards are not there (kvtier never fetches them): weights from the config, the
    # checkpoint's size from the index beside them
    assert plan["weights_source"] == "config"
    assert plan["checkpoint_bytes"] == LLAMA3_8B_BYTES == plan["weight_bytes"]
    assert "weights-estimate-differs" not in [w["code"] for w in plan["warnings"]]


def test_the_hub_home_layout_and_emit_keep_the_hub_id(tmp_path):
    """HF_HOME alone (cache under HF_HOME/hub), and what --emit prints names the hub id
    that vllm serve takes, not the cache's snapshot directory."""
    config = Path(model("llama3-8b"), "config.json").read_text()
    lay_out_cache(tmp_path / "home" / "hub", REPO, {"config.json": config})
    out = kvtier(
        tmp_path,
        "size",
        "--model",
        REPO,
        "--emit",
        "vllm-args",
        HF_HOME=str(tmp_path / "home"),
        HF_HUB_OFFLINE="1",
    )
    assert out.returncode == 0, out.stderr
    assert REPO in out.stdout and "snapshots" not in out.stdout


def test_an_uncached_hub_id_offline_is_one_line_that_says_what_to_do(tmp_path, cache):
    out = kvtier(
        tmp_path,
        "size",
        "--model",
        "no-such-org/no-such-model",
        HF_HUB_CACHE=str(cache),
        HF_HUB_OFFLINE="1",
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    line = lines[0]
    assert line.startswith("kvtier size: error: no-such-org/no-such-model: HF_HUB_OFFLINE")
    for hint in ("go online once", "HF_TOKEN", "local model directory", str(cache)):
        assert hint in line


#: what the loopback hub serves: repo -> file -> bytes (a file absent is EntryNotFound);
#: the weights' bytes are never served, only their size (HEAD), as the hub's LFS answers
HUB_FILES: dict[str, dict[str, bytes]] = {}
#: the requests it answered, "METHOD /path"
HUB_LOG: list[str] = []


class _Hub(http.server.BaseHTTPRequestHandler):
    """Answers as huggingface.co does: ``/<org>/<name>/resolve/<rev>/<file>`` of a repo in
    HUB_FILES, with the commit and ETag headers the hub client caches by; ``gated/...``
    403 GatedRepo; any other repository 404 RepoNotFound."""

    def _answer(self, body: bool) -> None:
        HUB_LOG.append(f"{self.command} {self.path}")
        parts = self.path.lstrip("/").split("/")
        repo, name = "/".join(parts[:2]), "/".join(parts[4:])
        if repo in HUB_FILES:
            files = HUB_FILES[repo]
            if name not in files:
                return self._error(404, "EntryNotFound")
            data = files[name]
            self.send_response(200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{abs(hash(data)):x}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)
            return None
        if repo.startswith("gated/"):
            return self._error(403, "GatedRepo")
        return self._error(404, "RepoNotFound")

    def _error(self, status: int, code: str) -> None:
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_hub() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    HUB_LOG.clear()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        HUB_FILES.clear()


@pytest.mark.parametrize("sharded", [True, False])
def test_online_once_then_offline_from_the_cache(tmp_path, fake_hub, sharded):
    """The first run asks the hub for config.json and the index (or, for one file, the
    size of model.safetensors: a HEAD, never a GET); a second run with HF_HUB_OFFLINE=1
    plans from the hub cache the first one filled, and fetches nothing."""
    repo = "org/sharded" if sharded else "org/single"
    config = Path(model("llama3-8b"), "config.json").read_bytes()
    HUB_FILES[repo] = {"config.json": config}
    if sharded:
        HUB_FILES[repo]["model.safetensors.index.json"] = index_json(LLAMA3_8B_BYTES).encode()
    else:
        HUB_FILES[repo]["model.safetensors"] = b"\0" * 4096  # its size stands for 15 GiB
    cache = str(tmp_path / "cache")
    online = kvtier(
        tmp_path, "size", "--model", repo, "--json", HF_ENDPOINT=fake_hub, HF_HUB_CACHE=cache
    )
    assert online.returncode == 0, online.stderr
    plan = json.loads(online.stdout)
    assert plan["kv_bytes_per_token"] == 131_072
    assert plan["checkpoint_bytes"] == (LLAMA3_8B_BYTES if sharded else 4096)
    assert not [r for r in HUB_LOG if r.startswith("GET") and r.endswith(".safetensors")]
    assert any(r.startswith("GET") and r.endswith("/config.json") for r in HUB_LOG)
    HUB_LOG.clear()
    offline = kvtier(
        tmp_path,
        "size",
        "--model",
        repo,
        "--json",
        HF_ENDPOINT=fake_hub,
        HF_HUB_CACHE=cache,
        HF_HUB_OFFLINE="1",
    )
    assert offline.returncode == 0, offline.stderr
    assert HUB_LOG == []
    again = json.loads(offline.stdout)
    assert again["kv_bytes_per_token"] == plan["kv_bytes_per_token"]
    # offline, the single file's size is not asked for: the index is cached, a size is not
    assert again["checkpoint_bytes"] == (LLAMA3_8B_BYTES if sharded else None)


@pytest.mark.parametrize(
    ("repo", "says"),
    [
        (
            "someone/not-a-model",
            [
                "no model someone/not-a-model on the Hugging Face hub",
                "set HF_TOKEN",
                "local model directory",
            ],
        ),
        ("gated/llama", ["gated/llama is gated", "set HF_TOKEN", "local model directory"]),
    ],
)
def test_an_unknown_or_gated_hub_id_is_one_line(tmp_path, fake_hub, repo, says):
    out = kvtier(
        tmp_path,
        "size",
        "--model",
        repo,
        HF_ENDPOINT=fake_hub,
        HF_HUB_CACHE=str(tmp_path / "empty"),
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    for text in says:
        assert text in lines[0]


def test_what_is_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub.is_hub_id("meta-llama/Meta-Llama-3-8B")
    assert hub.is_hub_id("Qwen/Qwen3-30B-A3B@main")
    assert not hub.is_hub_id("org/name")  # a local directory wins
    assert not hub.is_hub_id("models/llama")  # under a local directory: a missing path
    assert not hub.is_hub_id("some/config.json")
    assert not hub.is_hub_id("./a/b") and not hub.is_hub_id("/abs/path")
    assert not hub.is_hub_id("gpt2") and not hub.is_hub_id("a/b/c")


def _index_only_model(tmp_path: Path, total: int) -> str:
    """A directory as a hub snapshot holds it: config.json and the index, no shards."""
    d = tmp_path / "snap"
    d.mkdir()
    (d / "config.json").write_text(Path(model("llama3-8b"), "config.json").read_text())
    (d / "model.safetensors.index.json").write_text(index_json(total))
    return str(d)


def test_an_index_without_its_shards_sizes_from_the_config(tmp_path):
    from kvtier.sizing.model import load_shape

    d = _index_only_model(tmp_path, LLAMA3_8B_BYTES)
    w = load_weights(d, load_shape(d))
    assert w.source == "config" and w.checkpoint_bytes == LLAMA3_8B_BYTES


def test_a_checkpoint_the_config_estimate_misses_is_a_warning(tmp_path):
    d = _index_only_model(tmp_path, 2 * LLAMA3_8B_BYTES)  # as a float32 checkpoint
    plan = make_plan(PlanInputs(model=d, gpu_memory_gib=80))
    (w,) = [w for w in plan["warnings"] if w["code"] == "weights-estimate-differs"]
    assert "29.92 GiB" in w["message"] and "14.96 GiB" in w["message"]
