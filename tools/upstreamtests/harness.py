"""Extract upstream's suite, complete the environment under test, run, summarize.

Only the standard library is used here: the harness runs under any python and
drives the environment under test (``--python``) in a subprocess, where
:mod:`upstreamtests.plugin` is loaded.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from upstreamtests.expected import Entry, load, lookup
from upstreamtests.shims import SUITE_VARIABLE

TOOLS = Path(__file__).resolve().parents[1]

#: Outcomes, in the order the summary gives their counts. "xpassed" is a pass
#: of a test that upstream marks as a (non-strict) expected failure: not a
#: problem. "xpassed-strict" is a pass of a strict one, upstream's or listed.
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
FAILURES = ("failed", "error", "xpassed-strict")
PASSES = ("passed", "xpassed", "xpassed-strict")


class HarnessError(Exception):
    """A problem the user must fix; the CLI prints it and exits non-zero."""


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def extract(archive: Path, dest: Path) -> Path:
    """Extract the suite afresh into ``dest``, without the archive's top folder."""
    if dest.exists():
        shutil.rmtree(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        for m in members:
            parts = Path(m.name).parts
            if m.name.startswith("/") or ".." in parts or not (m.isfile() or m.isdir()):
                raise HarnessError(f"{archive}: unexpected member {m.name!r}")
        tops = {Path(m.name).parts[0] for m in members}
        if len(tops) != 1:
            raise HarnessError(f"{archive}: expected one top folder, got {tops}")
        tar.extractall(tmp, members)
    (tmp / tops.pop()).rename(dest)
    shutil.rmtree(tmp)
    for required in ("conftest.py", "setup.cfg", "distributed"):
        if not (dest / required).exists():
            raise HarnessError(f"{archive}: no {required} at the top")
    return dest


def inspect(python: str) -> dict[str, str]:
    """Where ``python`` finds distributed, and what it is."""
    code = (
        "import json, os, sys, distributed; print(json.dumps({"
        "'package': os.path.dirname(distributed.__file__), 'prefix': sys.prefix,"
        "'version': distributed.__version__}))"
    )
    # -I: not from the current folder (a checkout has a folder "distributed").
    proc = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True)
    if proc.returncode:
        raise HarnessError(f"{python} cannot import distributed:\n{proc.stderr}")
    info: dict[str, str] = json.loads(proc.stdout)
    return info


def complete_environment(python: str, suite: Path) -> list[str]:
    """Put into the installed package the test files that its sdist leaves out.

    ``distributed.utils_test.get_cert`` reads the TLS certificates from the
    ``tests`` folder beside it, and upstream's conftest.py loads the plugin
    ``distributed.pytest_resourceleaks``. Both are copied from the suite into the
    package, which must be inside the environment (a regular install, not an
    editable one pointing at a source tree). Returns what was done.
    """
    info = inspect(python)
    package = Path(info["package"]).resolve()
    prefix = Path(info["prefix"]).resolve()
    if prefix not in package.parents:
        raise HarnessError(
            f"{python} imports distributed from {package}, outside its environment "
            f"{prefix}: the suite needs a regular install, whose package it can add "
            "test files to"
        )
    done = [f"distributed {info['version']} at {package}"]
    certs = sorted((suite / "distributed/tests").glob("*.pem"))
    (package / "tests").mkdir(exist_ok=True)
    for cert in certs:
        shutil.copyfile(cert, package / "tests" / cert.name)
    done.append(f"{len(certs)} TLS .pem files copied into {package / 'tests'}")
    leaks = "pytest_resourceleaks.py"
    if not (package / leaks).exists():
        shutil.copyfile(suite / "distributed" / leaks, package / leaks)
        done.append(f"distributed/{leaks} copied from the suite")
    return done


