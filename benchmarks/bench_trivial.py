"""Trivial tasks on one in-process worker.

``client.map`` of a no-op over ``--size`` keys, with scheduler, worker and client
all in this process. Figures:

- ``tasks_per_s``: throughput from submission until every task is done;
- ``cpu_us_per_task``: CPU of the whole process (all its threads) per task.

Queuing on the scheduler is off (see ``_common.cluster``), so that the worker
gets the tasks in large batches; with ``--queuing`` it is left at its default
(``distributed.scheduler.worker-saturation`` not overridden), as users run it:
the worker then holds one or two tasks at a time, and every task or two costs a
round trip to the scheduler. With ``--quiet``, the worker and the scheduler do
no per-second work (see ``_common.QUIET_CONFIG``), for counting what they do per
task. The tasks, from submission until every one is done, are the measured
section (``_common.measured_section``) of ``instructions.py --section``.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from _common import (
    QUIET_CONFIG,
    check_size,
    cluster,
    emit,
    measured_section,
    noop,
    size_parser,
    stop_periodic_callbacks,
)

from distributed import wait


def run(size: int, quiet: bool = False, queuing: bool = False) -> dict[str, float]:
    """Time ``size`` no-op tasks, after a small unmeasured warm-up batch"""
    config = QUIET_CONFIG if quiet else None
    with cluster(1, processes=False, config=config, queuing=queuing) as client:
        if quiet:
            client.run(stop_periodic_callbacks)
            client.run_on_scheduler(stop_periodic_callbacks)
        # Warm up: deserialize the function, fill caches, start the thread pool
        wait(client.map(noop, range(min(size, 100)), key="warmup"))

        with measured_section():
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
    parser = size_parser(__doc__ or "", 5000)
    parser.add_argument(
        "--quiet", action="store_true", help="no per-second work in the cluster"
    )
    parser.add_argument(
        "--queuing",
        action="store_true",
        help="queuing on the scheduler at its default, instead of off",
    )
    args = parser.parse_args(argv)
    check_size(parser, args)
    emit(run(args.size, args.quiet, args.queuing))


if __name__ == "__main__":
    main()
