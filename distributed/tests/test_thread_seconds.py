"""Every thread-second of a worker accounted for: busy running tasks, or idle by
cause; seceded tasks; tasks still running posted as they go.
"""
from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor

import pytest

import dask

from distributed import Event, WorkerPlugin
from distributed import metrics as metrics_module
from distributed import rejoin, secede, threadpoolexecutor, worker_client
from distributed.core import Status
from distributed.metrics import ThreadSecondsAccount, context_meter, is_fine_metric
from distributed.tests.test_worker_metrics import CustomExecutor
from distributed.utils_test import (
    BlockedGetData,
    async_poll_for,
    captured_logger,
    gen_cluster,
    inc,
)
from distributed.worker_state_machine import InstructionMetricsRecorder


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_account_partitions_the_threads_seconds():
    clock = FakeClock()
    account = ThreadSecondsAccount(2, "idle-no-tasks", func=clock)
    account.acquire(1.0)
    clock.now = 3.0
    account.set_idle_label("idle-paused")
    account.acquire(4.0)
    account.release(5.0)
    account.release(5.0)
    clock.now = 6.0
    account.advance()
    # 0-1: 2 idle; 1-3: 1 busy, 1 idle; 3-4: 1 busy, 1 paused; 4-5: 2 busy;
    # 5-6: 2 paused
    assert account.totals == pytest.approx(
        {"busy": 2.0 + 1.0 + 2.0, "idle-no-tasks": 2.0 + 2.0, "idle-paused": 1.0 + 2.0}
    )
    assert sum(account.totals.values()) == pytest.approx(2 * 6.0)
    assert account.last - account.start == 6.0


def test_account_counts_the_threads_taken_now():
    """What threads still taken did so far is busy, up to the last advance()"""
    clock = FakeClock()
    account = ThreadSecondsAccount(1, "idle-no-tasks", func=clock)
    account.acquire(1.0)
    clock.now = 4.0
    account.advance()
    assert account.totals == {"busy": 3.0, "idle-no-tasks": 1.0}
    clock.now = 5.0
    assert account.totals == {"busy": 3.0, "idle-no-tasks": 1.0}
    account.advance()
    assert account.totals == {"busy": 4.0, "idle-no-tasks": 1.0}


def test_account_with_more_threads_taken_than_the_pool_has():
    """e.g. the task the state machine starts after a rejoin(), which waits for a
    thread in the executor's queue: only as many threads as the pool has count
    """
    clock = FakeClock()
    account = ThreadSecondsAccount(1, "idle-no-tasks", func=clock)
    account.acquire(0.0)
    account.acquire(1.0)
    account.release(2.0)
    account.release(4.0)
    clock.now = 5.0
    account.advance()
    assert account.totals == {"busy": 4.0, "idle-no-tasks": 1.0}


def test_account_told_late_does_not_rewrite_what_it_counted():
    """A thread taken or given back before the last advance() counts from then:
    the owner learns it late (see call_soon_threadsafe), and no label ever
    decreases
    """
    clock = FakeClock()
    account = ThreadSecondsAccount(1, "idle-no-tasks", func=clock)
    account.acquire(0.0)
    clock.now = 3.0
    account.advance()
    assert account.totals == {"busy": 3.0, "idle-no-tasks": 0.0}
    account.release(1.0)  # given back at 1.0, told at 3.0
    clock.now = 4.0
    account.advance()
    assert account.totals == {"busy": 3.0, "idle-no-tasks": 1.0}
    account.acquire(3.5)  # taken at 3.5, told at 4.0
    clock.now = 5.0
    account.advance()
    assert account.totals == {"busy": 4.0, "idle-no-tasks": 1.0}


def test_account_told_late_does_not_rewrite_an_idle_label():
    """A thread taken before the idle label last changed counts from that change:
    the idle seconds already attributed to a label stay, also when the label
    changed twice since the last advance()
    """
    clock = FakeClock()
    account = ThreadSecondsAccount(2, "idle-no-tasks", func=clock)
    clock.now = 1.0
    account.advance()
    before = account.totals
    account.set_idle_label("idle-fetching-inputs")  # at 1.0
    clock.now = 3.0
    account.set_idle_label("idle-no-tasks")  # at 3.0
    account.acquire(2.0)  # taken at 2.0 (a rejoin() in a task's thread), told now
    clock.now = 3.1
    account.advance()
    after = account.totals
    assert all(after[label] >= value for label, value in before.items())
    assert after == {
        "busy": pytest.approx(0.1),
        "idle-no-tasks": pytest.approx(2.1),
        "idle-fetching-inputs": pytest.approx(4.0),
    }
    assert sum(after.values()) == pytest.approx(2 * 3.1)


def test_account_told_late_counts_no_thread_twice():
    """A thread taken back at 3.0 (a rejoin() in a task's thread) and told after the
    owner handled a thread given back at 5.0 (the end of another task): on a pool
    of one thread, both are not counted between 3.0 and 5.0
    """
    clock = FakeClock()
    account = ThreadSecondsAccount(1, "idle-no-tasks", func=clock)
    account.acquire(0.0)
    account.release(5.0)
    account.acquire(3.0)
    clock.now = 6.0
    account.advance()
    assert account.totals == {"busy": 6.0, "idle-no-tasks": 0.0}
    account.release(5.5)  # Given back at 5.5, told after the advance() at 6.0
    clock.now = 7.0
    account.advance()
    assert account.totals == {"busy": 6.0, "idle-no-tasks": 1.0}


def test_account_calls_from_other_threads_go_through_the_loop():
    clock = FakeClock()
    account = ThreadSecondsAccount(1, "idle-no-tasks", func=clock)

    async def run() -> None:
        account.loop = asyncio.get_running_loop()
        thread = threading.Thread(
            target=account.call_soon_threadsafe, args=(account.acquire, 1.0)
        )
        thread.start()
        thread.join()
        assert account.busy == 0  # not yet: on the loop
        await asyncio.sleep(0)
        assert account.busy == 1
        account.call_soon_threadsafe(account.release, 3.0)
        await asyncio.sleep(0)
        assert account.busy == 0

    asyncio.run(run())
    clock.now = 4.0
    account.advance()
    assert account.totals == {"busy": 2.0, "idle-no-tasks": 2.0}


