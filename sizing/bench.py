"""``kvtier bench``: drive an OpenAI-compatible endpoint with a shared-prefix workload."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the bench's flags."""


def run(args: argparse.Namespace) -> int:
    """Run the bench; returns the process exit code."""
    raise SystemExit("kvtier bench is not built yet")
