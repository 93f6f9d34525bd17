"""Tests of benchmarks/instructions.py: parsing, arithmetic and arguments always,
and a real run when valgrind is installed (slow).
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from distributed.tests.utils_ci import skip_or_fail

BENCH = Path(__file__).resolve().parent.parent

#: The tail of what cachegrind prints on stderr (valgrind 3.19)
STDERR = """\
==25052== Cachegrind, a cache and branch-prediction profiler
==25052== Command: python bench_trivial.py --size 200
==25052==
==25052==
==25052== I   refs:      2,982,664,681
"""

#: The head of the dump of a measured section, as callgrind writes it (3.19)
SECTION_DUMP = """\
# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 1173
cmd:  python bench_trivial.py --size 1700 --quiet
part: 2


desc: I1 cache:
desc: Trigger: Client Request: section

positions: line
events: Ir
summary: 4013467212


totals: 4013899302
"""


@pytest.fixture(scope="module")
def instructions() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_instructions", BENCH / "instructions.py"
        )
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_parse_total(instructions):
    assert instructions.parse_total(STDERR) == 2_982_664_681


def test_parse_total_by_pid(instructions):
    """The driver and the worker both report; pick the worker's"""
    stderr = STDERR + STDERR.replace("25052", "25060").replace("2,982", "1,234")
    assert instructions.parse_total(stderr, 25060) == 1_234_664_681
    assert instructions.parse_total(stderr, 25052) == 2_982_664_681
    with pytest.raises(RuntimeError, match="No instruction count"):
        instructions.parse_total(stderr, 1)


def test_count(instructions):
    stderr = STDERR + STDERR.replace("25052", "25060").replace("2,982", "1,234")
    stdout = (
        'INFO: something\n{"wall_s": 1.0, "tasks_per_s": 2.0, "worker_pid": 25060}\n'
    )
    assert instructions.count("worker", stdout, stderr) == 1_234_664_681
    assert instructions.count("trivial", "", STDERR) == 2_982_664_681


@pytest.mark.parametrize(
    "stderr",
    [
        "Traceback (most recent call last):\nImportError: no distributed\n",
        # The counts of two processes (e.g. with --trace-children)
        STDERR + STDERR.replace("25052", "25060"),
    ],
)
def test_parse_total_bad_output(instructions, stderr):
    with pytest.raises(RuntimeError, match="No instruction count"):
        instructions.parse_total(stderr)


def test_per_task(instructions):
    # Start-up costs 1000 at both sizes; each task costs 7
    assert instructions.per_task(1000 + 7 * 200, 1000 + 7 * 1700, (200, 1700)) == 7


def test_command(instructions):
    """worker runs the driver and the worker process each under valgrind; trivial
    runs the whole in-process cluster under it
    """
    valgrind = ["/usr/bin/valgrind", *instructions.VALGRIND_ARGS]
    worker = instructions.command("worker", "/usr/bin/valgrind", "py", 200)
    assert worker == [
        *valgrind,
        "py",
        str(BENCH / "worker_process.py"),
        "--size",
        "200",
        "--",
        *valgrind,
    ]

    trivial = instructions.command("trivial", "/usr/bin/valgrind", "py", 200)
    assert trivial == [
        "/usr/bin/valgrind",
        *instructions.VALGRIND_ARGS,
        "py",
        str(BENCH / "bench_trivial.py"),
        "--size",
        "200",
        "--quiet",
    ]

    default = instructions.command("trivial-default", "/usr/bin/valgrind", "py", 200)
    assert default == [*trivial, "--queuing"]


def test_default_workload(instructions):
    args = instructions.parse_args(["--fork", "a", "--pristine", "b"])
    assert args.workload == "trivial"


def test_command_section(instructions):
    """With --section, callgrind counts the in-process cluster into the file given"""
    section = instructions.command(
        "trivial-default", "/usr/bin/valgrind", "py", 200, "/tmp/x/fork.out"
    )
    assert section == [
        "/usr/bin/valgrind",
        *instructions.SECTION_ARGS,
        "--callgrind-out-file=/tmp/x/fork.out",
        "py",
        str(BENCH / "bench_trivial.py"),
        "--size",
        "200",
        "--quiet",
        "--queuing",
    ]
    with pytest.raises(ValueError, match="no measured section"):
        instructions.command("worker", "/usr/bin/valgrind", "py", 200, "/tmp/x/f")