def threads(w) -> dict[Hashable, float]:
    """The worker's thread-seconds up to now, by label"""
    w.digest_running()
    return {
        k[1]: v
        for k, v in w.digests_total.items()
        if is_fine_metric(k) and k[0] == "threads"
    }


def execute_seconds(w, *, seceded: bool = False) -> float:
    """The seconds of the worker's execute breakdown, ``seceded`` or the rest"""
    return sum(
        v
        for k, v in w.digests_total.items()
        if is_fine_metric(k)
        and k[0] == "execute"
        and k[3] == "seconds"
        and (k[2] == "seceded") == seceded
    )


class Phase:
    """What a worker's threads did over a stretch of a test"""

    def __init__(self, w):
        self.w = w

    def __enter__(self) -> Phase:
        self.before = threads(self.w)
        self.execute_before = execute_seconds(self.w)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        after = threads(self.w)
        self.elapsed = time.perf_counter() - self.start
        self.delta = {k: v - self.before.get(k, 0.0) for k, v in after.items()}
        self.delta = {k: v for k, v in self.delta.items() if v}
        self.execute = execute_seconds(self.w) - self.execute_before

    def __getitem__(self, label: str) -> float:
        return self.delta.get(label, 0.0)

    def assert_partition(self, metered_away: float = 0.0) -> None:
        """The labels add up to the threads × the wall time, and the busy part is the
        execute breakdown, except time out of the pool: ``seceded``, and what the
        tasks metered while out of it (``metered_away``)
        """
        nthreads = self.w.state.nthreads
        assert sum(self.delta.values()) == pytest.approx(
            nthreads * self.elapsed, rel=0.01
        )
        # No state goes down, and no more threads are busy than the worker has
        assert all(v >= 0 for v in self.delta.values()), self.delta
        assert self["busy"] <= nthreads * self.elapsed
        # Exactly, but for the time between the clock reads of a task's split at
        # secede() and rejoin() and those of the account's: microseconds, which a
        # thread holding the GIL meanwhile stretches to milliseconds (a switch
        # interval is 5 ms) on a loaded machine
        assert self["busy"] == pytest.approx(
            self.execute - metered_away, rel=1e-9, abs=0.01
        )


#: Keywords of gen_cluster for workers that a test pauses, by making their memory
#: monitor read a process memory beyond the pause threshold
PAUSABLE: dict = {
    "worker_kwargs": {"memory_limit": "10 GB"},
    "config": {
        "distributed.worker.memory.target": False,
        "distributed.worker.memory.spill": False,
        "distributed.worker.memory.pause": 0.8,
        "distributed.worker.memory.monitor-interval": "10ms",
    },
}


def sleep_task(seconds: float, key: object = None) -> float:
    time.sleep(seconds)
    return seconds


def seceding_task(before: float, away: float, after: float) -> int:
    time.sleep(before)
    secede()
    time.sleep(away)
    rejoin()
    time.sleep(after)
    return 1


@gen_cluster(
    client=True,
    nthreads=[("", 2, {"resources": {"R": 1}}), ("", 1)],
    Worker=BlockedGetData,
    **PAUSABLE,
)
async def test_partition_of_a_worker_with_two_threads(c, s, a, b):
    a.block_get_data.set()  # Only b is slow to answer
    with Phase(a) as whole:
        # Nothing at all
        with Phase(a) as nothing:
            await asyncio.sleep(0.3)
        assert set(nothing.delta) == {"idle-no-tasks"}
        nothing.assert_partition()

        # Two tasks at once
        with Phase(a) as busy:
            await c.gather(
                c.map(sleep_task, [0.3, 0.3], key=["s-1", "s-2"], workers=[a.address])
            )
        assert busy["busy"] == pytest.approx(0.6, rel=0.3)
        busy.assert_partition()

        # A task waiting for its input from a slow peer
        x = c.submit(inc, 1, key="x", workers=[b.address])
        await async_poll_for(lambda: "x" in b.data, timeout=5)
        y = c.submit(inc, x, key="y", workers=[a.address])
        await b.in_get_data.wait()
        with Phase(a) as fetching:
            await asyncio.sleep(0.3)
        assert set(fetching.delta) == {"idle-fetching-inputs"}
        fetching.assert_partition()
        b.block_get_data.set()
        assert await y == 3

        # Paused by the memory limits
        rss = 0
        a.monitor.get_process_memory = lambda: rss
        rss = 900 * 1000**3
        await async_poll_for(lambda: a.status == Status.paused, timeout=5)
        with Phase(a) as paused:
            await asyncio.sleep(0.3)
        assert set(paused.delta) == {"idle-paused"}
        paused.assert_partition()
        rss = 0
        await async_poll_for(lambda: a.status == Status.running, timeout=5)

        # Two tasks that need the one R: one waits for the other
        with Phase(a) as constrained:
            await c.gather(
                c.map(
                    sleep_task,
                    [0.3, 0.3],
                    key=["r-1", "r-2"],
                    workers=[a.address],
                    resources={"R": 1},
                )
            )
        assert constrained["busy"] == pytest.approx(0.6, rel=0.3)
        assert constrained["idle-constrained"] == pytest.approx(0.3, rel=0.3)
        constrained.assert_partition()

        # A task that leaves the pool for a while
        with Phase(a) as seceding:
            assert await c.submit(seceding_task, 0.2, 0.3, 0.1, workers=[a.address])
        assert seceding["busy"] == pytest.approx(0.3, rel=0.3)
        seceded = execute_seconds(a, seceded=True)
        assert seceded == pytest.approx(0.3, rel=0.3)
        assert seceding.elapsed >= 0.6
        seceding.assert_partition()

    whole.assert_partition()
    for label in (
        "busy",
        "idle-no-tasks",
        "idle-fetching-inputs",
        "idle-paused",
        "idle-constrained",
    ):
        assert whole[label] > 0, label


