"""End-to-end tests of the fine performance metrics of the worker: execute,
gather-dep, get-data, memory-monitor, gather and update-data, as posted to Worker.digests_total and
carried on the events of the worker state machine.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

import pytest

import dask
from dask.local import SynchronousExecutor
from dask.sizeof import sizeof

from distributed import (
    Client,
    Event,
    Reschedule,
    Scheduler,
    Worker,
    get_client,
    get_worker,
    rejoin,
    secede,
)
from distributed.comm import connect
from distributed.compatibility import PeriodicCallback
from distributed.core import Status
from distributed.metrics import (
    FINE_METRICS_ACTIVITIES,
    ThreadRoot,
    _callbacks_var,
    context_meter,
    current_root,
    is_fine_metric,
)
from distributed.spill import SpillBuffer
from distributed.tests.test_worker_state_machine_metrics import recording
from distributed.utils import sync
from distributed.utils_test import (
    BlockedGatherDep,
    BlockedGetData,
    async_poll_for,
    asyncinc,
    gen_cluster,
    gen_test,
    inc,
    wait_for_state,
)
from distributed.worker import apply_function_simple
from distributed.worker_memory import WorkerMemoryManager
from distributed.worker_state_machine import (
    ExecuteDoneEvent,
    ExecuteFailureEvent,
    ExecuteSuccessEvent,
    FreeKeysEvent,
    GatherDepDoneEvent,
    GatherDepNetworkFailureEvent,
    GatherDepSuccessEvent,
    InstructionMetricsRecorder,
    RescheduleEvent,
)

REMOVED_DIGESTS = {
    "compute-duration",
    "get-data-load-duration",
    "get-data-send-duration",
    "disk-load-duration",
    "disk-write-target-duration",
    "disk-write-spill-duration",
}


#: Spill anything larger than ~1 MiB as soon as it's inserted (with a memory
#: limit of 1 GiB), and nothing else
SPILL_AT_ONCE = {
    "distributed.worker.memory.target": 0.001,
    "distributed.worker.memory.spill": False,
    "distributed.worker.memory.pause": False,
}


#: The labels and units of an activity that spilled, and did nothing else
SPILLING = {
    ("serialize", "seconds"),
    ("compress", "seconds"),
    ("disk-write", "seconds"),
    ("disk-write", "count"),
    ("disk-write", "bytes"),
    ("other", "seconds"),
}


def activity_digests(w: Worker, activity: str) -> dict:
    """Worker.digests_total for one activity, without the activity itself"""
    return {
        k[1:]: v
        for k, v in w.digests_total.items()
        if isinstance(k, tuple) and k[0] == activity
    }


def execute_digests(w: Worker, prefix: str) -> dict:
    return {
        k[1:]: v for k, v in activity_digests(w, "execute").items() if k[0] == prefix
    }


def events_of(w: Worker, cls: type, key: str | None = None) -> list:
    return [
        ev
        for ev in w.state.stimulus_log
        if isinstance(ev, cls) and (key is None or getattr(ev, "key", None) == key)
    ]


def sum_metrics(events: Iterable[ExecuteDoneEvent | GatherDepDoneEvent]) -> dict:
    """Sum the metrics of events by (label, unit)"""
    out: defaultdict = defaultdict(int)
    for ev in events:
        for label, value, unit in ev.metrics:
            out[label, unit] += value
    return dict(out)


def busy(seconds: float) -> None:
    """Burn CPU in the current thread"""
    t0 = time.thread_time()
    while time.thread_time() < t0 + seconds:
        pass


def emit_and_sleep(x):
    with context_meter.meter("my-sleep"):
        time.sleep(0.02)
    context_meter.digest_metric(("ping", "x"), 1, "count")
    context_meter.digest_metric("my-bytes", 10, "bytes")
    busy(0.02)
    return x + 1


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_execute_thread_pool(c, s, a):
    t0 = time.perf_counter()
    assert await c.submit(emit_and_sleep, 1, key="f-1") == 2
    elapsed = time.perf_counter() - t0

    [ev] = events_of(a, ExecuteSuccessEvent, "f-1")
    labels = [(label, unit) for label, _, unit in ev.metrics]
    assert labels == [
        ("deserialize", "seconds"),
        ("my-sleep", "seconds"),
        (("ping", "x"), "count"),
        ("my-bytes", "bytes"),
        ("thread-cpu", "seconds"),
        ("thread-noncpu", "seconds"),
        ("other", "seconds"),
    ]
    m = {(label, unit): value for label, value, unit in ev.metrics}
    # The label is always a single element of the key, even when it's a tuple
    assert execute_digests(a, "f") == m
    # int stays int
    assert m[("ping", "x"), "count"] == 1
    assert type(m[("ping", "x"), "count"]) is int
    assert type(a.digests_total["execute", "f", ("ping", "x"), "count"]) is int
    assert type(a.digests_total["execute", "f", "my-bytes", "bytes"]) is int
    assert m["my-sleep", "seconds"] >= 0.02
    # The in-thread time of the task, as in startstops, is broken down exactly: the
    # task's own seconds are subtracted from the thread time (which is measured by a
    # monotonic clock, read next to the wall clock of startstops)
    [startstop] = a.state.tasks["f-1"].startstops
    compute = startstop["stop"] - startstop["start"]
    assert m["thread-cpu", "seconds"] + m["thread-noncpu", "seconds"] == pytest.approx(
        compute - m["my-sleep", "seconds"], abs=1e-3
    )
    # The seconds posted for the task never exceed the wall time around it
    seconds = sum(v for (_, unit), v in m.items() if unit == "seconds")
    assert 0.04 <= seconds <= elapsed
    assert all(v >= 0 for v in m.values())
    assert not REMOVED_DIGESTS & set(a.digests_total)

    # startstops (used by the scheduler for occupancy) measure only the in-thread
    # compute
    [startstop] = a.state.tasks["f-1"].startstops
    assert startstop["action"] == "compute"
    assert 0.04 <= startstop["stop"] - startstop["start"] <= elapsed


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_execute_thread_cpu(c, s, a):
    """Time spent burning CPU goes to thread-cpu, time spent waiting goes to
    thread-noncpu
    """

    def f():
        busy(0.1)
        time.sleep(0.1)

    await c.submit(f, key="f-1")
    m = execute_digests(a, "f")
    assert m["thread-cpu", "seconds"] >= 0.09
    assert m["thread-noncpu", "seconds"] >= 0.09


def refund():
    context_meter.digest_metric("refund", -5.0, "seconds")


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_execute_negative_seconds(c, s, a):
    """A task that posts negative seconds fails, like one that posts nan: they would
    give its phases more than its time
    """
    with pytest.raises(ValueError, match="must not be negative"):
        await c.submit(refund, key="refund-1")
    m = execute_digests(a, "refund")
    assert set(m) == {("failed", "seconds")}


def wait_for_own_thread():
    """Hand work to a thread of the task's own and wait for it, with no meter block
    open around it
    """

    def sleep_metered():
        with context_meter.meter("my-sleep"):
            time.sleep(0.2)
        # Seconds measured by hand
        t0 = time.perf_counter()
        time.sleep(0.1)
        context_meter.digest_metric("my-bare", time.perf_counter() - t0, "seconds")

    with ThreadPoolExecutor(1) as ex:
        ex.submit(context_meter.in_thread(sleep_metered)).result()


def burn_then_wait_for_threads():
    """Burn CPU, then wait for four threads at once, which meter their own time"""
    busy(0.2)

    def sleep_metered():
        with context_meter.meter("my-sleep"):
            time.sleep(0.2)

    with ThreadPoolExecutor(4) as ex:
        futures = [ex.submit(context_meter.in_thread(f)) for f in [sleep_metered] * 4]
        for future in futures:
            future.result()


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_execute_task_waits_for_threads_at_once(c, s, a):
    """What a task's threads metered while it waited for all of them at once, more
    than the time it waited, comes out of its waiting only, not its CPU time
    """
    await c.submit(burn_then_wait_for_threads, key="f-1")
    m = execute_digests(a, "f")
    assert m["my-sleep", "seconds"] >= 0.8
    assert m["thread-cpu", "seconds"] >= 0.15
    assert m["thread-noncpu", "seconds"] < 0.1


def subtract(x, *, y):
    return x - y


def subtract_in_a_thread(x, *, y):
    """Hand a function to a thread with keyword arguments"""
    with ThreadPoolExecutor(1) as ex:
        return ex.submit(context_meter.in_thread(subtract), x, y=y).result()


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_execute_in_thread_with_keyword_arguments(c, s, a):
    """What in_thread returns takes the function's arguments, keywords included,
    in a task as outside one
    """
    assert subtract_in_a_thread(5, y=2) == 3
    assert await c.submit(subtract_in_a_thread, 5, y=2, key="f-1") == 3


def crunch_in_the_callers_thread():
    """Hand a function to an executor that runs it in the task's own thread"""

    def crunch():
        with context_meter.meter("my-crunch"):
            busy(0.2)

    with SynchronousExecutor() as ex:
        ex.submit(context_meter.in_thread(crunch)).result()


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_execute_in_thread_run_in_the_callers_thread(c, s, a):
    """A function handed to an executor that runs it in the caller's thread is
    nested in the task's phase, CPU time included: its CPU time is not counted
    twice
    """
    await c.submit(crunch_in_the_callers_thread, key="f-1")
    m = execute_digests(a, "f")
    assert m["my-crunch", "seconds"] >= 0.19
    assert m["thread-cpu", "seconds"] < 0.1


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_execute_function_decorated_in_a_body(c, s, a):
    """A function decorated where it can't be imported from (in __main__, a
    notebook, or a function's body, as here) is pickled by value, and runs metered
    on the worker
    """

    @context_meter.meter("my-sleep")
    def sleep_metered(x):
        time.sleep(0.05)
        return x + 1

    assert await c.submit(sleep_metered, 1, key="f-1") == 2
    m = execute_digests(a, "f")
    assert m["my-sleep", "seconds"] >= 0.05


