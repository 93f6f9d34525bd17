"""Memory: what one worker process holds after ``--size`` trivial tasks.

The tasks run in batches of at most 10,000, each released before the next, after
a warm-up batch of 1,000; the worker's state is read after the warm-up and at the
end, each time after a full garbage collection. Figures:

- ``rss_mib``: RSS of the worker process at the end;
- ``rss_growth_mib``: its change since the warm-up (may be negative);
- ``callbacks_growth``: change in the number of callbacks installed on
  ``context_meter``, as seen from the worker's event loop plus from inside a task;
- ``ledgers_growth``: change in the number of live ``DelayedMetricsLedger``.

The last two are null in pristine, which has neither.
"""
from __future__ import annotations

from collections.abc import Sequence

from _common import FigureValue, cluster, emit, noop, parse_size, worker_state

from distributed import Client, wait

BATCH = 10_000
WARMUP = 1_000
MIB = 2**20


def read_state(client: Client) -> dict[str, FigureValue]:
    """The worker's state, with callbacks counted both on its loop and in a task"""
    (on_loop,) = client.run(worker_state).values()
    in_task = client.submit(worker_state, pure=False).result()
    state = dict(on_loop)
    if on_loop["callbacks"] is not None and in_task["callbacks"] is not None:
        state["callbacks"] = on_loop["callbacks"] + in_task["callbacks"]
    return state


def growth(before: FigureValue, after: FigureValue) -> FigureValue:
    """``after - before``, or None if either is unknown"""
    if before is None or after is None:
        return None
    return after - before


def run(size: int) -> dict[str, FigureValue]:
    """Run ``size`` no-op tasks and compare the worker's state before and after"""
    with cluster(1) as client:
        wait(client.map(noop, range(WARMUP), key="warmup"))
        before = read_state(client)
        for start in range(0, size, BATCH):
            wait(client.map(noop, range(start, min(start + BATCH, size))))
        after = read_state(client)
    assert after["rss"] is not None and before["rss"] is not None
    return {
        "rss_mib": after["rss"] / MIB,
        "rss_growth_mib": (after["rss"] - before["rss"]) / MIB,
        "callbacks_growth": growth(before["callbacks"], after["callbacks"]),
        "ledgers_growth": growth(before["ledgers"], after["ledgers"]),
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point"""
    emit(run(parse_size(__doc__ or "", 100_000, argv)))


if __name__ == "__main__":
    main()