@gen_cluster(
    client=True,
    nthreads=[("", 2)],
    **PAUSABLE,
)
async def test_paused_worker_that_starts_closing(c, s, a):
    """A paused worker that starts to retire (which may take long, replicating its
    data) has no task to run any more: its idle threads are no longer paused
    """
    a.monitor.get_process_memory = lambda: 900 * 1000**3
    await async_poll_for(lambda: a.status == Status.paused, timeout=5)
    with Phase(a) as paused:
        await asyncio.sleep(0.1)
    assert set(paused.delta) == {"idle-paused"}
    # What Worker.close_gracefully does first
    a.status = Status.closing_gracefully
    with Phase(a) as closing:
        await asyncio.sleep(0.1)
    assert set(closing.delta) == {"idle-no-tasks"}
    closing.assert_partition()


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    config={"distributed.scheduler.worker-saturation": math.inf},
)
async def test_back_to_back_tasks_hand_over_their_thread(c, s, a, monkeypatch):
    """On a full worker, the next task starts while the event loop handles the end
    of the previous one: it takes the thread when that is done, so that the
    execute breakdown never counts one thread twice
    """
    intervals = []
    finalize = InstructionMetricsRecorder.finalize

    def wrapper(self, *args, **kwargs):
        out = finalize(self, *args, **kwargs)
        intervals.append((self.start, self.stop))
        return out

    monkeypatch.setattr(InstructionMetricsRecorder, "finalize", wrapper)
    with Phase(a) as phase:
        await c.gather(c.map(inc, range(300)))
    phase.assert_partition()
    assert phase["busy"] <= phase.elapsed
    assert all(value >= 0 for value in phase.delta.values()), phase.delta
    intervals.sort()
    assert len(intervals) == 300
    assert all(
        start >= previous_stop
        for (_, previous_stop), (start, _) in zip(intervals, intervals[1:])
    )


def wait_then_sleep(ev: Event, seconds: float) -> float:
    ev.wait()
    time.sleep(seconds)
    return seconds


@gen_cluster(
    client=True,
    nthreads=[("", 2, {"resources": {"R": 1}})],
    config={"distributed.scheduler.worker-saturation": math.inf},
)
async def test_task_that_finds_a_free_thread_starts_at_once(c, s, a, monkeypatch):
    """A task that starts while the event loop handles the end of another waits for
    that one's thread only if every thread is held; one that takes a free thread
    starts its clock at once, as the thread account counts it from then
    """
    finalize = InstructionMetricsRecorder.finalize
    intervals = {}

    def slow_end(self, *args, **kwargs):
        # The end of "first" takes a while after "next" has started
        if self.prefix == ("execute", "first"):
            time.sleep(0.2)
        out = finalize(self, *args, **kwargs)
        intervals[self.prefix[1]] = (self.start, self.stop)
        return out

    monkeypatch.setattr(InstructionMetricsRecorder, "finalize", slow_end)
    ev = Event()
    with Phase(a) as phase:
        # Both need the one R: "next" waits for "first", while the other thread is
        # free, and starts on it when "first" ends
        first = c.submit(wait_then_sleep, ev, 0.1, key="first-1", resources={"R": 1})
        await async_poll_for(lambda: a.state.executing_count == 1, timeout=5)
        second = c.submit(sleep_task, 0.1, key="next-1", resources={"R": 1})
        await async_poll_for(
            lambda: "next-1" in a.state.tasks
            and a.state.tasks["next-1"].state == "constrained",
            timeout=5,
        )
        await ev.set()
        await c.gather([first, second])
    # "next" started during the end of "first", on its own thread
    assert intervals["next"][0] < intervals["first"][1]
    phase.assert_partition()


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_async_task_holds_its_thread(c, s, a):
    async def f():
        await asyncio.sleep(0.3)
        return 1

    with Phase(a) as phase:
        assert await c.submit(f) == 1
    assert phase["busy"] == pytest.approx(0.3, rel=0.3)
    phase.assert_partition()


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_seceded_task_frees_its_thread(c, s, a):
    """While a task is out of the pool, another one runs in its slot: the worker's
    one thread is busy with it, and the seceded time is not counted twice
    """
    ev = Event()

    def away(ev):
        secede()
        ev.wait()
        return 1

    with Phase(a) as phase:
        x = c.submit(away, ev, key="away")
        await async_poll_for(lambda: a.state.long_running, timeout=5)
        assert await c.submit(sleep_task, 0.3, key="other") == 0.3
        await ev.set()
        assert await x == 1
    # The one slot was busy with `other` only
    assert phase["busy"] == pytest.approx(
        sum(
            v
            for k, v in a.digests_total.items()
            if is_fine_metric(k) and k[:2] == ("execute", "other") and k[3] == "seconds"
        )
        + sum(
            v
            for k, v in a.digests_total.items()
            if is_fine_metric(k)
            and k[:2] == ("execute", "away")
            and k[2] != "seceded"
            and k[3] == "seconds"
        ),
        rel=0.01,
        abs=0.005,
    )
    assert a.digests_total["execute", "away", "seceded", "seconds"] >= 0.3
    phase.assert_partition()


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    # So that the memory monitor does not unpause the worker that the test paused
    config={"distributed.worker.memory.pause": False},
)
async def test_thread_pool_secede_tells_why_the_thread_idles(c, s, a):
    """A task that leaves its thread pool with the pool's own secede(), which the
    state machine never hears of, frees its thread: idle for the cause of the
    moment, not for the one of before the task took the thread
    """
    started, may_go, seceded, done = Event(), Event(), Event(), Event()

    def away(started, may_go, seceded, done):
        started.set()
        may_go.wait()
        threadpoolexecutor.secede()
        seceded.set()
        done.wait()
        return 1

    x = c.submit(away, started, may_go, seceded, done, key="away")
    await started.wait()
    try:
        # Paused while its one thread is busy: no idle thread to say why it idles
        a.status = Status.paused
        await may_go.set()
        await seceded.wait()
        await async_poll_for(lambda: a.thread_seconds.busy == 0, timeout=5)
        account = a.thread_seconds
        account.advance()
        before, start = account.totals, account.last
        await asyncio.sleep(0.1)
        account.advance()
        gained = {k: v - before.get(k, 0.0) for k, v in account.totals.items()}
        # All of the one thread's time since, by the account's own clock
        assert gained.get("idle-paused", 0.0) == pytest.approx(account.last - start)
        assert gained.get("idle-paused", 0.0) > 0
        assert gained["busy"] == 0
        assert gained.get("idle-no-tasks", 0.0) == 0
    finally:
        a.status = Status.running
        await done.set()
    assert await x == 1