seen_roots: list = []


def record_root():
    root = current_root()
    parent = root.parent
    seen_roots.append((root, root.is_current(), parent, parent.thread_root is root))


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_execute_thread_root(c, s, a):
    """In the task's thread, the root is a ThreadRoot of the task's own, current,
    whose caller is the instruction's recorder, which keeps it while the task runs
    (for interim posts); once the task is done, the root is over and the recorder
    finalized, and neither holds the other
    """
    await c.submit(record_root, key="f-1")
    try:
        [(root, current, parent, kept)] = seen_roots
    finally:
        seen_roots.clear()  # Don't keep the recorder alive
    assert isinstance(root, ThreadRoot)
    assert current is True
    assert root.owned is True
    assert kept is True
    assert root.wants_cpu is True
    assert isinstance(parent, InstructionMetricsRecorder)
    assert parent.prefix == ("execute", "f")
    assert root.thread is None
    assert root.context is None
    assert root.parent is None
    assert parent.metrics is None  # Finalized
    assert parent.thread_root is None


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_execute_task_waits_for_its_own_thread(c, s, a):
    """What a task meters in a thread that it waits for is the task's, and comes out
    of the time that the task's thread spent waiting for it, once
    """
    await c.submit(wait_for_own_thread, key="f-1")
    m = execute_digests(a, "f")
    assert m["my-sleep", "seconds"] >= 0.2
    assert m["my-bare", "seconds"] >= 0.1
    # Not counted again as the task's thread waiting
    assert m["thread-noncpu", "seconds"] < 0.1
    [startstop] = a.state.tasks["f-1"].startstops
    compute = startstop["stop"] - startstop["start"]
    seconds = (
        m["thread-cpu", "seconds"]
        + m["thread-noncpu", "seconds"]
        + m["my-sleep", "seconds"]
        + m["my-bare", "seconds"]
    )
    assert seconds == pytest.approx(compute, abs=1e-3)  # See test_execute_thread_pool


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_execute_async_task(c, s, a):
    async def f():
        await asyncio.sleep(0.02)
        context_meter.digest_metric("n", 2, "count")
        return 1

    t0 = time.perf_counter()
    assert await c.submit(f, key="f-1") == 1
    elapsed = time.perf_counter() - t0
    [ev] = events_of(a, ExecuteSuccessEvent, "f-1")
    assert [(label, unit) for label, _, unit in ev.metrics] == [
        ("deserialize", "seconds"),
        ("n", "count"),
        ("thread-noncpu", "seconds"),
        ("other", "seconds"),
    ]
    m = execute_digests(a, "f")
    assert m["thread-noncpu", "seconds"] >= 0.02
    assert m["n", "count"] == 2
    assert sum(v for (_, u), v in m.items() if u == "seconds") <= elapsed


class CustomExecutor(Executor):
    """An executor that is neither a ThreadPoolExecutor nor propagates
    contextvars
    """

    def __init__(self):
        self._pool = ThreadPoolExecutor(1)

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        return self._pool.submit(fn, *args, **kwargs)

    def shutdown(self, wait=True, **kwargs):
        self._pool.shutdown(wait=wait)


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    worker_kwargs={"executor": {"custom": CustomExecutor()}},
)
async def test_execute_other_executor(c, s, a):
    def f():
        context_meter.digest_metric("n", 1, "count")  # Can't reach the worker
        time.sleep(0.02)

    with dask.annotate(executor="custom"):
        x = c.submit(f, key="f-1")
    await x
    m = execute_digests(a, "f")
    assert set(m) == {
        ("deserialize", "seconds"),
        ("executor", "seconds"),
        ("other", "seconds"),
    }
    assert m["executor", "seconds"] >= 0.02


def raise_after_emitting():
    context_meter.digest_metric("n", 1, "count")
    time.sleep(0.01)
    raise ValueError("my error")


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_execute_failed(c, s, a):
    x = c.submit(raise_after_emitting, key="f-1")
    with pytest.raises(ValueError, match="my error"):
        await x
    # The task's own traceback is intact
    tb = await x.traceback()
    assert "raise_after_emitting" in "".join(traceback.format_tb(tb))
    [ev] = events_of(a, ExecuteFailureEvent, "f-1")
    # Non-time metrics are kept; all time is in one lump
    assert [(label, unit) for label, _, unit in ev.metrics] == [
        ("n", "count"),
        ("failed", "seconds"),
    ]
    m = execute_digests(a, "f")
    assert m == {(label, unit): value for label, value, unit in ev.metrics}
    assert m["failed", "seconds"] >= 0.01

    # startstops are unchanged
    assert [ss["action"] for ss in a.state.tasks["f-1"].startstops] == ["compute"]


@pytest.mark.parametrize(
    "value,unit,exc",
    [
        (float("nan"), "seconds", ValueError),
        (float("inf"), "count", ValueError),
        ("1", "count", TypeError),
        (1, None, TypeError),
    ],
)
@gen_cluster(client=True, nthreads=[("", 1)])
async def test_execute_bad_metric(c, s, a, value, unit, exc):
    """A task that emits a bad metric fails like any task raising, and the worker
    stays healthy
    """

    def f():
        context_meter.digest_metric("bad", value, unit)

    with pytest.raises(exc):
        await c.submit(f, key="f-1")
    assert a.status == Status.running
    assert await c.submit(emit_and_sleep, 1, key="g-1") == 2
    assert ("execute", "f", "failed", "seconds") in a.digests_total
    assert not any(k[2] == "bad" for k in activity_digests(a, "execute"))


