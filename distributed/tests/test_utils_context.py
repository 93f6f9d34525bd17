from __future__ import annotations

import asyncio
import contextvars
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from distributed import metrics
from distributed.metrics import MeterRoot, ThreadRoot, context_meter
from distributed.utils import offload, run_in_executor_with_context
from distributed.utils_test import captured_logger, gen_test

var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="default")


def read_and_set(x, *, y):
    """Return the value of var as seen by the thread, then change it"""
    seen = var.get()
    var.set("set in thread")
    return seen, x + y, threading.current_thread().name


@pytest.mark.parametrize("use_default_executor", [False, True])
@gen_test()
async def test_run_in_executor_with_context(use_default_executor):
    with ThreadPoolExecutor(1, thread_name_prefix="Test-Executor") as ex:
        executor = None if use_default_executor else ex
        token = var.set("set in loop")
        try:
            seen, res, name = await run_in_executor_with_context(
                executor, read_and_set, 1, y=2
            )
            assert seen == "set in loop"
            assert res == 3
            assert name != threading.current_thread().name
            if not use_default_executor:
                assert name.startswith("Test-Executor")
            # The thread ran in a copy of the context
            assert var.get() == "set in loop"
        finally:
            var.reset(token)


@gen_test()
async def test_run_in_executor_with_context_raises():
    def f():
        raise ValueError(var.get())

    token = var.set("foo")
    try:
        with ThreadPoolExecutor(1) as ex:
            with pytest.raises(ValueError, match="foo"):
                await run_in_executor_with_context(ex, f)
    finally:
        var.reset(token)


@gen_test()
async def test_offload():
    token = var.set("set in loop")
    try:
        seen, res, name = await offload(read_and_set, 3, y=4)
    finally:
        var.reset(token)
    assert seen == "set in loop"
    assert res == 7
    assert name.startswith("Dask-Offload")
    assert var.get() == "default"


@pytest.mark.parametrize("how", ["offload", "run_in_executor_with_context"])
@gen_test()
async def test_context_meter_callbacks_in_thread(how):
    """context_meter callbacks installed in the event loop are called from the
    thread, and seconds digested in the thread are subtracted from the enclosing
    meter.
    """
    out = []

    def cb(label, value, unit):
        out.append((label, value, unit, threading.current_thread().name))

    def f():
        context_meter.digest_metric("in-thread", 1, "count")
        context_meter.digest_metric("thread-seconds", 1000.0, "seconds")

    with ThreadPoolExecutor(1, thread_name_prefix="Test-Executor") as ex:
        with context_meter.add_callback(cb):
            with context_meter.meter("outer", floor=False):
                if how == "offload":
                    await offload(f)
                else:
                    await run_in_executor_with_context(ex, f)

    loop_thread = threading.current_thread().name
    assert [(label, unit) for label, _, unit, _ in out] == [
        ("in-thread", "count"),
        ("thread-seconds", "seconds"),
        ("outer", "seconds"),
    ]
    assert out[0][3] != loop_thread
    assert out[0][3].startswith("Dask-Offload" if how == "offload" else "Test-Executor")
    assert out[2][3] == loop_thread
    # The 1000 fake seconds from the thread were subtracted from outer
    assert out[2][1] < -900


@gen_test()
async def test_context_meter_no_callbacks_leak_into_executor():
    """Callbacks installed while a task runs in the thread are not seen by tasks
    submitted without context
    """
    out = []
    with ThreadPoolExecutor(1) as ex:
        with context_meter.add_callback(lambda *args: out.append(args)):
            fut = ex.submit(context_meter.digest_metric, "x", 1, "count")
            fut.result()
            await run_in_executor_with_context(
                ex, context_meter.digest_metric, "y", 1, "count"
            )
    assert out == [("y", 1, "count")]


class LoopRoot(MeterRoot):
    """A MeterRoot whose own work is one asyncio task, like the worker's recorder"""

    def __init__(self):
        self.thread = threading.get_ident()
        self.task = None

    def is_current(self):
        return (
            threading.get_ident() == self.thread and asyncio.current_task() is self.task
        )


