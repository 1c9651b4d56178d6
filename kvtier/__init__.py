"""kvtier: tiered KV-cache offload for vLLM (host RAM, then a shared object store)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvtier")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+local"

__all__ = ["__version__"]
