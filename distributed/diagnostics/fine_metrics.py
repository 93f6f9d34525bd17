"""Where the workers' time goes: a table of their fine performance metrics.

Run as a script, it prints the table for a running cluster, from the
scheduler's store (so it includes the workers that have left)::

    python -m distributed.diagnostics.fine_metrics tcp://scheduler:8786

or, with no address, for a small demonstration workload on a LocalCluster that
computes, transfers data between workers, spills to disk and fails one task
(what ``make demo`` runs). The demonstration then prints the URL of the
dashboard's page of the same metrics and, when run in a terminal, keeps the
cluster up until Enter is pressed, so that one can look at it.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import defaultdict
from collections.abc import Hashable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TextIO

from distributed.client import Client, NoFineMetricsError, wait
from distributed.metrics import (
    FINE_METRICS_ACTIVITIES,
    FINE_METRICS_UNITS,
    format_fine_metrics,
    is_fine_metric,
)

if TYPE_CHECKING:
    from distributed.deploy.local import LocalCluster

#: The activities that post fine performance metrics, in the order of the report.
ACTIVITIES = tuple(FINE_METRICS_ACTIVITIES)
UNITS = FINE_METRICS_UNITS

#: Render fine performance metrics as a text table
format_table = format_fine_metrics


def worker_fine_metrics(dask_worker: object) -> dict[Hashable, float]:
    """The fine performance metrics of a worker (for use with ``Client.run``)"""
    digests = dask_worker.digests_total  # type: ignore[attr-defined]
    return {k: v for k, v in digests.items() if is_fine_metric(k)}


def cluster_fine_metrics(client: Client) -> Any:
    """The fine performance metrics of the cluster, from the scheduler's store
    (workers that have left included), after every worker delivered what it
    holds: a :class:`~distributed.metrics.FineMetrics`, or an awaitable of it if
    the client is asynchronous.
    """
    return client.get_fine_metrics()


def workers_fine_metrics(client: Client) -> Any:
    """The fine performance metrics of the live workers, asked of each with
    ``Client.run`` and added up; see :func:`cluster_fine_metrics` for the
    scheduler's view.
    """
    return client.sync(_workers_fine_metrics, client)


async def _workers_fine_metrics(client: Client) -> dict[Hashable, float]:
    total: dict[Hashable, float] = defaultdict(int)
    per_worker = await client.run(worker_fine_metrics)
    for metrics in per_worker.values():
        for key, value in metrics.items():
            total[key] += value
    return dict(total)


def worker_thread_seconds(dask_worker: Any) -> dict[str, Any]:
    """What a worker's threads did since it started (for use with ``Client.run``):
    ``{"nthreads": int, "elapsed": seconds, "seconds": {label: thread-seconds}}``,
    with ``seconds`` adding up to ``nthreads * elapsed``
    """
    dask_worker.digest_running()
    account = dask_worker.thread_seconds
    seconds = {
        key[1]: value
        for key, value in dask_worker.digests_total.items()
        if is_fine_metric(key) and key[0] == "threads"
    }
    return {
        "nthreads": account.nthreads,
        "elapsed": account.last - account.start,
        "seconds": seconds,
    }


def format_thread_seconds(workers: Mapping[str, Mapping[str, Any]]) -> str:
    """Render what :func:`worker_thread_seconds` returns for each worker: the
    partition of each worker's thread-seconds, with the share of each state, what
    they add up to, and the cluster's efficiency (the busy share)
    """
    lines = []
    busy = total = 0.0
    for address, part in sorted(workers.items()):
        seconds = part["seconds"]
        expect = part["nthreads"] * part["elapsed"]
        added = sum(seconds.values())
        lines.append(
            f"{address}: {part['nthreads']} threads x {part['elapsed']:.2f} s"
            f" = {expect:.2f} thread-seconds"
        )
        for label in sorted(seconds, key=lambda label: (label != "busy", label)):
            share = 100 * seconds[label] / added if added else 0.0
            lines.append(f"    {label:<22} {seconds[label]:>10.3f} s {share:6.1f}%")
        lines.append(f"    {'(added up)':<22} {added:>10.3f} s")
        busy += seconds.get("busy", 0.0)
        total += added
    share = 100 * busy / total if total else 0.0
    lines.append(f"The cluster's threads were busy {share:.1f}% of the time.")
    return "\n".join(lines)


def thread_seconds_add_up(part: Mapping[str, Any], rel: float = 1e-6) -> bool:
    """Whether a worker's partition adds up to its threads times the time elapsed"""
    expect = part["nthreads"] * part["elapsed"]
    return abs(sum(part["seconds"].values()) - expect) <= rel * max(expect, 1.0)