def test_in_thread_without_root():
    """Without a root, a function is run in the thread as it is, in a copy of the
    caller's context: what it meters nests into the caller's open block, which waits
    for it, as it would in the caller
    """
    out = []

    def f():
        assert var.get() == "caller's"
        with context_meter.meter("inner"):
            time.sleep(0.01)
        return metrics.current_root()

    token = var.set("caller's")
    try:
        with context_meter.add_callback(lambda *args: out.append(args)):
            with context_meter.meter("outer", floor=False) as m:
                func = context_meter.in_thread(f)
                with ThreadPoolExecutor(1) as ex:
                    root = ex.submit(func).result()
    finally:
        var.reset(token)
    assert not isinstance(func, ThreadRoot)
    assert root is None
    [(inner_label, inner, _), (outer_label, outer, _)] = out
    assert (inner_label, outer_label) == ("inner", "outer")
    assert inner >= 0.01
    assert outer == pytest.approx(m.delta - inner)


@gen_test()
async def test_offload_without_root_nests_what_it_starts():
    """Without a root, what an offloaded function starts on the event loop and
    doesn't wait for nests its own blocks as it would anywhere: nothing is counted
    twice
    """
    loop = asyncio.get_running_loop()
    out = []

    async def on_loop():
        with context_meter.meter("outer"):
            with context_meter.meter("inner"):
                await asyncio.sleep(0.05)

    def in_thread():
        return asyncio.run_coroutine_threadsafe(on_loop(), loop)

    with context_meter.add_callback(lambda *args: out.append(args)):
        future = await offload(in_thread)
    await asyncio.wrap_future(future)
    by_label = {label: value for label, value, _ in out}
    assert by_label["inner"] >= 0.05
    assert by_label["outer"] < 0.01


@gen_test()
async def test_thread_root_nests_in_caller():
    """Under a root, what the function meters in its thread reaches the callbacks,
    nests into the caller's open block, and tells the blocks' CPU time apart.
    """
    root = LoopRoot()
    out = []

    def cb(label, value, unit):
        # A callback like the worker's recorder: takes only the root's own work
        if metrics.current_root().is_current():
            out.append((label, value, unit))

    cpu = []

    def burn_then_sleep():
        # The CPU time of the thread spent in a block is known to the thread root
        c0 = metrics.thread_time()
        with context_meter.meter("burn"):
            t0 = metrics.thread_time()
            while metrics.thread_time() - t0 < 0.05:
                pass
        with context_meter.meter("sleep"):
            time.sleep(0.05)
        cpu.append(metrics.thread_time() - c0)
        # Bare seconds: no CPU time
        context_meter.digest_metric("bare", 1.0, "seconds")
        return metrics.current_root()

    async def main():
        with context_meter.add_callback(cb):
            with context_meter.meter("outer", floor=False) as m:
                thread_root = await run_in_executor_with_context(None, burn_then_sleep)
        return thread_root, m

    ctx = context_meter.new_context(root=root)
    task = ctx.run(asyncio.create_task, main())
    root.task = task
    thread_root, m = await task

    assert isinstance(thread_root, ThreadRoot)
    assert thread_root.func is None  # Not kept alive after it ran
    assert thread_root.thread is None
    assert [label for label, _, _ in out] == ["burn", "sleep", "bare", "outer"]
    burn, sleep, bare = (v for _, v, _ in out[:3])
    assert thread_root.nested == pytest.approx(burn + sleep + bare)
    # The CPU time of the thread inside the two blocks (burn: at least 0.05 s)
    assert 0.05 <= thread_root.nested_cpu <= cpu[0]
    assert thread_root.nested_cpu == pytest.approx(cpu[0], abs=0.01)
    # The caller's block waited for the thread: its seconds were subtracted
    assert out[3][1] == pytest.approx(m.delta - thread_root.nested)


@gen_test()
async def test_thread_root_not_owned():
    """Work handed to a thread by something that is not the root's own work (e.g. an
    asyncio task that the root's task started and didn't wait for) isn't current
    there either
    """
    root = LoopRoot()
    seen = []

    def f():
        r = metrics.current_root()
        seen.append((type(r), r.is_current()))

    async def background():
        await offload(f)

    async def main():
        await offload(f)
        await asyncio.create_task(background())

    ctx = context_meter.new_context(root=root)
    task = ctx.run(asyncio.create_task, main())
    root.task = task
    await task
    assert seen == [(ThreadRoot, True), (ThreadRoot, False)]


