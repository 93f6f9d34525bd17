"""Run upstream's own test suite of the base release against a build of the fork.

The suite (a tarball of upstream's test folders, ``conftest.py`` and ``setup.cfg``)
is test input: it is extracted at run time under ``build/upstream``, never kept in
the repository. Modules:

- :mod:`upstreamtests.expected`: the list of upstream tests expected to fail (or
  deselected) against the fork, each with its kind and reason;
- :mod:`upstreamtests.plugin`: the pytest plugin, loaded into the run, that turns
  that list into strict expected failures and deselections, applies the shim for
  names the fork removes, and writes a report of every test's outcome;
- :mod:`upstreamtests.harness`: extracts the suite, adds the data files the sdist
  leaves out to the environment under test, runs pytest and prints the summary;
- :mod:`upstreamtests.cli`: the command line behind ``make test-upstream``.

docs/upstream_tests.rst says how it is used and what it found.
"""
from __future__ import annotations