def test_parse_section(instructions):
    assert instructions.parse_section(SECTION_DUMP) == 4_013_467_212


@pytest.mark.parametrize(
    "dump",
    [
        # The dump at the end of the run, not the section's
        SECTION_DUMP.replace("Client Request: section", "Program termination"),
        SECTION_DUMP.replace("summary: 4013467212\n", ""),
        "",
    ],
)
def test_parse_section_bad_dump(instructions, dump):
    with pytest.raises(RuntimeError, match="Not the dump of a measured section"):
        instructions.parse_section(dump)


def test_section_dump(instructions, tmp_path):
    out = tmp_path / "fork.out"
    (tmp_path / "fork.out.1").write_text(SECTION_DUMP)
    # The dump at the end of the run is not a candidate
    (tmp_path / "fork.out").write_text("desc: Trigger: Program termination\n")
    assert instructions.section_dump(str(out)) == SECTION_DUMP
    with pytest.raises(RuntimeError, match="found 0: does the script mark one"):
        instructions.section_dump(str(tmp_path / "pristine.out"))
    (tmp_path / "fork.out.2").write_text(SECTION_DUMP)
    with pytest.raises(RuntimeError, match="found 2"):
        instructions.section_dump(str(out))


def test_run_pair_section(instructions, monkeypatch, tmp_path):
    """With a section, each side runs once at the larger size, with the library,
    into a file of its own under the section's directory; per task is the
    section's count divided by the size
    """
    runs = []

    def fake_start(workload, valgrind, python, size, cpu, out=None, lib=None):
        runs.append((python, size, lib, os.path.dirname(os.path.dirname(out))))
        count = {"a": 1700 * 2_000_000, "b": 1700 * 1_000_000}[python]
        dump = SECTION_DUMP.replace("4013467212", str(count))
        Path(f"{out}.1").write_text(dump)
        return subprocess.Popen(
            [sys.executable, "-c", "pass"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    monkeypatch.setattr(instructions, "start", fake_start)
    section = instructions.Section("/x/libsection.so", str(tmp_path))
    counts = instructions.run_pair(
        "trivial",
        "valgrind",
        {"fork": "a", "pristine": "b"},
        (200, 1700),
        [None, None],
        section,
    )
    assert counts == {"fork": 2_000_000, "pristine": 1_000_000}
    assert sorted(runs) == [
        ("a", 1700, "/x/libsection.so", str(tmp_path)),
        ("b", 1700, "/x/libsection.so", str(tmp_path)),
    ]


def test_build_section_lib_without_compiler(instructions, monkeypatch, tmp_path):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(instructions.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="needs a C compiler"):
        instructions.build_section_lib(str(tmp_path))


def test_build_section_lib_failing(instructions, monkeypatch, tmp_path):
    """A compiler that fails (e.g. for want of valgrind's headers) says so"""
    monkeypatch.setenv("CC", "false")
    with pytest.raises(SystemExit, match="it needs valgrind's headers"):
        instructions.build_section_lib(str(tmp_path))


def require_valgrind() -> None:
    """Skip the test if valgrind is missing (fail it on CI)"""
    if shutil.which("valgrind") is None:
        skip_or_fail("valgrind is not installed: tools/install-valgrind.sh")


def require_section_build() -> None:
    """Skip the test if what building section.c needs is missing (fail it on CI)"""
    if (
        shutil.which("gcc") is None
        or not Path("/usr/include/valgrind/callgrind.h").exists()
    ):
        skip_or_fail("needs gcc and valgrind's headers: tools/install-valgrind.sh")


def test_build_section_lib(instructions, tmp_path):
    """The library builds, has the functions that _common calls, and does nothing
    outside valgrind
    """
    require_section_build()
    lib = ctypes.CDLL(instructions.build_section_lib(str(tmp_path)))
    lib.section_start()
    lib.section_stop()


def test_pair_cpus(instructions):
    a, b = instructions.pair_cpus(0), instructions.pair_cpus(1)
    assert a == b[::-1]
    assert len(a) == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sizes", "1700", "200"], "--sizes must be two increasing"),
        (["--sizes", "0", "10"], "--sizes must be two increasing"),
        (["--pairs", "0"], "--pairs must be positive"),
        (["--workload", "cluster"], "invalid choice"),
        (["--section", "--workload", "worker"], "--section counts the in-process"),
    ],
)
def test_bad_arguments(instructions, capsys, argv, message):
    with pytest.raises(SystemExit):
        instructions.parse_args(["--fork", "a", "--pristine", "b", *argv])
    assert message in capsys.readouterr().err