def plain_folders(suite: Path) -> list[str]:
    """Make the suite's test folders plain folders, for ``--import-mode=prepend``.

    Upstream runs its tests inside its source tree, where ``distributed`` and its
    subpackages are packages, and a few test folders have an ``__init__.py``
    (``distributed.http.tests.test_core`` there). In the suite, without the
    package around them, each of these would be a top-level package named
    ``tests``, and they would collide. Without its ``__init__.py`` a test folder is
    a plain folder, as most are upstream, and its modules are imported by file
    name (as upstream's own ``test_utils`` expects). The ``__init__.py`` of a folder
    stays where one of its modules has the name of another folder's module; at
    most one such folder can. Returns what was done.
    """

    def names(folder: Path) -> set[str]:
        return {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}

    folders = sorted({p.parent for p in suite.glob("distributed/**/tests/*.py")})
    inits = [f / "__init__.py" for f in folders if (f / "__init__.py").exists()]
    plain: set[str] = set()
    for folder in folders:
        if not (folder / "__init__.py").exists():
            plain |= names(folder)
    keep = [i for i in inits if names(i.parent) & plain]
    if len(keep) > 1:
        raise HarnessError(f"more than one test package named 'tests': {keep}")
    every = Counter(
        n for f in folders if f / "__init__.py" not in keep for n in names(f)
    )
    if clash := sorted(n for n, k in every.items() if k > 1):
        raise HarnessError(f"test modules of the same name in plain folders: {clash}")
    done = []
    for init in inits:
        rel = init.relative_to(suite)
        if init in keep:
            done.append(f"kept {rel}: a module name there is also in another folder")
        else:
            init.unlink()
            done.append(f"removed {rel}: a plain folder")
    return done


#: Tests that need a port free on this machine: they fail (on both sides) while
#: another process listens there, as a LocalCluster's dashboard does.
PORTS = {
    8787: "distributed/tests/test_worker.py::test_plugin_internal_exception "
    "(a Scheduler with the default dashboard port)",
}


def busy_ports() -> list[str]:
    """A warning for each port of :data:`PORTS` that is in use now."""
    warnings = []
    for port, test in PORTS.items():
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                warnings.append(
                    f"warning: port {port} is in use: expect {test} to fail"
                )
    return warnings


@dataclass
class Run:
    """One run of the suite, for one side."""

    side: str
    python: str
    archive: Path
    out: Path
    expected: Path
    modules: list[str]
    timeout: int = 300
    import_mode: str = "prepend"
    pytest_args: list[str] = field(default_factory=list)

    @property
    def suite(self) -> Path:
        return self.out / "suite"

    @property
    def report(self) -> Path:
        return self.out / "report.json"

    @property
    def log(self) -> Path:
        return self.out / "pytest.log"

    def command(self) -> list[str]:
        # A module may be given as a test id too (PATH::TEST).
        paths = [m.split("::", 1)[0] for m in self.modules]
        missing = [p for p in paths if not (self.suite / p).exists()]
        if missing:
            raise HarnessError(f"not in the suite: {' '.join(missing)}")
        return [
            self.python,
            "-m",
            "pytest",
            # upstream's configuration, with the root and conftest.py of the suite
            "-c",
            str(self.suite / "setup.cfg"),
            "--rootdir",
            str(self.suite),
            f"--import-mode={self.import_mode}",
            # upstream's CI: slow tests included, and a per-test timeout that
            # fails the test rather than the whole run
            "--runslow",
            "-o",
            "timeout_method=signal",
            f"--timeout={self.timeout}",
            "--color=no",
            "-p",
            "no:cacheprovider",
            "-p",
            "upstreamtests.plugin",
            f"--upstream-side={self.side}",
            f"--upstream-expected={self.expected}",
            f"--upstream-report={self.report}",
            # In the order upstream's CI collects them (``pytest distributed``):
            # some of upstream's tests leave state that a test of an earlier
            # module, in that order, would see.
            *[str(self.suite / m) for m in sorted(self.modules)],
            *self.pytest_args,
        ]

    def execute(self) -> int:
        """Prepare and run; return pytest's exit status."""
        self.out.mkdir(parents=True, exist_ok=True)
        load(self.expected)  # fail early on a malformed list
        extract(self.archive, self.suite)
        print(f"upstream suite extracted from {self.archive} into {self.suite}")
        if self.import_mode == "prepend":
            for line in plain_folders(self.suite):
                print(f"  {line}")
        for line in complete_environment(self.python, self.suite):
            print(f"  {line}")
        work = self.out / "work"  # the tests' current directory
        if work.exists():
            shutil.rmtree(work)
        work.mkdir()
        if self.report.exists():
            self.report.unlink()
        env = dict(os.environ)
        # The plugin, and the shims' hook in every python process of the run.
        site = TOOLS / "upstreamtests/site"
        env["PYTHONPATH"] = os.pathsep.join(
            [str(site), str(TOOLS), *filter(None, [env.get("PYTHONPATH")])]
        )
        env[SUITE_VARIABLE] = str(self.suite)
        # As in an activated environment: some tests run its scripts (``dask``).
        env["PATH"] = os.pathsep.join(
            [os.path.dirname(self.python), *filter(None, [env.get("PATH")])]
        )
        cmd = self.command()
        for warning in busy_ports():
            print(warning)
        print("+", " ".join(cmd), flush=True)
        start = time.monotonic()
        with self.log.open("w", buffering=1) as log:  # whole lines, if we die
            proc = subprocess.Popen(
                cmd,
                cwd=work,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
            )
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            rc = proc.wait()
        print(f"pytest exited {rc} after {time.monotonic() - start:.0f} s")
        return rc


