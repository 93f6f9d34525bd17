from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import logging
import math
import pickle
import threading
import time
import weakref
from decimal import Decimal
from fractions import Fraction

import pytest

from distributed import metrics
from distributed.metrics import DelayedMetricsLedger, MeterOutput, context_meter
from distributed.tests.utils_ci import import_or_skip
from distributed.utils_test import captured_logger, gen_test


class FakeClock:
    """Clock which only moves when the test says so"""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_wall_clock():
    for _ in range(3):
        t1 = metrics.time()
        t2 = time.time()
        assert abs(t1 - t2) < 1


def test_monotonic():
    t1 = metrics.monotonic()
    t2 = metrics.monotonic()
    assert t2 >= t1


def test_thread_time():
    # thread_time only measures the CPU time of the current thread
    t1 = metrics.thread_time()
    threading.Event().wait(0.05)
    t2 = metrics.thread_time()
    assert 0 <= t2 - t1 < 0.05


def test_meter():
    clock = FakeClock(10)
    with metrics.meter(clock) as m:
        assert isinstance(m, MeterOutput)
        assert m.start == 10
        assert math.isnan(m.stop)
        assert math.isnan(m.delta)
        clock.t = 12.5
    assert m.start == 10
    assert m.stop == 12.5
    assert m.delta == 2.5


def test_meter_default_clock():
    with metrics.meter() as m:
        pass
    assert m.stop >= m.start
    assert m.delta == m.stop - m.start


def test_meter_raise():
    clock = FakeClock()
    with pytest.raises(ZeroDivisionError):
        with metrics.meter(clock) as m:
            clock.t = 2
            1 / 0
    assert m.stop == 2
    assert m.delta == 2


@pytest.mark.parametrize(
    "floor,expect",
    [(0.0, 0.0), (-3, -2.0), (False, -2.0), (1, 1)],
)
def test_meter_floor(floor, expect):
    clock = FakeClock(2)
    with metrics.meter(clock, floor=floor) as m:
        clock.t = 0
    assert m.stop == 0
    assert m.delta == expect


def test_context_meter():
    clock = FakeClock()
    out = []

    with context_meter.add_callback(lambda *args: out.append(args)):
        with context_meter.meter("m1", func=clock):
            clock.t = 1
        context_meter.digest_metric("m2", 2, "count")
        with context_meter.meter("m3", unit="bytes", func=clock):
            clock.t = 4

    assert out == [("m1", 1, "seconds"), ("m2", 2, "count"), ("m3", 3, "bytes")]
    # Nothing is called after the callback is removed
    context_meter.digest_metric("m4", 1, "count")
    with context_meter.meter("m5"):
        pass
    assert len(out) == 3


def test_context_meter_no_callbacks():
    """Without callbacks, the decorator doesn't even read the clock, and the block
    reads it only for its own measurement
    """
    calls = []

    def clock():
        calls.append(None)
        return 0.0

    @context_meter.meter("z", func=clock)
    def f():
        return 1

    context_meter.digest_metric("y", 1, "seconds")
    assert f() == 1
    assert calls == []

    with context_meter.meter("x", func=clock) as m:
        pass
    assert calls == [None, None]
    assert m.delta == 0
    assert metrics._current_meter_var.get() is None


@pytest.mark.parametrize("listening", [False, True])
def test_context_meter_measurement(listening):
    """The block is a measurement, like meter()'s, whether or not anybody listens"""
    clock = FakeClock(10)
    out = []
    with contextlib.ExitStack() as stack:
        if listening:
            stack.enter_context(context_meter.add_callback(lambda *a: out.append(a)))
        with context_meter.meter("x", func=clock) as m:
            assert m.start == 10
            assert math.isnan(m.stop)
            assert math.isnan(m.delta)
            clock.t = 12
            context_meter.digest_metric("y", 0.5, "seconds")
            clock.t = 12.5
    assert m.start == 10
    assert m.stop == 12.5
    # delta is the whole time of the block; the digested value is net of what was
    # digested inside it
    assert m.delta == 2.5
    assert out == ([("y", 0.5, "seconds"), ("x", 2.0, "seconds")] if listening else [])


@pytest.mark.parametrize("listening", [False, True])
def test_context_meter_measurement_raise(listening):
    clock = FakeClock(1)
    out = []
    with contextlib.ExitStack() as stack:
        if listening:
            stack.enter_context(context_meter.add_callback(lambda *a: out.append(a)))
        with pytest.raises(ZeroDivisionError):
            with context_meter.meter("x", func=clock) as m:
                clock.t = 3
                1 / 0
    assert (m.start, m.stop, m.delta) == (1, 3, 2)
    assert out == ([("x", 2, "seconds")] if listening else [])


def test_context_meter_measurement_floor():
    clock = FakeClock(5)
    with context_meter.meter("x", func=clock) as m:
        clock.t = 4
    assert m.delta == 0
    with context_meter.meter("x", func=clock, floor=False) as m:
        clock.t = 3
    assert m.delta == -1


def test_context_meter_measurement_reused():
    """A block can be entered again once it has exited; stop and delta are reset"""
    clock = FakeClock(0)
    block = context_meter.meter("x", func=clock)
    with block as m1:
        clock.t = 1
    assert m1.delta == 1
    with block as m2:
        assert m2 is m1
        assert math.isnan(m2.stop)
        clock.t = 4
    assert m2.delta == 3