def execute_breakdown(w, prefix: str) -> dict[Hashable, float]:
    """The seconds of a task prefix, by label"""
    return {
        k[2]: v
        for k, v in w.digests_total.items()
        if is_fine_metric(k) and k[:2] == ("execute", prefix) and k[3] == "seconds"
    }


def block_around_secede(before: float, away: float, after: float) -> int:
    with context_meter.meter("my-block"):
        time.sleep(before)
        secede()
        time.sleep(away)
        rejoin()
        time.sleep(after)
    return 1


def block_ends_while_away(before: float, away: float) -> int:
    with context_meter.meter("my-block"):
        time.sleep(before)
        secede()
        with context_meter.meter("inner"):
            time.sleep(away / 2)
    time.sleep(away / 2)
    rejoin()
    return 1


def block_around_worker_client(seconds: float) -> int:
    with context_meter.meter("fan-out"):
        with worker_client() as c:
            c.submit(time.sleep, seconds, key="zz-1").result()
    return 1


@pytest.mark.parametrize(
    "func,args,block,seceded",
    [
        (block_around_secede, (0.2, 0.5, 0.2), 0.4, 0.5),
        # The block is suspended when it ends; what is digested out of the pool
        # keeps its label, and comes out of `seceded`
        (block_ends_while_away, (0.2, 0.6), 0.2, 0.3),
        (block_around_worker_client, (0.5,), 0, 0.5),
    ],
)
@gen_cluster(client=True, nthreads=[("", 1)])
async def test_meter_block_around_secede(c, s, a, func, args, block, seceded):
    """A meter block open across secede() and rejoin() doesn't count the time out of
    the pool, which is `seceded`: the seconds of the task add up to its time, and
    the busy seconds are its execute seconds but `seceded`
    """
    with Phase(a) as phase:
        assert await c.submit(func, *args, key=f"{func.__name__}-1") == 1
    bd = execute_breakdown(a, func.__name__)
    label = "fan-out" if func is block_around_worker_client else "my-block"
    # Without the cut, the block would also count the 0.5 s out of the pool
    assert block <= bd[label] < block + 0.25
    assert seceded <= bd["seceded"] < seceded + 0.25
    assert sum(args) <= sum(bd.values()) <= phase.elapsed
    assert bd["thread-noncpu"] < 0.1
    if func is block_ends_while_away:
        assert 0.3 <= bd["inner"] < 0.4
    phase.assert_partition(metered_away=bd.get("inner", 0.0))


def secede_then_fail(away: float) -> None:
    secede()
    time.sleep(away)
    rejoin()
    raise ValueError("boom")


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_seceded_task_that_fails(c, s, a):
    """A task that fails lumps its time into `failed`, but for its time out of the
    pool, which wasn't busy and stays `seceded`
    """
    with Phase(a) as phase:
        with pytest.raises(ValueError, match="boom"):
            await c.submit(secede_then_fail, 0.5, key="secede_then_fail-1")
    bd = execute_breakdown(a, "secede_then_fail")
    assert set(bd) == {"seceded", "failed"}
    assert bd["seceded"] >= 0.5
    assert bd["failed"] < 0.1
    phase.assert_partition()


def away_then_back(ev: Event) -> int:
    secede()
    ev.wait()
    rejoin()
    time.sleep(0.2)
    return 1


def wait_then_sleep_briefly(ev: Event) -> int:
    ev.wait()
    time.sleep(0.2)
    return 1


class SlowEndOf(WorkerPlugin):
    """Python work on the event loop when a task ends (a plugin that logs, e.g.)"""

    def __init__(self, key: str):
        self.key = key

    def transition(self, key, start, finish, **kwargs):
        if key == self.key and finish == "memory":
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.3:
                pass


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_rejoin_told_after_the_end_of_the_other_task(c, s, a):
    """A task rejoins as soon as the other one's function returns, while the loop
    spends 0.3 s on the other's end: whichever the loop learns of first (it is a
    race; test_account_told_late_counts_no_thread_twice pins the late case), no
    state goes down, and no more threads than the worker has are busy
    """
    await c.register_worker_plugin(SlowEndOf("other-1"))
    back, other = Event(), Event()
    with Phase(a) as phase:
        x = c.submit(away_then_back, back, key="back-1")
        await async_poll_for(lambda: a.state.long_running, timeout=5)
        y = c.submit(wait_then_sleep_briefly, other, key="other-1")
        await async_poll_for(lambda: a.state.executing_count == 1, timeout=5)
        await back.set()  # back-1 rejoins, and waits for other-1's thread
        await other.set()
        assert await y == await x == 1
    assert all(v >= 0 for v in phase.delta.values()), phase.delta
    assert phase["busy"] <= phase.elapsed
    assert sum(phase.delta.values()) == pytest.approx(phase.elapsed, rel=0.01)


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_rejoin_while_another_task_has_the_slot(c, s, a):
    """After rejoin(), the state machine, which doesn't know, starts the next task
    in the slot of the one that rejoined: that task waits for a thread in the
    executor's queue, in its own breakdown but not among the busy threads
    """
    ev = Event()

    def away_and_back(ev):
        secede()
        ev.wait()
        rejoin()
        time.sleep(0.3)
        return 1

    with Phase(a) as phase:
        x = c.submit(away_and_back, ev, key="back")
        await async_poll_for(lambda: a.state.long_running, timeout=5)
        ys = c.map(sleep_task, [0.3, 0.3, 0.3], key=["q-1", "q-2", "q-3"])
        await async_poll_for(lambda: a.state.executing_count == 1, timeout=5)
        await ev.set()
        assert await x == 1
        await c.gather(ys)
    assert sum(phase.delta.values()) == pytest.approx(phase.elapsed, rel=0.01)
    assert all(v >= 0 for v in phase.delta.values()), phase.delta
    assert phase["busy"] <= phase.elapsed
    # The 4 x 0.3 s ran one at a time in the one thread
    assert phase["busy"] >= 1.2
    assert phase.execute >= phase["busy"] - 1e-4


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    worker_kwargs={"executor": {"other": CustomExecutor()}},
)
async def test_task_in_another_executor_holds_its_thread(c, s, a):
    with Phase(a) as phase:
        with dask.annotate(executor="other"):
            x = c.submit(sleep_task, 0.3, key="other-1")
        assert await x == 0.3
    assert phase["busy"] == pytest.approx(0.3, rel=0.3)
    phase.assert_partition()