def raise_in_failing_meter():
    def bad_callback(label, value, unit):
        raise RuntimeError("metering is broken")

    with context_meter.add_callback(bad_callback):
        with context_meter.meter("my-meter"):
            time.sleep(0.01)
            raise ValueError("my error")


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_metering_failure_does_not_hide_task_error(c, s, a):
    """If the metering fails while a task raises, the task's own error and traceback
    still reach the client, and the instruction keeps the metric
    """
    x = c.submit(raise_in_failing_meter, key="f-1")
    with pytest.raises(ValueError, match="my error"):
        await x
    tb = await x.traceback()
    assert "raise_in_failing_meter" in "".join(traceback.format_tb(tb))
    assert a.status == Status.running
    # The callbacks of the instruction were still called; as the task failed, its
    # seconds are in the failed lump
    [ev] = events_of(a, ExecuteFailureEvent, "f-1")
    assert [label for label, _, _ in ev.metrics] == ["failed"]
    assert ev.metrics[0][1] >= 0.01
    assert await c.submit(inc, 1, key="g-1") == 2


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_execute_cancelled(c, s, a):
    """A task cancelled while running puts all its time in the cancelled lump"""
    ev_in, ev_out = Event(), Event()

    def f(ev_in, ev_out):
        context_meter.digest_metric("n", 1, "count")
        ev_in.set()
        ev_out.wait()

    x = c.submit(f, ev_in, ev_out, key="f-1")
    await ev_in.wait()
    x.release()
    await wait_for_state("f-1", "cancelled", a)
    await ev_out.set()
    await async_poll_for(lambda: "f-1" not in a.state.tasks, timeout=5)

    [ev] = events_of(a, ExecuteSuccessEvent, "f-1")
    assert [(label, unit) for label, _, unit in ev.metrics] == [
        ("n", "count"),
        ("cancelled", "seconds"),
    ]
    assert execute_digests(a, "f") == {
        (label, unit): value for label, value, unit in ev.metrics
    }


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_execute_rescheduled(c, s, a):
    def f():
        context_meter.digest_metric("n", 1, "count")
        raise Reschedule()

    # Rescheduled forever on the only worker
    c.submit(f, key="f-1")
    await async_poll_for(lambda: events_of(a, RescheduleEvent, "f-1"), timeout=5)
    ev = events_of(a, RescheduleEvent, "f-1")[0]
    assert [(label, unit) for label, _, unit in ev.metrics] == [
        ("n", "count"),
        ("cancelled", "seconds"),
    ]
    evs = events_of(a, RescheduleEvent, "f-1")
    m = execute_digests(a, "f")
    # The worker may have re-run it meanwhile
    assert m["n", "count"] >= len(evs)
    assert set(m) == {("n", "count"), ("cancelled", "seconds")}


in_task = threading.Event()
block_task = threading.Event()


def emit_and_block():
    context_meter.digest_metric("n", 1, "count")
    in_task.set()
    block_task.wait(timeout=10)


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_worker_close_with_execute_in_flight(c, s, a):
    """No metric is lost or double counted when a worker closes while a task is
    running
    """
    in_task.clear()
    block_task.clear()
    c.submit(emit_and_block, key="f-1")
    await asyncio.get_running_loop().run_in_executor(None, in_task.wait)
    # Worker.close() waits for the thread pool
    close_task = asyncio.create_task(a.close())
    await async_poll_for(lambda: a.status == Status.closing, timeout=5)
    await async_poll_for(lambda: not a._async_instructions, timeout=5)
    block_task.set()
    await close_task

    # There is no event; the metrics are posted directly
    assert not events_of(a, ExecuteDoneEvent)
    m = execute_digests(a, "f")
    assert set(m) == {("n", "count"), ("cancelled", "seconds")}
    assert m["n", "count"] == 1
    assert not recording()


@gen_cluster(client=True)
async def test_gather_dep(c, s, a, b):
    x = c.submit(lambda: b"0" * 10_000_000, key="x", workers=[a.address])
    y = c.submit(len, x, key="y", workers=[b.address])
    assert await y == 10_000_000

    [ev] = events_of(b, GatherDepSuccessEvent)
    m = sum_metrics([ev])
    assert activity_digests(b, "gather-dep") == m
    assert {"network", "deserialize", "other"} <= {label for label, _ in m}
    assert all(unit == "seconds" for _, unit in m)
    assert m["network", "seconds"] > 0

    # The sender's side
    await async_poll_for(lambda: not a.transfer_outgoing_count, timeout=5)
    m = activity_digests(a, "get-data")
    assert {("network", "seconds"), ("serialize", "seconds")} <= set(m)

    # Upstream behaviour: startstops and transfer bookkeeping
    [startstop] = [
        ss for ss in b.state.tasks["y"].startstops if ss["action"] == "transfer"
    ]
    assert startstop["source"] == a.address
    assert b.state.transfer_incoming_bytes == 0
    assert not b.state.in_flight_workers
    assert list(b.transfer_incoming_log)[-1]["keys"] == {"x": pytest.approx(1e7, 0.01)}
    assert a.transfer_outgoing_count == 0
    assert a.transfer_outgoing_bytes == 0
    assert list(a.transfer_outgoing_log)[-1]["who"] == b.address
    assert "transfer-bandwidth" in b.digests_total
    assert not REMOVED_DIGESTS & set(a.digests_total)
    assert not REMOVED_DIGESTS & set(b.digests_total)


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_gather_dep_peer_dies(c, s, a):
    """A peer dies mid-transfer: the whole attempt goes in the failed lump"""
    async with BlockedGetData(s.address) as x:
        fx = c.submit(inc, 1, key="x", workers=[x.address], allow_other_workers=True)
        await wait_for_state("x", "memory", x)
        fy = c.submit(inc, fx, key="y", workers=[a.address])
        await x.in_get_data.wait()
        close_task = asyncio.create_task(x.close())
        # x is lost and recomputed on a
        assert await fy == 3
        x.block_get_data.set()
        await close_task

    evs = events_of(a, GatherDepDoneEvent)
    assert len(evs) == 1
    assert isinstance(evs[0], GatherDepNetworkFailureEvent)
    assert [label for label, _, _ in evs[0].metrics] == ["failed"]
    assert activity_digests(a, "gather-dep") == {
        ("failed", "seconds"): evs[0].metrics[0][1]
    }
    # gather_dep's story uses the vocabulary of later releases of upstream
    failed_logs = [ev for ev in a.state.log if ev[0] == "gather-dep-failed"]
    assert len(failed_logs) == 1
    assert failed_logs[0][1:3] == (x.address, {"x"})
    assert not any(ev[0] == "receive-dep-failed" for ev in a.state.log)
    assert evs[0].stimulus_id.startswith("gather-dep-failed-")
    # The story of the key tells it too
    assert any(e[0] == "gather-dep-failed" for e in a.state.story("x"))


@gen_cluster(client=True)
async def test_gather_dep_busy(c, s, a, b):
    a.transfer_outgoing_count_limit = 0  # Always busy
    x = c.submit(inc, 1, key="x", workers=[a.address])
    y = c.submit(inc, x, key="y", workers=[b.address])
    await async_poll_for(
        lambda: ("gather-dep", "busy", "seconds") in b.digests_total, 5
    )
    a.transfer_outgoing_count_limit = 10
    assert await y == 3
    evs = events_of(b, GatherDepDoneEvent)
    assert {ev.metrics[-1][0] for ev in evs} == {"busy", "other"}
    assert activity_digests(b, "gather-dep") == sum_metrics(evs)
    # gather_dep's story uses the vocabulary of later releases of upstream
    busy_logs = [ev for ev in b.state.log if ev[0] == "gather-dep-busy"]
    assert busy_logs[0][1:3] == (a.address, {"x"})
    assert not any(ev[0] == "busy-gather" for ev in b.state.log)


@gen_cluster(client=True)
async def test_gather_dep_missing(c, s, a, b):
    """The peer had none of the keys"""
    x = c.submit(inc, 1, key="x", workers=[a.address])
    await x
    async with BlockedGatherDep(s.address) as w:
        y = c.submit(inc, x, key="y", workers=[w.address])
        await w.in_gather_dep.wait()
        # Release x on a behind the scheduler's back; a tells the scheduler, which
        # recomputes x
        a.handle_stimulus(FreeKeysEvent(keys=["x"], stimulus_id="test"))
        w.block_gather_dep.set()
        assert await y == 3
        evs = events_of(w, GatherDepDoneEvent)
        assert evs[0].metrics[-1][0] == "missing"
        assert activity_digests(w, "gather-dep") == sum_metrics(evs)


@gen_cluster(client=True)
async def test_gather_dep_cancelled(c, s, a, b):
    """Data arrived, but no key ended in memory"""
    x = c.submit(inc, 1, key="x", workers=[a.address])
    await x
    async with BlockedGatherDep(s.address) as w:
        y = c.submit(inc, x, key="y", workers=[w.address])
        await wait_for_state("x", "flight", w)
        await w.in_gather_dep.wait()
        y.release()
        await wait_for_state("x", "cancelled", w)
        w.block_gather_dep.set()
        await async_poll_for(lambda: events_of(w, GatherDepDoneEvent), timeout=5)
        [ev] = events_of(w, GatherDepDoneEvent)
        assert isinstance(ev, GatherDepSuccessEvent)
        assert set(ev.data) == {"x"}
        assert [label for label, _, _ in ev.metrics] == ["cancelled"]
        assert activity_digests(w, "gather-dep") == sum_metrics([ev])


class _Unspillable:
    """Large enough to be spilled at once; cannot be pickled"""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __sizeof__(self) -> int:
        return 50_000_000