def test_context_meter_other_units_subtract_nothing():
    """Only blocks in seconds lose the seconds digested inside them. A block in
    another unit is transparent: what is nested in it is subtracted from the
    enclosing block in seconds.
    """
    clock = FakeClock(100)
    out = []
    with context_meter.add_callback(lambda *a: out.append(a)):
        with context_meter.meter("outer", func=clock):
            with context_meter.meter("b", unit="bytes", func=clock) as m:
                context_meter.digest_metric("s", 30, "seconds")
                with context_meter.meter("inner", func=clock):
                    clock.t = 110
                clock.t = 200
            clock.t = 250
    assert out == [
        ("s", 30, "seconds"),
        ("inner", 10, "seconds"),
        # An int clock gives an int value
        ("b", 100, "bytes"),
        # 150 - 30 - 10
        ("outer", 110, "seconds"),
    ]
    assert type(out[2][1]) is int
    assert m.delta == 100


def test_context_meter_int_clock_seconds():
    """An int clock gives an int value in seconds too, when nothing is nested"""
    clock = FakeClock(100)
    out = []
    with context_meter.add_callback(lambda *a: out.append(a)):
        with context_meter.meter("x", func=clock):
            clock.t = 200
    assert out == [("x", 100, "seconds")]
    assert type(out[0][1]) is int


@pytest.mark.parametrize("unit", ["bytes", "seconds"])
def test_context_meter_int_clock_floored(unit):
    """An int clock that goes backwards gives an int value too, floored to 0"""
    clock = FakeClock(100)
    out = []
    with context_meter.add_callback(lambda *a: out.append(a)):
        with context_meter.meter("x", unit=unit, func=clock) as m:
            clock.t = 70
    assert out == [("x", 0, unit)]
    assert type(out[0][1]) is int
    assert type(m.delta) is int
    with metrics.meter(clock) as m2:
        clock.t = 40
    assert m2.delta == 0
    assert type(m2.delta) is int
    # A floor that isn't a whole number can't be an int
    with context_meter.add_callback(lambda *a: out.append(a)):
        with context_meter.meter("y", unit=unit, func=clock, floor=0.5):
            clock.t = 30
    assert out[-1] == ("y", 0.5, unit)


def test_context_meter_callbacks_stack():
    out1 = []
    out2 = []
    with context_meter.add_callback(lambda *args: out1.append(args)):
        context_meter.digest_metric("a", 1, "count")
        with context_meter.add_callback(lambda *args: out2.append(args)):
            context_meter.digest_metric("b", 2, "count")
        context_meter.digest_metric("c", 3, "count")

    assert out1 == [("a", 1, "count"), ("b", 2, "count"), ("c", 3, "count")]
    assert out2 == [("b", 2, "count")]


def test_context_meter_labels():
    """A label is any hashable and is passed through unaltered"""
    out = []
    with context_meter.add_callback(lambda *args: out.append(args)):
        context_meter.digest_metric(("ping", "x"), 1, "count")
        context_meter.digest_metric(123, 2, "count")
    assert out == [(("ping", "x"), 1, "count"), (123, 2, "count")]


def test_context_meter_decorator():
    clock = FakeClock()
    out = []

    @context_meter.meter("f", func=clock)
    def f(x, *, y):
        """Docstring"""
        clock.t += 1
        return x + y

    assert f.__name__ == "f"
    assert f.__doc__ == "Docstring"

    with context_meter.add_callback(lambda *args: out.append(args)):
        assert f(1, y=2) == 3
        assert f(3, y=4) == 7

    assert out == [("f", 1, "seconds"), ("f", 1, "seconds")]


def test_context_meter_decorator_raise():
    clock = FakeClock()
    out = []

    @context_meter.meter("f", func=clock)
    def f():
        clock.t += 1
        raise ValueError("foo")

    with context_meter.add_callback(lambda *args: out.append(args)):
        with pytest.raises(ValueError, match="foo"):
            f()
    assert out == [("f", 1, "seconds")]


def test_context_meter_decorator_recursive():
    clock = FakeClock()
    out = []

    @context_meter.meter("f", func=clock)
    def f(n):
        clock.t += 1
        if n:
            f(n - 1)

    with context_meter.add_callback(lambda *args: out.append(args)):
        f(2)
    # Each call is metered separately and the inner calls are not counted twice
    assert out == [("f", 1, "seconds")] * 3


@gen_test()
async def test_context_meter_async_decorator_no_callbacks():
    calls = []

    def clock():
        calls.append(None)
        return 0.0

    @context_meter.meter("f", func=clock)
    async def f(x):
        await asyncio.sleep(0)
        return x + 1

    assert await f(1) == 2
    assert calls == []


@gen_test()
async def test_context_meter_async_decorator():
    clock = FakeClock()
    out = []
    ev = asyncio.Event()

    @context_meter.meter("f", func=clock)
    async def f(x):
        clock.t += 1
        await ev.wait()
        return x * 2

    assert asyncio.iscoroutinefunction(f)
    assert f.__name__ == "f"

    with context_meter.add_callback(lambda *args: out.append(args)):
        task = asyncio.create_task(f(21))
        await asyncio.sleep(0)
        assert not task.done()
        assert out == []
        clock.t += 2
        ev.set()
        assert await task == 42

    assert out == [("f", 3, "seconds")]


def test_context_meter_nested():
    clock = FakeClock()
    out = []

    with context_meter.add_callback(lambda *args: out.append(args)):
        with context_meter.meter("outer", func=clock):
            clock.t += 1
            with context_meter.meter("inner1", func=clock):
                clock.t += 2
                with context_meter.meter("inner2", func=clock):
                    clock.t += 4
                context_meter.digest_metric("inner3", 0.5, "seconds")
                context_meter.digest_metric("n", 5, "count")
            with context_meter.meter("b", unit="bytes", func=clock):
                clock.t += 8
            clock.t += 16

    assert out == [
        ("inner2", 4, "seconds"),
        ("inner3", 0.5, "seconds"),
        ("n", 5, "count"),
        ("inner1", 1.5, "seconds"),
        # Metrics that are not seconds are not subtracted
        ("b", 8, "bytes"),
        ("outer", 25, "seconds"),
    ]
    # Additive: the total seconds are the time spent in the outermost block
    assert sum(v for _, v, u in out if u == "seconds") == 31


