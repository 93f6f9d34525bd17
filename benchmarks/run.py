"""Run the benchmarks in the fork and in pristine distributed, side by side.

Usage::

    python benchmarks/run.py --fork PYTHON_A --pristine PYTHON_B [--quick]
        [--only NAME[,NAME...]] [--rounds N] [--out build/bench] [--no-pin]

``PYTHON_A`` and ``PYTHON_B`` are the python executables of two environments, one
with the fork installed and one with pristine distributed 2023.3.1. Each workload
script (``bench_NAME.py`` beside this file, some with arguments: see
``WORKLOADS``) runs in a fresh subprocess of each interpreter in turn, A B A B,
for a few rounds after a warm-up; the runner prints the median, min-max spread
and fork/pristine ratio of every figure (of the medians, and the median of each
round's ratio), checks the targets, and writes all raw numbers as JSON under
``--out``. Each script runs pinned to one CPU (see
:func:`run_script`). docs/benchmarks.rst says more.

Only the standard library is used here, so that any python can run this.
Exit status: 0 if every run succeeded (whether targets were met or not), 1 if any
run failed, 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Union

HERE = Path(__file__).resolve().parent
SIDES = ("fork", "pristine")
MODES = ("full", "quick", "tiny")
#: Unmeasured runs of each workload on each side before the measured rounds.
#: Quick mode relies on the one global warm-up that primes the interpreters.
WARMUPS = {"full": 1, "quick": 0, "tiny": 0}
#: Longest a single script may run before it counts as failed
TIMEOUT = 900

Figures = Dict[str, Union[int, float, None]]


@dataclass(frozen=True)
class Target:
    """What a figure must stay below: the fork's median, or the fork/pristine
    ratio of medians if ``ratio`` is set.
    """

    limit: float
    ratio: bool = False
    strict: bool = False

    def check(self, fork: float | None, ratio: float | None) -> bool | None:
        """True if met, False if missed, None if there is nothing to check"""
        value = ratio if self.ratio else fork
        if value is None:
            return None
        return value < self.limit if self.strict else value <= self.limit

    def __str__(self) -> str:
        op = "<" if self.strict else "<="
        return f"{'ratio ' if self.ratio else ''}{op} {self.limit:g}"


@dataclass(frozen=True)
class Workload:
    """A script ``bench_NAME.py`` and how much of it to run in each mode"""

    name: str
    #: ``--size`` in full, quick and tiny mode
    sizes: tuple[int, int, int]
    #: measured rounds in full, quick and tiny mode
    rounds: tuple[int, int, int]
    #: True if the figures exist in the fork only (not run in pristine)
    fork_only: bool = False
    #: False to skip the per-workload warm-up (long runs that warm themselves)
    warm_up: bool = True
    targets: dict[str, Target] = field(default_factory=dict)
    #: The script is ``bench_SCRIPT.py``, by default ``bench_NAME.py``
    script_name: str | None = None
    #: Arguments of the script besides ``--size``
    args: tuple[str, ...] = ()

    @property
    def script(self) -> Path:
        return HERE / f"bench_{self.script_name or self.name}.py"

    def size(self, mode: str) -> int:
        return self.sizes[MODES.index(mode)]

    def n_rounds(self, mode: str) -> int:
        return self.rounds[MODES.index(mode)]


CPU_RATIO = Target(1.02, ratio=True)
WORKLOADS = [
    Workload(
        "trivial",
        (20_000, 3_000, 200),
        (5, 3, 1),
        targets={"cpu_us_per_task": CPU_RATIO},
    ),
    # The same under the default configuration: queuing on, a round trip to the
    # scheduler for every task or two
    Workload(
        "trivial-default",
        (10_000, 2_000, 200),
        (5, 3, 1),
        targets={"cpu_us_per_task": CPU_RATIO},
        script_name="trivial",
        args=("--queuing",),
    ),
    Workload(
        "cluster",
        (20_000, 2_000, 200),
        (5, 3, 1),
        targets={
            "worker_cpu_us_per_task": CPU_RATIO,
            "scheduler_cpu_us_per_task": CPU_RATIO,
        },
    ),
    Workload(
        "transfer",
        (10_000, 1_000, 100),
        (5, 3, 1),
        targets={"worker_cpu_us_per_dep": CPU_RATIO},
    ),
    Workload(
        "spill",
        (1_000, 200, 20),
        (5, 3, 1),
        targets={"worker_cpu_us_per_task": CPU_RATIO},
    ),
    Workload(
        "micro",
        (200_000, 50_000, 1_000),
        (5, 3, 1),
        fork_only=True,
        targets={
            "digest_1cb_us": Target(0.4, strict=True),
            "meter_flat_us": Target(2.0, strict=True),
            "meter_nested3_us": Target(2.0, strict=True),
        },
    ),
    # What one delivery of fine metrics with the heartbeat costs the scheduler:
    # --size prefixes of 20 labels each, all changed. No target: docs/benchmarks.rst
    # says what it comes to for a cluster
    Workload(
        "delivery",
        (1_000, 1_000, 10),
        (5, 3, 1),
        fork_only=True,
    ),
    Workload(
        "memory",
        (100_000, 5_000, 500),
        (2, 1, 1),
        warm_up=False,
        targets={
            "rss_mib": Target(1.05, ratio=True),
            "callbacks_growth": Target(0),
            "ledgers_growth": Target(0),
        },
    ),
]
BY_NAME = {w.name: w for w in WORKLOADS}

#: Run in each interpreter to say what it is
PROBE = """\
import json, platform, sys
import distributed, distributed.metrics as m
print(json.dumps({
    "python": platform.python_version(),
    "executable": sys.executable,
    "distributed": distributed.__version__,
    "path": distributed.__file__,
    "fine_metrics": hasattr(m, "context_meter"),
}))
"""


def log(msg: str) -> None:
    """Progress goes to stderr, so that stdout holds the report only"""
    print(msg, file=sys.stderr, flush=True)


#: The environment variable that names the library built from section.c, with
#: which a script marks its measured section (``_common.measured_section``, which
#: reads it; ``instructions.py --section``, which sets it)
SECTION_LIB_VAR = "BENCH_SECTION_LIB"


def child_env() -> dict[str, str]:
    """Environment of the scripts: ours, without PYTHONPATH and without a library
    of a measured section.

    A PYTHONPATH inherited from the caller would put the same distributed in
    front of both environments and compare it with itself. Wrappers that need
    one set it themselves. A measured section is marked only where
    ``instructions.py --section`` asks for it.
    """
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop(SECTION_LIB_VAR, None)
    return env


def probe(python: str) -> dict[str, Any]:
    """Describe an interpreter and its distributed; exit if it has none"""
    try:
        proc = subprocess.run(
            [python, "-c", PROBE],
            capture_output=True,
            text=True,
            env=child_env(),
            # Not the caller's directory: ``python -c`` would look there first,
            # and a checkout has a distributed/ of its own
            cwd=HERE,
            timeout=120,
        )
    except OSError as e:
        sys.exit(f"Cannot run {python}: {e}")
    if proc.returncode:
        sys.exit(f"{python} cannot import distributed:\n{proc.stderr.strip()}")
    info: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return info


def machine() -> dict[str, Any]:
    """Cores, CPU model and OS of this machine"""
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu": model,
        "platform": platform.platform(),
        "runner_python": platform.python_version(),
    }


def pick_cpu() -> int | None:
    """The CPU to pin the scripts to: the last one we may use, as the first ones
    tend to take more interrupts; None where affinity cannot be set.
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    return max(os.sched_getaffinity(0))


