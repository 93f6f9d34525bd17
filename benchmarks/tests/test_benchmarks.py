"""Smoke test of the benchmark scripts and their runner.

Each script runs once with a tiny size under the interpreter running the tests,
and must print the figures it documents, with sane values. Nothing here asserts
on timings: speed is what the benchmarks report, not what the tests check.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import pytest

import dask
import distributed.metrics
from distributed import Client, LocalCluster

BENCH = Path(__file__).resolve().parent.parent
#: Figures of each workload of the runner, and the tiny size to run it with
FIGURES = {
    "trivial": ({"tasks_per_s", "cpu_us_per_task"}, 200),
    "trivial-default": ({"tasks_per_s", "cpu_us_per_task"}, 200),
    "cluster": (
        {
            "worker_cpu_us_per_task",
            "scheduler_cpu_us_per_task",
            "wall_s",
            "tasks_per_s",
        },
        200,
    ),
    "transfer": ({"worker_cpu_us_per_dep", "wall_s"}, 100),
    "spill": ({"worker_cpu_us_per_task", "wall_s", "spilled_fraction"}, 20),
    "micro": (
        {
            "digest_0cb_us",
            "digest_1cb_us",
            "digest_3cb_us",
            "meter_flat_us",
            "meter_nested3_us",
            "ledger_us",
        },
        1000,
    ),
    "delivery": (
        {"deliver_us", "deliver_us_per_key", "collect_us", "delivery_bytes", "keys"},
        10,
    ),
    "memory": (
        {"rss_mib", "rss_growth_mib", "callbacks_growth", "ledgers_growth"},
        500,
    ),
}
#: Workloads whose scripts print ``{"applicable": false}`` in pristine
FORK_ONLY = {"micro", "delivery"}
#: Figures that may be zero or negative
SIGNED = {"rss_growth_mib", "callbacks_growth", "ledgers_growth"}
HAS_FINE_METRICS = hasattr(distributed.metrics, "context_meter")


def child_env() -> dict[str, str]:
    """Make the scripts import the same distributed as this test does, even when
    it is found through the current directory rather than PYTHONPATH
    """
    env = dict(os.environ)
    root = str(Path(distributed.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def run_script(script: Path, size: int, *args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(script), "--size", str(size), *args],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert isinstance(figures, dict)
    return figures


@pytest.mark.parametrize("name", list(FIGURES))
def test_script(name: str, runner: ModuleType) -> None:
    """Each workload's script, with its arguments, as the runner runs it"""
    expected, size = FIGURES[name]
    w = runner.BY_NAME[name]
    figures = run_script(w.script, size, *w.args)
    if name in FORK_ONLY and not HAS_FINE_METRICS:
        assert figures == {"applicable": False}
        return
    assert set(figures) == expected
    for figure, value in figures.items():
        if value is None:
            # Only the fork's own state may be unknown, and only in pristine
            assert figure in {"callbacks_growth", "ledgers_growth"}
            assert not HAS_FINE_METRICS
            continue
        assert isinstance(value, (int, float)) and not isinstance(value, bool)
        assert math.isfinite(value), figure
        if figure not in SIGNED:
            assert value > 0, figure
    if name == "spill":
        assert figures["spilled_fraction"] <= 1
    if name == "delivery":
        # 20 labels for each of the --size prefixes, every one of them delivered
        assert figures["keys"] == 20 * size
        assert figures["deliver_us_per_key"] == pytest.approx(
            figures["deliver_us"] / figures["keys"]
        )
        # A key and its value take a few dozen bytes
        assert 20 * figures["keys"] < figures["delivery_bytes"] < 200 * figures["keys"]
    if name == "memory" and HAS_FINE_METRICS:
        assert isinstance(figures["callbacks_growth"], int)
        assert isinstance(figures["ledgers_growth"], int)


def run_worker_process(*prefix: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / "worker_process.py"), "--size", "50", *prefix],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=240,
    )