def test_context_meter_nested_floor():
    clock = FakeClock()
    out = []

    with context_meter.add_callback(lambda *args: out.append(args)):
        with context_meter.meter("a", func=clock):
            with context_meter.meter("b", func=clock, floor=False):
                clock.t += 1
                context_meter.digest_metric("c", 3, "seconds")
            clock.t += 1
        with context_meter.meter("d", func=clock, floor=0.5):
            context_meter.digest_metric("e", 3, "seconds")
        with context_meter.meter("f", func=clock):
            clock.t -= 1  # Non-monotonic clock

    assert out == [
        ("c", 3, "seconds"),
        ("b", -2, "seconds"),
        # 2 - (-2) - 3
        ("a", 1, "seconds"),
        ("e", 3, "seconds"),
        ("d", 0.5, "seconds"),
        ("f", 0, "seconds"),
    ]


def test_context_meter_pickle():
    assert pickle.loads(pickle.dumps(context_meter)) is context_meter

    cloudpickle = import_or_skip("cloudpickle")
    assert cloudpickle.loads(cloudpickle.dumps(context_meter)) is context_meter


def test_context_meter_raise():
    clock = FakeClock()
    out = []

    with pytest.raises(ValueError, match="foo"):
        with context_meter.add_callback(lambda *args: out.append(args)):
            with context_meter.meter("m", func=clock):
                clock.t = 1
                raise ValueError("foo")

    assert out == [("m", 1, "seconds")]
    # The callback was removed on error
    context_meter.digest_metric("x", 1, "count")
    assert len(out) == 1
    assert metrics._callbacks_var.get() == ()
    assert metrics._current_meter_var.get() is None


def test_context_meter_callback_raise_does_not_hide_error():
    """A failure in a callback while the metered block raises is logged, and the
    block's own exception and traceback come through unaltered.
    """

    def cb(label, value, unit):
        raise RuntimeError("callback failed")

    def user_code():
        raise ValueError("user error")

    with captured_logger("distributed.metrics") as log:
        with pytest.raises(ValueError, match="user error") as excinfo:
            with context_meter.add_callback(cb):
                with context_meter.meter("m"):
                    user_code()

    assert excinfo.value.__context__ is None
    assert excinfo.traceback[-1].name == "user_code"
    assert "callback failed" in log.getvalue()
    assert "Failed to digest metric 'm'" in log.getvalue()


def test_context_meter_callback_raise():
    """A failure in a callback surfaces when the block itself did not raise"""

    def cb(label, value, unit):
        raise RuntimeError("callback failed")

    with context_meter.add_callback(cb):
        with pytest.raises(RuntimeError, match="callback failed"):
            with context_meter.meter("m"):
                pass
        with pytest.raises(RuntimeError, match="callback failed"):
            context_meter.digest_metric("x", 1, "count")

    assert metrics._callbacks_var.get() == ()
    assert metrics._current_meter_var.get() is None


def test_context_meter_callback_raise_others_still_called():
    out = []

    def bad1(label, value, unit):
        raise RuntimeError("bad1")

    def bad2(label, value, unit):
        raise RuntimeError("bad2")

    with context_meter.add_callback(bad1):
        with context_meter.add_callback(lambda *args: out.append(args)):
            with context_meter.add_callback(bad2):
                with pytest.raises(RuntimeError, match="bad1"):
                    context_meter.digest_metric("x", 1, "count")
                with pytest.raises(RuntimeError, match="bad1"):
                    with context_meter.meter("y", func=FakeClock()):
                        pass
    assert out == [("x", 1, "count"), ("y", 0, "seconds")]
    assert metrics._current_meter_var.get() is None


def test_add_callback_removed_on_error():
    out = []
    with pytest.raises(ZeroDivisionError):
        with context_meter.add_callback(lambda *args: out.append(args)):
            context_meter.digest_metric("x", 1, "count")
            1 / 0
    context_meter.digest_metric("y", 1, "count")
    assert out == [("x", 1, "count")]
    assert metrics._callbacks_var.get() == ()


def test_add_callback_not_reentrant():
    scope = context_meter.add_callback(lambda *args: None)
    with scope:
        with pytest.raises(RuntimeError, match="not reentrant"):
            with scope:
                pass
    # Can be reused sequentially
    with scope:
        assert len(metrics._callbacks_var.get()) == 1
    assert metrics._callbacks_var.get() == ()


@pytest.mark.parametrize(
    "label,value,unit,exc,match",
    [
        ("x", "1", "count", TypeError, "must be a real number"),
        ("x", None, "count", TypeError, "must be a real number"),
        ("x", True, "count", TypeError, "must be a real number"),
        ("x", 1 + 0j, "count", TypeError, "must be a real number"),
        ("x", float("nan"), "seconds", ValueError, "must be a finite number"),
        ("x", float("inf"), "seconds", ValueError, "must be a finite number"),
        ("x", -float("inf"), "seconds", ValueError, "must be a finite number"),
        ("x", 1, b"count", TypeError, "unit must be a str"),
        ("x", 1, None, TypeError, "unit must be a str"),
        (["x"], 1, "count", TypeError, "label must be hashable"),
    ],
)
def test_digest_metric_bad_input(label, value, unit, exc, match):
    """Bad metrics are rejected at the call site, whether or not someone is
    listening, and are not passed to the callbacks.
    """
    out = []
    with context_meter.add_callback(lambda *args: out.append(args)):
        with pytest.raises(exc, match=match):
            context_meter.digest_metric(label, value, unit)
    with pytest.raises(exc, match=match):
        context_meter.digest_metric(label, value, unit)
    assert out == []