@gen_test()
async def test_thread_root_not_current_elsewhere():
    """What a function run under a thread root starts and doesn't wait for, e.g. a
    callback scheduled on the event loop, inherits the root, which isn't current
    there, and doesn't receive the seconds digested there
    """
    root = LoopRoot()
    loop = asyncio.get_running_loop()
    seen = []
    done = asyncio.Event()

    def on_loop():
        r = metrics.current_root()
        with context_meter.add_callback(lambda *args: None):
            context_meter.digest_metric("x", 5.0, "seconds")
        seen.append((r, r.is_current()))
        done.set()

    def in_thread():
        loop.call_soon_threadsafe(on_loop)
        return metrics.current_root()

    async def main():
        thread_root = await offload(in_thread)
        await done.wait()
        return thread_root

    ctx = context_meter.new_context(root=root)
    task = ctx.run(asyncio.create_task, main())
    root.task = task
    thread_root = await task
    assert seen == [(thread_root, False)]
    assert thread_root.nested == 0


@pytest.mark.parametrize("owned", [True, False])
def test_thread_root_in_thread_root(owned):
    """A function run under a thread root hands work to a thread of its own and
    waits for it, with no block open: the seconds metered there reach the outer
    root (add_waited), not its CPU time, if the outer function was its own work
    """
    out = []
    outer = ThreadRoot(
        lambda f: f(),
        LoopRoot(),
        owned=owned,
        context=context_meter.new_context(lambda *args: out.append(args)),
    )

    def inner():
        with context_meter.meter("x"):
            time.sleep(0.01)

    def wait_for_inner():
        assert metrics.current_root() is outer
        with ThreadPoolExecutor(1) as ex:
            func = context_meter.in_thread(inner)
            assert func.owned is owned
            ex.submit(func).result()

    with ThreadPoolExecutor(1) as ex:
        ex.submit(outer, wait_for_inner).result()
    [(label, value, unit)] = out
    assert label == "x"
    assert value >= 0.01
    # Not the outer thread's own: they took none of its CPU time
    assert outer.nested == 0
    assert outer.nested_cpu == 0
    assert outer.waited == (value if owned else 0)


class RecordingRoot(LoopRoot):
    """A LoopRoot that records the secede() and rejoin() that reach it, and from
    which thread
    """

    def __init__(self):
        super().__init__()
        self.calls = []

    def secede(self):
        self.calls.append(("secede", threading.get_ident()))

    def rejoin(self):
        self.calls.append(("rejoin", threading.get_ident()))


def test_thread_root_secession():
    """A function that leaves its thread pool: its ThreadRoot keeps its time out of
    the pool, passes secede() and rejoin() on to the caller's root, and tells what
    the function spent so far while it is out. A function that it hands to a thread
    of its own, and that secedes, can't make it secede: its thread is still held,
    waiting.
    """
    caller = RecordingRoot()
    away = threading.Event()
    checked = threading.Event()
    outer = ThreadRoot(lambda f: f(), caller, owned=True)

    def child():
        metrics.current_root().secede()
        metrics.current_root().rejoin()

    def func():
        with ThreadPoolExecutor(1) as ex:
            ex.submit(context_meter.in_thread(child)).result()
        assert outer.secession is None
        t0 = metrics.thread_time()
        while metrics.thread_time() - t0 < 0.02:
            pass
        metrics.current_root().secede()
        time.sleep(0.05)
        away.set()
        checked.wait(5)
        metrics.current_root().rejoin()
        return threading.get_ident()

    with ThreadPoolExecutor(1) as ex:
        future = ex.submit(outer, func)
        assert away.wait(5)
        so_far = outer.so_far()
        checked.set()
        ident = future.result()

    assert caller.calls == [("secede", ident), ("rejoin", ident)]
    assert outer.secession.total[0] >= 0.05
    assert not outer.secession.away
    # None only where the platform can't read another thread's CPU clock
    if not hasattr(time, "pthread_getcpuclockid"):  # pragma: nocover
        assert so_far is None
    else:
        assert so_far is not None
        labels = dict(so_far)
        assert list(labels) == ["seceded", "thread-cpu", "thread-noncpu"]
        assert labels["seceded"] >= 0.05
        assert labels["thread-cpu"] >= 0.015
    assert outer.so_far() is None  # Not running any more
    assert outer.parent is None  # Let go of once it ran
    phase = dict(outer.phase(1.0, 0.5))
    assert phase["seceded"] == pytest.approx(outer.secession.total[0])
    assert phase["thread-cpu"] + phase["thread-noncpu"] == pytest.approx(
        1.0 - phase["seceded"]
    )