def test_worker_process(tmp_path: Path) -> None:
    """The worker runs under the prefix, in a process of its own, and exits
    normally once the tasks are done
    """
    log = tmp_path / "argv"
    prefix = tmp_path / "prefix"
    prefix.write_text(f'#!/bin/sh\necho "$@" > "{log}"\nexec "$@"\n')
    prefix.chmod(0o755)
    proc = run_worker_process("--", str(prefix))
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(figures) == {"wall_s", "tasks_per_s", "worker_pid"}
    assert all(value > 0 for value in figures.values())
    assert isinstance(figures["worker_pid"], int)
    assert figures["worker_pid"] != os.getpid()
    argv = log.read_text().split()
    assert argv[:3] == [sys.executable, "-m", "distributed.cli.dask_worker"]
    assert "--no-nanny" in argv
    assert "End worker" in proc.stderr


@pytest.mark.parametrize("args", [["--quiet"], ["--quiet", "--queuing"]])
def test_script_trivial_options(args: list[str]) -> None:
    figures = run_script(BENCH / "bench_trivial.py", 50, *args)
    assert set(figures) == FIGURES["trivial"][0]


def test_workloads_and_scripts(runner: ModuleType) -> None:
    """Every workload is tested above, and trivial-default is trivial with queuing
    at its default
    """
    assert list(FIGURES) == list(runner.BY_NAME)
    assert all(w.script.exists() for w in runner.WORKLOADS)
    default = runner.BY_NAME["trivial-default"]
    assert default.script == runner.BY_NAME["trivial"].script
    assert default.args == ("--queuing",)
    assert runner.BY_NAME["trivial"].args == ()


@pytest.fixture
def common() -> Iterator[ModuleType]:
    """_common.py and worker_process.py, imported as the scripts import them"""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("_common")
    finally:
        sys.path.remove(str(BENCH))


class FakeSectionLib:
    """Stands for the library built from section.c: records its calls"""

    def __init__(self, path: str, calls: list[str]):
        calls.append(f"load {path}")
        self.calls = calls

    def section_start(self) -> None:
        self.calls.append("start")

    def section_stop(self) -> None:
        self.calls.append("stop")


def test_measured_section(common: ModuleType, monkeypatch) -> None:
    """Without the library, the section does nothing; with it, it is marked at both
    ends, also when the block raises
    """
    calls: list[str] = []
    monkeypatch.setattr(common.ctypes, "CDLL", lambda path: FakeSectionLib(path, calls))
    monkeypatch.delenv(common.SECTION_LIB_VAR, raising=False)
    with common.measured_section():
        calls.append("block")
    assert calls == ["block"]

    calls.clear()
    monkeypatch.setenv(common.SECTION_LIB_VAR, "/tmp/libsection.so")
    with pytest.raises(ZeroDivisionError):
        with common.measured_section():
            calls.append("block")
            1 / 0
    assert calls == ["load /tmp/libsection.so", "start", "block", "stop"]


# Upstream's synchronous LocalCluster, under tornado 6.2
@pytest.mark.filterwarnings("ignore:make_current is deprecated:DeprecationWarning")
def test_quiet_cluster(common: ModuleType) -> None:
    """Under QUIET_CONFIG, and once stop_periodic_callbacks has run, a cluster has
    no profiler and no periodic callback running, and still runs tasks
    """
    with dask.config.set(common.QUIET_CONFIG), LocalCluster(
        n_workers=1, processes=False, dashboard_address=None
    ) as lc, Client(lc) as client:
        (w,) = lc.workers.values()
        assert w.periodic_callbacks["heartbeat"].is_running()
        assert "profile" not in w.periodic_callbacks
        assert lc.scheduler.worker_ttl is None

        client.run(common.stop_periodic_callbacks)
        client.run_on_scheduler(common.stop_periodic_callbacks)
        for server in (w, lc.scheduler):
            assert server.periodic_callbacks
            assert not any(pc.is_running() for pc in server.periodic_callbacks.values())
        assert client.submit(common.noop, 1).result() == 1