def test_meter_bad_input():
    with pytest.raises(TypeError, match="unit must be a str"):
        context_meter.meter("x", unit=1)
    with pytest.raises(TypeError, match="label must be hashable"):
        context_meter.meter(["x"])
    # Labels can be any hashable
    out = []
    with context_meter.add_callback(lambda *args: out.append(args)):
        with context_meter.meter(("x", 1), func=FakeClock()):
            pass
    assert out == [(("x", 1), 0, "seconds")]


def test_digest_metric_other_real_numbers():
    out = []
    with context_meter.add_callback(lambda *args: out.append(args)):
        context_meter.digest_metric("x", Fraction(1, 2), "seconds")
        context_meter.digest_metric("y", -1.5, "bytes")
    assert out == [("x", Fraction(1, 2), "seconds"), ("y", -1.5, "bytes")]

    np = import_or_skip("numpy")
    with context_meter.add_callback(lambda *args: out.append(args)):
        context_meter.digest_metric("z", np.int64(3), "count")
        with pytest.raises(ValueError, match="finite"):
            context_meter.digest_metric("z", np.float64("nan"), "count")
    assert out[2:] == [("z", 3, "count")]


def test_int_stays_int():
    out = []
    with context_meter.add_callback(lambda *args: out.append(args)):
        context_meter.digest_metric("n", 1, "count")
        with context_meter.meter("m"):
            context_meter.digest_metric("b", 123, "bytes")
            context_meter.digest_metric("s", 2, "seconds")
    assert [(type(v), v) for _, v, _ in out[:3]] == [(int, 1), (int, 123), (int, 2)]

    for coarse_time in (False, "failed"):
        ledger = DelayedMetricsLedger()
        with ledger.record():
            context_meter.digest_metric("n", 1, "count")
            context_meter.digest_metric("b", 10, "bytes")
        out = ledger.finalize(coarse_time=coarse_time)
        assert type(out[0][1]) is int
        assert type(out[1][1]) is int


@gen_test()
async def test_context_meter_isolation_asyncio_tasks():
    ev1 = asyncio.Event()
    ev2 = asyncio.Event()
    out1 = []
    out2 = []

    async def task1():
        with context_meter.add_callback(lambda *args: out1.append(args)):
            with context_meter.meter("t1"):
                ev2.set()
                await ev1.wait()
                context_meter.digest_metric("n1", 1, "count")

    async def task2():
        with context_meter.add_callback(lambda *args: out2.append(args)):
            with context_meter.meter("t2"):
                await ev2.wait()
                context_meter.digest_metric("n2", 2, "seconds")
                ev1.set()

    out0 = []
    with context_meter.add_callback(lambda *args: out0.append(args)):
        # Tasks inherit a copy of the context at the moment of their creation
        await asyncio.gather(task1(), task2())

    assert [m[0] for m in out1] == ["n1", "t1"]
    assert [m[0] for m in out2] == ["n2", "t2"]
    assert [m[0] for m in out0] == ["n2", "t2", "n1", "t1"]
    # The seconds of n2 were not subtracted from t1
    assert out2[0] == ("n2", 2, "seconds")
    assert metrics._callbacks_var.get() == ()


def test_context_meter_isolation_threads():
    out_main = []
    out_thread = []
    barrier = threading.Barrier(2)

    def thread_main():
        with context_meter.add_callback(lambda *args: out_thread.append(args)):
            barrier.wait()
            context_meter.digest_metric("thread", 1, "count")
            barrier.wait()

    t = threading.Thread(target=thread_main)
    with context_meter.add_callback(lambda *args: out_main.append(args)):
        t.start()
        barrier.wait()
        context_meter.digest_metric("main", 2, "count")
        barrier.wait()
        t.join()

    assert out_main == [("main", 2, "count")]
    assert out_thread == [("thread", 1, "count")]


def test_context_meter_thread_with_context():
    """Running a thread in a copy of the context makes it see the callbacks, and
    its seconds are subtracted from the enclosing meter.
    """
    clock = FakeClock()
    out = []

    def thread_main():
        with context_meter.meter("thread", func=clock):
            clock.t += 1

    with context_meter.add_callback(lambda *args: out.append(args)):
        with context_meter.meter("main", func=clock):
            ctx = contextvars.copy_context()
            t = threading.Thread(target=ctx.run, args=(thread_main,))
            t.start()
            t.join()
            clock.t += 2

    assert out == [("thread", 1, "seconds"), ("main", 2, "seconds")]


other_var: contextvars.ContextVar[str] = contextvars.ContextVar("other_var")


def test_new_context():
    out_outer = []
    out_new = []
    with context_meter.add_callback(lambda *args: out_outer.append(args)):
        ctx = context_meter.new_context(lambda *args: out_new.append(args))
        # The new context doesn't inherit the callbacks of the current one
        ctx.run(context_meter.digest_metric, "a", 1, "count")
        # ...and the current context is untouched
        context_meter.digest_metric("b", 2, "count")
    assert out_new == [("a", 1, "count")]
    assert out_outer == [("b", 2, "count")]
    assert metrics._callbacks_var.get() == ()

    # Several callbacks, or none at all
    out2 = []
    ctx = context_meter.new_context(out_new.append, out2.append)
    assert ctx.run(metrics._callbacks_var.get) == (out_new.append, out2.append)
    assert context_meter.new_context().run(metrics._callbacks_var.get) == ()
    with context_meter.add_callback(lambda *args: None):
        assert context_meter.new_context().run(metrics._callbacks_var.get) == ()


