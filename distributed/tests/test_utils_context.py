from __future__ import annotations

import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from distributed.metrics import context_meter
from distributed.utils import offload, run_in_executor_with_context
from distributed.utils_test import gen_test

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