def read_report(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise HarnessError(f"{path} was not written: pytest stopped early")
    report: dict[str, Any] = json.loads(path.read_text())
    return report


def counts(report: dict[str, Any]) -> Counter[str]:
    c = Counter(report["outcomes"].values())
    c["deselected (listed)"] = len(report["deselected"])
    return c


def format_counts(c: Counter[str]) -> str:
    keys = [*OUTCOMES, "xpassed-strict", "deselected (listed)"]
    return ", ".join(f"{c[k]} {k}" for k in keys if c[k] or k in OUTCOMES)


def problems(report: dict[str, Any], entries: list[Entry]) -> dict[str, list[str]]:
    """What makes a run fail, each with the test ids concerned.

    Judged against ``entries``, the list as it is now (which is the list the run
    had, when called at the end of a run), so that a report can be summarized
    again after the list has been edited.
    """
    side = report["side"]
    failed, passed = [], []
    for nodeid, outcome in sorted(report["outcomes"].items()):
        entry = lookup(entries, nodeid)
        action = entry.action(side) if entry else None
        if entry and action == "xfail":
            if outcome in PASSES:
                passed.append(f"{nodeid}  (listed as {entry.describe()})")
        elif entry and action == "deselect":
            pass  # ran, since the list said otherwise then
        elif outcome in FAILURES:
            note = f"  (listed as {entry.describe()})" if entry else ""
            failed.append(f"{nodeid}{note}")
    collected = report["collected"]
    modules = {nodeid.split("::", 1)[0] for nodeid in collected}
    stale = [
        e.test
        for e in entries
        if e.path in modules and not any(e.matches(n) for n in collected)
    ]
    return {
        f"unexpected failures on {side}": failed,
        f"unexpected passes on {side} (listed, but passed)": passed,
        "collection errors": list(report["collect_errors"]),
        "stale entries (listed, not collected)": stale,
    }


def summarize(report: dict[str, Any], entries: list[Entry], expected: Path) -> int:
    """Print the summary that ends a run; return 1 if the run failed."""
    found = problems(report, entries)
    print()
    print(f"==== upstream tests, {report['side']} ====")
    if report["shims"]:
        print(f"shims applied: {', '.join(report['shims'])}")
    if report["reruns"]:
        print(f"reruns (flaky marker): {sum(report['reruns'].values())}")
    for title, ids in found.items():
        if ids:
            print(f"{title} ({len(ids)}):")
            for test in ids:
                print(f"  {test}")
    if any(found.values()):
        print(f"(update {expected} if these are expected: TEST KIND: REASON)")
    c = counts(report)
    print(f"{report['side']}: {format_counts(c)}")
    bad = sum(len(v) for v in found.values())
    # The closing line, in the plain form that CI reads.
    print(f"upstream-{report['side']}: {c['passed']} passed, {bad} failed")
    return 1 if bad else 0


def compare(fork: dict[str, Any], pristine: dict[str, Any]) -> list[str]:
    """The tests whose outcome differs between the two sides, one line each."""
    a, b = fork["outcomes"], pristine["outcomes"]
    lines = []
    for nodeid in sorted(set(a) | set(b)):
        x, y = a.get(nodeid, "not run"), b.get(nodeid, "not run")
        if x != y:
            lines.append(f"{nodeid}: fork {x}, pristine {y}")
    return lines