def run_script(
    python: str, script: Path, size: int, cpu: int | None, args: Sequence[str] = ()
) -> Figures:
    """Run a workload script once, with ``args`` besides ``--size``, and return
    the figures it printed.

    If ``cpu`` is given, the script and every process it starts run on that CPU
    only. CPU time is then the cost of the work alone: spread over several cores,
    the same work costs 10-50% more or less from run to run, depending on how
    often threads and processes wake each other up across cores.

    Raises RuntimeError with the tail of its stderr if it fails.
    """

    def pin() -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})

    proc = subprocess.run(
        [python, str(script), "--size", str(size), *args],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=HERE,
        timeout=TIMEOUT,
        preexec_fn=pin,
    )
    for line in reversed(proc.stdout.splitlines()):
        if proc.returncode == 0 and line.startswith("{"):
            figures: Figures = json.loads(line)
            return figures
    tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
    raise RuntimeError(f"{script.name} exited with {proc.returncode}:\n{tail}")


def run_workload(
    w: Workload, pythons: dict[str, str], mode: str, rounds: int, cpu: int | None
) -> tuple[dict[str, list[Figures]], list[str]]:
    """Warm up, then run the measured rounds alternating the sides.

    Returns the figures of every measured run per side, and the errors. A failed
    run stops the workload, as the next ones would most likely fail the same way.
    """
    sides = SIDES[:1] if w.fork_only else SIDES
    size = w.size(mode)
    runs: dict[str, list[Figures]] = {side: [] for side in sides}
    warmups = WARMUPS[mode] if w.warm_up else 0
    schedule = [(0, side) for _ in range(warmups) for side in sides]
    schedule += [(r, side) for r in range(1, rounds + 1) for side in sides]
    for r, side in schedule:
        what = f"round {r}/{rounds}" if r else "warm-up"
        t0 = time.perf_counter()
        try:
            figures = run_script(pythons[side], w.script, size, cpu, w.args)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            log(f"  {w.name} {what} {side}: FAILED")
            return runs, [f"{side}: {e}"]
        log(f"  {w.name} {what} {side}: {time.perf_counter() - t0:.1f}s")
        if figures.get("applicable") is False:
            log(f"  {w.name} does not apply to {side}; skipped")
            return runs, []
        if r:
            runs[side].append(figures)
    return runs, []