def test_new_context_keeps_other_variables():
    """Only the metering starts afresh: the other context variables are kept, and the
    current context is untouched
    """
    token = other_var.set("hello")
    try:
        with context_meter.add_callback(lambda *args: None):
            with context_meter.meter("x"):
                ctx = context_meter.new_context()
                assert metrics._current_meter_var.get() is not None
        assert ctx.run(other_var.get) == "hello"
        assert ctx.run(metrics._callbacks_var.get) == ()
        assert ctx.run(metrics._current_meter_var.get) is None
        ctx.run(other_var.set, "changed")
        assert other_var.get() == "hello"
    finally:
        other_var.reset(token)


class Root(metrics.MeterRoot):
    """A MeterRoot that is current when the test says so"""

    def __init__(self):
        self.current = True
        self.received = []

    def is_current(self):
        return self.current

    def add_nested(self, seconds, cpu):
        self.received.append((seconds, cpu))


def test_new_context_root():
    root = Root()
    ctx = context_meter.new_context(root=root)
    assert ctx.run(metrics.current_root) is root
    assert metrics.current_root() is None

    def f():
        with context_meter.add_callback(lambda *args: None):
            with context_meter.meter("x"):
                # A block knows the root of its context
                assert metrics.current_root() is root
                context_meter.digest_metric("y", 1, "seconds")
            context_meter.digest_metric("z", 2, "seconds")

    ctx.run(f)
    # The root receives the blocks and bare seconds directly inside it, with no CPU
    # time: it didn't ask for it
    assert len(root.received) == 2
    assert root.received[0][0] >= 1
    assert root.received[0][1] == 0
    assert root.received[1] == (2, 0)


@gen_test()
async def test_new_context_asyncio_task():
    """An asyncio task and its done callback can run in a new context, and so does
    everything the task starts
    """
    out = []

    async def child():
        context_meter.digest_metric("child", 1, "count")

    async def main():
        with context_meter.meter("main"):
            await asyncio.create_task(child())
        return 123

    with context_meter.add_callback(lambda *args: None):
        ctx = context_meter.new_context(lambda *args: out.append(args))
        task = ctx.run(asyncio.create_task, main())
        done = asyncio.Event()
        task.add_done_callback(
            lambda _: (context_meter.digest_metric("done", 1, "count"), done.set()),
            context=ctx,
        )
        assert await task == 123
        await done.wait()
    assert [label for label, _, _ in out] == ["child", "main", "done"]


def _ledger_with_metrics(clock):
    ledger = DelayedMetricsLedger(clock)
    clock.t = 1
    with ledger.record():
        with context_meter.meter("foo", func=clock):
            clock.t += 2
        context_meter.digest_metric("n", 1, "count")
    clock.t += 4
    # Re-enter the same ledger later, e.g. from a callback
    with ledger.record():
        context_meter.digest_metric("foo", 0.5, "seconds")
        context_meter.digest_metric("b", 10, "bytes")
    clock.t += 8
    # Not recorded
    context_meter.digest_metric("bar", 100, "seconds")
    return ledger


def test_delayed_metrics_ledger():
    ledger = _ledger_with_metrics(FakeClock())
    assert ledger.seconds == 2.5
    assert ledger.finalize() == [
        ("foo", 2, "seconds"),
        ("n", 1, "count"),
        ("foo", 0.5, "seconds"),
        ("b", 10, "bytes"),
        ("other", 12.5, "seconds"),
    ]


def test_delayed_metrics_ledger_coarse_time():
    ledger = _ledger_with_metrics(FakeClock())
    assert ledger.finalize(coarse_time="failed") == [
        ("n", 1, "count"),
        ("b", 10, "bytes"),
        ("failed", 15, "seconds"),
    ]


@pytest.mark.parametrize(
    "t,kwargs,expect",
    [
        (1, {}, [("foo", 3, "seconds"), ("other", 0, "seconds")]),
        (1, {"floor": False}, [("foo", 3, "seconds"), ("other", -2, "seconds")]),
        (1, {"floor": 1.5}, [("foo", 3, "seconds"), ("other", 1.5, "seconds")]),
        (-1, {"coarse_time": "x"}, [("x", 0, "seconds")]),
        (-1, {"coarse_time": "x", "floor": False}, [("x", -1, "seconds")]),
    ],
)
def test_delayed_metrics_ledger_floor(t, kwargs, expect):
    clock = FakeClock()
    ledger = DelayedMetricsLedger(clock)
    with ledger.record():
        context_meter.digest_metric("foo", 3, "seconds")
    clock.t = t
    assert ledger.finalize(**kwargs) == expect


def test_delayed_metrics_ledger_finalized():
    """Once finalized, the ledger records nothing more and can't be finalized again"""
    ledger = DelayedMetricsLedger()
    with ledger.record():
        context_meter.digest_metric("a", 1, "seconds")
        out = ledger.finalize()
        context_meter.digest_metric("b", 1, "seconds")
    ledger("c", 1, "seconds")
    ledger.add_phase("d", 1, 0)
    ledger.add_thread_phase(1, 1, thread_root())
    assert [m[0] for m in out] == ["a", "other"]
    assert ledger.metrics is None
    assert ledger.seconds == 1
    with pytest.raises(RuntimeError, match="finalized twice"):
        ledger.finalize()


@pytest.mark.parametrize("nested,expect", [(0, 5), (2, 3), (5, 0), (6, 0)])
def test_delayed_metrics_ledger_add_phase(nested, expect):
    """The seconds recorded during a phase come out of it; the rest is floored"""
    ledger = DelayedMetricsLedger()
    ledger(("before",), 10, "seconds")
    mark = ledger.seconds
    ledger("n", 3, "count")  # Not subtracted
    if nested:
        ledger("own", nested, "seconds")
    ledger.add_phase("deserialize", 5, mark)
    assert ledger.metrics[-1] == ("deserialize", expect, "seconds")
    # The phase counts towards the seconds of any enclosing phase
    assert ledger.seconds == 10 + nested + expect


