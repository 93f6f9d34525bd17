"""Helpers shared by the benchmark scripts.

Every script in this directory runs alone (``python benchmarks/bench_X.py --size N``)
and prints exactly one JSON object of figures on its last line of stdout, which is
what ``benchmarks/run.py`` collects. The scripts must run unchanged against both the
fork and pristine distributed 2023.3.1, so anything that only exists in the fork is
feature-detected here.
"""
from __future__ import annotations

import argparse
import contextvars
import ctypes
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Union

import psutil

import dask
from distributed import Client, LocalCluster, worker_state_machine

#: What a figure may be: a number, or None where it does not apply (pristine)
FigureValue = Union[int, float, None]


#: Configuration under which a cluster does no work per unit of time, rather than
#: per task, once :func:`stop_periodic_callbacks` has run on its servers: no
#: statistical profiler (a thread that samples every 10 ms), and the scheduler does
#: not drop workers for missing heartbeats. Counting instructions runs everything
#: some 30 times slower, so that this work would weigh 30 times more than usual,
#: and vary with how fast the machine happens to be.
QUIET_CONFIG: dict[str, Any] = {
    "distributed.worker.profile.enabled": False,
    "distributed.scheduler.worker-ttl": None,
}


def stop_periodic_callbacks(
    dask_worker: Any = None, dask_scheduler: Any = None
) -> None:
    """Stop the periodic callbacks of a worker or of the scheduler (heartbeats,
    health checks, monitors: nothing that running tasks needs); meant for
    ``client.run`` and ``client.run_on_scheduler`` on a cluster under
    :data:`QUIET_CONFIG`
    """
    server = dask_worker if dask_worker is not None else dask_scheduler
    for pc in server.periodic_callbacks.values():
        pc.stop()


def size_parser(description: str, default: int) -> argparse.ArgumentParser:
    """The command line shared by all scripts: ``--size``"""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--size",
        type=int,
        default=default,
        help=f"how much work to do; see the script's docstring (default {default})",
    )
    return parser