def test_no_valgrind(instructions, monkeypatch):
    monkeypatch.setattr(instructions.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="valgrind is not installed"):
        instructions.main(["--fork", "a", "--pristine", "b"])


#: Work before the measured section, and in it: a sum over a range of each size
SECTION_SCRIPT = """\
import sys
sys.path.insert(0, sys.argv[1])
from _common import measured_section
sum(range(2_000_000))
with measured_section():
    sum(range(1_000))
"""


@pytest.mark.slow
def test_section_counts_only_the_section(instructions, tmp_path):
    """Under callgrind, the dump of the section has the work inside it, not the
    imports nor the work before it
    """
    require_valgrind()
    require_section_build()
    lib = instructions.build_section_lib(str(tmp_path))
    script = tmp_path / "script.py"
    script.write_text(SECTION_SCRIPT)
    out = str(tmp_path / "run.out")
    proc = subprocess.run(
        [
            "valgrind",
            *instructions.SECTION_ARGS,
            f"--callgrind-out-file={out}",
            sys.executable,
            str(script),
            str(BENCH),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**instructions.child_env(), instructions.SECTION_LIB_VAR: lib},
    )
    assert proc.returncode == 0, proc.stderr
    section = instructions.parse_section(instructions.section_dump(out))
    # The sum of a thousand numbers, and the calls that mark the section: some
    # tens of thousands of instructions. Before it: 2 million numbers summed,
    # and the imports, billions of instructions in all.
    assert 0 < section < 1_000_000


@pytest.mark.slow
@pytest.mark.parametrize(
    "workload, method",
    [
        ("worker", []),
        ("trivial", []),
        ("trivial-default", []),
        ("trivial", ["--section"]),
    ],
    ids=["worker", "trivial", "trivial-default", "trivial-section"],
)
def test_end_to_end(tmp_path, workload, method):
    """The interpreter running the tests on both sides: an A/A pair. One side is
    given by a path relative to the caller's directory, as make does.
    """
    require_valgrind()
    if "--section" in method:
        require_section_build()
    python = Path(sys.executable)
    relative = os.path.relpath(python, tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "instructions.py"),
            "--fork",
            relative,
            "--pristine",
            str(python),
            "--sizes",
            "20",
            "120",
            "--pairs",
            "1",
            "--workload",
            workload,
            *method,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    *_, header, _, row, summary = proc.stdout.strip().splitlines()
    suffix = " (measured section)" if method else ""
    assert header == f"Workload: {workload}{suffix}"
    pair, fork, pristine, ratio = row.split()
    assert pair == "1"
    assert int(fork.replace(",", "")) > 0
    assert int(pristine.replace(",", "")) > 0
    # Same interpreter on both sides; the counts vary a little with timing
    assert 0.8 < float(ratio) < 1.25

    assert summary.startswith("Instructions per task, fork / pristine: median ")


def test_run_pair_failure_stops_the_other_side(instructions, monkeypatch):
    """When one side fails, the pair raises and the other side does not run on"""
    started = []

    def fake_start(workload, valgrind, python, size, cpu, out=None, lib=None):
        code = (
            "import sys; sys.exit(3)"
            if python == "bad"
            else "import time; time.sleep(60)"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stderr=subprocess.PIPE, text=True
        )
        started.append(proc)
        return proc

    monkeypatch.setattr(instructions, "start", fake_start)
    with pytest.raises(RuntimeError, match="fork exited with 3"):
        instructions.run_pair(
            "trivial",
            "valgrind",
            {"fork": "bad", "pristine": "good"},
            (1, 2),
            [None, None],
        )
    assert len(started) == 2
    assert all(proc.poll() is not None for proc in started)
