"""Transfer-heavy: dependencies gathered from one worker process by another.

Worker A produces ``--size`` small values (1 KiB) and four large ones (16 MiB,
about 2:1 compressible); worker B then runs tasks that need them: one per group of
ten small values and one per large value, so that B gathers every dependency from
A. Only this second phase is measured. Figures:

- ``worker_cpu_us_per_dep``: CPU of both worker processes per gathered dependency;
- ``wall_s``: wall time of the phase.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from _common import cluster, cpu_seconds, emit, parse_size, payload, worker_pids

from distributed import wait

SMALL_BYTES = 1024
LARGE_BYTES = 16 * 2**20
N_LARGE = 4
GROUP = 10


def consume(*parts: bytes) -> int:
    """A task that needs its dependencies in memory and does little else"""
    return sum(len(part) for part in parts)


def run(size: int) -> dict[str, float]:
    """Produce on worker A, then time gathering everything to worker B"""
    with cluster(2) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        pids = worker_pids(client)
        small = client.map(
            payload, [SMALL_BYTES] * size, key="small", pure=False, workers=[a]
        )
        large = client.map(
            payload, [LARGE_BYTES] * N_LARGE, key="large", pure=False, workers=[a]
        )
        wait(small + large)

        cpu0 = cpu_seconds(pids)
        wall0 = time.perf_counter()
        groups = [small[i : i + GROUP] for i in range(0, size, GROUP)]
        consumers = [client.submit(consume, *g, workers=[b]) for g in groups]
        consumers += [client.submit(consume, f, workers=[b]) for f in large]
        wait(consumers)
        wall = time.perf_counter() - wall0
        cpu = cpu_seconds(pids) - cpu0
        assert (
            sum(client.gather(consumers)) == size * SMALL_BYTES + N_LARGE * LARGE_BYTES
        )
    return {
        "worker_cpu_us_per_dep": cpu / (size + N_LARGE) * 1e6,
        "wall_s": wall,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point"""
    emit(run(parse_size(__doc__ or "", 5000, argv)))


if __name__ == "__main__":
    main()