def views_agree(
    scheduler: Mapping[Hashable, float], workers: Mapping[Hashable, float]
) -> bool:
    """Whether the scheduler's totals and the workers' agree: the same keys, counts
    and bytes equal, seconds within rounding
    """
    if set(scheduler) != set(workers):
        return False
    for key, value in workers.items():
        other = scheduler[key]
        if isinstance(key, tuple) and key[-1] == "seconds":
            if abs(other - value) > 1e-9 * max(1.0, abs(value)):
                return False
        elif other != value:
            return False
    return True


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
    # A chunk is larger than a worker keeps in memory (DEMO_CONFIG): each is
    # spilled as soon as it is made, and read back from disk by every task that
    # uses it, or sends it to a peer
    wait(chunks)
    # Pairs from different workers: one input of each is gathered from the peer
    sums = [
        client.submit(crunch, chunks[i], chunks[i + 1], key=f"crunch-{i}")
        for i in range(0, len(chunks) - 1)
    ]
    client.gather(sums)
    failure = client.submit(explode, sums[0], key="explode-0")
    # Waited for, not raised: Future.result() would attach this frame to the
    # exception that the client keeps, and with it every future here, until the
    # client closes. Their keys would then be released while the workers close,
    # and a worker that has already removed its spilled files would fail to
    # delete one (a traceback on stderr)
    wait(failure)


#: The dask configuration of the demonstration cluster
DEMO_CONFIG: dict[str, Any] = {
    # Keep less than a chunk (6 of 8 MiB) in memory, so that every chunk is
    # spilled when it is made, or arrives from a peer: by the task or transfer
    # that stored it, whatever the timing. (With a target of several chunks, the
    # memory monitor raced the tasks for spilling them, and sometimes won all.)
    "distributed.worker.memory.target": 0.02,
    # The memory monitor, which looks at the process memory, spills the rest...
    "distributed.worker.memory.spill": 0.5,
    # ...but never pause or restart the workers
    "distributed.worker.memory.pause": False,
    "distributed.worker.memory.terminate": False,
}

#: The page of the scheduler's dashboard that shows the fine performance metrics
PAGE = "individual-fine-performance-metrics"


@contextmanager
def demo_cluster(
    config: Mapping[str, Any] | None = None, **cluster_kwargs: Any
) -> Iterator[tuple[LocalCluster, Client]]:
    """A LocalCluster for :func:`demo_workload`, and a client of it: two workers
    of 300 MiB that spill early, and the dashboard on a free port of the loopback
    interface

    Parameters
    ----------
    config:
        dask configuration over :data:`DEMO_CONFIG`; both are set while the
        cluster runs
    **cluster_kwargs:
        Passed to :class:`~distributed.LocalCluster` (e.g. ``loop``)

    Yields
    ------
    The cluster and the client
    """
    import dask

    from distributed.deploy.local import LocalCluster

    kwargs = {
        "n_workers": 2,
        "threads_per_worker": 2,
        "memory_limit": "300 MiB",
        "dashboard_address": "127.0.0.1:0",
        **cluster_kwargs,
    }
    with dask.config.set({**DEMO_CONFIG, **(config or {})}):
        with LocalCluster(**kwargs) as cluster, Client(
            cluster, loop=cluster_kwargs.get("loop")
        ) as client:
            yield cluster, client


def settle(client: Client) -> None:
    """Wait until every worker has posted the metrics of what it did: ``get-data``
    posts its metrics once the peer acknowledged the data, which may be after
    the peer moved on
    """
    client.run(_wait_for_transfers)


def _wait_for_transfers(dask_worker: Any) -> None:
    deadline = time.monotonic() + 5
    while dask_worker.transfer_outgoing_count and time.monotonic() < deadline:
        time.sleep(0.01)