def thread_root(
    nested: float = 0.0, nested_cpu: float = 0.0, waited: float = 0.0
) -> metrics.ThreadRoot:
    """The ThreadRoot of a function that ran in a thread, and received these"""
    root = metrics.ThreadRoot(lambda: None, None, owned=True)
    root()
    root.nested, root.nested_cpu, root.waited = nested, nested_cpu, waited
    return root


@pytest.mark.parametrize(
    "nested,nested_cpu,expect_cpu,expect_noncpu",
    [
        # wall 5, of which 3 CPU time
        (0, 0, 3, 2),
        # Blocks come out of the CPU time by their CPU time, and out of the rest by
        # the rest
        (1, 1, 2, 2),
        (2, 0, 3, 0),
        (2, 1, 2, 1),
        (5, 3, 0, 0),
        # Bare seconds come out of the rest first, then out of the CPU time
        (3, 0, 2, 0),
        # Both floored at 0
        (6, 0, 0, 0),
        (6, 4, 0, 0),
    ],
)
def test_delayed_metrics_ledger_add_thread_phase(
    nested, nested_cpu, expect_cpu, expect_noncpu
):
    ledger = DelayedMetricsLedger()
    ledger("n", 7, "count")  # Not subtracted
    ledger.add_thread_phase(5, 3, thread_root(nested, nested_cpu))
    assert ledger.metrics[-2:] == [
        ("thread-cpu", expect_cpu, "seconds"),
        ("thread-noncpu", expect_noncpu, "seconds"),
    ]
    assert ledger.seconds == expect_cpu + expect_noncpu


@pytest.mark.parametrize(
    "nested,nested_cpu,waited,expect_cpu,expect_noncpu",
    [
        # wall 5, of which 3 CPU time: what other threads did while this one waited
        # comes out of the rest only
        (0, 0, 1, 3, 1),
        (0, 0, 2, 3, 0),
        # e.g. several threads at once: never out of the CPU time
        (0, 0, 7, 3, 0),
        (1, 1, 1, 2, 1),
        (1, 0, 1, 3, 0),
    ],
)
def test_delayed_metrics_ledger_add_thread_phase_waited(
    nested, nested_cpu, waited, expect_cpu, expect_noncpu
):
    ledger = DelayedMetricsLedger()
    ledger.add_thread_phase(5, 3, thread_root(nested, nested_cpu, waited))
    assert ledger.metrics == [
        ("thread-cpu", expect_cpu, "seconds"),
        ("thread-noncpu", expect_noncpu, "seconds"),
    ]


def test_delayed_metrics_ledger_add_thread_phase_cpu_exceeds_wall():
    """The two clocks may disagree slightly; noncpu is floored, and the phase stays
    as long as the wall time
    """
    ledger = DelayedMetricsLedger()
    ledger.add_thread_phase(1.0, 1.5, thread_root())
    assert ledger.metrics == [
        ("thread-cpu", 1.0, "seconds"),
        ("thread-noncpu", 0.0, "seconds"),
    ]


def test_delayed_metrics_ledger_phases_finalize():
    clock = FakeClock(100)
    ledger = DelayedMetricsLedger(clock)
    ledger("a", 1.5, "seconds")
    ledger("n", 3, "count")
    ledger.add_phase("deserialize", 2, ledger.seconds)
    ledger.add_thread_phase(5, 4, thread_root())
    clock.t = 110
    assert ledger.finalize() == [
        ("a", 1.5, "seconds"),
        ("n", 3, "count"),
        ("deserialize", 2, "seconds"),
        ("thread-cpu", 4, "seconds"),
        ("thread-noncpu", 1, "seconds"),
        ("other", 1.5, "seconds"),
    ]


def test_delayed_metrics_ledger_nested_in_meter():
    """The ledger's callback stacks on top of the ones already installed"""
    clock = FakeClock()
    out = []
    with context_meter.add_callback(lambda *args: out.append(args)):
        ledger = DelayedMetricsLedger(clock)
        with ledger.record():
            with context_meter.meter("foo", func=clock):
                clock.t += 1
    assert out == [("foo", 1, "seconds")]
    assert ledger.finalize() == [("foo", 1, "seconds"), ("other", 0, "seconds")]


@gen_test()
async def test_delayed_metrics_ledger_thread_and_callback():
    ledger = DelayedMetricsLedger()
    loop = asyncio.get_running_loop()

    def in_thread():
        context_meter.digest_metric("thread", 1, "count")
        return threading.get_ident()

    with ledger.record():
        ctx = contextvars.copy_context()
        tid = await loop.run_in_executor(None, ctx.run, in_thread)
    assert tid != threading.get_ident()

    fut = loop.create_future()

    def callback():
        with ledger.record():
            context_meter.digest_metric("callback", 2, "count")
        fut.set_result(None)

    loop.call_soon(callback)
    await fut

    labels = [label for label, _, _ in ledger.finalize()]
    assert labels == ["thread", "callback", "other"]


def test_no_leaks():
    """Nothing piles up after many uses"""
    for _ in range(1000):
        ledger = DelayedMetricsLedger()
        with ledger.record():
            with context_meter.meter("x"):
                context_meter.digest_metric("y", 1, "count")
        ledger.finalize()
    assert metrics._callbacks_var.get() == ()
    assert metrics._current_meter_var.get() is None


def test_meter_logs_on_block_error_only(caplog):
    with caplog.at_level(logging.ERROR, logger="distributed.metrics"):
        with context_meter.add_callback(lambda *args: None):
            with context_meter.meter("x"):
                pass
    assert not caplog.records


