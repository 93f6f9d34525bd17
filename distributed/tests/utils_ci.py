"""What the tests that need a real component (a Prometheus server, a browser) do
when it is missing: skip with a clear reason, except on CI; and the cluster they
run, as users run it.

CI (``CI=true``, as ``.ci/run`` runs) installs every such component, so there a
missing one fails the test instead: CI cannot silently lose the tests that need it.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any, NoReturn

import pytest

from distributed import LocalCluster


def on_ci() -> bool:
    """Whether the tests run on CI: the environment variable ``CI`` is ``true``
    (or ``1``, ``yes``)
    """
    return os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"}


def skip_or_fail(reason: str) -> NoReturn:
    """Skip the test (or the module, at import); but fail it on CI, where what it
    needs must be installed

    Parameters
    ----------
    reason : str
        What is missing, and how to install it
    """
    if on_ci():
        pytest.fail(f"{reason}; CI=true, so this fails instead of skipping")
    pytest.skip(reason, allow_module_level=True)


def import_or_skip(name: str) -> ModuleType:
    """Import a module that the constraints of ``continuous_integration/`` pin, and
    that ``make install`` installs; if it can't be imported, skip the test (or the
    module, at import), but fail it on CI

    Parameters
    ----------
    name : str
        The module's name, e.g. ``"prometheus_client"``
    """
    try:
        return importlib.import_module(name)
    except ImportError as e:
        skip_or_fail(f"{name} can't be imported ({e}): make install installs it")


def require_executable(path: str, install_hint: str) -> str:
    """``path``, if it is an executable file; otherwise skip the test (fail it on
    CI)

    Parameters
    ----------
    path : str
        The absolute path of the executable
    install_hint : str
        How to install it, for the reason of the skip

    Returns
    -------
    str
        ``path``
    """
    if not os.access(path, os.X_OK):
        skip_or_fail(f"{path} is not installed: {install_hint}")
    return path


def loopback_process_cluster(loop: Any) -> LocalCluster:
    """Two worker processes with a thread each and their own dashboards, on
    loopback, as users run a cluster; its ports are to be read back from it (a
    fixed port that is taken silently becomes another). Each process has its own
    ``prometheus_client`` registry, so that each endpoint serves its own metrics.

    Parameters
    ----------
    loop : IOLoop
        The test's event loop (upstream's ``loop`` fixture)
    """
    return LocalCluster(
        n_workers=2,
        processes=True,
        threads_per_worker=1,
        dashboard_address="127.0.0.1:0",
        worker_dashboard_address="127.0.0.1:0",
        host="127.0.0.1",
        loop=loop,
    )