#: Lets away_until_set() return (the workers of gen_cluster share the process)
AWAY = threading.Event()


def away_until_set() -> int:
    secede()
    AWAY.wait(10)
    return 1


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_worker_closes_while_a_task_is_out_of_the_pool(c, s, a):
    """The instruction is over when the worker closes; its function, still
    running, rejoining at its end must not take a thread of the account again
    """
    AWAY.clear()
    x = c.submit(away_until_set, key="away-1")
    await async_poll_for(lambda: a.state.long_running, timeout=5)
    assert a.thread_seconds.busy == 0
    await a.close()
    assert a.thread_seconds.busy == 0
    AWAY.set()
    await asyncio.sleep(0.1)
    assert a.thread_seconds.busy == 0
    del x


@pytest.mark.parametrize("interim", [False, True])
@gen_cluster(client=True, nthreads=[("", 1)])
async def test_worker_closes_while_a_task_is_out_of_the_pool_keeps_seceded(
    c, s, a, interim
):
    """The time out of the pool of a task that the closing worker cancels stays
    `seceded`, and only its time in the pool is `cancelled`: busy is the execute
    breakdown but `seceded`, as for any task
    """
    AWAY.clear()
    try:
        with Phase(a) as phase:
            x = c.submit(away_until_set, key="away_until_set-1")
            await async_poll_for(lambda: a.state.long_running, timeout=5)
            for _ in range(10):
                await asyncio.sleep(0.05)
                if interim:
                    a.digest_running()
            await a.close()
        bd = execute_breakdown(a, "away_until_set")
        assert bd["seceded"] >= 0.45, bd
        assert bd["cancelled"] < 0.1, bd
        phase.assert_partition()
    finally:
        AWAY.set()
        del x


#: Set by secede_and_wait() when it starts, and once out of the pool; lets it
#: return
STARTED = threading.Event()
SECEDED = threading.Event()
DONE = threading.Event()


def secede_and_wait() -> int:
    STARTED.set()
    time.sleep(0.1)
    secede()
    SECEDED.set()
    DONE.wait(5)
    return 1


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_busy_never_decreases_when_the_loop_lags(c, s, a):
    """The event loop learns late that a task left the pool: what it counted busy
    meanwhile stays busy
    """
    for event in (STARTED, SECEDED, DONE):
        event.clear()
    x = c.submit(secede_and_wait, key="secede_and_wait-1")
    try:
        assert await asyncio.to_thread(STARTED.wait, 5)
        # The loop is busy (e.g. with a large message) when the task secedes
        assert SECEDED.wait(5)
        time.sleep(0.2)
        before = threads(a)["busy"]
        await asyncio.sleep(0.05)
        assert threads(a)["busy"] >= before
    finally:
        DONE.set()
    assert await x == 1


def record_finalized(monkeypatch) -> list[tuple[dict, list]]:
    """Collect, for every recorder that is finalized, what its interim posts gave
    and what it returns at the end; :data:`elapsed` gets its elapsed time
    """
    calls: list[tuple[dict, list]] = []
    finalize = InstructionMetricsRecorder.finalize
    elapsed.clear()

    def wrapper(self, *args, **kwargs):
        posted = dict(self.posted or {})
        out = finalize(self, *args, **kwargs)
        calls.append((posted, out))
        elapsed.append(self.stop - self.start)
        return out

    monkeypatch.setattr(InstructionMetricsRecorder, "finalize", wrapper)
    return calls


#: The elapsed time of each recorder that record_finalized saw finalized
elapsed: list[float] = []


def assert_all_seconds_once(w, prefix: str) -> None:
    """The seconds of the one task of ``prefix`` add up to its instruction's elapsed
    time, whatever was posted while it ran: nothing counted twice or lost
    """
    [expect] = elapsed
    seconds = sum(
        v
        for k, v in w.digests_total.items()
        if is_fine_metric(k) and k[:2] == ("execute", prefix) and k[3] == "seconds"
    )
    assert seconds == pytest.approx(expect, rel=1e-9, abs=1e-9)


def without_interim(posted: dict, rest: list) -> dict:
    """The breakdown the instruction would have posted without interim posts"""
    out: dict = {}
    for label, value, unit in rest:
        out[label, unit] = out.get((label, unit), 0) + value
    for key, value in posted.items():
        out[key] = out.get(key, 0) + value
    return out


async def deliver_until_done(future, w, every: float = 0.05) -> None:
    """Have the worker deliver its fine metrics every ``every`` seconds until the
    future is done (the scheduler sets the pace of heartbeats otherwise)
    """
    while not future.done():
        await w.heartbeat()
        await asyncio.sleep(every)