def demo_metrics(client: Client) -> tuple[dict[Hashable, float], bool]:
    """Run :func:`demo_workload`; return its metrics, as the scheduler holds them
    once the workers delivered everything, and whether they agree with the
    workers' own
    """
    demo_workload(client)
    settle(client)
    # A heartbeat between the two reads delivers the threads' seconds since the
    # flush (see cluster_fine_metrics) to a store already read: read both again
    for _ in range(5):
        scheduler = dict(cluster_fine_metrics(client))
        workers = workers_fine_metrics(client)
        if views_agree(scheduler, workers):
            return scheduler, True
    return scheduler, False


def page_url(client: Client) -> str:
    """The URL of the dashboard's page of fine performance metrics: the
    dashboard's link (``distributed.dashboard.link``) with :data:`PAGE` in place
    of its ``status`` page
    """
    link = client.dashboard_link
    base = link[: -len("/status")] if link.endswith("/status") else link.rstrip("/")
    return f"{base}/{PAGE}"


def wait_for_enter(stdin: TextIO) -> None:
    """Wait until Enter (or end of input, or Ctrl-C) is pressed, if ``stdin`` is
    a terminal; return at once otherwise (tests, CI, a pipe)
    """
    if not stdin.isatty():
        return
    print("Press Enter to stop the cluster.", flush=True)
    try:
        stdin.readline()
    except KeyboardInterrupt:
        pass


def demo(
    stdin: TextIO | None = None, **cluster_kwargs: Any
) -> tuple[dict[Hashable, float], bool]:
    """Run the demonstration: :func:`demo_workload` on a :func:`demo_cluster`;
    print its metrics and the URL of the dashboard's page of them; keep the
    cluster up until Enter is pressed if ``stdin`` (default: ``sys.stdin``) is a
    terminal

    Returns
    -------
    What :func:`demo_metrics` returns: the metrics, as the scheduler holds them,
    and whether they agree with the workers' own totals
    """
    print("Running the demonstration workload on a LocalCluster...")
    print(
        "(Its workers log that a task failed, as one does on purpose, and may warn\n"
        "that their unmanaged memory is high: they are given 300 MiB and spill\n"
        "from 150 MiB, less than a worker process takes by itself.)",
        flush=True,
    )
    with demo_cluster(**cluster_kwargs) as (_, client):
        metrics, agree = demo_metrics(client)
        print("The scheduler's view of the cluster (Client.get_fine_metrics()):")
        print(format_table(metrics))
        if agree:
            print(
                "The scheduler's view agrees with the workers' own totals "
                "(the same keys; counts and bytes equal; seconds within rounding)."
            )
        else:
            print("WARNING: the scheduler's view differs from the workers' own totals")
        parts = client.run(worker_thread_seconds)
        print()
        print("Every second of every worker's threads: busy running tasks, or idle")
        print("by cause (the `threads` rows above are the whole cluster's):")
        print(format_thread_seconds(parts))
        if all(thread_seconds_add_up(part) for part in parts.values()):
            print("Each worker's states add up to its threads times its lifetime.")
        else:
            print("WARNING: a worker's states do not add up to its threads' time")
        print(f"The dashboard shows them at {page_url(client)}", flush=True)
        wait_for_enter(sys.stdin if stdin is None else stdin)
    return metrics, agree


def main(argv: Iterable[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m distributed.diagnostics.fine_metrics",
        description=__doc__,
        # The docstring's example stays on a line of its own
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "scheduler", nargs="?", help="scheduler address; omit to run the demo"
    )
    args = parser.parse_args(None if argv is None else list(argv))
    if args.scheduler:
        try:
            with Client(args.scheduler) as client:
                metrics = dict(cluster_fine_metrics(client))
        except (OSError, ValueError, asyncio.TimeoutError, NoFineMetricsError) as e:
            # Unreachable, lost, not an address, or not a scheduler of the fork: a
            # line, not a traceback; the exception's name if it has no message (a
            # timeout)
            parser.exit(
                1,
                "Could not read the fine metrics of the scheduler at "
                f"{args.scheduler}: {str(e) or type(e).__name__}\n",
            )
        print(format_table(metrics))
        return
    demo()


if __name__ == "__main__":
    main()  # pragma: nocover