@pytest.mark.parametrize("listening", [False, True])
@pytest.mark.parametrize("unit", ["seconds", "bytes"])
def test_context_meter_block_not_reentrant(listening, unit):
    """A block can't be entered again while it is open, in whatever unit, and
    whether or not somebody is listening
    """
    out = []
    scope = (
        context_meter.add_callback(lambda *args: out.append(args))
        if listening
        else contextlib.nullcontext()
    )
    clock = FakeClock(0)
    block = context_meter.meter("x", unit=unit, func=clock)
    with scope:
        with block as m:
            clock.t = 1
            with pytest.raises(RuntimeError, match="not reentrant"):
                with block:
                    pass
            clock.t = 2
    assert m.delta == 2
    assert out == ([("x", 2, unit)] if listening else [])
    assert metrics._current_meter_var.get() is None


def test_meter_not_reentrant():
    clock = FakeClock(0)
    block = metrics.meter(clock)
    with block as m:
        with pytest.raises(RuntimeError, match="not reentrant"):
            with block:
                pass
        clock.t = 2
    assert m.delta == 2
    # Can be reused sequentially
    with block as m2:
        clock.t = 3
    assert m2.delta == 1


def test_context_meter_clock_raises_on_enter():
    """A block whose clock raises when it is entered was never entered: the blocks
    after it nest where they would have
    """

    class BadClock:
        def __call__(self):
            raise OSError("no clock")

    out = []
    clock = FakeClock(0)
    with context_meter.add_callback(lambda *args: out.append(args)):
        with context_meter.meter("outer", func=clock):
            with pytest.raises(OSError, match="no clock"):
                with context_meter.meter("inner", func=BadClock()):
                    pass
            with context_meter.meter("next", func=clock):
                clock.t = 2
    assert out == [("next", 2, "seconds"), ("outer", 0, "seconds")]
    assert metrics._current_meter_var.get() is None


@pytest.mark.parametrize(
    "start,stop,exc",
    [
        (0.0, float("nan"), ValueError),
        (0.0, float("inf"), ValueError),
        (Decimal(0), Decimal(1), TypeError),
    ],
)
@pytest.mark.parametrize("unit", ["seconds", "count"])
def test_context_meter_clock_gives_bad_value(start, stop, exc, unit):
    """A block whose clock gives something other than a finite real number raises
    on exit, like digest_metric, and digests nothing; the blocks around it carry on
    """
    out = []
    inner_clock = FakeClock(start)
    clock = FakeClock(0)
    with context_meter.add_callback(lambda *args: out.append(args)):
        with context_meter.meter("outer", func=clock):
            with pytest.raises(exc):
                with context_meter.meter("inner", unit=unit, func=inner_clock):
                    inner_clock.t = stop
            clock.t = 1
    assert out == [("outer", 1, "seconds")]
    assert metrics._current_meter_var.get() is None


def test_context_meter_clock_gives_bad_value_while_raising():
    """... unless the block raises already: then its own exception goes on, and
    the bad value is logged
    """
    out = []
    clock = FakeClock(0.0)
    with context_meter.add_callback(lambda *args: out.append(args)):
        with captured_logger("distributed.metrics") as log:
            with pytest.raises(ZeroDivisionError):
                with context_meter.meter("x", func=clock):
                    clock.t = float("nan")
                    1 / 0
    assert out == []
    assert "Invalid value of metric 'x'" in log.getvalue()
    assert metrics._current_meter_var.get() is None


class FailingClock(FakeClock):
    """A FakeClock that raises while ``fail`` is set"""

    fail = False

    def __call__(self):
        if self.fail:
            raise OSError("no clock")
        return super().__call__()


@pytest.mark.parametrize("unit", ["seconds", "count"])
def test_context_meter_clock_raises_on_exit(unit):
    """A block whose clock raises when it exits is left, and digests nothing; what
    was digested inside it goes to the block around it, as bare seconds; the block
    can be entered again
    """
    out = []
    inner_clock = FailingClock(0)
    clock = FakeClock(0)
    block = context_meter.meter("inner", unit=unit, func=inner_clock)
    with context_meter.add_callback(lambda *args: out.append(args)):
        with context_meter.meter("outer", func=clock):
            with pytest.raises(OSError, match="no clock"):
                with block:
                    context_meter.digest_metric("nested", 3, "seconds")
                    inner_clock.fail = True
            assert metrics._current_meter_var.get().label == "outer"
            inner_clock.fail = False
            with block:
                inner_clock.t = 1
            clock.t = 10
    assert out == [
        ("nested", 3, "seconds"),
        ("inner", 1, unit),
        # 10 s, less 3 nested, less the inner block's second if in seconds
        ("outer", 6 if unit == "seconds" else 7, "seconds"),
    ]
    assert metrics._current_meter_var.get() is None


def test_meter_clock_raises_on_exit():
    """meter() too: a block whose clock raises on exit is closed, and can be
    entered again
    """
    clock = FailingClock(0)
    block = metrics.meter(clock)
    with pytest.raises(OSError):
        with block:
            clock.fail = True
    clock.fail = False
    with block as m:
        clock.t = 2
    assert m.delta == 2


def test_context_meter_bad_value_passes_on_what_is_inside():
    """A block whose clock gives a bad value still passes on the seconds digested
    inside it: the block around it does not count them again
    """
    out = []
    inner_clock = FakeClock(0.0)
    clock = FakeClock(0.0)
    with context_meter.add_callback(lambda *args: out.append(args)):
        with context_meter.meter("outer", func=clock):
            with pytest.raises(ValueError):
                with context_meter.meter("inner", func=inner_clock):
                    context_meter.digest_metric("nested", 0.5, "seconds")
                    inner_clock.t = float("nan")
            clock.t = 1.0
    assert out == [("nested", 0.5, "seconds"), ("outer", 0.5, "seconds")]