def burn(seconds: float) -> int:
    """Spend ``seconds`` of CPU time, then as many sleeping"""
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass
    time.sleep(seconds)
    return 1


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_running_task_posts_at_each_delivery(c, s, a, monkeypatch):
    calls = record_finalized(monkeypatch)
    key_cpu = ("execute", "burn", "thread-cpu", "seconds")
    key_noncpu = ("execute", "burn", "thread-noncpu", "seconds")
    seen: list[tuple[float, float]] = []
    x = c.submit(burn, 0.8, key="burn-1")
    while not x.done():
        await a.heartbeat()
        store = s.cumulative_worker_metrics
        point = (store.get(key_cpu, 0), store.get(key_noncpu, 0))
        if not seen or point != seen[-1]:
            seen.append(point)
        await asyncio.sleep(0.05)
    await x
    # The totals grew while the task ran: CPU time, then the rest
    assert len(seen) >= 4, seen
    assert seen == sorted(seen)
    assert all(
        cpu_2 >= cpu_1 and noncpu_2 >= noncpu_1
        for (cpu_1, noncpu_1), (cpu_2, noncpu_2) in zip(seen, seen[1:])
    ), seen
    assert any(cpu > 0.4 for cpu, _ in seen), seen
    assert any(noncpu > 0.2 for _, noncpu in seen), seen

    # ... and end where they would have ended without intermediate posts
    [(posted, rest)] = calls
    assert posted, "no interim post"
    # (but for the microseconds between the ThreadRoot's and apply_function's reads
    # of the clocks when the task started)
    assert all(value >= -1e-4 for _, value, _ in rest), rest
    expect = without_interim(posted, rest)
    await c.get_fine_metrics(flush=True)
    for (label, unit), value in expect.items():
        key = ("execute", "burn", label, unit)
        assert a.digests_total[key] == pytest.approx(value, rel=1e-9, abs=1e-12)
        assert s.cumulative_worker_metrics[key] == pytest.approx(
            value, rel=1e-9, abs=1e-12
        )
    assert_all_seconds_once(a, "burn")
    assert expect["thread-cpu", "seconds"] == pytest.approx(0.8, rel=0.2)
    # The sleep, and the time the thread waited for the GIL while burning
    assert expect["thread-noncpu", "seconds"] >= 0.75


def metered_sleep(seconds: float) -> int:
    with context_meter.meter("my-sleep"):
        time.sleep(seconds)
    return 1


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_interim_posts_leave_an_open_block_out(c, s, a, monkeypatch):
    """A meter block open in the task's thread at a delivery takes its seconds out
    of the phase when it ends: what was posted before is never taken back
    """
    calls = record_finalized(monkeypatch)
    x = c.submit(metered_sleep, 0.5, key="metered_sleep-1")
    await deliver_until_done(x, a)
    assert await x == 1
    [(posted, rest)] = calls
    assert posted
    assert posted.get(("thread-noncpu", "seconds"), 0) < 0.05
    # (but for the microseconds between the ThreadRoot's and apply_function's reads
    # of the clocks when the task started)
    assert all(value >= -1e-4 for _, value, _ in rest), rest
    expect = without_interim(posted, rest)
    assert expect["my-sleep", "seconds"] == pytest.approx(0.5, rel=0.2)
    assert_all_seconds_once(a, "metered_sleep")
    for (label, unit), value in expect.items():
        key = ("execute", "metered_sleep", label, unit)
        assert a.digests_total[key] == pytest.approx(value, rel=1e-9, abs=1e-12)


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_interim_posts_of_a_block_around_secede(c, s, a, monkeypatch):
    """A delivery while the task is out of the pool, inside a meter block opened
    before, posts none of the block's time as the task's phase
    """
    calls = record_finalized(monkeypatch)
    x = c.submit(block_around_secede, 0.2, 0.5, 0.2, key="block_around_secede-1")
    await async_poll_for(lambda: a.state.long_running, timeout=5)
    await asyncio.sleep(0.2)
    a.digest_running()
    await deliver_until_done(x, a)
    assert await x == 1
    [(posted, rest)] = calls
    assert posted.get(("thread-noncpu", "seconds"), 0) < 0.05
    assert all(value >= -1e-4 for _, value, _ in rest), rest
    assert_all_seconds_once(a, "block_around_secede")


def secede_in_inner_block(before: float, away: float, after: float) -> int:
    with context_meter.meter("my-block"):
        time.sleep(before)
        secede()
        with context_meter.meter("inner"):
            time.sleep(0.05)
        time.sleep(away - 0.05)
        rejoin()
        time.sleep(after)
    return 1


@pytest.mark.parametrize(
    "func", [seceding_task, block_around_secede, secede_in_inner_block]
)
@gen_cluster(client=True, nthreads=[("", 1)])
async def test_interim_seceded_grows_while_away(c, s, a, monkeypatch, func):
    """While a task is out of the pool, the deliveries post its time out of the pool
    so far, also when a meter block was open when it left (the block's time stops
    there, while `seceded` runs on); and what was digested meanwhile comes out of it
    """
    calls = record_finalized(monkeypatch)
    prefix = func.__name__
    key = ("execute", prefix, "seceded", "seconds")
    seen: list[float] = []
    x = c.submit(func, 0.1, 0.8, 0.1, key=f"{prefix}-1")
    while not x.done():
        await a.heartbeat()
        seen.append(s.cumulative_worker_metrics.get(key, 0))
        await asyncio.sleep(0.05)
    assert await x == 1
    assert seen == sorted(seen)
    # Seen growing in the middle of the 0.8 s out of the pool, not all at once at
    # the end of it
    assert any(0.2 < v < 0.6 for v in seen), seen
    [(posted, rest)] = calls
    assert all(value >= -1e-4 for _, value, _ in rest), rest
    expect = without_interim(posted, rest)
    assert 0.8 - 0.05 <= expect["seceded", "seconds"] < 0.8 + 0.1
    # The 0.2 s in the pool are the block's, or the task's own
    in_pool = "thread-noncpu" if func is seceding_task else "my-block"
    assert 0.2 <= expect[in_pool, "seconds"] < 0.3
    if func is not seceding_task:
        assert expect["thread-noncpu", "seconds"] < 0.1
    if func is secede_in_inner_block:
        assert 0.05 <= expect["inner", "seconds"] < 0.1
    assert_all_seconds_once(a, prefix)


#: Set in the task's thread: its next read of its CPU time stops it there
STOP_AT_NEXT_CPU_READ = threading.local()
AT_CPU_READ = threading.Event()
GO_ON = threading.Event()


