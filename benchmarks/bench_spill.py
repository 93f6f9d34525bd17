"""Spill-heavy: one worker process whose memory target holds only a few results.

The worker's target is 8 MiB of managed memory (pausing, spilling by process
memory and terminating are off, so only the target acts). ``--size`` tasks each
produce 1 MiB (about 2:1 compressible), so nearly all of them are spilled; then one
task per result reads it back, unspilling it and spilling another in its place.
Figures:

- ``worker_cpu_us_per_task``: CPU of the worker process per task (both phases);
- ``wall_s``: wall time of both phases;
- ``spilled_fraction``: share of the results on disk at the end of the first
  phase, to show that the workload does what it says.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from _common import cluster, cpu_seconds, emit, parse_size, payload, worker_pids

from distributed import Worker, wait

CHUNK_BYTES = 2**20
MEMORY_LIMIT = 2**30
TARGET_BYTES = 8 * 2**20


def spilled_count(dask_worker: Worker) -> int:
    """Number of keys in the worker's spill buffer that are on disk"""
    return len(dask_worker.data.slow)  # type: ignore[attr-defined]


def run(size: int) -> dict[str, float]:
    """Time producing ``size`` results and reading each back"""
    config = {
        "distributed.worker.memory.target": TARGET_BYTES / MEMORY_LIMIT,
        "distributed.worker.memory.spill": False,
        "distributed.worker.memory.pause": False,
        "distributed.worker.memory.terminate": False,
    }
    with cluster(1, config=config, memory_limit=MEMORY_LIMIT) as client:
        pids = worker_pids(client)
        cpu0 = cpu_seconds(pids)
        wall0 = time.perf_counter()
        chunks = client.map(payload, [CHUNK_BYTES] * size, pure=False)
        wait(chunks)
        spilled = sum(client.run(spilled_count).values())
        sizes = client.map(len, chunks)
        wait(sizes)
        wall = time.perf_counter() - wall0
        cpu = cpu_seconds(pids) - cpu0
        assert sum(client.gather(sizes)) == size * CHUNK_BYTES
    return {
        "worker_cpu_us_per_task": cpu / (2 * size) * 1e6,
        "wall_s": wall,
        "spilled_fraction": spilled / size,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point"""
    emit(run(parse_size(__doc__ or "", 500, argv)))


if __name__ == "__main__":
    main()
