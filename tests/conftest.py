"""Suite-wide options: real-GPU tests are opt-in (``--gpu``), skipped by default."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu", action="store_true", default=False,
                     help="run tests marked 'gpu' (needs an NVIDIA GPU; scripts/gpu-check.sh)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--gpu"):
        return
    skip = pytest.mark.skip(reason="needs a real GPU: opt in with --gpu")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