def block_then_return(seconds: float) -> int:
    with context_meter.meter("my-block"):
        time.sleep(seconds)
        # The next read of the thread's CPU time is in the block's __exit__, where
        # its seconds are passed on to the root
        STOP_AT_NEXT_CPU_READ.on = True
    return 1


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_delivery_while_a_block_ends(c, s, a, monkeypatch):
    """A delivery while the task's thread is in the middle of ending its outermost
    block (as after a switch of the GIL there) posts no phase for the block
    """
    AT_CPU_READ.clear()
    GO_ON.clear()
    thread_time = metrics_module.thread_time

    def stopping_thread_time() -> float:
        if getattr(STOP_AT_NEXT_CPU_READ, "on", False):
            STOP_AT_NEXT_CPU_READ.on = False
            AT_CPU_READ.set()
            GO_ON.wait(5)
        return thread_time()

    monkeypatch.setattr(metrics_module, "thread_time", stopping_thread_time)
    calls = record_finalized(monkeypatch)
    x = c.submit(block_then_return, 0.5, key="block_then_return-1")
    try:
        assert await asyncio.to_thread(AT_CPU_READ.wait, 5)
        a.digest_running()
    finally:
        GO_ON.set()
    assert await x == 1
    [(posted, rest)] = calls
    assert posted.get(("thread-noncpu", "seconds"), 0) < 0.05, posted
    assert all(value >= -1e-4 for _, value, _ in rest), rest
    assert_all_seconds_once(a, "block_then_return")


#: Set by block_then_wait() once its block has ended
BLOCK_DONE = threading.Event()


def block_then_wait(seconds: float) -> int:
    with context_meter.meter("my-block"):
        time.sleep(seconds)
    BLOCK_DONE.set()
    GO_ON.wait(5)
    return 1


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_delivery_while_a_block_ends_between_its_reads(c, s, a, monkeypatch):
    """A delivery that reads the task's clocks while its outermost block ends
    posts no phase for the block
    """
    GO_ON.clear()
    BLOCK_DONE.clear()
    open_block_since = metrics_module.open_block_since

    def slow_open_block_since(context):
        # The task's thread runs on meanwhile, as after a switch of the GIL
        BLOCK_DONE.wait(5)
        return open_block_since(context)

    calls = record_finalized(monkeypatch)
    x = c.submit(block_then_wait, 0.5, key="block_then_wait-1")
    try:
        await asyncio.sleep(0.3)  # inside the block
        monkeypatch.setattr(metrics_module, "open_block_since", slow_open_block_since)
        a.digest_running()
        monkeypatch.setattr(metrics_module, "open_block_since", open_block_since)
    finally:
        GO_ON.set()
    assert await x == 1
    [(posted, rest)] = calls
    assert posted.get(("thread-noncpu", "seconds"), 0) < 0.1, posted
    assert all(value >= -1e-4 for _, value, _ in rest), rest
    assert_all_seconds_once(a, "block_then_wait")


#: Set by downloads() once its blocks have ended
BLOCKS_DONE = threading.Event()


def downloads(n: int, seconds: float) -> int:
    for _ in range(n):
        with context_meter.meter("download"):
            time.sleep(seconds)
    BLOCKS_DONE.set()
    GO_ON.wait(5)
    return 1


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_interim_posts_the_blocks_that_ended(c, s, a, monkeypatch):
    """A delivery posts the meter blocks of a running task that have ended, not
    only its phase so far: a task that spends its time in metered I/O grows at
    each delivery, rather than all at once when it ends
    """
    BLOCKS_DONE.clear()
    GO_ON.clear()
    calls = record_finalized(monkeypatch)
    key = ("execute", "downloads", "download", "seconds")
    x = c.submit(downloads, 4, 0.1, key="downloads-1")
    try:
        assert await asyncio.to_thread(BLOCKS_DONE.wait, 5)
        await c.get_fine_metrics(flush=True)
        assert s.cumulative_worker_metrics[key] == pytest.approx(0.4, rel=0.2)
        assert not x.done()
    finally:
        GO_ON.set()
    assert await x == 1
    [(posted, rest)] = calls
    assert posted["download", "seconds"] == pytest.approx(0.4, rel=0.2)
    expect = without_interim(posted, rest)
    assert expect["download", "seconds"] == posted["download", "seconds"]
    assert_all_seconds_once(a, "downloads")
    await c.get_fine_metrics(flush=True)
    for (label, unit), value in expect.items():
        k = ("execute", "downloads", label, unit)
        assert a.digests_total[k] == pytest.approx(value, rel=1e-9, abs=1e-12)
        assert s.cumulative_worker_metrics[k] == pytest.approx(
            value, rel=1e-9, abs=1e-12
        )


