"""The ``kvtier`` command line (placeholder until the planner lands)."""

from __future__ import annotations

import argparse

from kvtier import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier", description="Tiered KV-cache offload for vLLM.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    parser.parse_args(argv)
    parser.print_help()
    return 0