class _Sendable:
    """Large enough to be spilled at once; pickles fine, but arrives as an
    _Unspillable
    """

    def __reduce__(self) -> tuple:
        return _Unspillable, ()

    def __sizeof__(self) -> int:
        return 50_000_000


@gen_cluster(
    client=True,
    nthreads=[("", 1, {"memory_limit": "10 GB"}), ("", 1, {"memory_limit": "200 MB"})],
    config={
        "distributed.worker.memory.target": 0.1,
        "distributed.worker.memory.spill": False,
        "distributed.worker.memory.pause": False,
    },
)
async def test_gather_dep_fails_to_spill(c, s, a, b):
    """Data arrived, but failed to serialize as b spilled it: the attempt failed"""
    x = c.submit(_Sendable, key="x", workers=[a.address])
    y = c.submit(type, x, key="y", workers=[b.address])
    await wait_for_state("x", "error", b)
    [ev] = events_of(b, GatherDepDoneEvent)
    assert isinstance(ev, GatherDepSuccessEvent)
    assert b.state.tasks["x"].state == "error"
    assert {label for label, _, unit in ev.metrics if unit == "seconds"} == {"failed"}
    assert activity_digests(b, "gather-dep") == sum_metrics([ev])
    # Upstream 2023.3.1 leaves y waiting for x, which is in error, for ever
    y.release()
    await async_poll_for(lambda: "y" not in b.state.tasks, timeout=5)


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_worker_close_with_gather_dep_in_flight(c, s, a):
    x = c.submit(inc, 1, key="x", workers=[a.address])
    await x
    async with BlockedGatherDep(s.address) as w:
        c.submit(inc, x, key="y", workers=[w.address])
        await w.in_gather_dep.wait()
    assert set(activity_digests(w, "gather-dep")) == {("cancelled", "seconds")}
    assert not recording()


def n_callbacks(*args):
    return len(_callbacks_var.get())


def seceding(x):
    secede()
    return len(_callbacks_var.get())


@gen_cluster(client=True, nthreads=[("", 2)])
async def test_no_leaks(c, s, a):
    """After many tasks, including tasks that secede, every task sees exactly one
    callback (its own ledger's), and no ledger is left alive.
    """

    n_before = len(_callbacks_var.get())
    futs = c.map(seceding, range(5), key=[f"s-{i}" for i in range(5)])
    futs += c.map(n_callbacks, range(200), key=[f"n-{i}" for i in range(200)])
    assert set(await c.gather(futs)) == {1}
    assert len(_callbacks_var.get()) == n_before
    assert not a._async_instructions
    assert not recording()
    del futs
    gc.collect()
    assert not [
        o for o in gc.get_objects() if isinstance(o, InstructionMetricsRecorder)
    ]
    # 205 tasks, each counted once
    evs = events_of(a, ExecuteSuccessEvent)
    assert len(evs) == min(205, a.state.stimulus_log.maxlen or 205)


class _Canary:
    """An object in a reference cycle of its own"""

    def __init__(self) -> None:
        self.me = self


@contextlib.contextmanager
def cyclic_garbage() -> Iterator[list[object]]:
    """Collect in a list the objects that become garbage in the block and that
    only the cyclic garbage collector can free: those in reference cycles, and
    what they hold. The collector is off meanwhile; its settings, and whatever
    ``gc.garbage`` held before, are restored after.
    """
    gc.collect()
    enabled = gc.isenabled()
    debug = gc.get_debug()
    saved = gc.garbage[:]
    gc.garbage.clear()
    gc.disable()
    gc.set_debug(debug | gc.DEBUG_SAVEALL)
    found: list[object] = []
    try:
        yield found
        gc.collect()
        found.extend(gc.garbage)
    finally:
        gc.set_debug(debug)
        gc.garbage[:] = saved
        if enabled:
            gc.enable()


def is_metering(o: object) -> bool:
    """Whether ``o`` is an object of the fine metrics' own, or a context that holds
    one (the context of an instruction or of its task's thread)
    """
    if isinstance(o, contextvars.Context):
        return any(is_metering(v) for v in o.values())
    if isinstance(o, tuple):
        return any(is_metering(v) for v in o)
    return isinstance(o, InstructionMetricsRecorder) or (
        type(o).__module__ == "distributed.metrics"
    )


def seceding_and_rejoining(x):
    secede()
    rejoin()
    return x


@gen_cluster(
    client=True,
    nthreads=[("", 2), ("", 2)],
    worker_kwargs={"memory_limit": "1 GiB"},
    config=SPILL_AT_ONCE,
)
async def test_metering_leaves_no_cyclic_garbage(c, s, a, b):
    """The metering's objects are freed by reference counting as soon as an
    instruction is done, none by the cyclic garbage collector: a cycle per task
    would leave every task's recorder and contexts to the collector's passes.
    Tried with tasks in a thread, async tasks, tasks that secede and rejoin, a
    transfer between workers (gather-dep and get-data) and spilling.

    Not with failed tasks: upstream's ``apply_function_simple`` keeps the
    exception in the dict that the exception's traceback holds, a cycle that
    holds the frames of the task's thread up to the recorder's, which is then
    freed with it by the collector, as pristine frees the rest.
    """
    with cyclic_garbage() as garbage:
        canary = _Canary()
        futs = c.map(inc, range(20), key=[f"inc-{i}" for i in range(20)])
        futs += c.map(asyncinc, range(5), key=[f"async-{i}" for i in range(5)])
        futs += c.map(
            seceding_and_rejoining, range(3), key=[f"sec-{i}" for i in range(3)]
        )
        await c.gather(futs)
        x = c.submit(make_big, key="x", workers=[a.address])
        y = c.submit(len, x, key="y", workers=[b.address])
        assert await y == 2_000_000
        assert "x" in a.data.slow
        assert activity_digests(a, "get-data")
        assert activity_digests(b, "gather-dep")
        assert not a._async_instructions and not b._async_instructions
        del futs, x, y
        await async_poll_for(lambda: not s.tasks, timeout=5)
        canary_id = id(canary)
        del canary
    # The collector did find what only it can free
    assert any(id(o) == canary_id and isinstance(o, _Canary) for o in garbage)
    assert not [o for o in garbage if is_metering(o)]


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_stimulus_log_and_dump(c, s, a):
    await c.submit(emit_and_sleep, 1, key="f-1")
    [ev] = events_of(a, ExecuteSuccessEvent, "f-1")
    assert ev.metrics
    d = a._to_dict()
    [logged] = [
        e
        for e in d["stimulus_log"]
        if e["cls"] == "ExecuteSuccessEvent" and e["key"] == "f-1"
    ]
    assert len(logged["metrics"]) == len(ev.metrics)
    assert logged["metrics"][0] == ["deserialize", ev.metrics[0][1], "seconds"]


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_digests_int_stays_int(c, s, a):
    a.digest_metric("n", 1)
    a.digest_metric("n", 2)
    assert a.digests_total["n"] == 3
    assert type(a.digests_total["n"]) is int
    assert type(a.digests_max["n"]) is int
    a.digest_metric("x", 0.0)
    assert type(a.digests_total["x"]) is float
    assert type(a.digests_max["x"]) is float
    a.digest_metric("n", 0.5)
    assert a.digests_total["n"] == 3.5
    assert a.digests_max["n"] == 2
    # Tuple keys
    a.digest_metric(("foo", "bar"), 1)
    assert a.digests_total["foo", "bar"] == 1


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_digest_metrics(c, s, a):
    """Server.digest_metrics, which BaseWorker calls once per instruction, is the same
    as calling digest_metric for each metric under (*prefix, label, unit)
    """
    metrics = [("x", 1, "count"), ("y", 0.5, "seconds"), ("x", 2, "count")]
    a.digest_metrics(("foo",), metrics)
    assert a.digests_total["foo", "x", "count"] == 3
    assert type(a.digests_total["foo", "x", "count"]) is int
    assert a.digests_max["foo", "x", "count"] == 2
    assert a.digests_total["foo", "y", "seconds"] == 0.5
    # Long prefixes and labels of any hashable type
    a.digest_metrics(("foo", "bar"), [(("ping", "z"), 1.5, "seconds")])
    assert a.digests_total["foo", "bar", ("ping", "z"), "seconds"] == 1.5

    # Same as digest_metric; the scheduler has it too
    for server in (a, s):
        server.digest_metric(("baz", "x", "count"), 1)
        server.digest_metric(("baz", "x", "count"), 2)
        server.digest_metrics(("qux",), [("x", 1, "count"), ("x", 2, "count")])
        assert server.digests_total["baz", "x", "count"] == 3
        assert server.digests_total["qux", "x", "count"] == 3
        assert server.digests_max["baz", "x", "count"] == 2
        assert server.digests_max["qux", "x", "count"] == 2


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_digest_metrics_names(c, s, a):
    """digest_metrics builds the name of each digest once and reuses it. The same
    label under other units or prefixes stays apart, an equal prefix that is another
    object finds the same names, and so does a reset of the maximums (Prometheus
    clears them at every poll).
    """
    for _ in range(2):
        a.digest_metrics(("p",), [("x", 1, "count"), ("x", 0.5, "seconds")])
        a.digest_metrics(("q", "r"), [("x", 2, "count")])
    a.digest_metrics(tuple(["p"]), [("x", 1, "count")])
    assert a.digests_total["p", "x", "count"] == 3
    assert a.digests_total["p", "x", "seconds"] == 1.0
    assert a.digests_total["q", "r", "x", "count"] == 4

    a.digests_max.clear()
    a.digest_metrics(("p",), [("x", 0.25, "seconds")])
    assert a.digests_max == {("p", "x", "seconds"): 0.25}
    assert a.digests_total["p", "x", "seconds"] == 1.25
    (total_key,) = [k for k in a.digests_total if k == ("p", "x", "seconds")]
    (max_key,) = a.digests_max
    assert max_key is total_key