def stats(values: list[float]) -> dict[str, float] | None:
    """Median, min and max, or None if there is nothing"""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def paired_ratio(runs: dict[str, list[Figures]], name: str) -> float | None:
    """Median over the rounds of fork / pristine, or None if there is no pair.

    The two runs of a round are adjacent in time, so this is less sensitive than
    the ratio of medians to a machine whose speed drifts during the benchmark.
    """
    ratios = [
        f[name] / p[name]
        for f, p in zip(runs.get("fork", []), runs.get("pristine", []))
        if isinstance(f.get(name), (int, float))
        and isinstance(p.get(name), (int, float))
        and p[name]
    ]
    return statistics.median(ratios) if ratios else None


def summarize(w: Workload, runs: dict[str, list[Figures]]) -> list[dict[str, Any]]:
    """One row per figure: stats per side, ratio of medians, median of the ratios
    of each round, target check (on the ratio of medians)
    """
    names: list[str] = []
    for side_runs in runs.values():
        for figures in side_runs:
            names += [n for n in figures if n not in names]
    # A target whose figure never came is reported, not forgotten
    names += [n for n in w.targets if n not in names]
    rows = []
    for name in names:
        row: dict[str, Any] = {"workload": w.name, "figure": name}
        for side in SIDES:
            values = [
                f[name]
                for f in runs.get(side, [])
                if isinstance(f.get(name), (int, float))
            ]
            row[side] = stats(values)  # type: ignore[arg-type]
        fork = row["fork"]["median"] if row["fork"] else None
        pristine = row["pristine"]["median"] if row["pristine"] else None
        ratio = fork / pristine if fork is not None and pristine else None
        row["ratio"] = ratio
        row["paired"] = paired_ratio(runs, name)
        target = w.targets.get(name)
        row["target"] = str(target) if target else None
        row["met"] = target.check(fork, ratio) if target else None
        rows.append(row)
    return rows


def fmt(value: float | None) -> str:
    """A number in 4 significant digits, ints as ints"""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if float(value).is_integer() and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.4g}"


def table(rows: list[dict[str, Any]]) -> str:
    """The report as an reStructuredText simple table (readable as plain text)"""
    header = [
        "workload",
        "figure",
        "fork",
        "fork min..max",
        "pristine",
        "pristine min..max",
        "ratio",
        "paired",
        "target",
        "",
    ]
    cells = [header]
    for row in rows:
        line = [row["workload"], row["figure"]]
        for side in SIDES:
            s = row[side]
            line += (
                [fmt(s["median"]), f"{fmt(s['min'])}..{fmt(s['max'])}"]
                if s
                else ["n/a", ""]
            )
        for col in ("ratio", "paired"):
            line.append(f"{row[col]:.3f}" if row[col] is not None else "n/a")
        line.append(row["target"] or "")
        line.append({True: "ok", False: "MISS", None: ""}[row["met"]])
        if row["target"] and row["met"] is None:
            line[-1] = "?"
        cells.append(line)
    widths = [max(len(line[i]) for line in cells) or 1 for i in range(len(header))]
    rule = "  ".join("=" * w for w in widths)

    def render(line: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()

    return "\n".join([rule, render(header), rule, *map(render, cells[1:]), rule])


def verdict(rows: list[dict[str, Any]], errors: dict[str, list[str]]) -> str:
    """Closing lines: what missed its target, what could not be checked or run"""
    lines = []
    for row in rows:
        name = f"{row['workload']}.{row['figure']}"
        if row["met"] is False:
            lines.append(f"MISSED {name}: target {row['target']}")
        elif row["target"] and row["met"] is None:
            lines.append(f"NOT MEASURED {name}: target {row['target']}")
    for name, errs in errors.items():
        lines += [f"FAILED {name}: {e.splitlines()[0]}" for e in errs]
    return "\n".join(lines) if lines else "All targets met."


def add_interpreter_arguments(parser: argparse.ArgumentParser) -> None:
    """``--fork`` and ``--pristine``: the python of each environment"""
    parser.add_argument("--fork", required=True, help="python of the fork's env")
    parser.add_argument("--pristine", required=True, help="python of pristine's env")


def interpreters(args: argparse.Namespace) -> dict[str, str]:
    """``{"fork": python, "pristine": python}`` from the parsed arguments.

    The scripts run from benchmarks/: paths to the interpreters are made absolute,
    while bare names are left for the PATH to resolve.
    """
    return {
        side: os.path.abspath(exe) if os.sep in exe else exe
        for side, exe in (("fork", args.fork), ("pristine", args.pristine))
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark the fork against pristine distributed, interleaved."
    )
    add_interpreter_arguments(parser)
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, fewer rounds (< 2 min)"
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="NAME[,NAME]",
        help=f"run only these workloads, out of: {', '.join(BY_NAME)}",
    )
    parser.add_argument(
        "--out", default="build/bench", help="directory of the JSON results"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        metavar="N",
        help="measured rounds of every workload, instead of the mode's own",
    )
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="let the scripts use every CPU (noisier CPU figures)",
    )
    # For the smoke test: tiny sizes, one round, no warm-up
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = [n for opt in args.only or [] for n in opt.split(",") if n]
    unknown = sorted(set(names) - set(BY_NAME))
    if unknown:
        parser.error(f"unknown workload(s): {', '.join(unknown)}")
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be positive")
    args.workloads = [BY_NAME[n] for n in names] if names else WORKLOADS
    args.mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    return args


