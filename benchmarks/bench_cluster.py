"""Trivial tasks on a cluster of two worker processes and a scheduler process.

``client.map`` of a no-op over ``--size`` keys. The scheduler runs in a process of
its own (see ``_common.cluster_own_scheduler``), the client in this one; the
workers heartbeat as usual, and in the fork deliver their fine metrics to the
scheduler with every heartbeat. Figures:

- ``worker_cpu_us_per_task``: CPU of the two worker processes, read with psutil
  on their pids, per task;
- ``scheduler_cpu_us_per_task``: CPU of the scheduler's process, per task: the
  tasks, the heartbeats and the deliveries that come with them, and whatever the
  scheduler does per unit of time;
- ``wall_s``: wall time from submission until every task is done;
- ``tasks_per_s``: the same, as throughput.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from _common import (
    cluster_own_scheduler,
    cpu_seconds,
    emit,
    noop,
    parse_size,
    scheduler_pid,
    worker_pids,
)

from distributed import wait


def run(size: int) -> dict[str, float]:
    """Time ``size`` no-op tasks, after a small unmeasured warm-up batch"""
    with cluster_own_scheduler(2) as client:
        pids = worker_pids(client)
        scheduler = [scheduler_pid(client)]
        wait(client.map(noop, range(min(size, 100)), key="warmup"))

        cpu0 = cpu_seconds(pids)
        scheduler_cpu0 = cpu_seconds(scheduler)
        wall0 = time.perf_counter()
        futures = client.map(noop, range(size))
        wait(futures)
        wall = time.perf_counter() - wall0
        cpu = cpu_seconds(pids) - cpu0
        scheduler_cpu = cpu_seconds(scheduler) - scheduler_cpu0
        del futures
    return {
        "worker_cpu_us_per_task": cpu / size * 1e6,
        "scheduler_cpu_us_per_task": scheduler_cpu / size * 1e6,
        "wall_s": wall,
        "tasks_per_s": size / wall,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point"""
    emit(run(parse_size(__doc__ or "", 5000, argv)))


if __name__ == "__main__":
    main()