SPILL_LABELS = [
    (label, unit)
    for label in ("disk-write", "disk-read")
    for unit in ("seconds", "count", "bytes")
]


async def assert_spill_accounted(w: Worker) -> None:
    """Everything the SpillBuffer did is accounted for exactly once across the
    activities of the worker: nothing lost, nothing counted twice
    """
    assert isinstance(w.data, SpillBuffer)
    # get_data posts its metrics after the peer acknowledged receipt, which may
    # happen after the peer (e.g. the client) moved on
    await async_poll_for(lambda: not w.transfer_outgoing_count, timeout=5)
    totals: defaultdict = defaultdict(int)
    for k, v in w.digests_total.items():
        # Every activity; the threads are no activity
        if isinstance(k, tuple) and k[0] in set(FINE_METRICS_ACTIVITIES) - {"threads"}:
            totals[k[-2:]] += v
    for label, unit in SPILL_LABELS:
        expect = w.data.cumulative_metrics.get((label, unit), 0)
        if unit == "seconds":
            assert totals[label, unit] == pytest.approx(expect), (label, unit)
        else:
            assert totals[label, unit] == expect, (label, unit)
            assert type(totals[label, unit]) is int


def make_big(i=0):
    return b"0" * 2_000_000


@gen_cluster(
    client=True,
    nthreads=[("", 1), ("", 1)],
    worker_kwargs={"memory_limit": "1 GiB"},
    config=SPILL_AT_ONCE,
)
async def test_spill_and_unspill(c, s, a, b):
    x = c.submit(make_big, key="x", workers=[a.address])
    await wait_for_state("x", "memory", a)
    assert "x" in a.data.slow

    # Spilling the output is part of execute
    [ev] = events_of(a, ExecuteSuccessEvent, "x")
    m = sum_metrics([ev])
    assert m["disk-write", "count"] == 1
    assert m["disk-write", "bytes"] > 0
    assert type(m["disk-write", "bytes"]) is int
    assert m["disk-write", "seconds"] > 0
    assert m["serialize", "seconds"] > 0
    assert execute_digests(a, "x") == m

    # Unspilling the inputs is part of execute
    y = c.submit(len, x, key="y", workers=[a.address])
    assert await y == 2_000_000
    m = execute_digests(a, "y")
    assert m["disk-read", "count"] == 1
    assert m["disk-read", "bytes"] > 0
    assert m["disk-read", "seconds"] > 0
    assert m["deserialize", "seconds"] > 0

    # Sending spilled data is part of get-data; spilling what arrived is part of
    # gather-dep
    z = c.submit(len, x, key="z", workers=[b.address])
    assert await z == 2_000_000
    await async_poll_for(lambda: not a.transfer_outgoing_count, timeout=5)
    m = activity_digests(a, "get-data")
    assert m["disk-read", "count"] >= 1
    assert {("network", "seconds"), ("serialize", "seconds")} <= set(m)
    [ev] = events_of(b, GatherDepSuccessEvent)
    m = sum_metrics([ev])
    assert m["disk-write", "count"] == 1
    assert {"network", "deserialize", "serialize", "disk-write", "other"} <= {
        label for label, _ in m
    }
    assert activity_digests(b, "gather-dep") == m

    await assert_spill_accounted(a)
    await assert_spill_accounted(b)
    assert not activity_digests(a, "memory-monitor")
    assert not REMOVED_DIGESTS & set(a.digests_total)


@gen_cluster(
    client=True,
    nthreads=[("", 1), ("", 1)],
    worker_kwargs={"memory_limit": "1 GiB"},
    config={
        **SPILL_AT_ONCE,
        "distributed.worker.memory.rebalance.measure": "managed",
        "distributed.worker.memory.rebalance.sender-min": 0,
        "distributed.worker.memory.rebalance.recipient-max": 1,
        "distributed.worker.memory.rebalance.sender-recipient-gap": 0,
    },
)
async def test_scatter_replicate_and_rebalance(c, s, a, b):
    """Data given to a worker outside of its tasks is metered too: storing what
    a client scatters is update-data; fetching keys from peers for the scheduler
    (rebalance, replicate) is gather, and storing them is update-data again
    """
    x, y = await c.scatter([b"x" * 2_000_000, b"y" * 2_000_000], workers=[a.address])
    assert {x.key, y.key} <= set(a.data.slow)
    m = activity_digests(a, "update-data")
    assert m["disk-write", "count"] == 2
    assert type(m["disk-write", "bytes"]) is int
    assert m["disk-write", "bytes"] == a.data.cumulative_metrics["disk-write", "bytes"]
    assert set(m) == SPILLING
    assert not activity_digests(a, "gather")
    assert not activity_digests(b, "update-data")

    # One of the two moves to b
    await c.rebalance([x, y])
    assert len(b.data.slow) == 1
    m = activity_digests(b, "gather")
    # What arrived was deserialized (and decompressed, with lz4 installed); spilling
    # it is not gather's
    assert (
        {("network", "seconds"), ("deserialize", "seconds"), ("other", "seconds")}
        <= set(m)
        <= {
            ("network", "seconds"),
            ("deserialize", "seconds"),
            ("decompress", "seconds"),
            ("other", "seconds"),
        }
    )
    assert m["network", "seconds"] > 0
    assert activity_digests(b, "update-data")["disk-write", "count"] == 1

    # The other one is copied to b
    await c.replicate([x, y], n=2)
    assert len(b.data.slow) == 2
    assert activity_digests(b, "update-data")["disk-write", "count"] == 2
    assert activity_digests(b, "gather")["network", "seconds"] > m["network", "seconds"]
    # a sent both, unspilling them first
    await async_poll_for(lambda: not a.transfer_outgoing_count, timeout=5)
    assert activity_digests(a, "get-data")["disk-read", "count"] == 2

    await assert_spill_accounted(a)
    await assert_spill_accounted(b)
    assert not activity_digests(a, "memory-monitor")
    assert not activity_digests(b, "memory-monitor")


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    worker_kwargs={"memory_limit": "1 GiB"},
    config=SPILL_AT_ONCE,
)
async def test_update_data_from_a_task(c, s, a):
    """A task that stores data on its worker itself: the spilling is the task's, and
    counted once
    """

    async def store():
        get_worker().update_data({"stored": b"s" * 2_000_000})

    await c.submit(store, key="store-1")
    assert "stored" in a.data.slow
    assert execute_digests(a, "store")["disk-write", "count"] == 1
    assert not activity_digests(a, "update-data")
    await assert_spill_accounted(a)


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_meter_activity_failed(c, s, a):
    """A block of an activity that raises keeps its counts and bytes, and lumps its
    seconds into "failed"
    """
    with pytest.raises(ZeroDivisionError):
        with a._meter_activity("update-data"):
            context_meter.digest_metric("serialize", 0.5, "seconds")
            context_meter.digest_metric("disk-write", 10, "bytes")
            1 / 0
    m = activity_digests(a, "update-data")
    assert set(m) == {("disk-write", "bytes"), ("failed", "seconds")}
    assert m["disk-write", "bytes"] == 10
    assert 0 <= m["failed", "seconds"] < 0.5


