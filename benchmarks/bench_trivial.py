"""Trivial tasks on one in-process worker.

``client.map`` of a no-op over ``--size`` keys, with scheduler, worker and client
all in this process. Figures:

- ``tasks_per_s``: throughput from submission until every task is done;
- ``cpu_us_per_task``: CPU of the whole process (all its threads) per task.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from _common import cluster, emit, noop, parse_size

from distributed import wait


def run(size: int) -> dict[str, float]:
    """Time ``size`` no-op tasks, after a small unmeasured warm-up batch"""
    with cluster(1, processes=False) as client:
        # Warm up: deserialize the function, fill caches, start the thread pool
        wait(client.map(noop, range(min(size, 100)), key="warmup"))

        cpu0 = time.process_time()
        wall0 = time.perf_counter()
        futures = client.map(noop, range(size))
        wait(futures)
        wall = time.perf_counter() - wall0
        cpu = time.process_time() - cpu0
        del futures
    return {"tasks_per_s": size / wall, "cpu_us_per_task": cpu / size * 1e6}


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point"""
    emit(run(parse_size(__doc__ or "", 5000, argv)))


if __name__ == "__main__":
    main()
