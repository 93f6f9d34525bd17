"""Instructions per trivial task of the fork and of pristine, counted by cachegrind.

CPU time on a shared virtual machine moves by tens of percent from one run to
the next, which hides a 2% difference under any practical number of rounds.
Instruction counts do not move like that: pristine against itself comes out
within 0.5%. This runs ``bench_trivial.py`` (scheduler, worker and client in one
process) under ``valgrind --tool=cachegrind --cache-sim=no`` at two sizes, and
takes the difference of the two totals divided by the difference of the sizes,
so that start-up and shutdown cancel out.

Each pair runs the fork and pristine at the same time, one on each of the first
two CPUs (swapped from one pair to the next), small size first. A run takes
about a minute per thousand tasks. The kernel's work (system calls, thread
switches) is not counted, and everything runs some 30 times slower than usual,
so that whatever the event loop does per unit of time (batched sends, periodic
callbacks) weighs more than in a real worker: treat the ratio as an upper bound
of the fork's extra CPU.

Usage::

    python benchmarks/instructions.py --fork PYTHON_A --pristine PYTHON_B
        [--sizes 200 1700] [--pairs 2]

Exit status: 0 if every run succeeded, 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
from collections.abc import Sequence

from run import HERE, TIMEOUT, add_interpreter_arguments, child_env, interpreters

SCRIPT = HERE / "bench_trivial.py"
#: The total that cachegrind prints on stderr at exit
TOTAL_RE = re.compile(r"^==\d+== I\s+refs:\s+([\d,]+)\s*$", re.MULTILINE)


def parse_total(stderr: str) -> int:
    """The number of instructions that cachegrind reported for the process"""
    totals = TOTAL_RE.findall(stderr)
    if len(totals) != 1:
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"No instruction count in the output of valgrind:\n{tail}")
    return int(totals[0].replace(",", ""))


def per_task(small: int, large: int, sizes: tuple[int, int]) -> float:
    """Instructions per task, from the totals at the two sizes"""
    return (large - small) / (sizes[1] - sizes[0])


def start(valgrind: str, python: str, size: int, cpu: int | None) -> subprocess.Popen:
    """Start ``bench_trivial.py`` under cachegrind, pinned to ``cpu`` if given"""

    def pin() -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})

    cmd = [
        valgrind,
        "--tool=cachegrind",
        "--cache-sim=no",
        "--cachegrind-out-file=/dev/null",
        python,
        str(SCRIPT),
        "--size",
        str(size),
    ]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        cwd=HERE,
        preexec_fn=pin,
    )


def run_pair(
    valgrind: str,
    pythons: dict[str, str],
    sizes: tuple[int, int],
    cpus: list[int | None],
) -> dict[str, float]:
    """Instructions per task of each side, both sides running at the same time"""
    totals: dict[str, list[int]] = {side: [] for side in pythons}
    for size in sizes:
        procs = {
            side: start(valgrind, python, size, cpu)
            for (side, python), cpu in zip(pythons.items(), cpus)
        }
        try:
            for side, proc in procs.items():
                _, stderr = proc.communicate(timeout=TIMEOUT)
                if proc.returncode:
                    tail = "\n".join(stderr.strip().splitlines()[-15:])
                    raise RuntimeError(f"{side} exited with {proc.returncode}:\n{tail}")
                totals[side].append(parse_total(stderr))
        finally:
            # Don't leave the other side running when one fails
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
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
    args = parser.parse_args(argv)
    if not 0 < args.sizes[0] < args.sizes[1]:
        parser.error("--sizes must be two increasing positive numbers")
    if args.pairs < 1:
        parser.error("--pairs must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        sys.exit("valgrind is not installed (Debian: apt-get install valgrind)")
    pythons = interpreters(args)
    sizes = tuple(args.sizes)
    ratios = []
    print(f"{'pair':>4}  {'fork':>12}  {'pristine':>12}  {'ratio':>6}")
    for i in range(args.pairs):
        try:
            counts = run_pair(valgrind, pythons, sizes, pair_cpus(i))
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