class SlowSizeof:
    """Data whose sizeof() takes 0.2 s (e.g. a pandas frame of Python objects)"""

    def __init__(self):
        self.payload = b"x" * 1000


@sizeof.register(SlowSizeof)
def _sizeof_slow(obj):
    time.sleep(0.2)
    return 1000


def payload_len(obj: SlowSizeof) -> int:
    return len(obj.payload)


@gen_cluster(client=True, nthreads=[("", 1)] * 2)
async def test_get_data_other(c, s, a, b):
    """get-data's seconds that no label takes, e.g. sizeof() of the keys that it
    unspills, are its ``other``; spilling the keys that unspilling pushes out is
    part of it too
    """
    x = c.submit(SlowSizeof, key="x", workers=[a.address])
    await wait_for_state("x", "memory", a)
    assert a.data.evict() > 0
    assert "x" in a.data.slow
    y = c.submit(payload_len, x, key="y", workers=[b.address])
    assert await y == 1000
    await async_poll_for(lambda: not a.transfer_outgoing_count, timeout=5)
    m = activity_digests(a, "get-data")
    assert m["disk-read", "count"] == 1
    # sizeof() of x, outside of every other label, at least once
    assert m["other", "seconds"] >= 0.2


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_get_data_requester_goes_away(c, s, a):
    """A requester that closes the connection instead of acknowledging receipt:
    the attempt failed, and its seconds are not network time
    """
    x = c.submit(lambda: b"0" * 1_000_000, key="x")
    await wait_for_state("x", "memory", a)
    comm = await connect(a.address)
    try:
        await comm.write({"op": "get_data", "keys": ["x"], "reply": True})
        response = await comm.read()
        assert set(response["data"]) == {"x"}
    finally:
        comm.abort()
    await async_poll_for(lambda: not a.transfer_outgoing_count, timeout=5)
    m = activity_digests(a, "get-data")
    assert {label for label, unit in m if unit == "seconds"} == {"failed"}
    # What is not seconds stays
    assert m["memory-read", "count"] == 1
    # Upstream behaviour: the bookkeeping of the transfer is undone
    assert a.transfer_outgoing_bytes == 0
    assert not a.transfer_outgoing_log


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_memory_monitor_other(c, s, a):
    """The memory monitor's seconds that no label takes, e.g. sizeof() of the key
    that it spills, are its ``other``
    """
    x = c.submit(SlowSizeof, key="x")
    await wait_for_state("x", "memory", a)
    assert "x" in a.data.fast
    assert WorkerMemoryManager._evict(a, a.data) > 0
    assert "x" in a.data.slow
    m = activity_digests(a, "memory-monitor")
    assert m["disk-write", "count"] == 1
    assert m["other", "seconds"] >= 0.2
    assert set(m) == SPILLING


MONITOR_CONFIG = {
    "distributed.worker.memory.target": False,
    "distributed.worker.memory.spill": 0.7,
    "distributed.worker.memory.pause": False,
    "distributed.worker.memory.monitor-interval": "10ms",
}


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    worker_kwargs={"memory_limit": "1 GiB"},
    config=MONITOR_CONFIG,
)
async def test_memory_monitor_failed_eviction(c, s, a):
    """An eviction that fails (here, the value fails to pickle) is not spilling: its
    seconds are ``failed``, at every tick that tries again
    """
    a.monitor.get_process_memory = lambda: 2**40
    x = c.submit(_Unspillable, key="x")
    await wait_for_state("x", "memory", a)
    key = ("memory-monitor", "failed", "seconds")
    await async_poll_for(lambda: key in a.digests_total, timeout=5)
    first = a.digests_total[key]
    await async_poll_for(lambda: a.digests_total[key] > first, timeout=5)
    assert "x" in a.data.fast
    m = activity_digests(a, "memory-monitor")
    assert {label for label, unit in m if unit == "seconds"} == {"failed"}
    assert ("disk-write", "count") not in m
    del x


class BigSizeof:
    """Small to pickle, but a large share of the memory limit to the monitor"""

    def __sizeof__(self) -> int:
        return 500 * 2**20


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    worker_kwargs={"memory_limit": "1 GiB"},
    config=MONITOR_CONFIG,
)
async def test_memory_monitor_gc_and_measuring(c, s, a):
    """Between evictions, the spill loop measures the process memory and, once it
    evicted more than it needed to and the memory is still high, collects garbage:
    both are the memory monitor's, as ``other`` and ``gc``
    """

    def get_process_memory() -> int:
        time.sleep(0.01)
        return 2**30 if a.data.fast else 0

    def collect() -> None:
        time.sleep(0.05)

    futs = c.map(lambda i: BigSizeof(), range(2), key=["big-0", "big-1"])
    await c.gather(futs)
    a.memory_manager._throttled_gc.collect = collect
    a.monitor.get_process_memory = get_process_memory
    await async_poll_for(lambda: not a.data.fast, timeout=5)
    m = activity_digests(a, "memory-monitor")
    assert m["disk-write", "count"] == 2
    # Once, after the first eviction: 500 MiB is more than the 300 MiB needed
    assert m["gc", "seconds"] >= 0.05
    # Three measurements, and the rest of two evictions
    assert m["other", "seconds"] >= 0.03


def read_and_block(x, ev_in, ev_out):
    ev_in.set()
    ev_out.wait()
    return len(x)


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    worker_kwargs={"memory_limit": "1 GiB"},
    config={
        "distributed.worker.memory.target": False,
        "distributed.worker.memory.spill": 0.7,
        "distributed.worker.memory.pause": False,
        "distributed.worker.memory.monitor-interval": "10ms",
    },
)
async def test_memory_monitor(c, s, a):
    """The memory monitor spills concurrently with a running task. Its metrics
    don't land in the task's, nor the other way round.
    """
    # Spill everything, as soon as possible
    a.monitor.get_process_memory = lambda: 2**40 if a.data.fast else 0

    x = c.submit(make_big, key="x")
    await async_poll_for(lambda: "x" in a.data.slow, timeout=5)
    m = activity_digests(a, "memory-monitor")
    assert m["disk-write", "count"] == 1
    assert type(m["disk-write", "count"]) is int
    assert m["disk-write", "bytes"] > 0
    assert m["serialize", "seconds"] > 0
    assert ("disk-write", "seconds") in m
    assert set(execute_digests(a, "x")) == {
        ("deserialize", "seconds"),
        ("thread-cpu", "seconds"),
        ("thread-noncpu", "seconds"),
        ("other", "seconds"),
    }

    # The task unspills x, then the memory monitor spills it again while the task
    # is running
    ev_in, ev_out = Event(), Event()
    y = c.submit(read_and_block, x, ev_in, ev_out, key="y")
    await ev_in.wait()
    await async_poll_for(lambda: "x" in a.data.slow, timeout=5)
    assert activity_digests(a, "memory-monitor")["disk-write", "count"] == 2
    await ev_out.set()
    assert await y == 2_000_000

    [ev] = events_of(a, ExecuteSuccessEvent, "y")
    labels = {label for label, _, _ in ev.metrics}
    assert "disk-read" in labels
    assert "disk-write" not in labels
    m = activity_digests(a, "memory-monitor")
    # x twice, and possibly the output of y
    assert m["disk-write", "count"] >= 2
    assert not any(label == "disk-read" for label, _ in m)
    await assert_spill_accounted(a)


@gen_cluster(
    client=True,
    worker_kwargs={"memory_limit": "1 GiB"},
    config={
        "distributed.worker.memory.target": False,
        "distributed.worker.memory.spill": 0.7,
        "distributed.worker.memory.pause": False,
        "distributed.worker.memory.monitor-interval": "10ms",
    },
)
async def test_memory_monitor_and_transfers(c, s, a, b):
    """The memory monitors spill concurrently with get_data and gather_dep. Their
    metrics don't mix.
    """
    for w in (a, b):
        w.monitor.get_process_memory = lambda w=w: 2**40 if w.data.fast else 0

    x = c.submit(make_big, key="x", workers=[a.address])
    await async_poll_for(lambda: "x" in a.data.slow, timeout=5)
    z = c.submit(len, x, key="z", workers=[b.address])
    assert await z == 2_000_000
    await async_poll_for(lambda: "x" in b.data.slow, timeout=5)

    # a unspilled x to send it
    await async_poll_for(lambda: not a.transfer_outgoing_count, timeout=5)
    assert activity_digests(a, "get-data")["disk-read", "count"] == 1
    # b spilled x after it arrived, in the memory monitor
    [ev] = events_of(b, GatherDepSuccessEvent)
    assert not any(label.startswith("disk-") for label, _, _ in ev.metrics)
    assert activity_digests(b, "gather-dep") == sum_metrics([ev])
    assert activity_digests(b, "memory-monitor")["disk-write", "count"] >= 1
    await assert_spill_accounted(a)
    await assert_spill_accounted(b)


