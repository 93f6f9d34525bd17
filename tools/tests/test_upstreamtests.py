"""The upstream-suite harness: the list, the plugin's strictness, the summary."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from upstreamtests import harness, shims
from upstreamtests.cli import main
from upstreamtests.expected import Entry, ListError, load, lookup, parse

from conftest import TOOLS

LIST = """\
# a comment

a/test_m.py::test_one  fork: the fork renames it
a/test_m.py::test_p[1]  env: root can write anywhere
a/test_m.py::test_q  deselect: flaky on 2 cores
"""


def test_parse_and_match():
    one, p1, q = parse(LIST)
    assert one == Entry("a/test_m.py::test_one", "fork", "the fork renames it", 3)
    assert p1.path == "a/test_m.py"
    assert lookup([one, p1, q], "a/test_m.py::test_p[1]") is p1
    assert lookup([one, p1, q], "a/test_m.py::test_p[2]") is None
    # Without parameters, an entry covers each parametrization, and only those.
    assert lookup([one, p1, q], "a/test_m.py::test_q[x-y]") is q
    assert lookup([one, p1, q], "a/test_m.py::test_qq") is None
    assert [one.action(s) for s in ("fork", "pristine")] == ["xfail", None]
    assert [p1.action(s) for s in ("fork", "pristine")] == ["xfail", "xfail"]
    assert [q.action(s) for s in ("fork", "pristine")] == ["deselect"] * 2


@pytest.mark.parametrize(
    "text, message",
    [
        ("a.py::t\n", "expected 'TEST KIND: REASON'"),
        ("a.py::t reason without kind\n", "expected 'TEST KIND: REASON'"),
        ("a.py::t flaky: maybe\n", "unknown kind 'flaky'"),
        ("a.py::t fork:   \n", "has no reason"),
        ("a.py::t fork: x\na.py::t env: y\n", "already covered by line 1"),
        ("a.py::t fork: x\na.py::t[1] env: y\n", "already covered by line 1"),
        ("a.py::t[1] fork: x\na.py::t env: y\n", "overlaps an entry"),
    ],
)
def test_parse_errors(text, message):
    with pytest.raises(ListError, match=message) as info:
        parse(text, "list.txt")
    assert str(info.value).startswith("list.txt:")


def test_the_repository_list_parses():
    entries = load(TOOLS.parent / "continuous_integration/upstream-tests-expected.txt")
    assert all(e.reason for e in entries)


SUITE = """\
import pytest

def test_pass():
    pass

def test_fail():
    assert False

def test_one():
    assert False, "renamed by the fork"

def test_listed_passes():
    pass

@pytest.mark.parametrize("n", [1, 2])
def test_p(n):
    assert n == 2

def test_q():
    assert False, "flaky"

@pytest.mark.xfail(reason="upstream's own, not strict")
def test_upstream_xfail():
    pass

@pytest.fixture
def broken():
    yield
    raise RuntimeError("teardown")

def test_teardown_error(broken):
    pass