# Upstream's synchronous LocalCluster, under tornado 6.2
@pytest.mark.filterwarnings("ignore:make_current is deprecated:DeprecationWarning")
@pytest.mark.parametrize("queuing", [False, True])
def test_cluster_queuing(common: ModuleType, queuing: bool) -> None:
    """cluster() turns queuing off, unless asked to leave it at its default"""
    default = dask.config.get("distributed.scheduler.worker-saturation")
    assert default != float("inf")
    with common.cluster(1, processes=False, queuing=queuing) as client:
        saturation = client.run_on_scheduler(get_worker_saturation)
        assert client.submit(common.noop, 1).result() == 1
    assert saturation == (default if queuing else float("inf"))
    assert common.queuing_config(queuing) == (
        {} if queuing else {"distributed.scheduler.worker-saturation": float("inf")}
    )


def test_cluster_own_scheduler(common: ModuleType) -> None:
    """The scheduler, the workers and the client run in three kinds of processes;
    the config reaches the scheduler and the workers, whose heartbeats stay on;
    the processes are gone afterwards
    """
    with common.cluster_own_scheduler(2, config={"test-benchmarks": 1}) as client:
        scheduler = common.scheduler_pid(client)
        workers = common.worker_pids(client)
        assert client.submit(common.noop, 1).result() == 1
        # Lambdas, which cloudpickle sends by value: the processes of the cluster
        # cannot import this module
        saturation = client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.WORKER_SATURATION
        )
        heartbeats = client.run(
            lambda dask_worker: dask_worker.periodic_callbacks["heartbeat"].is_running()
        )
        config = client.run(dask.config.get, "test-benchmarks")
        assert common.cpu_seconds([scheduler]) > 0
    assert len(set(workers)) == 2
    assert len({os.getpid(), scheduler, *workers}) == 4
    assert saturation == float("inf")
    assert list(heartbeats.values()) == [True, True]
    assert list(config.values()) == [1, 1]
    assert not psutil.pid_exists(scheduler)


def get_worker_saturation(dask_scheduler: Any) -> float:
    saturation: float = dask_scheduler.WORKER_SATURATION
    return saturation


def test_worker_process_passes_config_on(common: ModuleType) -> None:
    """The worker of worker_process.py inherits the config of the script"""
    worker_process = importlib.import_module("worker_process")
    with dask.config.set(common.QUIET_CONFIG):
        env = worker_process.worker_env()
    config = dask.config.deserialize(env["DASK_INTERNAL_INHERIT_CONFIG"])
    assert config["distributed"]["worker"]["profile"]["enabled"] is False
    assert str(BENCH) in env["PYTHONPATH"].split(os.pathsep)


def test_worker_process_worker_fails() -> None:
    proc = run_worker_process("--", "false")
    assert proc.returncode != 0
    assert "The worker exited with 1" in proc.stderr