@pytest.mark.slow
@gen_cluster(client=True, nthreads=[("", 2)], timeout=120)
async def test_no_leaks_many_tasks(c, s, a):
    """Thousands of tasks leave no recorder alive. The count is exact (gc), so it
    needs enough tasks to span many batches, not a fixed wall time; a task costs
    a few ms here, on a slow runner several times more.
    """
    n = 2_000
    futs = c.map(n_callbacks, range(n), key=[f"n-{i}" for i in range(n)])
    assert set(await c.gather(futs)) == {1}
    del futs
    assert not recording()
    gc.collect()
    assert not [
        o for o in gc.get_objects() if isinstance(o, InstructionMetricsRecorder)
    ]
    assert a.digests_total["execute", "n", "thread-cpu", "seconds"] > 0


def use_worker_client(x):
    return get_client().submit(inc, x, key=f"inner-{x}").result()


async def use_worker_client_async(x):
    return await get_client().submit(inc, x, key=f"inner-{x}")


@pytest.mark.parametrize("func", [use_worker_client, use_worker_client_async])
@gen_cluster(client=False, nthreads=[("", 2)])
async def test_worker_client_does_not_inherit_task_metrics(s, a, func):
    """The client that a worker creates when a task first calls get_client() must
    not inherit the task's context: its background tasks would keep dispatching
    their metrics to the callbacks of that task forever.
    """
    async with Client(s.address, asynchronous=True, set_as_default=False) as c:
        assert await c.submit(func, 1, key="outer-1") == 2
        assert a._client is not None
        assert a._client is not c
        # The periodic callbacks of the client are rescheduled, forever, in a copy
        # of the context where they were started
        for pc in a._client._periodic_callbacks.values():
            assert pc._timeout._context.get(_callbacks_var, ()) == ()


started_by_tasks: list[PeriodicCallback] = []
n_periodic_runs = 0


def start_periodic_callback():
    """Start, on the worker's event loop, a periodic callback that outlives the
    task, like e.g. a Semaphore does
    """

    def cb():
        global n_periodic_runs
        n_periodic_runs += 1
        context_meter.digest_metric("periodic", 1, "count")

    pc = PeriodicCallback(cb, 10)
    started_by_tasks.append(pc)
    get_worker().loop.add_callback(pc.start)


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_ledger_does_not_outlive_instruction(c, s, a):
    """Whatever a task starts that outlives it inherits its context, but must
    neither feed nor keep alive the metrics of its Execute instruction
    """
    started_by_tasks.clear()
    try:
        await c.submit(start_periodic_callback, key="f-1")
        [ev] = events_of(a, ExecuteSuccessEvent, "f-1")
        n_metrics = len(ev.metrics)
        digests = execute_digests(a, "f")
        [pc] = started_by_tasks
        # Wait for the periodic callback to run a few times after the task
        n0 = n_periodic_runs
        await async_poll_for(lambda: n_periodic_runs > n0 + 3, timeout=5)

        assert len(ev.metrics) == n_metrics
        assert execute_digests(a, "f") == digests
        assert not any(label == "periodic" for label, _ in digests)
        # The recorder lives on in the context of the periodic callback, but has
        # let go of the metrics of the instruction
        gc.collect()
        recorders = [
            o for o in gc.get_objects() if isinstance(o, InstructionMetricsRecorder)
        ]
        assert len(recorders) == 1
        assert recorders[0].prefix == ("execute", "f")
        assert recorders[0].metrics is None
    finally:
        for pc in started_by_tasks:
            pc.stop()


class BigUnpicklable:
    def __sizeof__(self):
        return 2_000_000

    def __reduce__(self):
        raise TypeError("can't pickle me")


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    worker_kwargs={"memory_limit": "1 GiB"},
    config=SPILL_AT_ONCE,
)
async def test_execute_output_fails_to_spill(c, s, a):
    """The output of the task is too large for memory and fails to serialize: the
    task fails, and its time goes in the failed lump
    """
    x = c.submit(BigUnpicklable, key="x")
    with pytest.raises(TypeError, match="Could not serialize"):
        await x
    [ev] = events_of(a, ExecuteSuccessEvent, "x")
    assert [label for label, _, _ in ev.metrics] == ["failed"]
    assert execute_digests(a, "x") == sum_metrics([ev])
    assert a.status == Status.running
    await assert_spill_accounted(a)


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    worker_kwargs={"memory_limit": "1 GiB"},
    config={
        "distributed.worker.memory.target": False,
        "distributed.worker.memory.spill": 0.7,
        "distributed.worker.memory.pause": 0.8,
        "distributed.worker.memory.monitor-interval": "10ms",
    },
)
async def test_memory_monitor_unpauses(c, s, a):
    """The memory monitor's periodic callback unpauses the worker, which starts a
    task from within it. The task's metrics don't land in the memory monitor.
    """
    memory = 0
    a.monitor.get_process_memory = lambda: memory
    # Fill the only thread, so that the next task waits on the worker
    ev = Event()
    blocker = c.submit(lambda ev: ev.wait(), ev, key="blocker")
    await wait_for_state("blocker", "executing", a)
    x = c.submit(emit_and_sleep, 1, key="f-1")
    await wait_for_state("f-1", "ready", a)
    memory = 2**40
    await async_poll_for(lambda: a.status == Status.paused, timeout=5)
    await ev.set()
    await blocker
    assert a.state.tasks["f-1"].state == "ready"
    memory = 0
    assert await x == 2
    assert a.status == Status.running
    assert execute_digests(a, "f")[("ping", "x"), "count"] == 1
    # The memory monitor may have spilled the output of blocker, and nothing else
    m = activity_digests(a, "memory-monitor")
    assert {label for label, _ in m} <= {
        "serialize",
        "compress",
        "disk-write",
        "gc",
        "other",
    }
    await assert_spill_accounted(a)


class SteppedWallClock:
    """The wall clock of the worker, which an NTP daemon may step"""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


STEPPED_WALL_CLOCK = SteppedWallClock()


def step_the_wall_clock() -> int:
    STEPPED_WALL_CLOCK.offset += 100.0
    return 1


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_wall_clock_stepped_during_a_task(c, s, a, monkeypatch):
    """A task's phase in its thread is timed by a monotonic clock: a step of the
    wall clock meanwhile does not add to its seconds
    """
    monkeypatch.setattr("distributed.worker.time", STEPPED_WALL_CLOCK)
    assert await c.submit(step_the_wall_clock, key="step-1") == 1
    seconds = {
        label: v
        for (label, unit), v in execute_digests(a, "step").items()
        if unit == "seconds"
    }
    assert set(seconds) == {"deserialize", "thread-cpu", "thread-noncpu", "other"}
    assert sum(seconds.values()) < 1, seconds


def test_apply_function_simple_msg():
    """apply_function_simple returns the CPU time of its thread next to what it
    returned upstream, and needs no metering context
    """
    msg = apply_function_simple(busy, (0.05,), {}, 1000)
    assert set(msg) == {
        "op",
        "status",
        "result",
        "nbytes",
        "type",
        "start",
        "stop",
        "thread",
        "elapsed",
        "cpu",
    }
    assert msg["op"] == "task-finished"
    assert msg["thread"] == threading.get_ident()
    # time_delay shifts start and stop, not the durations
    assert msg["start"] > time.time() + 900
    assert msg["elapsed"] == pytest.approx(msg["stop"] - msg["start"], abs=0.01)
    assert 0.04 <= msg["cpu"] <= msg["elapsed"] + 0.01

    msg = apply_function_simple(raise_after_emitting, (), {}, 0)
    assert msg["op"] == "task-erred"
    assert isinstance(msg["actual-exception"], ValueError)
    keys = {"exception", "traceback", "start", "stop", "thread", "elapsed", "cpu"}
    assert keys <= set(msg)
    assert 0 <= msg["cpu"] <= msg["elapsed"] + 0.01


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_execute_not_metered(c, s, a, monkeypatch):
    """Worker.execute also works outside of a metered instruction, e.g. when a
    subclass starts its instructions without a recorder: nothing is recorded or
    posted, and no thread is counted as held
    """
    start = a._start_async_instruction
    monkeypatch.setattr(
        a,
        "_start_async_instruction",
        lambda coro, name, prefix: start(coro, name, None),
    )
    assert await c.submit(emit_and_sleep, 1, key="f-1") == 2
    [ev] = events_of(a, ExecuteSuccessEvent, "f-1")
    assert ev.metrics == []
    assert not execute_digests(a, "f")
    assert a.thread_seconds.busy == 0