@pytest.mark.parametrize(
    "bad_at,expect",
    [
        # The piece before leaving can't be measured; the one after rejoining can
        ("secede", [("x", 2.0, "seconds")]),
        # The piece before leaving is the block's; after it, the block can't be
        # measured: its time is the thread's, not the block's too, and the block
        # ends with 0, as one that ends out of the pool
        ("rejoin", [("x", 1.0, "seconds"), ("x", 0.0, "seconds")]),
    ],
)
@pytest.mark.parametrize("bad", ["nan", "raise"])
def test_secession_with_a_bad_clock(bad_at, expect, bad):
    """A block open where its function leaves its pool or comes back, and whose
    clock gives nan or raises then: that piece of the block can't be measured. It
    is logged, secede() and rejoin() go on, no value that is not a finite number
    reaches the callbacks or the root, and no second is the block's and the
    thread's both.
    """
    out = []
    now = [0.0]

    def clock():
        if now[0] == "raise":
            raise OSError("no clock")
        return now[0]

    def at(t, where):
        now[0] = (float("nan") if bad == "nan" else "raise") if where == bad_at else t

    def func():
        with context_meter.meter("x", func=clock):
            at(1.0, "secede")
            metrics.current_root().secede()
            at(1.5, "rejoin")
            metrics.current_root().rejoin()
            now[0] = 3.5

    class Caller(MeterRoot):
        def is_current(self):
            return True

    # Run in the caller's thread, under a ThreadRoot, as an inline executor would
    ctx = context_meter.new_context(lambda *args: out.append(args), root=Caller())
    root = ctx.run(context_meter.in_thread, func)
    with captured_logger("distributed.metrics") as log:
        root()
    assert "Invalid value of metric 'x' where its thread left" in log.getvalue()
    assert out == expect
    assert math.isfinite(root.nested)
    assert root.nested == sum(v for _, v, _ in out)


@pytest.mark.skipif(
    not hasattr(time, "pthread_getcpuclockid"), reason="no per-thread CPU clocks"
)
def test_thread_cpu_time():
    """The CPU time of a thread, read with the id of its clock from another thread;
    None once the thread is gone
    """
    clocks = []
    t = threading.Thread(target=lambda: clocks.append(metrics.thread_cpu_clock()))
    t.start()
    t.join()
    [clock] = clocks
    # join() returns when the thread's Python code is done, which may be a moment
    # before the system's thread is
    deadline = time.monotonic() + 5
    while metrics.thread_cpu_time(clock) is not None:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    own = metrics.thread_cpu_clock()
    assert metrics.thread_cpu_time(own) == pytest.approx(time.thread_time(), abs=0.01)


def test_thread_root_runs_once():
    root = ThreadRoot(lambda x: x + 1, LoopRoot(), owned=True)
    assert root(1) == 2
    with pytest.raises(RuntimeError, match="only once"):
        root(1)
    assert context_meter.in_thread(root) is root


@gen_test()
async def test_block_not_reduced_by_work_it_does_not_wait_for():
    """An asyncio task or a callback started inside a block, under a root, inherits
    the block; what it digests does not come out of the block
    """
    root = LoopRoot()
    out = []
    started = asyncio.Event()

    async def background():
        context_meter.digest_metric("background", 100.0, "seconds")
        with context_meter.meter("background-block"):
            pass
        started.set()

    async def main():
        with context_meter.add_callback(lambda *a: out.append(a)):
            with context_meter.meter("network", floor=False) as m:
                task = asyncio.create_task(background())
                asyncio.get_running_loop().call_soon(
                    context_meter.digest_metric, "callback", 100.0, "seconds"
                )
                await started.wait()
                await asyncio.sleep(0)
                context_meter.digest_metric("own", 0.001, "seconds")
        await task
        return m

    ctx = context_meter.new_context(root=root)
    task = ctx.run(asyncio.create_task, main())
    root.task = task
    m = await task
    network = [v for label, v, _ in out if label == "network"]
    assert len(network) == 1
    # Only "own" came out of it
    assert network[0] == pytest.approx(m.stop - m.start - 0.001, abs=1e-12)
