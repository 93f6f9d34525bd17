"""Trivial tasks on a LocalCluster with two worker processes.

``client.map`` of a no-op over ``--size`` keys; scheduler and client stay in this
process. Figures:

- ``worker_cpu_us_per_task``: CPU of the two worker processes, read with psutil
  on their pids, per task;
- ``wall_s``: wall time from submission until every task is done;
- ``tasks_per_s``: the same, as throughput.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from _common import cluster, cpu_seconds, emit, noop, parse_size, worker_pids

from distributed import wait


def run(size: int) -> dict[str, float]:
    """Time ``size`` no-op tasks, after a small unmeasured warm-up batch"""
    with cluster(2) as client:
        pids = worker_pids(client)
        wait(client.map(noop, range(min(size, 100)), key="warmup"))

        cpu0 = cpu_seconds(pids)
        wall0 = time.perf_counter()
        futures = client.map(noop, range(size))
        wait(futures)
        wall = time.perf_counter() - wall0
        cpu = cpu_seconds(pids) - cpu0
        del futures
    return {
        "worker_cpu_us_per_task": cpu / size * 1e6,
        "wall_s": wall,
        "tasks_per_s": size / wall,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point"""
    emit(run(parse_size(__doc__ or "", 5000, argv)))


if __name__ == "__main__":
    main()