def check_interpreters(pythons: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Probe both sides, log what they are and warn about likely mistakes"""
    info = {side: probe(python) for side, python in pythons.items()}
    for side, i in info.items():
        log(f"{side}: Python {i['python']}, distributed {i['distributed']}")
        log(f"  at {i['path']}")
    if info["fork"]["path"] == info["pristine"]["path"]:
        log("WARNING: fork and pristine import the same distributed")
    if not info["fork"]["fine_metrics"]:
        log("WARNING: the fork has no distributed.metrics.context_meter")
    return info


def header(mode: str, started: float, host: dict[str, Any], info: Any) -> str:
    """First line of the report: when, where, with what"""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(started))
    pinned = host["pinned_to_cpu"]
    return (
        f"Benchmarks ({mode}) of {when}, {time.time() - started:.0f} s; "
        f"{host['cores']} cores, {host['cpu']}; "
        f"{'scripts pinned to one CPU' if pinned is not None else 'not pinned'}; "
        f"Python {info['fork']['python']} (fork), "
        f"{info['pristine']['python']} (pristine)"
    )


def write_results(out: Path, mode: str, started: float, doc: dict[str, Any]) -> Path:
    """Write the raw numbers to a timestamped file, latest.json and latest.txt"""
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    path = out / f"bench-{stamp}-{mode}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    shutil.copyfile(path, out / "latest.json")
    (out / "latest.txt").write_text(doc["report"] + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit status"""
    args = parse_args(argv)
    started = time.time()
    pythons = interpreters(args)
    host = machine()
    cpu = None if args.no_pin else pick_cpu()
    host["pinned_to_cpu"] = cpu
    log(f"Machine: {host['cores']} cores, {host['cpu']}, {host['platform']}")
    log(f"Scripts pinned to CPU {cpu}" if cpu is not None else "Scripts not pinned")
    info = check_interpreters(pythons)

    if WARMUPS[args.mode] == 0 and args.mode != "tiny":
        # Prime the interpreters (bytecode caches, file cache) once for all
        log("Global warm-up")
        for side in SIDES:
            try:
                run_script(pythons[side], BY_NAME["trivial"].script, 200, cpu)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                log(f"  {side} failed to warm up: {e}")

    results: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    errors: dict[str, list[str]] = {}
    for w in args.workloads:
        rounds = args.rounds or w.n_rounds(args.mode)
        log(f"{w.name}: size {w.size(args.mode)}, {rounds} rounds")
        runs, errs = run_workload(w, pythons, args.mode, rounds, cpu)
        summary = summarize(w, runs)
        rows += summary
        if errs:
            errors[w.name] = errs
        results[w.name] = {
            "size": w.size(args.mode),
            "rounds": rounds,
            "runs": runs,
            "errors": errs,
            "summary": summary,
        }

    report = "\n\n".join(
        [header(args.mode, started, host, info), table(rows), verdict(rows, errors)]
    )
    print(report, flush=True)
    doc = {
        "mode": args.mode,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": time.time() - started,
        "machine": host,
        "interpreters": info,
        "warmups": WARMUPS[args.mode],
        "workloads": results,
        "report": report,
    }
    path = write_results(Path(args.out), args.mode, started, doc)
    log(f"Raw numbers: {path} (and latest.json, latest.txt beside it)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