def check_size(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error unless ``args.size`` is positive"""
    if args.size < 1:
        parser.error("--size must be positive")


def parse_size(description: str, default: int, argv: Sequence[str] | None) -> int:
    """Parse the command line shared by all scripts and return ``--size``"""
    parser = size_parser(description, default)
    args = parser.parse_args(argv)
    check_size(parser, args)
    size: int = args.size
    return size


def emit(figures: Mapping[str, FigureValue | bool | str]) -> None:
    """Print the figures as one JSON line, the only thing the runner reads"""
    for name, value in figures.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"figure {name} is not finite: {value}")
    print(json.dumps(figures), flush=True)


#: The environment variable that names the shared library built from section.c,
#: which marks the measured section for callgrind (see :func:`measured_section`);
#: the same as ``run.SECTION_LIB_VAR``, which the drivers set or clear
SECTION_LIB_VAR = "BENCH_SECTION_LIB"


@contextmanager
def measured_section() -> Iterator[None]:
    """Mark the block as the measured section of the script: under callgrind, with
    the library built from ``section.c`` named by ``BENCH_SECTION_LIB``, the counts
    are zeroed when the block starts and dumped when it ends (see
    ``instructions.py --section``). Without it, do nothing.
    """
    path = os.environ.get(SECTION_LIB_VAR)
    if not path:
        yield
        return
    lib = ctypes.CDLL(path)
    lib.section_start()
    try:
        yield
    finally:
        lib.section_stop()


def fine_metrics_api() -> Any | None:
    """Return ``distributed.metrics`` if it has the fork's metering API, else None"""
    import distributed.metrics

    needed = ("context_meter", "DelayedMetricsLedger", "meter")
    if all(hasattr(distributed.metrics, name) for name in needed):
        return distributed.metrics
    return None


def queuing_config(queuing: bool) -> dict[str, Any]:
    """The configuration of queuing on the scheduler: left at its default if
    ``queuing``, else turned off (see :func:`cluster`)
    """
    return {} if queuing else {"distributed.scheduler.worker-saturation": float("inf")}


@contextmanager
def cluster(
    n_workers: int,
    processes: bool = True,
    config: Mapping[str, Any] | None = None,
    queuing: bool = False,
    **worker_kwargs: Any,
) -> Iterator[Client]:
    """A LocalCluster of single-threaded workers and a client connected to it.

    Unless ``queuing`` is True, queuing on the scheduler is turned off: with it,
    a single-threaded worker holds one or two tasks at a time and trivial tasks
    run at the pace of the batched-send intervals, which measures idle time
    rather than overhead, and costs more per task (a round trip to the scheduler
    for every task or two). ``queuing=True`` leaves it at its default, as users
    run it. The dashboard is left out: bokeh may be missing from either
    environment, and its periodic callbacks would only add noise to the CPU
    readings. ``config`` is set in this process, and the nannies hand it on to
    the worker processes.
    """
    config = {**queuing_config(queuing), **(config or {})}
    with dask.config.set(config), LocalCluster(
        n_workers=n_workers,
        threads_per_worker=1,
        processes=processes,
        dashboard_address=None,
        **worker_kwargs,
    ) as lc, Client(lc) as client:
        yield client


#: Seconds for the processes of :func:`cluster_own_scheduler` to start, or to stop
PROCESS_TIMEOUT = 120


def inherit_env() -> dict[str, str]:
    """The environment of a process of the cluster started from the command line:
    it imports the tasks from this directory, and inherits this process' dask
    config (``DASK_INTERNAL_INHERIT_CONFIG``, read when dask is imported)
    """
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    env["DASK_INTERNAL_INHERIT_CONFIG"] = dask.config.serialize(
        dask.config.global_config
    )
    return env


def wait_for_file(path: str, proc: subprocess.Popen, what: str) -> None:
    """Wait until ``proc``, the ``what``, has written ``path``; fail if it exits
    first
    """
    deadline = time.monotonic() + PROCESS_TIMEOUT
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise RuntimeError(f"The {what} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"No {path} after {PROCESS_TIMEOUT} s")
        time.sleep(0.05)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, which the dask command lines handle by closing down; SIGKILL if
    that takes too long
    """
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=PROCESS_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def cluster_own_scheduler(
    n_workers: int,
    config: Mapping[str, Any] | None = None,
    queuing: bool = False,
) -> Iterator[Client]:
    """Like :func:`cluster` with processes, but the scheduler runs in a process of
    its own, so that its CPU time can be read apart from the client's: in a
    LocalCluster, the scheduler and a synchronous client share one event loop, in
    one thread.

    The scheduler is ``python -m distributed.cli.dask_scheduler``; the workers,
    ``python -m distributed.cli.dask_worker --nworkers N --nthreads 1`` (a nanny
    and a process for each, as in LocalCluster), both without dashboard and with
    this process' config, set with ``config`` and ``queuing`` as in
    :func:`cluster`. Heartbeats and every other periodic callback stay on.
    """
    config = {**queuing_config(queuing), **(config or {})}
    with dask.config.set(config), tempfile.TemporaryDirectory() as tmp:
        env = inherit_env()
        scheduler_file = os.path.join(tmp, "scheduler.json")
        cli = [sys.executable, "-m"]
        common = ["--no-dashboard", "--dashboard-address", ":0"]
        common += ["--scheduler-file", scheduler_file]
        procs: list[subprocess.Popen] = []
        try:
            procs.append(
                subprocess.Popen(
                    [*cli, "distributed.cli.dask_scheduler", "--host", "127.0.0.1"]
                    + ["--port", "0", *common],
                    env=env,
                    cwd=tmp,
                )
            )
            wait_for_file(scheduler_file, procs[0], "scheduler")
            procs.append(
                subprocess.Popen(
                    [*cli, "distributed.cli.dask_worker", "--host", "127.0.0.1"]
                    + ["--nworkers", str(n_workers), "--nthreads", "1", *common],
                    env=env,
                    cwd=tmp,
                )
            )
            with Client(scheduler_file=scheduler_file) as client:
                client.wait_for_workers(n_workers, timeout=PROCESS_TIMEOUT)
                yield client
        finally:
            for proc in reversed(procs):
                stop_process(proc)


def scheduler_pid(client: Client) -> int:
    """Process id of the scheduler"""
    pid: int = client.run_on_scheduler(os.getpid)
    return pid


def worker_pids(client: Client) -> list[int]:
    """Process ids of all the workers, in the order of their addresses"""
    pids = client.run(os.getpid)
    return [pids[addr] for addr in sorted(pids)]


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds consumed so far by the given processes"""
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def noop(x: int) -> int:
    """The trivial task: all of its cost is in the scheduler and the worker"""
    return x


def payload(nbytes: int) -> bytes:
    """Fresh data that lz4 compresses about 2:1, so that (de)compression takes part.

    The random half is sliced from a block made once per process: generating
    random bytes anew for every result would cost more CPU than the transfer or
    spill being measured, and hide it.
    """
    global _random_block
    half = nbytes // 2
    if len(_random_block) < half:
        _random_block = os.urandom(half)
    return _random_block[:half] + bytes(nbytes - half)


_random_block = b""


def worker_state() -> dict[str, FigureValue]:
    """Read the memory and metering state of the worker this runs in.

    Meant for ``client.run``. ``callbacks`` counts the callbacks installed on
    ``context_meter`` as the calling context sees them and ``ledgers`` the
    ``DelayedMetricsLedger`` objects, and the worker's own ledgers of its
    instructions (``InstructionMetricsRecorder``), still alive after a full
    collection. Both are None in pristine; ``callbacks`` is also None if the fork
    does not keep its callbacks as :func:`installed_callbacks` expects.
    """
    gc.collect()
    state: dict[str, FigureValue] = {
        "rss": psutil.Process().memory_info().rss,
        "callbacks": None,
        "ledgers": None,
    }
    api = fine_metrics_api()
    if api is None:
        return state
    kinds = (api.DelayedMetricsLedger, worker_state_machine.InstructionMetricsRecorder)
    state["ledgers"] = sum(isinstance(obj, kinds) for obj in gc.get_objects())
    state["callbacks"] = installed_callbacks(api)
    return state


def installed_callbacks(api: Any) -> int | None:
    """Count the callbacks that ``api.context_meter`` holds in the current context.

    The fork keeps them in a ContextVar holding a sized collection, on the
    ContextMeter or in its module; rather than depend on a private name, add up
    every such ContextVar found there. None if there is none.
    """
    meter = api.context_meter
    candidates = [getattr(meter, name, None) for name in dir(meter)]
    candidates += list(vars(api).values())
    found = False
    total = 0
    for var in candidates:
        if not isinstance(var, contextvars.ContextVar):
            continue
        value = var.get(None)
        if value is None:
            found = True
        elif hasattr(value, "__len__"):
            found = True
            total += len(value)
    return total if found else None
