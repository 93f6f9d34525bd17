"""Where the workers' time goes: a table of their fine performance metrics.

Run as a script, it prints the table for a running cluster::

    python -m distributed.diagnostics.fine_metrics tcp://scheduler:8786

or, with no address, for a small demonstration workload on a LocalCluster that
computes, transfers data between workers, spills to disk and fails one task.
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from dask.utils import format_bytes

from distributed.client import Client, wait

#: The activities that post fine performance metrics, in the order of the report.
ACTIVITIES = ("execute", "gather-dep", "get-data", "memory-monitor")
UNITS = ("seconds", "bytes", "count")


def is_fine_metric(key: Hashable) -> bool:
    """Whether a key of ``Worker.digests_total`` is a fine performance metric"""
    return isinstance(key, tuple) and len(key) >= 3 and key[0] in ACTIVITIES


def worker_fine_metrics(dask_worker: object) -> dict[Hashable, float]:
    """The fine performance metrics of a worker (for use with ``Client.run``)"""
    digests = dask_worker.digests_total  # type: ignore[attr-defined]
    return {k: v for k, v in digests.items() if is_fine_metric(k)}


def cluster_fine_metrics(client: Client) -> Any:
    """The fine performance metrics of all workers of a cluster, added up.

    Returns a dict, or an awaitable of it if the client is asynchronous.
    """
    return client.sync(_cluster_fine_metrics, client)


async def _cluster_fine_metrics(client: Client) -> dict[Hashable, float]:
    total: dict[Hashable, float] = defaultdict(int)
    per_worker = await client.run(worker_fine_metrics)
    for metrics in per_worker.values():
        for key, value in metrics.items():
            total[key] += value
    return dict(total)


def _label_text(label: Hashable) -> str:
    if isinstance(label, tuple):
        return "/".join(map(str, label))
    return str(label)


def _rows(
    metrics: Mapping[Hashable, float]
) -> dict[tuple[str, str, str], dict[str, float]]:
    """{(activity, task prefix or "", label): {unit: value}}"""
    rows: dict[tuple[str, str, str], dict[str, float]] = defaultdict(dict)
    for key, value in metrics.items():
        if not is_fine_metric(key):
            continue
        assert isinstance(key, tuple)
        if key[0] == "execute":
            _, prefix, label, unit = key
        else:
            (_, label, unit), prefix = key, ""
        row = rows[key[0], str(prefix), _label_text(label)]
        row[unit] = row.get(unit, 0) + value
    return rows


def _cell(unit: str, value: float | None) -> str:
    if value is None:
        return ""
    if unit == "seconds":
        return f"{value:.3f}"
    if unit == "bytes":
        return format_bytes(int(value))
    return f"{value:g}"


def format_table(metrics: Mapping[Hashable, float]) -> str:
    """Render fine performance metrics as a text table.

    One row per activity, task prefix (for ``execute``) and label, with a column
    for each of seconds, bytes and count, and a total of seconds per activity and
    prefix. Rows are sorted by activity, then by seconds, largest first.
    Labels a task posts itself in another unit are listed in an extra column.

    Parameters
    ----------
    metrics:
        A mapping like ``Worker.digests_total``; keys that are not fine
        performance metrics are ignored.
    """
    rows = _rows(metrics)
    extra_units = sorted({u for r in rows.values() for u in r} - set(UNITS))
    header = ["activity", "task prefix", "label", *UNITS, *extra_units]
    table: list[list[str]] = [header]
    groups: dict[tuple[str, str], list[tuple[str, dict[str, float]]]] = defaultdict(
        list
    )
    for (activity, prefix, label), row in rows.items():
        groups[activity, prefix].append((label, row))

    def group_order(item: tuple[tuple[str, str], object]) -> tuple[int, str]:
        (activity, prefix), _ = item
        return ACTIVITIES.index(activity), prefix

    for (activity, prefix), labels in sorted(groups.items(), key=group_order):
        labels.sort(key=lambda lr: (-lr[1].get("seconds", -1.0), lr[0]))
        for label, row in labels:
            cells = [_cell(u, row.get(u)) for u in (*UNITS, *extra_units)]
            table.append([activity, prefix, label, *cells])
        total = sum(row.get("seconds", 0) for _, row in labels)
        blanks = [""] * (len(UNITS) - 1 + len(extra_units))
        table.append([activity, prefix, "(total)", _cell("seconds", total), *blanks])
    return _render(table)


def _render(table: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = []
    for n, row in enumerate(table):
        cells = [
            cell.ljust(w) if i < 3 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def demo_workload(client: Client) -> None:
    """Compute, transfer between workers, spill, and fail one task."""
    import numpy as np

    from distributed.metrics import context_meter

    def make_chunk(i: int) -> np.ndarray:
        # 8 MiB each, compressible, so that spilling shows compression too
        return np.arange(1 << 20, dtype="float64") % (i + 7)

    def crunch(a: np.ndarray, b: np.ndarray) -> float:
        time.sleep(0.05)  # waiting, not CPU: thread-noncpu
        # A metric of the task's own, next to the worker's
        context_meter.digest_metric("pairs", 1, "count")
        with context_meter.meter("crunch"):
            return float((a * b).sum())

    def explode(x: float) -> float:
        raise ValueError("this task fails on purpose")

    workers = list(client.scheduler_info()["workers"])
    chunks = [
        client.submit(make_chunk, i, workers=[workers[i % 2]], key=f"make-chunk-{i}")
        for i in range(24)
    ]
    # Each worker makes more chunks than it keeps in memory: wait for all of them,
    # so that the oldest are spilled before anything reads them (otherwise whether
    # a task unspills its inputs depends on timing)
    wait(chunks)
    # Pairs from different workers: one input of each is gathered from the peer
    sums = [
        client.submit(crunch, chunks[i], chunks[i + 1], key=f"crunch-{i}")
        for i in range(0, len(chunks) - 1)
    ]
    client.gather(sums)
    failure = client.submit(explode, sums[0], key="explode-0")
    try:
        failure.result()
    except ValueError:
        pass


def run_demo(**cluster_kwargs: Any) -> dict[Hashable, float]:
    """Run :func:`demo_workload` on a LocalCluster and return its metrics.

    ``cluster_kwargs`` go to :class:`~distributed.LocalCluster` (e.g. ``loop``).
    """
    import dask

    from distributed.deploy.local import LocalCluster

    config = {
        # Keep little in memory, so that most chunks are spilled...
        "distributed.worker.memory.target": 0.2,
        # ...also by the memory monitor, which looks at the process memory...
        "distributed.worker.memory.spill": 0.5,
        # ...but never pause or restart the workers
        "distributed.worker.memory.pause": False,
        "distributed.worker.memory.terminate": False,
    }
    with dask.config.set(config):
        with LocalCluster(
            n_workers=2,
            threads_per_worker=2,
            memory_limit="300 MiB",
            dashboard_address=":0",
            **cluster_kwargs,
        ) as cluster, Client(cluster, loop=cluster_kwargs.get("loop")) as client:
            demo_workload(client)
            return cluster_fine_metrics(client)


def main(argv: Iterable[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m distributed.diagnostics.fine_metrics", description=__doc__
    )
    parser.add_argument(
        "scheduler", nargs="?", help="scheduler address; omit to run the demo"
    )
    args = parser.parse_args(None if argv is None else list(argv))
    if args.scheduler:
        with Client(args.scheduler) as client:
            metrics = cluster_fine_metrics(client)
    else:
        print("Running the demonstration workload on a LocalCluster...")
        metrics = run_demo()
    print(format_table(metrics))


if __name__ == "__main__":
    main()  # pragma: nocover
