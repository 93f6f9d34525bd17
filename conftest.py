"""Root pytest configuration of the fork, laid over build/tree as it is.

Upstream's own conftest.py is not in its sdist; this one provides what the
fork's tests need from it: the fixtures of ``distributed.utils_test`` and the
``--runslow`` option that selects tests marked ``slow``; and the fork's own
fixtures: ``browser`` of ``distributed.tests.utils_browser``.
"""
from __future__ import annotations

import pytest

pytest_plugins = ["distributed.utils_test", "distributed.tests.utils_browser"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="run slow tests")


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    if config.getoption("--runslow"):
        return
    skip_slow = pytest.mark.skip(reason="need --runslow option to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
