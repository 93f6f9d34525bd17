"""Trivial tasks on one worker in a process of its own, started under a command
prefix such as ``valgrind``.

The scheduler and the client run in this process; the worker is
``python -m distributed.cli.dask_worker`` with one thread and no nanny (a nanny
would kill a worker that is slow to shut down, before a tool like valgrind writes
its report), run as ``PREFIX python ...`` with its stderr passed through.
``client.map`` of a no-op over ``--size`` keys, after a warm-up batch; then the
worker is retired, and exits normally. The worker does no per-second work (see
``_common.QUIET_CONFIG``), so that what it does is all per task. Figures:

- ``wall_s``: wall time from submission until every task is done;
- ``tasks_per_s``: the same, as throughput;
- ``worker_pid``: the process id of the worker, e.g. to find its report.

Usage::

    python worker_process.py --size N [-- PREFIX...]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from _common import QUIET_CONFIG, emit, noop, queuing_config, stop_periodic_callbacks
from run import HERE

import dask
from distributed import Client, LocalCluster, wait

#: Seconds to wait for the worker to start, and then to exit. Under valgrind,
#: importing distributed alone takes about a minute.
TIMEOUT = 600


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1000, help="number of tasks")
    parser.add_argument(
        "prefix",
        nargs=argparse.REMAINDER,
        help="after --, the command that runs the worker's python",
    )
    args = parser.parse_args(argv)
    if args.size < 1:
        parser.error("--size must be positive")
    if args.prefix[:1] == ["--"]:
        args.prefix = args.prefix[1:]
    return args


def worker_command(prefix: Sequence[str], scheduler_address: str) -> list[str]:
    """The command line of the worker process"""
    return [
        *prefix,
        sys.executable,
        "-m",
        "distributed.cli.dask_worker",
        scheduler_address,
        "--no-nanny",
        "--nthreads",
        "1",
        "--no-dashboard",
    ]


def worker_env() -> dict[str, str]:
    """The environment of the worker: it must import the task from ``_common``, and
    inherit this process' dask config
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(HERE), env.get("PYTHONPATH")])
    )
    env["DASK_INTERNAL_INHERIT_CONFIG"] = dask.config.serialize(
        dask.config.global_config
    )
    return env


def wait_for_worker(client: Client, proc: subprocess.Popen) -> None:
    """Wait until the worker has joined the scheduler; fail if it exits first"""
    deadline = time.monotonic() + TIMEOUT
    while not client.scheduler_info()["workers"]:
        if proc.poll() is not None:
            raise RuntimeError(f"The worker exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"No worker after {TIMEOUT} s")
        time.sleep(0.2)


def close_worker(client: Client, lc: LocalCluster, proc: subprocess.Popen) -> None:
    """Retire the worker and wait for its process to exit normally.

    The client releases its futures asynchronously: until the scheduler has
    forgotten them, the worker holds their results, has nowhere to move them, and
    retiring it would do nothing.
    """
    deadline = time.monotonic() + TIMEOUT
    while lc.scheduler.tasks:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Tasks still on the scheduler after {TIMEOUT} s")
        time.sleep(0.05)
    client.retire_workers(list(client.scheduler_info()["workers"]), close_workers=True)
    returncode = proc.wait(timeout=TIMEOUT)
    if returncode:
        raise RuntimeError(f"The worker exited with {returncode}")


def run(size: int, prefix: Sequence[str]) -> dict[str, float | int]:
    """Time ``size`` no-op tasks on a worker process started under ``prefix``"""
    # See _common.cluster on queuing
    config = {**queuing_config(False), **QUIET_CONFIG}
    with dask.config.set(config), LocalCluster(
        n_workers=0, processes=False, protocol="tcp://", dashboard_address=None
    ) as lc, Client(lc) as client:
        proc = subprocess.Popen(
            worker_command(prefix, lc.scheduler_address), env=worker_env()
        )
        try:
            wait_for_worker(client, proc)
            client.run(stop_periodic_callbacks)
            wait(client.map(noop, range(min(size, 100)), key="warmup"))

            wall0 = time.perf_counter()
            futures = client.map(noop, range(size))
            wait(futures)
            wall = time.perf_counter() - wall0
            del futures
            close_worker(client, lc, proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {"wall_s": wall, "tasks_per_s": size / wall, "worker_pid": proc.pid}


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point"""
    args = parse_args(argv)
    emit(run(args.size, args.prefix))


if __name__ == "__main__":
    main()