def helper_downloads(n: int, seconds: float) -> int:
    """Hand metered I/O to a thread of the task's own, and wait for it"""

    def downloads():
        for _ in range(n):
            with context_meter.meter("download"):
                time.sleep(seconds)

    with ThreadPoolExecutor(1) as ex:
        ex.submit(context_meter.in_thread(downloads)).result()
    return 1


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_interim_posts_of_a_task_waiting_for_a_thread(c, s, a, monkeypatch):
    """What a thread that the task waits for meters comes out of the task's phase
    only when the thread returns: the deliveries meanwhile post the phase so far,
    and leave the thread's blocks to the end, rather than count that time twice
    """
    calls = record_finalized(monkeypatch)
    prefix = "helper_downloads"
    x = c.submit(helper_downloads, 6, 0.1, key=f"{prefix}-1")
    await asyncio.sleep(0.2)
    seen = []
    while not x.done():
        start = a.state.tasks[f"{prefix}-1"].start_time
        a.digest_running()
        posted = sum(
            v
            for k, v in a.digests_total.items()
            if k[:2] == ("execute", prefix) and k[3] == "seconds"
        )
        seen.append((posted, time.time() - start))
        await asyncio.sleep(0.1)
    assert await x == 1
    assert len(seen) >= 3, seen
    # Never more than the task's time so far (and its deserialization)
    assert all(posted < elapsed + 0.05 for posted, elapsed in seen), seen
    [(posted, rest)] = calls
    assert ("download", "seconds") not in posted
    expect = without_interim(posted, rest)
    assert expect["download", "seconds"] == pytest.approx(0.6, rel=0.2)
    assert expect["thread-noncpu", "seconds"] < 0.1
    assert_all_seconds_once(a, prefix)


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_delivery_after_the_function_returned(c, s, a, monkeypatch):
    """A delivery between the function's return, when its whole phase is recorded,
    and the end of the instruction posts nothing of it again
    """
    calls = record_finalized(monkeypatch)
    key = ("execute", "burn", "thread-cpu", "seconds")
    late = []
    add_thread_phase = InstructionMetricsRecorder.add_thread_phase

    def add_thread_phase_then_deliver(self, *args, **kwargs):
        add_thread_phase(self, *args, **kwargs)
        # As a heartbeat, or a scrape of /metrics, that the event loop runs before
        # the instruction ends
        a.digest_running()
        late.append(a.digests_total[key])

    monkeypatch.setattr(
        InstructionMetricsRecorder, "add_thread_phase", add_thread_phase_then_deliver
    )
    x = c.submit(burn, 0.4, key="burn-1")
    await deliver_until_done(x, a)
    assert await x == 1
    [(posted, rest)] = calls
    assert posted["thread-cpu", "seconds"] > 0.2
    # The CPU time was all posted while the task slept, and not again after
    [after_return] = late
    assert after_return == pytest.approx(a.digests_total[key], abs=0.05)
    assert a.digests_total[key] == pytest.approx(0.4, rel=0.25)
    assert_all_seconds_once(a, "burn")


class LoopUnfriendlyClock:
    """A clock that only the thread that made it can read"""

    def __init__(self):
        self.thread = threading.get_ident()

    def __call__(self) -> float:
        if threading.get_ident() != self.thread:
            raise RuntimeError("not from this thread")
        return time.perf_counter()


def block_with_own_clock(seconds: float) -> int:
    with context_meter.meter("device", func=LoopUnfriendlyClock()):
        BLOCKS_DONE.set()
        GO_ON.wait(seconds)
    return 1


@gen_cluster(client=True, nthreads=[("", 2)])
async def test_delivery_with_a_clock_that_fails_on_the_loop(c, s, a, monkeypatch):
    """A meter block's clock that can't be read from the event loop leaves that
    task's phase to be posted when it ends, once with a warning; every other
    metric is delivered meanwhile
    """
    BLOCKS_DONE.clear()
    GO_ON.clear()
    record_finalized(monkeypatch)
    x = c.submit(block_with_own_clock, 5, key="block_with_own_clock-1")
    try:
        assert await asyncio.to_thread(BLOCKS_DONE.wait, 5)
        assert await c.submit(inc, 1, key="inc-1") == 2
        with captured_logger("distributed.worker.state_machine") as log:
            for _ in range(3):
                await c.get_fine_metrics(flush=True)
        assert log.getvalue().count("Could not read what a running task") == 1
        store = s.cumulative_worker_metrics
        assert store["execute", "inc", "thread-cpu", "seconds"] > 0
        assert any(k[0] == "threads" for k in store)
        assert not x.done()
    finally:
        GO_ON.set()
    assert await x == 1
    # Nothing counted twice or lost: the seconds of the task (finalized after inc)
    # add up to its instruction's
    seconds = sum(
        v
        for k, v in a.digests_total.items()
        if k[:2] == ("execute", "block_with_own_clock") and k[3] == "seconds"
    )
    assert seconds == pytest.approx(elapsed[-1], rel=1e-9, abs=1e-9)
    await c.get_fine_metrics(flush=True)
    assert s.cumulative_worker_metrics[
        "execute", "block_with_own_clock", "device", "seconds"
    ] == pytest.approx(
        a.digests_total["execute", "block_with_own_clock", "device", "seconds"]
    )


def fail_late(seconds: float) -> None:
    time.sleep(seconds)
    raise ValueError("late")


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_failed_task_takes_back_its_interim_posts(c, s, a, monkeypatch):
    """A task that fails lumps its time into `failed`: what interim posts gave its
    phases is taken back, so that the totals end as without them
    """
    calls = record_finalized(monkeypatch)
    x = c.submit(fail_late, 0.4, key="fail_late-1")
    await deliver_until_done(x, a)
    with pytest.raises(ValueError, match="late"):
        await x
    [(posted, rest)] = calls
    assert posted.get(("thread-noncpu", "seconds"), 0) > 0.1
    assert_all_seconds_once(a, "fail_late")
    await c.get_fine_metrics(flush=True)
    for store in (a.digests_total, s.cumulative_worker_metrics):
        # Exactly: the posts are taken back in the order in which they were made
        assert store["execute", "fail_late", "thread-noncpu", "seconds"] == 0
        assert store.get(("execute", "fail_late", "thread-cpu", "seconds"), 0) == 0
        assert store["execute", "fail_late", "failed", "seconds"] >= 0.4


@gen_cluster(client=True, nthreads=[("", 2), ("", 2)])
async def test_scheduler_sees_the_threads_seconds_grow(c, s, a, b):
    """At each delivery, the scheduler's store gains what the threads did meanwhile:
    by the threads of the cluster per second
    """
    await c.get_fine_metrics(flush=True)

    def total() -> float:
        return sum(
            v
            for k, v in s.cumulative_worker_metrics.items()
            if k[0] == "threads" and not math.isnan(v)
        )

    before = total()
    last = {w: w.thread_seconds.last for w in (a, b)}
    await asyncio.sleep(0.5)
    await c.get_fine_metrics(flush=True)
    # Each worker's threads, over the time between the two deliveries by its
    # account's clock, which covers the sleep
    gained = {w: w.thread_seconds.last - last[w] for w in (a, b)}
    assert all(g > 0.5 for g in gained.values())
    assert total() - before == pytest.approx(
        sum(w.state.nthreads * g for w, g in gained.items()), rel=1e-9
    )