def big_run_spec_func(x):
    return x + 1


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_execute_deserialize_offloaded(c, s, a, monkeypatch):
    """A large run_spec is deserialized in the offload thread; it is still metered
    as deserialize, once
    """
    monkeypatch.setattr("distributed.worker.OFFLOAD_THRESHOLD", 1)
    t0 = time.perf_counter()
    assert await c.submit(big_run_spec_func, 1, key="f-1") == 2
    elapsed = time.perf_counter() - t0
    [ev] = events_of(a, ExecuteSuccessEvent, "f-1")
    labels = [label for label, _, _ in ev.metrics]
    assert labels == ["deserialize", "thread-cpu", "thread-noncpu", "other"]
    m = {label: value for label, value, _ in ev.metrics}
    assert 0 <= m["deserialize"] <= elapsed
    assert sum(m.values()) <= elapsed


def timed_busy(seconds: float) -> tuple[float, float]:
    """busy(), returning the wall and CPU time it took"""
    t0, c0 = time.perf_counter(), time.thread_time()
    busy(seconds)
    return time.perf_counter() - t0, time.thread_time() - c0


def burn_then_metered_sleep():
    out = timed_busy(0.2)
    with context_meter.meter("my-sleep"):
        time.sleep(0.2)
    return out


def burn_then_bare_seconds():
    out = timed_busy(0.2)
    time.sleep(0.2)
    context_meter.digest_metric("my-sleep", 0.2, "seconds")
    return out


@pytest.mark.parametrize("func", [burn_then_metered_sleep, burn_then_bare_seconds])
@gen_cluster(client=True, nthreads=[("", 1)])
async def test_execute_task_meters_its_own_time(c, s, a, func):
    """The seconds that a task meters come out of the right phase of its thread: a
    meter block by the CPU time it took and the rest; bare seconds out of the
    non-CPU time first
    """
    busy_wall, busy_cpu = await c.submit(func, key="f-1")
    m = execute_digests(a, "f")
    assert m["my-sleep", "seconds"] >= 0.2
    # All the CPU time of the task is the busy loop's; so is all its non-CPU time
    # but the sleep (on a busy machine, the loop takes more wall time than CPU time)
    # (0.1 s of slack, for a busy machine: waiting for the GIL around the loop)
    assert m["thread-cpu", "seconds"] == pytest.approx(busy_cpu, abs=0.1)
    assert m["thread-noncpu", "seconds"] == pytest.approx(busy_wall - busy_cpu, abs=0.1)
    # Additive: the thread's phase is broken down exactly (see
    # test_execute_thread_pool)
    [startstop] = a.state.tasks["f-1"].startstops
    compute = startstop["stop"] - startstop["start"]
    parts = ("thread-cpu", "thread-noncpu", "my-sleep")
    assert sum(m[label, "seconds"] for label in parts) == pytest.approx(
        compute, abs=1e-3
    )


def start_work_on_loop():
    """Start work on the worker's event loop that digests seconds both while the task
    still runs and after it finished, through add_callback and sync()
    """
    w = get_worker()
    ran = threading.Event()

    def digest(label):
        context_meter.digest_metric(label, 10.0, "seconds")
        with context_meter.meter(f"{label}-block"):
            pass

    def while_running():
        digest("add-callback")
        ran.set()

    async def after_finished():
        await asyncio.sleep(0.1)
        digest("later")
        loop_work_done.set()

    async def synced():
        digest("sync")

    w.loop.add_callback(while_running)
    assert ran.wait(5)
    sync(w.loop, synced)
    w.loop.add_callback(after_finished)
    time.sleep(0.05)


async def start_work_on_loop_async():
    """An async task that starts another asyncio task, which digests seconds while
    the task runs and after it finished
    """
    ran = asyncio.Event()

    async def background():
        context_meter.digest_metric("background", 10.0, "seconds")
        ran.set()
        await asyncio.sleep(0.1)
        context_meter.digest_metric("later", 10.0, "seconds")
        loop_work_done.set()

    bg_tasks.add(asyncio.create_task(background()))
    await ran.wait()
    await asyncio.sleep(0.05)


loop_work_done = threading.Event()
bg_tasks: set[asyncio.Task] = set()


@pytest.mark.parametrize("func", [start_work_on_loop, start_work_on_loop_async])
@gen_cluster(client=True, nthreads=[("", 1)])
async def test_work_started_by_task_is_not_the_task(c, s, a, func):
    """What a task starts on the event loop, and what runs there after it finished,
    is not part of the task: it doesn't feed its metrics, and its seconds don't come
    out of the task's phases
    """
    loop_work_done.clear()
    t0 = time.perf_counter()
    await c.submit(func, key="f-1")
    elapsed = time.perf_counter() - t0
    await async_poll_for(loop_work_done.is_set, timeout=5)

    [ev] = events_of(a, ExecuteSuccessEvent, "f-1")
    labels = [label for label, _, _ in ev.metrics]
    assert labels == ["deserialize", "thread-cpu", "thread-noncpu", "other"] or (
        labels == ["deserialize", "thread-noncpu", "other"]
    )
    m = execute_digests(a, "f")
    assert set(m) == {(label, "seconds") for label in labels}
    # The 0.05 s that the task slept are still in its thread phase
    assert m["thread-noncpu", "seconds"] >= 0.04
    assert sum(m.values()) <= elapsed
    bg_tasks.clear()


request_id: contextvars.ContextVar[str] = contextvars.ContextVar(
    "request_id", default="unset"
)


def read_request_id():
    return request_id.get()


async def read_request_id_async():
    return request_id.get()


@gen_test()
async def test_context_variables_seen_by_tasks_and_handlers():
    """A context variable set before the worker starts (by a tracing library, say)
    is seen by sync and async tasks, and by handlers
    """
    token = request_id.set("r-1")
    try:
        async with Scheduler(dashboard_address=":0") as s:
            async with Worker(s.address, nthreads=1) as w:
                async with Client(s.address, asynchronous=True) as c:
                    assert await c.submit(read_request_id, key="f-1") == "r-1"
                    assert await c.submit(read_request_id_async, key="g-1") == "r-1"
                    assert await c.run(read_request_id) == {w.address: "r-1"}

                    # Still metered as usual
                    def labels(prefix):
                        return {
                            k[2]
                            for k in w.digests_total
                            if k[:2] == ("execute", prefix) and k[3] == "seconds"
                        }

                    assert labels("f") == {
                        "deserialize",
                        "thread-cpu",
                        "thread-noncpu",
                        "other",
                    }
                    assert labels("g") == {"deserialize", "thread-noncpu", "other"}
    finally:
        request_id.reset(token)


class SampledDigest:
    """Stands for ``distributed.counter.Digest`` (which needs crick): the values
    added to it
    """

    def __init__(self) -> None:
        self.values: list[float] = []

    def add(self, value: float) -> None:
        self.values.append(value)

    def shift(self) -> None:
        pass


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_fine_metrics_are_not_granular_digests(c, s, a):
    """With crick, a worker keeps a distribution for each of its digests
    (``Worker.digests``, which the Counters page of its dashboard draws, a figure
    per str name): the fine metrics are totals, under tuples, and stay out of it;
    the other digests are kept as before
    """
    a.digests = defaultdict(SampledDigest)
    await c.submit(inc, 1, key="inc-1")
    a.digest_metric("latency", 0.25)
    assert any(is_fine_metric(name) for name in a.digests_total)
    # And the worker's own, e.g. tick-duration, as they come
    assert all(isinstance(name, str) for name in a.digests)
    assert {"task-duration", "latency"} <= set(a.digests)
    assert a.digests["latency"].values == [0.25]