@pytest.mark.parametrize("where", ["entry", "exit"])
def test_context_meter_nan_clock_and_reentry(where):
    """A clock that gives nan, on entry or on exit, does not confuse whether the
    block is open: it can't be entered while open, and can be after
    """
    clock = FakeClock(float("nan") if where == "entry" else 0.0)
    block = context_meter.meter("x", func=clock)
    with context_meter.add_callback(lambda *args: None):
        with pytest.raises(ValueError, match="finite"):
            with block:
                with pytest.raises(RuntimeError, match="not reentrant"):
                    with block:
                        pass
                clock.t = float("nan")
        assert metrics._current_meter_var.get() is None
        clock.t = 0.0
        with block as m:
            clock.t = 1.0
    assert m.delta == 1.0
    assert metrics._current_meter_var.get() is None


def test_context_meter_block_releases_its_root():
    """A block kept after it ended (to read its delta, e.g.) does not keep the
    root it ran under, which in a worker holds the instruction's recorder
    """
    root = Root()
    block = context_meter.meter("x")

    def work():
        with block:
            pass

    context_meter.new_context(lambda *args: None, root=root).run(work)
    ref = weakref.ref(root)
    del root
    gc.collect()
    assert ref() is None
    assert block.delta >= 0


def test_thread_root_keywords_named_like_its_parameters():
    """A function run under a ThreadRoot takes any keyword, ``func`` and ``self``
    included, as it does without one
    """

    def f(*, func=None, self=None):
        return func, self

    ctx = context_meter.new_context(lambda *args: None, root=Root())
    root = ctx.run(context_meter.in_thread, f)
    assert isinstance(root, metrics.ThreadRoot)
    assert root(func=1, self=2) == (1, 2)


def test_context_meter_decorator_refuses_generators():
    """A call of a generator function only creates the generator: decorating one
    would meter nothing of its work
    """

    def gen():
        yield 1

    async def agen():
        yield 1

    for f in (gen, agen):
        with pytest.raises(TypeError, match="generator function"):
            context_meter.meter("x")(f)


def sync_decorated_in_a_body():
    @context_meter.meter("sync-work", func=FakeClock(1))
    def work(x):
        return x + 1

    return work


def async_decorated_in_a_body():
    @context_meter.meter("async-work", func=FakeClock(1))
    async def work(x):
        return x + 1

    return work


@gen_test()
async def test_context_meter_decorated_function_pickled_by_value():
    """cloudpickle pickles by value a function decorated where it can't be imported
    from (in __main__, in a notebook, in a function's body): the decorated function
    pickles, and is still metered
    """
    cloudpickle = import_or_skip("cloudpickle")
    sync_work = cloudpickle.loads(cloudpickle.dumps(sync_decorated_in_a_body()))
    async_work = cloudpickle.loads(cloudpickle.dumps(async_decorated_in_a_body()))
    out = []
    with context_meter.add_callback(lambda *args: out.append(args)):
        assert sync_work(1) == 2
        assert await async_work(2) == 3
    assert out == [("sync-work", 0, "seconds"), ("async-work", 0, "seconds")]


def test_a_block_is_whole_when_another_thread_can_see_it(monkeypatch):
    """Another thread may read the blocks open in a context at any instant
    (``open_block_since``, for what a running task spent so far): a block is whole
    when it is published in the context, and the reader finds the blocks around it
    also before the block has its token
    """
    var = metrics._current_meter_var
    seen = []

    class Spy:
        # Reads the context as another thread would, the instant a block is
        # published, before ContextVar.set returns its token
        def get(self, *args):
            return var.get(*args)

        def set(self, value):
            token = var.set(value)
            monkeypatch.setattr(metrics, "_current_meter_var", var)
            try:
                seen.append(metrics.open_block_since(contextvars.copy_context()))
            finally:
                monkeypatch.setattr(metrics, "_current_meter_var", self)
            return token

        def reset(self, token):
            var.reset(token)

    with context_meter.add_callback(lambda label, value, unit: None):
        monkeypatch.setattr(metrics, "_current_meter_var", Spy())
        with context_meter.meter("outer"):
            time.sleep(0.05)
            with context_meter.meter("inner"):
                pass
        monkeypatch.setattr(metrics, "_current_meter_var", var)
    assert var.get() is None
    assert len(seen) == 2
    # At the inner block's start, the time so far ends where the outer one started
    ago, cpu, held = seen[1]
    assert ago >= 0.05
    assert cpu is None
    assert held == 0


def test_negative_seconds_are_refused():
    """Seconds are time spent: a negative number of them would give the blocks and
    phases around them more than their time. Other units may be negative.
    """
    with context_meter.add_callback(lambda label, value, unit: None):
        with context_meter.meter("outer"):
            with pytest.raises(ValueError, match="must not be negative"):
                context_meter.digest_metric("refund", -5.0, "seconds")
            with pytest.raises(ValueError, match="must not be negative"):
                context_meter.digest_metric(("refund", 1), -1, "seconds")
            context_meter.digest_metric("freed", -100, "bytes")
            context_meter.digest_metric("refund", 0.0, "seconds")
    # Refused also when nobody listens, like any invalid value
    with pytest.raises(ValueError, match="must not be negative"):
        context_meter.digest_metric("refund", -5.0, "seconds")


def test_block_that_can_be_negative_adds_up():
    """A block with floor=False whose inner seconds claim more than its time gives
    a negative value, which corrects for them: the seconds of the activity still add
    up to its time
    """
    ledger = DelayedMetricsLedger()
    with ledger.record():
        with context_meter.meter("block", floor=False):
            context_meter.digest_metric("claimed", 0.5, "seconds")
            time.sleep(0.01)
        time.sleep(0.05)
    metrics = {label: value for label, value, _ in ledger.finalize()}
    assert metrics["block"] < -0.4
    assert metrics["other"] >= 0.05
    assert sum(metrics.values()) == pytest.approx(ledger.stop - ledger.start)
