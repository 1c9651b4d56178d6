"""Tests here need an NVIDIA GPU: ``cuda``-marked ones are skipped where CUDA is absent.

A skip, not a pass: these tests exercise the CUDA streams, events and pinned
registration that cannot run on the CPU. The hook is a ``pytest_runtest_setup``
in this directory's conftest, so it applies to tests under ``tests/cuda`` only.
"""

from __future__ import annotations

import pytest
import torch


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
        pytest.skip("needs CUDA: torch.cuda.is_available() is False on this machine")
