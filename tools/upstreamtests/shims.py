"""Names that upstream's test modules import and the fork removes, provided anew.

A module of upstream's suite that imports a removed name fails to import as a
whole, and none of its tests runs. A shim gives the name back (not its
behaviour: see each factory), so that the module's other tests run; the tests
that rely on the removed behaviour fail, and are listed.

Shims must be in place in every process of a run: upstream's tests also import
their own modules in worker processes (functions pickled by reference). So
:func:`install` adds an import hook that applies them whenever a shimmed module
is imported; ``site/sitecustomize.py`` beside this file calls it at the start of
every python process of a run, the harness putting that folder on PYTHONPATH.
The same hook lets upstream's test modules import each other by their names in
upstream's source tree (:class:`_SuiteFinder`).
"""
from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any


def _digest_metric(module: ModuleType) -> type:
    """A stand-in for the ``DigestMetric`` instruction, which the fork removes.

    Upstream's tests build it with keyword arguments and compare instructions to
    it; the fork's state machine never emits one, so each test that expects one
    fails (and is listed), while the other tests of the module run.
    """
    fields = [("name", str), ("value", float)]
    shim = dataclasses.make_dataclass(
        "DigestMetric", fields, bases=(module.Instruction,), slots=True
    )
    shim.__module__ = module.__name__
    shim.__doc__ = "Harness shim: the fork removes this instruction."
    return shim


#: ``module -> {name: factory}``: names to provide where the module lacks them.
SHIMS: dict[str, dict[str, Callable[[ModuleType], Any]]] = {
    "distributed.worker_state_machine": {"DigestMetric": _digest_metric},
}

#: What was provided in this process, as ``module.name``.
applied: list[str] = []


def apply(module: ModuleType) -> None:
    for name, factory in SHIMS.get(module.__name__, {}).items():
        if not hasattr(module, name):
            setattr(module, name, factory(module))
            applied.append(f"{module.__name__}.{name}")


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the shims."""

    def __init__(self, loader: Any):
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        apply(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in SHIMS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


class _SuiteFinder(importlib.abc.MetaPathFinder):
    """Upstream's test modules by their names within the package, from the suite.

    A few import another folder's test module as upstream's source tree has it,
    e.g. ``from distributed.tests.test_batched import EchoServer``; the installed
    package has no tests. This finds ``distributed.[...].tests[.NAME]`` in the
    suite's folders instead.
    """

    def __init__(self, suite: str):
        self.suite = suite

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        parts = fullname.split(".")
        if parts[0] != "distributed" or "tests" not in parts[1:]:
            return None
        base = os.path.join(self.suite, *parts)
        if os.path.isdir(base):
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = [base]
            return spec
        if os.path.isfile(base + ".py"):
            return importlib.util.spec_from_file_location(fullname, base + ".py")
        return None


#: Where the harness says the suite is, for :class:`_SuiteFinder`.
SUITE_VARIABLE = "UPSTREAM_TESTS_SUITE"


def install() -> None:
    """Apply the shims to shimmed modules when imported (and if already are)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    suite = os.environ.get(SUITE_VARIABLE)
    # First: the installed package has a folder distributed/tests too (of TLS
    # certificates), which the path finder would take for a namespace package.
    if suite and not any(isinstance(f, _SuiteFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SuiteFinder(suite))
    for name in SHIMS:
        if name in sys.modules:
            apply(sys.modules[name])


def apply_now() -> list[str]:
    """Import each shimmed module (applying its shims); return what was applied."""
    install()
    for name in SHIMS:
        importlib.import_module(name)
    return list(applied)
