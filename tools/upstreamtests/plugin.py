"""The pytest plugin loaded into a run of upstream's suite: ``-p upstreamtests.plugin``.

With ``--upstream-side SIDE`` it:

- reads the list given by ``--upstream-expected`` and, for each collected test
  that an entry matches, marks it as a *strict* expected failure or deselects it,
  as the entry's kind says for that side (see :mod:`upstreamtests.expected`); an
  entry whose module was collected but which matches no test is *stale*, and
  makes the run fail;
- applies the shims for names that upstream's test modules import and the fork
  removes (:mod:`upstreamtests.shims`), so that the rest of those modules runs;
- writes, with ``--upstream-report PATH``, a JSON report of every test's outcome,
  the shims applied and the stale entries, that the harness summarizes.

Without ``--upstream-side`` it does nothing.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from upstreamtests import shims
from upstreamtests.expected import SIDES, Entry, load, lookup


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("upstream tests")
    group.addoption("--upstream-side", choices=SIDES, help="activate, for this side")
    group.addoption("--upstream-expected", type=Path, help="the list of entries")
    group.addoption("--upstream-report", type=Path, help="write a JSON report here")


_ORIGIN = pytest.StashKey[str]()


def check_not_shadowed(root: Path) -> str:
    """Where distributed comes from; an error if from the suite's own folders."""
    import distributed

    where = Path(distributed.__file__).resolve().parent
    if root.resolve() in where.parents:
        raise pytest.UsageError(
            f"distributed is imported from the suite ({where}), not from the "
            "environment under test"
        )
    return f"distributed {distributed.__version__} from {where}"


def pytest_configure(config: pytest.Config) -> None:
    side = config.getoption("--upstream-side")
    if side:
        config.stash[_ORIGIN] = check_not_shadowed(config.rootpath)
        path = config.getoption("--upstream-expected")
        entries = load(path) if path else []
        report = config.getoption("--upstream-report")
        config.pluginmanager.register(Expectations(side, entries, report), "upstream")


class Expectations:
    def __init__(self, side: str, entries: list[Entry], report: Path | None):
        self.side = side
        self.entries = entries
        self.report = report
        self.shims = shims.apply_now()
        self.stale: list[str] = []
        self.collected: list[str] = []
        self.xfail: dict[str, Entry] = {}
        self.deselected: dict[str, Entry] = {}
        self.outcomes: dict[str, str] = {}
        self.reruns: dict[str, int] = {}
        self.collect_errors: list[str] = []

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        shims = ", ".join(self.shims) or "none"
        return [
            f"upstream tests: side {self.side}, {config.stash[_ORIGIN]}",
            f"upstream tests: {len(self.entries)} listed entries, shims: {shims}",
        ]

    # Before -k/-m deselect anything, so that staleness is judged on all tests.
    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        self.collected = [item.nodeid for item in items]
        modules = {nodeid.split("::", 1)[0] for nodeid in self.collected}
        used: set[Entry] = set()
        keep, drop = [], []
        for item in items:
            entry = lookup(self.entries, item.nodeid)
            action = entry.action(self.side) if entry else None
            if entry:
                used.add(entry)
            if entry and action == "xfail":
                self.xfail[item.nodeid] = entry
                reason = f"listed ({entry.describe()})"
                item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
            if entry and action == "deselect":
                self.deselected[item.nodeid] = entry
                drop.append(item)
            else:
                keep.append(item)
        self.stale = [
            e.test for e in self.entries if e.path in modules and e not in used
        ]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collect_errors.append(report.nodeid)
        elif report.skipped:  # a module that skips itself (importorskip)
            self.outcomes[report.nodeid] = "skipped"

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        nodeid = report.nodeid
        if report.outcome == "rerun":
            self.reruns[nodeid] = self.reruns.get(nodeid, 0) + 1
            return
        current = self.outcomes.get(nodeid)
        if report.when == "call" or current is None:
            self.outcomes[nodeid] = _outcome(report)
        elif report.failed and current in ("passed", "skipped", "xpassed"):
            # Passed or skipped, then failed in teardown: an error.
            self.outcomes[nodeid] = "error"

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        write = terminalreporter.write_line
        if self.stale:
            terminalreporter.section("stale entries in the upstream list", red=True)
            for test in self.stale:
                write(f"{test}: listed, but no such test was collected")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.stale and exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if self.report:
            self.report.parent.mkdir(parents=True, exist_ok=True)
            self.report.write_text(json.dumps(self.as_dict(), indent=1) + "\n")

    def as_dict(self) -> dict[str, Any]:
        return {
            "side": self.side,
            "shims": self.shims,
            "outcomes": self.outcomes,
            "collected": self.collected,
            "reruns": self.reruns,
            "collect_errors": self.collect_errors,
            "stale": self.stale,
            "xfail": {k: e.describe() for k, e in self.xfail.items()},
            "deselected": {k: e.describe() for k, e in self.deselected.items()},
        }


def _outcome(report: pytest.TestReport) -> str:
    """One word for a test's outcome so far, from its latest phase's report."""
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.failed:
        if str(report.longrepr).startswith("[XPASS(strict)]"):
            return "xpassed-strict"
        return "failed" if report.when == "call" else "error"
    return "skipped" if report.skipped else "passed"
