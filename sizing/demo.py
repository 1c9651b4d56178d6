"""``kvtier demo`` (filled in with the connector)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the demo's flags."""


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the process exit code."""
    raise SystemExit("kvtier demo is not built yet")