@pytest.fixture
def python(tmp_path: Path) -> str:
    """This interpreter, behind a wrapper that sets its own PYTHONPATH, since the
    runner does not pass its own on
    """
    wrapper = tmp_path / "python"
    pythonpath = child_env()["PYTHONPATH"]
    wrapper.write_text(
        f'#!/bin/sh\nPYTHONPATH="{pythonpath}" exec "{sys.executable}" "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


def run_runner(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / "run.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.skipif(sys.platform == "win32", reason="shell wrapper")
def test_runner(python: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_runner(
        "--fork",
        python,
        "--pristine",
        python,
        "--tiny",
        "--only",
        "trivial,trivial-default,micro",
        "--rounds",
        "2",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert "cpu_us_per_task" in proc.stdout
    assert "ratio <= 1.02" in proc.stdout

    doc = json.loads((out / "latest.json").read_text())
    assert doc["mode"] == "tiny"
    assert doc["machine"]["cores"] >= 1
    assert (out / "latest.txt").read_text().strip() == doc["report"]
    assert len(list(out.glob("bench-*-tiny.json"))) == 1

    trivial = doc["workloads"]["trivial"]
    assert trivial["errors"] == []
    assert [len(trivial["runs"][side]) for side in ("fork", "pristine")] == [2, 2]
    row = next(r for r in trivial["summary"] if r["figure"] == "cpu_us_per_task")
    assert row["ratio"] == row["fork"]["median"] / row["pristine"]["median"]
    assert row["met"] in (True, False)
    default = doc["workloads"]["trivial-default"]
    assert default["errors"] == []
    assert [len(default["runs"][side]) for side in ("fork", "pristine")] == [2, 2]
    # The micro workload never runs in pristine
    assert list(doc["workloads"]["micro"]["runs"]) == ["fork"]


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="shell wrapper")
def test_runner_all(python: str, tmp_path: Path) -> None:
    proc = run_runner(
        "--fork", python, "--pristine", python, "--tiny", "--out", str(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "latest.json").read_text())
    assert list(doc["workloads"]) == list(FIGURES)
    assert all(not w["errors"] for w in doc["workloads"].values())


@pytest.mark.skipif(sys.platform == "win32", reason="shell wrapper")
def test_runner_cluster_and_delivery(
    python: str, tmp_path: Path, runner: ModuleType
) -> None:
    """The scheduler's CPU has its target in the cluster workload; the delivery
    workload runs in the fork only, and has no target
    """
    out = tmp_path / "out"
    proc = run_runner(
        *("--fork", python, "--pristine", python, "--tiny"),
        *("--only", "cluster,delivery", "--rounds", "1", "--out", str(out)),
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((out / "latest.json").read_text())
    assert list(doc["workloads"]) == ["cluster", "delivery"]
    cluster = doc["workloads"]["cluster"]
    assert cluster["errors"] == []
    rows = {r["figure"]: r for r in cluster["summary"]}
    for figure in ("worker_cpu_us_per_task", "scheduler_cpu_us_per_task"):
        assert rows[figure]["target"] == "ratio <= 1.02"
        assert rows[figure]["met"] in (True, False)
    assert runner.BY_NAME["cluster"].targets == {
        "worker_cpu_us_per_task": runner.CPU_RATIO,
        "scheduler_cpu_us_per_task": runner.CPU_RATIO,
    }

    delivery = doc["workloads"]["delivery"]
    assert delivery["errors"] == []
    assert list(delivery["runs"]) == ["fork"]
    assert runner.BY_NAME["delivery"].fork_only
    assert runner.BY_NAME["delivery"].targets == {}
    rows = {r["figure"]: r for r in delivery["summary"]}
    assert set(rows) == FIGURES["delivery"][0]
    assert all(r["pristine"] is None and r["ratio"] is None for r in rows.values())
    assert rows["keys"]["fork"]["median"] == 20 * runner.BY_NAME["delivery"].size(
        "tiny"
    )
    assert "deliver_us_per_key" in proc.stdout


def test_runner_bad_arguments(python: str, tmp_path: Path) -> None:
    proc = run_runner("--fork", "x", "--pristine", "y", "--only", "nosuch")
    assert proc.returncode == 2
    assert "unknown workload(s): nosuch" in proc.stderr

    proc = run_runner(
        "--fork",
        python,
        "--pristine",
        "/nonexistent/python",
        "--out",
        str(tmp_path / "out"),
    )
    assert proc.returncode == 1
    assert "Cannot run /nonexistent/python" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def runner() -> ModuleType:
    """run.py imported as a module, for its pure functions"""
    spec = importlib.util.spec_from_file_location("bench_run", BENCH / "run.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_section_lib_var(runner: ModuleType, common: ModuleType) -> None:
    """The scripts read the variable that the drivers set"""
    assert common.SECTION_LIB_VAR == runner.SECTION_LIB_VAR


def test_child_env_drops_the_section_lib(runner: ModuleType, monkeypatch) -> None:
    monkeypatch.setenv(runner.SECTION_LIB_VAR, "/gone/libsection.so")
    monkeypatch.setenv("BENCH_SOMETHING_ELSE", "kept")
    env = runner.child_env()
    assert runner.SECTION_LIB_VAR not in env
    assert env["BENCH_SOMETHING_ELSE"] == "kept"


def test_target(runner: ModuleType) -> None:
    strict = runner.Target(0.4, strict=True)
    assert str(strict) == "< 0.4"
    assert strict.check(0.39, None) is True
    assert strict.check(0.4, None) is False
    assert strict.check(None, 1.0) is None

    ratio = runner.Target(1.02, ratio=True)
    assert str(ratio) == "ratio <= 1.02"
    assert ratio.check(100.0, 1.02) is True
    assert ratio.check(1.0, 1.03) is False
    assert ratio.check(1.0, None) is None


def test_summarize_and_table(runner: ModuleType) -> None:
    w = runner.Workload(
        "memory",
        (1, 1, 1),
        (1, 1, 1),
        targets={
            "rss_mib": runner.Target(1.05, ratio=True),
            "ledgers_growth": runner.Target(0),
        },
    )
    runs = {
        "fork": [
            {"rss_mib": 110, "ledgers_growth": 0},
            {"rss_mib": 90, "ledgers_growth": 2},
        ],
        "pristine": [{"rss_mib": 100, "ledgers_growth": None}],
    }
    rows = runner.summarize(w, runs)
    rss, ledgers = rows
    assert rss["fork"] == {"median": 100, "min": 90, "max": 110}
    assert rss["ratio"] == 1.0
    # Only the first round has both sides
    assert rss["paired"] == 1.1
    assert rss["met"] is True
    assert ledgers["pristine"] is None
    assert ledgers["ratio"] is None
    assert ledgers["paired"] is None
    assert ledgers["met"] is False  # median of 0 and 2 is 1

    text = runner.table(rows)
    assert "90..110" in text
    assert "MISS" in text
    assert "MISSED memory.ledgers_growth" in runner.verdict(rows, {})


def test_paired_ratio(runner: ModuleType) -> None:
    """The median of each round's ratio cancels a drift that the ratio of medians
    does not see
    """
    # The fork costs 10% more, but pristine's last run hit a slow spell
    runs = {
        "fork": [{"cpu": 110}, {"cpu": 220}, {"cpu": 150}],
        "pristine": [{"cpu": 100}, {"cpu": 200}, {"cpu": 300}],
    }
    assert runner.paired_ratio(runs, "cpu") == pytest.approx(1.1)
    assert runner.summarize(runner.Workload("w", (1, 1, 1), (3, 3, 3)), runs)[0][
        "ratio"
    ] == pytest.approx(0.75)
    assert runner.paired_ratio(runs, "missing") is None
    assert runner.paired_ratio({"fork": runs["fork"]}, "cpu") is None
    # Pairs with a zero or missing pristine figure are left out
    runs["pristine"][0]["cpu"] = 0
    runs["pristine"][2]["cpu"] = None
    assert runner.paired_ratio(runs, "cpu") == pytest.approx(1.1)


def test_summarize_missing_figure(runner: ModuleType) -> None:
    """A target whose figure no run produced shows up as not measured"""
    w = runner.Workload(
        "micro", (1, 1, 1), (1, 1, 1), targets={"meter_flat_us": runner.Target(2.0)}
    )
    (row,) = runner.summarize(w, {"fork": []})
    assert row["figure"] == "meter_flat_us"
    assert row["fork"] is None
    assert row["met"] is None
    assert "NOT MEASURED micro.meter_flat_us" in runner.verdict([row], {})