"""

SUITE_LIST = """\
a/test_m.py::test_one  fork: the fork renames it
a/test_m.py::test_listed_passes  env: said to fail here
a/test_m.py::test_p[1]  env: root can write anywhere
a/test_m.py::test_q  deselect: flaky on 2 cores
"""


def run_plugin(tmp_path: Path, side: str, listing: str) -> tuple[int, dict]:
    (tmp_path / "a").mkdir(exist_ok=True)
    (tmp_path / "a/test_m.py").write_text(SUITE)
    (tmp_path / "list.txt").write_text(listing)
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(TOOLS)}
    cmd = [sys.executable, "-m", "pytest", "-p", "upstreamtests.plugin"]
    cmd += ["-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-c", os.devnull]
    cmd += [f"--upstream-side={side}", f"--upstream-expected={tmp_path / 'list.txt'}"]
    cmd += [f"--upstream-report={report}", "a/test_m.py"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert report.exists(), proc.stdout + proc.stderr
    return proc.returncode, json.loads(report.read_text())


def test_plugin_is_strict_on_the_fork_side(tmp_path):
    rc, report = run_plugin(tmp_path, "fork", SUITE_LIST)
    assert rc == 1
    m = "a/test_m.py::"
    assert report["outcomes"] == {
        m + "test_pass": "passed",
        m + "test_fail": "failed",
        m + "test_one": "xfailed",
        m + "test_listed_passes": "xpassed-strict",
        m + "test_p[1]": "xfailed",
        m + "test_p[2]": "passed",
        m + "test_upstream_xfail": "xpassed",
        m + "test_teardown_error": "error",
    }
    assert list(report["deselected"]) == [m + "test_q"]
    assert report["stale"] == []
    found = harness.problems(report, parse(SUITE_LIST))
    assert found["unexpected failures on fork"] == [
        m + "test_fail",
        m + "test_teardown_error",
    ]
    assert found["unexpected passes on fork (listed, but passed)"] == [
        m + "test_listed_passes  (listed as env: said to fail here)"
    ]


def test_plugin_on_the_pristine_side_runs_fork_entries(tmp_path):
    rc, report = run_plugin(tmp_path, "pristine", SUITE_LIST)
    assert rc == 1
    assert report["outcomes"]["a/test_m.py::test_one"] == "failed"
    found = harness.problems(report, parse(SUITE_LIST))
    assert "a/test_m.py::test_one  (listed as fork: the fork renames it)" in (
        found["unexpected failures on pristine"]
    )


def test_plugin_passes_when_all_is_listed_and_flags_stale_entries(tmp_path):
    listing = SUITE_LIST.replace("test_listed_passes  env", "test_fail  env")
    listing += "a/test_m.py::test_teardown_error  deselect: teardown fails\n"
    rc, report = run_plugin(tmp_path, "fork", listing)
    assert rc == 0, report
    assert report["outcomes"]["a/test_m.py::test_fail"] == "xfailed"
    assert not any(harness.problems(report, parse(listing)).values())
    rc, report = run_plugin(tmp_path, "fork", listing + "a/test_m.py::gone  env: x\n")
    assert rc == 1
    assert report["stale"] == ["a/test_m.py::gone"]
    # An entry for a module not in this run is not stale: the run is partial.
    rc, report = run_plugin(tmp_path, "fork", listing + "b/test_n.py::t  env: x\n")
    assert rc == 0


def test_summary_ends_with_counts_and_fails_on_problems(capsys):
    report = {
        "side": "fork",
        "shims": ["m.X"],
        "outcomes": {"t.py::a": "passed", "t.py::b": "failed", "t.py::c": "xfailed"},
        "collected": ["t.py::a", "t.py::b", "t.py::c"],
        "reruns": {},
        "collect_errors": [],
        "stale": [],
        "xfail": {"t.py::c": "fork: why"},
        "deselected": {},
    }
    assert harness.summarize(report, parse("t.py::c fork: why\n"), Path("l")) == 1
    out = capsys.readouterr().out.splitlines()
    assert "unexpected failures on fork (1):" in out
    assert "  t.py::b" in out
    assert out[-1] == "upstream-fork: 1 passed, 1 failed"
    report["outcomes"]["t.py::b"] = "skipped"
    assert harness.summarize(report, [], Path("l")) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "upstream-fork: 1 passed, 0 failed"
    )
    # Summarized again against an edited list: judged by the list as it is now.
    report["outcomes"]["t.py::b"] = "failed"
    edited = parse("t.py::b env: why\nt.py::c fork: why\nt.py::gone env: x\n")
    found = harness.problems(report, edited)
    assert found["unexpected failures on fork"] == []
    assert found["stale entries (listed, not collected)"] == ["t.py::gone"]


def make_archive(path: Path, names: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in names.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_extract_strips_the_top_folder_and_checks_members(tmp_path):
    top = "distributed-2023.3.1-tests/"
    files = {top + n: b"x" for n in ("conftest.py", "setup.cfg", "distributed/a.py")}
    archive = make_archive(tmp_path / "ok.tar.gz", files)
    suite = harness.extract(archive, tmp_path / "suite")
    assert (suite / "distributed/a.py").read_bytes() == b"x"
    bad = make_archive(tmp_path / "bad.tar.gz", {**files, top + "../evil": b""})
    with pytest.raises(harness.HarnessError, match="unexpected member"):
        harness.extract(bad, tmp_path / "suite2")


def test_refuses_a_package_outside_the_environment(tmp_path, monkeypatch):
    info = {"package": "/src/tree/distributed", "prefix": str(tmp_path), "version": "x"}
    monkeypatch.setattr(harness, "inspect", lambda python: info)
    with pytest.raises(harness.HarnessError, match="regular install"):
        harness.complete_environment("python", tmp_path)


def test_absent_archive_skips_except_in_ci(tmp_path, monkeypatch, capsys):
    args = ["run", "--side", "fork", "--python", "python", "--out", str(tmp_path)]
    args += ["--archive", str(tmp_path / "absent.tar.gz"), "distributed/tests"]
    monkeypatch.setenv("CI", "")
    assert main(args) == 0
    assert "SKIPPED upstream tests: upstream test archive not found" in (
        capsys.readouterr().out
    )
    monkeypatch.setenv("CI", "true")
    assert main(args) == 1
    assert "CI needs it" in capsys.readouterr().err


def test_digest_metric_shim():
    from dataclasses import dataclass

    @dataclass
    class Instruction:
        __slots__ = ("stimulus_id",)
        stimulus_id: str

    module = type(sys)("fake_wsm")
    module.Instruction = Instruction  # type: ignore[attr-defined]
    shim = shims._digest_metric(module)
    a = shim(name="compute-duration", value=1.0, stimulus_id="s1")
    assert isinstance(a, Instruction)
    assert a == shim(stimulus_id="s1", name="compute-duration", value=1.0)
    assert not hasattr(a, "__dict__")
    assert shim.__module__ == "fake_wsm"


def test_shims_are_applied_on_import(tmp_path, monkeypatch):
    (tmp_path / "shimmed_mod.py").write_text("A = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(shims, "SHIMS", {"shimmed_mod": {"B": lambda m: m.A + 1}})
    monkeypatch.setattr(shims, "applied", [])
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    shims.install()
    import shimmed_mod  # type: ignore[import]

    try:
        assert shimmed_mod.B == 2
        assert shims.applied == ["shimmed_mod.B"]
        assert shimmed_mod.__loader__.get_source("shimmed_mod") == "A = 1\n"
    finally:
        del sys.modules["shimmed_mod"]


def test_every_process_of_a_run_gets_the_hook():
    site = TOOLS / "upstreamtests/site"
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{TOOLS}"}
    code = "import sys; print([type(f).__name__ for f in sys.meta_path][0])"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert out.stdout.strip() == "_Finder", out.stderr


def test_suite_modules_are_importable_by_their_package_names(tmp_path, monkeypatch):
    (tmp_path / "distributed/comm/tests").mkdir(parents=True)
    (tmp_path / "distributed/comm/tests/test_fake.py").write_text("X = 42\n")
    monkeypatch.setenv(shims.SUITE_VARIABLE, str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    shims.install()
    try:
        from distributed.comm.tests.test_fake import X  # type: ignore[import]

        assert X == 42
    finally:
        for name in ("distributed.comm.tests.test_fake", "distributed.comm.tests"):
            sys.modules.pop(name, None)
