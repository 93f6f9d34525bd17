"""Command line: ``python tools/upstream_tests.py COMMAND``; see ``make test-upstream``.

``run`` runs upstream's suite (the given modules of it) in one environment and
prints a summary ending in the unexpected failures and passes, by test id.
``summary`` prints that summary again from a run's report, against the list as
it is now; ``compare`` lists the tests whose outcome differs between two runs.

Exit status of ``run``: 0 if every test did as expected, 1 otherwise; 0 with a
message if the archive is absent, unless ``CI`` is set, where absence fails.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from upstreamtests.expected import SIDES, ListError, load
from upstreamtests.harness import (
    HarnessError,
    Run,
    compare,
    counts,
    format_counts,
    in_ci,
    read_report,
    summarize,
)

REPO = Path(__file__).resolve().parents[2]
EXPECTED = REPO / "continuous_integration/upstream-tests-expected.txt"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after a lone "--" goes to pytest as it is.
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(prog="upstream_tests", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the suite against one environment")
    run.add_argument("--side", choices=SIDES, required=True)
    run.add_argument("--python", required=True, help="the environment's python")
    run.add_argument("--archive", type=Path, required=True)
    run.add_argument("--out", type=Path, required=True, help="run folder")
    run.add_argument("--expected", type=Path, default=EXPECTED)
    run.add_argument("--timeout", type=int, default=300, help="per test, seconds")
    run.add_argument(
        "--import-mode", choices=("prepend", "importlib"), default="prepend"
    )
    run.add_argument("modules", nargs="+", help="paths (or test ids) in the suite")
    summ = sub.add_parser("summary", help="summarize a run's report again")
    summ.add_argument("report", type=Path, help="the run's report.json")
    summ.add_argument("--expected", type=Path, default=EXPECTED)
    cmp = sub.add_parser("compare", help="tests whose outcome differs")
    cmp.add_argument("fork", type=Path, help="the fork's report.json")
    cmp.add_argument("pristine", type=Path, help="pristine's report.json")
    args = parser.parse_args(argv)
    try:
        if args.command == "compare":
            return _compare(args.fork, args.pristine)
        if args.command == "summary":
            report = read_report(args.report)
            return summarize(report, load(args.expected), args.expected)
        return _run(args, extra)
    except (HarnessError, ListError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    if not args.archive.is_file():
        msg = f"upstream test archive not found: {args.archive} (set UPSTREAM_TESTS)"
        if in_ci():
            print(f"error: {msg}; CI needs it", file=sys.stderr)
            return 1
        print(f"SKIPPED upstream tests: {msg}")
        return 0
    # pytest runs in a folder of its own: make the paths absolute (a venv's
    # python keeps its symlink, which is what makes it the venv's).
    python = os.path.abspath(args.python) if os.sep in args.python else args.python
    run = Run(
        side=args.side,
        python=python,
        archive=args.archive.absolute(),
        out=args.out.absolute(),
        expected=args.expected.absolute(),
        modules=args.modules,
        timeout=args.timeout,
        import_mode=args.import_mode,
        pytest_args=extra,
    )
    rc = run.execute()
    report = read_report(run.report)
    failed = summarize(report, load(args.expected), args.expected)
    if rc and not failed:
        print(f"pytest exited {rc}: see {run.log}")
    return 1 if rc or failed else 0


def _compare(fork_path: Path, pristine_path: Path) -> int:
    fork, pristine = read_report(fork_path), read_report(pristine_path)
    lines = compare(fork, pristine)
    print(f"fork:     {format_counts(counts(fork))}")
    print(f"pristine: {format_counts(counts(pristine))}")
    print(f"{len(lines)} tests differ:")
    for line in lines:
        print(f"  {line}")
    return 0
