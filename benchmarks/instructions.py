"""Instructions per trivial task of the fork and of pristine, counted by cachegrind.

CPU time on a shared virtual machine moves by tens of percent from one run to
the next, which hides a 2% difference under any practical number of rounds.
Instruction counts do not move like that: pristine against itself comes out
within 0.5%. This runs a workload at two sizes under ``valgrind --tool=cachegrind
--cache-sim=no``, and takes the difference of the two totals divided by the
difference of the sizes, so that start-up and shutdown cancel out. Workloads:

``trivial`` (default)
    ``bench_trivial.py --quiet``: scheduler, worker and client in one process,
    all counted. The fork's extra work is all in the worker, but here it is
    diluted by the scheduler's and the client's.
``trivial-default``
    The same with queuing on the scheduler at its default (``bench_trivial.py
    --quiet --queuing``), as users run it: the worker holds one or two tasks at
    a time, and every task or two costs a round trip to the scheduler, where
    ``trivial`` sends the worker its tasks in large batches.
``worker``
    Only the worker is counted, which is what the fork's target is about:
    ``worker_process.py`` runs the scheduler and the client, and the worker in a
    process of its own, both under valgrind so that they slow down alike (the
    worker's report is found by its process id). A pair takes about 3.5 minutes.

Each pair runs the fork and pristine at the same time, one on each of the first
two CPUs (swapped from one pair to the next), small size first. A run takes
about a minute per thousand tasks. Under valgrind everything runs some 30 times
slower than usual, so that whatever a cluster does per unit of time rather than
per task (the profiler, heartbeats, monitors) would weigh 30 times more than in
a real one, and vary with the speed of the machine: both workloads turn it off
(see ``_common.QUIET_CONFIG``). Pristine against itself then comes out within
0.3%. The kernel's work (system calls, thread switches) is not counted; it is
nearly the same on both sides (the fork reads the CPU clock of the task's
thread three times more per task). The ratio is not a bound of the ratio of CPU
time: on a quiet machine, the fork's extra instructions took 2 to 4 times the
process's average time each (see docs/benchmarks.rst).

With ``--section``, the in-process workloads are counted by callgrind instead,
in one run of the larger size per side, and only over the tasks themselves:
``bench_trivial.py`` marks them, from submission until every one is done, as
its measured section (``_common.measured_section``, with a small library built
from ``section.c`` that zeroes the counts where the section starts and dumps
them where it ends). Start-up, warm-up and shutdown are left out without taking
a difference of two runs, which adds the noise of both; the release of the
tasks after the section is left out too. It needs a C compiler and valgrind's
headers (Debian's ``valgrind`` package has them).

Usage::

    python benchmarks/instructions.py --fork PYTHON_A --pristine PYTHON_B
        [--workload trivial|trivial-default|worker] [--sizes 200 1700]
        [--pairs 2] [--section]

Exit status: 0 if every run succeeded, 1 otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from run import (
    HERE,
    SECTION_LIB_VAR,
    TIMEOUT,
    add_interpreter_arguments,
    child_env,
    interpreters,
)

#: How valgrind runs the counted process
VALGRIND_ARGS = [
    "--tool=cachegrind",
    "--cache-sim=no",
    "--cachegrind-out-file=/dev/null",
]
WORKLOADS = ("trivial", "trivial-default", "worker")
#: Arguments of bench_trivial.py in the in-process workloads
TRIVIAL_ARGS = {"trivial": ["--quiet"], "trivial-default": ["--quiet", "--queuing"]}
#: The total that cachegrind prints on stderr at exit, after the process id
TOTAL_RE = re.compile(r"^==(\d+)== I\s+refs:\s+([\d,]+)\s*$", re.MULTILINE)
#: How callgrind runs the counted process with ``--section``. The counts of all
#: threads are pooled (``--separate-threads=no``, the default, which section.c
#: relies on), and the measured section's go to a dump of their own, numbered
#: after the file named by ``--callgrind-out-file`` (``OUT.1``)
SECTION_ARGS = ["--tool=callgrind", "--separate-threads=no", "--dump-instr=no"]
#: What the section's dump says of itself, and its total: ``summary`` is the sum
#: of the dump's costs (``totals``, a little more, adds what callgrind
#: attributes to calls in progress when it dumps)
SECTION_DESC = "desc: Trigger: Client Request: section"
SUMMARY_RE = re.compile(r"^summary:\s+(\d+)\s*$", re.MULTILINE)


def parse_total(stderr: str, pid: int | None = None) -> int:
    """The number of instructions that cachegrind reported for the process ``pid``,
    or for the only process it reported on
    """
    totals = [
        count for p, count in TOTAL_RE.findall(stderr) if pid is None or int(p) == pid
    ]
    if len(totals) != 1:
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"No instruction count in the output of valgrind:\n{tail}")
    return int(totals[0].replace(",", ""))


def count(workload: str, stdout: str, stderr: str) -> int:
    """The instructions of the counted process of a run of ``workload``"""
    if workload == "worker":
        # The last line of worker_process.py's output; the driver's own count is
        # on stderr too
        figures = json.loads(stdout.strip().splitlines()[-1])
        return parse_total(stderr, figures["worker_pid"])
    return parse_total(stderr)


def parse_section(dump: str) -> int:
    """The instructions of the measured section, from the text of its callgrind
    dump
    """
    totals = SUMMARY_RE.findall(dump)
    if SECTION_DESC not in dump or len(totals) != 1:
        head = "\n".join(dump.strip().splitlines()[:15])
        raise RuntimeError(f"Not the dump of a measured section:\n{head}")
    return int(totals[0])


def section_dump(out: str) -> str:
    """The text of the measured section's dump of a run whose callgrind file is
    ``out``; an error unless the run made exactly one (a script without the
    section, or with several)
    """
    dumps = glob.glob(glob.escape(out) + ".*")
    if len(dumps) != 1:
        raise RuntimeError(
            f"Expected the dump of one measured section next to {out}, found "
            f"{len(dumps)}: does the script mark one (_common.measured_section)?"
        )
    with open(dumps[0]) as f:
        return f.read()


def build_section_lib(directory: str) -> str:
    """Build section.c into a shared library in ``directory``; return its path.
    Exit if there is no C compiler, or no valgrind headers to build it with.
    """
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        sys.exit("--section needs a C compiler (Debian: apt-get install gcc)")
    lib = os.path.join(directory, "libsection.so")
    proc = subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-o", lib, str(HERE / "section.c")],
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        sys.exit(
            "Could not build section.c; it needs valgrind's headers "
            f"(valgrind/callgrind.h, in Debian's valgrind):\n{proc.stderr}"
        )
    return lib


def per_task(small: int, large: int, sizes: tuple[int, int]) -> float:
    """Instructions per task, from the totals at the two sizes"""
    return (large - small) / (sizes[1] - sizes[0])


def command(
    workload: str, valgrind: str, python: str, size: int, out: str | None = None
) -> list[str]:
    """The command line of one run; cachegrind reports on its stderr. With
    ``out``, callgrind counts the run instead, into that file, and its measured
    section into a dump of its own (``--section``; in-process workloads only).
    """
    if workload == "worker":
        if out is not None:
            raise ValueError("the worker workload has no measured section")
        # The script runs the worker under the prefix given after --
        script, extra = "worker_process.py", ["--", valgrind, *VALGRIND_ARGS]
    else:
        script, extra = "bench_trivial.py", TRIVIAL_ARGS[workload]
    tool = (
        VALGRIND_ARGS if out is None else [*SECTION_ARGS, f"--callgrind-out-file={out}"]
    )
    return [
        valgrind,
        *tool,
        python,
        str(HERE / script),
        "--size",
        str(size),
        *extra,
    ]


def start(
    workload: str,
    valgrind: str,
    python: str,
    size: int,
    cpu: int | None,
    out: str | None = None,
    lib: str | None = None,
) -> subprocess.Popen:
    """Start a run of ``workload``, pinned to ``cpu`` if given (the worker's process
    inherits it). With ``out`` and ``lib`` (``--section``), under callgrind, into
    ``out``, the script marking its measured section with the library ``lib``.
    """

    def pin() -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})

    env = child_env()
    if lib is not None:
        env[SECTION_LIB_VAR] = lib
    return subprocess.Popen(
        command(workload, valgrind, python, size, out),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=HERE,
        preexec_fn=pin,
    )


def run_both(
    workload: str,
    valgrind: str,
    pythons: dict[str, str],
    size: int,
    cpus: list[int | None],
    outs: dict[str, str] | None = None,
    lib: str | None = None,
) -> dict[str, tuple[str, str]]:
    """Run both sides at the same time, with ``size`` tasks (and, with ``outs``
    and ``lib``, a measured section: see :func:`start`); their stdout and stderr.
    If one fails, the other is stopped, and this raises.
    """
    procs = {
        side: start(
            workload,
            valgrind,
            python,
            size,
            cpu,
            None if outs is None else outs[side],
            lib,
        )
        for (side, python), cpu in zip(pythons.items(), cpus)
    }
    results = {}
    try:
        for side, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=TIMEOUT)
            if proc.returncode:
                tail = "\n".join(stderr.strip().splitlines()[-15:])
                raise RuntimeError(f"{side} exited with {proc.returncode}:\n{tail}")
            results[side] = (stdout, stderr)
    finally:
        # Don't leave the other side running when one fails
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@dataclass(frozen=True)
class Section:
    """What the runs of ``--section`` need: the library built from section.c
    (:func:`build_section_lib`), and a directory for callgrind's files
    """

    lib: str
    directory: str


def run_pair(
    workload: str,
    valgrind: str,
    pythons: dict[str, str],
    sizes: tuple[int, int],
    cpus: list[int | None],
    section: Section | None = None,
) -> dict[str, float]:
    """Instructions per task of each side, both sides running at the same time:
    from a run at each size; or, with ``section`` (``--section``), from the
    measured section of a run at the larger size
    """
    if section is not None:
        size = sizes[1]
        directory = tempfile.mkdtemp(dir=section.directory)
        outs = {side: os.path.join(directory, f"{side}.out") for side in pythons}
        run_both(workload, valgrind, pythons, size, cpus, outs, section.lib)
        return {
            side: parse_section(section_dump(out)) / size for side, out in outs.items()
        }
    totals: dict[str, list[int]] = {side: [] for side in pythons}
    for size in sizes:
        results = run_both(workload, valgrind, pythons, size, cpus)
        for side, (stdout, stderr) in results.items():
            totals[side].append(count(workload, stdout, stderr))
    return {side: per_task(t[0], t[1], sizes) for side, t in totals.items()}


def pair_cpus(i: int) -> list[int | None]:
    """CPUs of the fork and pristine in the ``i``-th pair: the first two we may
    use, swapped every other pair; None where affinity cannot be set
    """
    if not hasattr(os, "sched_getaffinity"):
        return [None, None]
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return [allowed[0], allowed[0]]
    first, second = allowed[:2]
    return [first, second] if i % 2 == 0 else [second, first]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Instructions per trivial task, fork against pristine"
    )
    add_interpreter_arguments(parser)
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default=WORKLOADS[0],
        help="what to count: the whole in-process cluster, queuing off or at its "
        "default, or the worker alone (default: trivial)",
    )
    parser.add_argument(
        "--sizes",
        type=int,
        nargs=2,
        default=(200, 1700),
        metavar=("SMALL", "LARGE"),
        help="numbers of tasks of the two runs of each side (default: 200 1700)",
    )
    parser.add_argument(
        "--pairs", type=int, default=2, help="pairs of runs (default: 2)"
    )
    parser.add_argument(
        "--section",
        action="store_true",
        help="count only the tasks, from submission until every one is done, "
        "with callgrind, in one run of the larger of --sizes per side (the "
        "smaller is not run; in-process workloads only; needs a C compiler and "
        "valgrind's headers)",
    )
    args = parser.parse_args(argv)
    if not 0 < args.sizes[0] < args.sizes[1]:
        parser.error("--sizes must be two increasing positive numbers")
    if args.pairs < 1:
        parser.error("--pairs must be positive")
    if args.section and args.workload == "worker":
        parser.error("--section counts the in-process workloads only")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        sys.exit("valgrind is not installed (Debian: apt-get install valgrind)")
    pythons = interpreters(args)
    sizes = tuple(args.sizes)
    with contextlib.ExitStack() as stack:
        section = None
        if args.section:
            directory = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="bench-section-")
            )
            section = Section(build_section_lib(directory), directory)
        return report(args, valgrind, pythons, sizes, section)


def report(
    args: argparse.Namespace,
    valgrind: str,
    pythons: dict[str, str],
    sizes: tuple[int, int],
    section: Section | None,
) -> int:
    """Run the pairs, print a line each and the median ratio; the exit status"""
    ratios = []
    method = " (measured section)" if section is not None else ""
    print(f"Workload: {args.workload}{method}")
    print(f"{'pair':>4}  {'fork':>12}  {'pristine':>12}  {'ratio':>6}")
    for i in range(args.pairs):
        try:
            counts = run_pair(
                args.workload, valgrind, pythons, sizes, pair_cpus(i), section
            )
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"Pair {i + 1} failed: {e}", file=sys.stderr)
            return 1
        ratio = counts["fork"] / counts["pristine"]
        ratios.append(ratio)
        print(
            f"{i + 1:>4}  {counts['fork']:>12,.0f}  {counts['pristine']:>12,.0f}"
            f"  {ratio:>6.3f}",
            flush=True,
        )
    median = statistics.median(ratios)
    print(f"Instructions per task, fork / pristine: median {median:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
