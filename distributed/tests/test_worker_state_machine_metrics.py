"""Fine performance metrics on the events of the worker state machine.

The state machine itself must stay free of metering: these tests pin that events
carry metrics without affecting transitions or instructions, and that the upstream
behaviour of the events they touch is unchanged.
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
from collections import defaultdict

import pytest

import distributed.worker_state_machine as wsm
from distributed.metrics import DelayedMetricsLedger, MeterRoot, context_meter
from distributed.protocol.serialize import Serialize
from distributed.tests.test_metrics import FakeClock
from distributed.utils import recursive_to_dict
from distributed.utils_test import async_poll_for, gen_test
from distributed.worker_state_machine import (
    AddKeysMsg,
    BaseWorker,
    ComputeTaskEvent,
    Execute,
    ExecuteFailureEvent,
    ExecuteSuccessEvent,
    FreeKeysEvent,
    GatherDep,
    GatherDepBusyEvent,
    GatherDepDoneEvent,
    GatherDepFailureEvent,
    GatherDepNetworkFailureEvent,
    GatherDepSuccessEvent,
    RescheduleEvent,
    RescheduleMsg,
    StateMachineEvent,
    TaskErredMsg,
    TaskFinishedMsg,
    WorkerState,
)

METRICS = [("deserialize", 0.5, "seconds"), (("ping", "x"), 1, "count")]


def recording() -> list[wsm.InstructionMetricsRecorder]:
    """The recorders of the instructions still in flight (not finalized yet)"""
    gc.collect()
    return [
        o
        for o in gc.get_objects()
        if isinstance(o, wsm.InstructionMetricsRecorder) and o.metrics is not None
    ]


def _gather_dep_events(**kwargs):
    common = dict(worker="127.0.0.1:2", total_nbytes=1, stimulus_id="s")
    failure = GatherDepFailureEvent.from_exception(ValueError("x"), **common)
    failure.metrics = kwargs.get("metrics", [])
    return [
        GatherDepSuccessEvent(data={"x": 1}, **common, **kwargs),
        GatherDepBusyEvent(**common, **kwargs),
        GatherDepNetworkFailureEvent(**common, **kwargs),
        failure,
    ]


def _id(ev):
    return type(ev).__name__


def _execute_events():
    return [
        ExecuteSuccessEvent.dummy("x", 1, stimulus_id="s"),
        ExecuteFailureEvent.dummy("x", stimulus_id="s"),
        RescheduleEvent.dummy("x", stimulus_id="s"),
    ]


def test_digest_metric_instruction_is_gone():
    assert not hasattr(wsm, "DigestMetric")


@pytest.mark.parametrize("ev", _gather_dep_events() + _execute_events(), ids=_id)
def test_metrics_default_to_empty(ev):
    """Code that builds events by hand keeps working"""
    assert ev.metrics == []


def test_metrics_default_is_not_shared():
    ev1, ev2 = (ExecuteSuccessEvent.dummy("x", stimulus_id="s") for _ in range(2))
    ev1.metrics.append(("foo", 1, "count"))
    assert ev2.metrics == []


@pytest.mark.parametrize("ev", _gather_dep_events(metrics=list(METRICS)), ids=_id)
def test_gather_dep_events_accept_metrics(ev):
    assert ev.metrics == METRICS
    assert not hasattr(ev, "__dict__")  # still slotted


def test_execute_events_accept_metrics():
    ev1 = ExecuteSuccessEvent(
        key="x",
        run_id=1,
        value=None,
        start=0.0,
        stop=1.0,
        nbytes=1,
        type=None,
        stimulus_id="s",
        metrics=list(METRICS),
    )
    ev2 = ExecuteFailureEvent(
        key="x",
        start=None,
        stop=None,
        exception=Serialize(None),
        traceback=None,
        exception_text="",
        traceback_text="",
        stimulus_id="s",
        metrics=list(METRICS),
    )
    ev3 = RescheduleEvent(key="x", stimulus_id="s", metrics=list(METRICS))
    for ev in (ev1, ev2, ev3):
        assert ev.metrics == METRICS
        assert not hasattr(ev, "__dict__")


def _done_event_classes():
    out = []
    todo = [wsm.InstructionDoneEvent]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(set(out), key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", _done_event_classes(), ids=lambda c: c.__name__)
def test_done_events_built_from_their_fields(cls):
    """Every event that ends an instruction, abstract bases included, can be built
    from its own fields, metrics among them
    """
    kwargs = {
        f.name: f"dummy-{f.name}"
        for f in dataclasses.fields(cls)
        if f.init and f.name != "metrics"
    }
    ev = cls(**kwargs, metrics=list(METRICS))
    assert ev.metrics == METRICS
    assert cls(**kwargs).metrics == []
    assert "metrics" in {f.name for f in dataclasses.fields(cls)}


def test_new_done_event_cannot_forget_metrics():
    """metrics is declared once, where it belongs: a new subclass with fields of its
    own, without defaults, has it too
    """

    @dataclasses.dataclass
    class MyGatherDepEvent(GatherDepDoneEvent):
        __slots__ = ("extra",)
        extra: int

    try:
        ev = MyGatherDepEvent("s", "w", 1, 2, metrics=list(METRICS))
        assert (ev.worker, ev.total_nbytes, ev.extra) == ("w", 1, 2)
        assert ev.metrics == METRICS
        assert MyGatherDepEvent("s", "w", 1, 2).metrics == []
        assert not hasattr(ev, "__dict__")
    finally:
        del wsm.StateMachineEvent._classes["MyGatherDepEvent"]


def test_to_loggable_keeps_metrics():
    """stimulus_log stores a shallow copy of some events; it must share the list of
    metrics, which BaseWorker fills in after handling the event
    """
    ev = GatherDepSuccessEvent(
        worker="127.0.0.1:2", total_nbytes=1, data={"x": 123}, stimulus_id="s"
    )
    ev2 = ev.to_loggable(handled=1.0)
    assert ev2 is not ev
    assert ev2.data == {"x": None}
    ev.metrics.append(("other", 1.0, "seconds"))
    assert ev2.metrics == [("other", 1.0, "seconds")]

    ev = ExecuteSuccessEvent.dummy("x", 123, stimulus_id="s")
    ev2 = ev.to_loggable(handled=1.0)
    assert ev2.value is None
    ev.metrics.append(("other", 1.0, "seconds"))
    assert ev2.metrics == [("other", 1.0, "seconds")]


@pytest.mark.parametrize("ev", _gather_dep_events() + _execute_events(), ids=_id)
def test_metrics_in_dump(ev):
    """The metrics are in the dump, and from_dict rebuilds them as they were: tuples,
    with a tuple label a tuple again (a list couldn't be a key)
    """
    ev.metrics = [*METRICS, ((("nested", 1), "x"), 2, "count")]
    d = recursive_to_dict(ev)
    assert d["metrics"] == recursive_to_dict(ev.metrics)
    ev2 = StateMachineEvent.from_dict(d)
    assert type(ev2) is type(ev)
    assert ev2.metrics == ev.metrics
    assert all(type(m) is tuple for m in ev2.metrics)


def test_execute_success_ignores_metrics(ws):
    """The state machine does not look at the metrics, and does not emit any
    instruction about them (it used to emit DigestMetric for compute-duration)
    """
    instructions = ws.handle_stimulus(ComputeTaskEvent.dummy("x", stimulus_id="s1"))
    assert instructions == [Execute(key="x", stimulus_id="s1")]
    ev = ExecuteSuccessEvent(
        key="x",
        run_id=0,
        value=123,
        start=1.0,
        stop=3.0,
        nbytes=8,
        type=int,
        stimulus_id="s2",
        metrics=list(METRICS),
    )
    instructions = ws.handle_stimulus(ev)
    assert len(instructions) == 1
    assert isinstance(instructions[0], TaskFinishedMsg)
    assert instructions[0].key == "x"
    assert ws.tasks["x"].state == "memory"
    assert ws.data["x"] == 123
    assert ev.metrics == METRICS
    # Upstream behaviour: startstops hold the in-thread compute only
    assert ws.tasks["x"].startstops == [
        {"action": "compute", "start": 1.0, "stop": 3.0}
    ]
    assert ws.stimulus_log[-1].metrics == METRICS


def test_execute_failure(ws):
    ws.handle_stimulus(ComputeTaskEvent.dummy("x", stimulus_id="s1"))
    ev = ExecuteFailureEvent.from_exception(
        ValueError("boo"), key="x", start=1.0, stop=2.0, stimulus_id="s2"
    )
    ev.metrics.append(("failed", 1.5, "seconds"))
    instructions = ws.handle_stimulus(ev)
    assert len(instructions) == 1
    assert isinstance(instructions[0], TaskErredMsg)
    assert instructions[0].exception_text == "ValueError('boo')"
    assert ws.tasks["x"].state == "error"
    assert ws.tasks["x"].startstops == [
        {"action": "compute", "start": 1.0, "stop": 2.0}
    ]


def test_reschedule(ws):
    ws.handle_stimulus(ComputeTaskEvent.dummy("x", stimulus_id="s1"))
    instructions = ws.handle_stimulus(
        RescheduleEvent(
            key="x", stimulus_id="s2", metrics=[("cancelled", 1, "seconds")]
        )
    )
    assert instructions == [RescheduleMsg(key="x", stimulus_id="s2")]
    assert "x" not in ws.tasks or ws.tasks["x"].state == "released"


def test_cancelled_while_executing(ws):
    ws.handle_stimulus(ComputeTaskEvent.dummy("x", stimulus_id="s1"))
    ws.handle_stimulus(FreeKeysEvent(keys=["x"], stimulus_id="s2"))
    assert ws.tasks["x"].state == "cancelled"
    instructions = ws.handle_stimulus(
        ExecuteSuccessEvent.dummy("x", 123, run_id=0, stimulus_id="s3")
    )
    assert instructions == []
    assert "x" not in ws.tasks
    assert "x" not in ws.data


def test_gather_dep_success_ignores_metrics(ws):
    instructions = ws.handle_stimulus(
        ComputeTaskEvent.dummy(
            "y", who_has={"x": ["127.0.0.1:2"]}, nbytes={"x": 8}, stimulus_id="s1"
        )
    )
    assert instructions == [
        GatherDep(
            worker="127.0.0.1:2", to_gather={"x"}, total_nbytes=8, stimulus_id="s1"
        )
    ]
    assert ws.transfer_incoming_bytes == 8
    instructions = ws.handle_stimulus(
        GatherDepSuccessEvent(
            worker="127.0.0.1:2",
            total_nbytes=8,
            data={"x": 123},
            stimulus_id="s2",
            metrics=list(METRICS),
        )
    )
    assert instructions == [
        AddKeysMsg(keys=["x"], stimulus_id="s2"),
        Execute(key="y", stimulus_id="s2"),
    ]
    assert ws.tasks["x"].state == "memory"
    # Transfer bookkeeping is unchanged
    assert ws.transfer_incoming_bytes == 0
    assert not ws.in_flight_tasks
    assert ws.stimulus_log[-1].metrics == METRICS
    assert ws.stimulus_log[-1].data == {"x": None}


class MetricsMockWorker(BaseWorker):
    """A BaseWorker whose instructions emit metrics through context_meter and
    return a predefined event
    """

    def __init__(self, state: WorkerState):
        super().__init__(state)
        self.digested: dict = defaultdict(int)
        self.gather_dep_events: dict = {}
        self.execute_events: dict = {}
        self.block = asyncio.Event()

    def batched_send(self, msg):
        pass

    def digest_metric(self, name, value):
        self.digested[name] += value

    async def gather_dep(self, worker, to_gather, total_nbytes, *, stimulus_id):
        context_meter.digest_metric("network-bytes", total_nbytes, "bytes")
        with context_meter.meter("network"):
            await self.block.wait()
        return self.gather_dep_events[worker]

    async def execute(self, key, *, stimulus_id):
        context_meter.digest_metric("n", 1, "count")
        with context_meter.meter("thread-noncpu"):
            await self.block.wait()
        return self.execute_events[key]

    async def retry_busy_worker_later(self, worker):
        # Never retry; Worker.close() cancels this
        await asyncio.Event().wait()


def _seconds(metrics):
    return {label for label, _, unit in metrics if unit == "seconds"}


@gen_test()
async def test_base_worker_execute_success(ws):
    w = MetricsMockWorker(ws)
    w.execute_events["x"] = ev = ExecuteSuccessEvent.dummy("x", 1, stimulus_id="s2")
    w.handle_stimulus(ComputeTaskEvent.dummy("x", stimulus_id="s1"))
    assert len(recording()) == 1
    w.block.set()
    await async_poll_for(lambda: not w._async_instructions, timeout=5)
    assert not recording()
    assert ws.tasks["x"].state == "memory"
    assert [m[0] for m in ev.metrics] == ["n", "thread-noncpu", "other"]
    assert ev.metrics[0] == ("n", 1, "count")
    assert ws.stimulus_log[-1].metrics is ev.metrics
    assert dict(w.digested) == {
        ("execute", "x", label, unit): value for label, value, unit in ev.metrics
    }
    assert type(w.digested["execute", "x", "n", "count"]) is int


@pytest.mark.parametrize("outcome", ["failure", "reschedule", "cancel"])
@gen_test()
async def test_base_worker_execute_lumps(ws, outcome):
    w = MetricsMockWorker(ws)
    if outcome == "failure":
        ev = ExecuteFailureEvent.from_exception(ValueError(), key="x", stimulus_id="s2")
    elif outcome == "reschedule":
        ev = RescheduleEvent(key="x", stimulus_id="s2")
    else:
        ev = ExecuteSuccessEvent.dummy("x", 1, run_id=0, stimulus_id="s2")
    w.execute_events["x"] = ev
    w.handle_stimulus(ComputeTaskEvent.dummy("x", stimulus_id="s1"))
    if outcome == "cancel":
        w.handle_stimulus(FreeKeysEvent(keys=["x"], stimulus_id="s3"))
    w.block.set()
    await async_poll_for(lambda: not w._async_instructions, timeout=5)
    lump = "failed" if outcome == "failure" else "cancelled"
    # Non-time metrics are kept; all time is in one lump
    assert [m[0] for m in ev.metrics] == ["n", lump]
    assert dict(w.digested) == {
        ("execute", "x", label, unit): value for label, value, unit in ev.metrics
    }


@pytest.mark.parametrize(
    "outcome", ["success", "busy", "network-failure", "failure", "missing", "cancel"]
)
@gen_test()
async def test_base_worker_gather_dep(ws, outcome):
    w = MetricsMockWorker(ws)
    common = dict(worker="127.0.0.1:2", total_nbytes=8, stimulus_id="s2")
    if outcome == "busy":
        ev = GatherDepBusyEvent(**common)
    elif outcome == "network-failure":
        ev = GatherDepNetworkFailureEvent(**common)
    elif outcome == "failure":
        ev = GatherDepFailureEvent.from_exception(ValueError(), **common)
    elif outcome == "missing":
        ev = GatherDepSuccessEvent(data={}, **common)
    else:
        ev = GatherDepSuccessEvent(data={"x": 123}, **common)
    w.gather_dep_events["127.0.0.1:2"] = ev
    w.handle_stimulus(
        ComputeTaskEvent.dummy(
            "y", who_has={"x": ["127.0.0.1:2"]}, nbytes={"x": 8}, stimulus_id="s1"
        )
    )
    if outcome == "cancel":
        w.handle_stimulus(FreeKeysEvent(keys=["y"], stimulus_id="s3"))
        assert ws.tasks["x"].state == "cancelled"
    w.block.set()
    await async_poll_for(lambda: ev.metrics, timeout=5)
    expect = {
        "success": ["network-bytes", "network", "other"],
        "busy": ["network-bytes", "busy"],
        "network-failure": ["network-bytes", "failed"],
        "failure": ["network-bytes", "failed"],
        "missing": ["network-bytes", "missing"],
        "cancel": ["network-bytes", "cancelled"],
    }[outcome]
    assert [m[0] for m in ev.metrics] == expect
    assert ev.metrics[0] == ("network-bytes", 8, "bytes")
    digested = {k: v for k, v in w.digested.items() if k[0] == "gather-dep"}
    assert digested == {
        ("gather-dep", label, unit): value for label, value, unit in ev.metrics
    }
    w.block.clear()
    await w.close(timeout=5)
    if outcome == "failure":
        # Upstream behaviour, unrelated to metrics: the dependents of a key that
        # failed to deserialize are left waiting for it, which validate_state()
        # (called by the ws fixture) does not accept
        ws.validate = False


@gen_test()
async def test_base_worker_close_with_instructions_in_flight(ws):
    """Instructions cancelled by close() post their metrics in the cancelled lump"""
    w = MetricsMockWorker(ws)
    w.handle_stimulus(ComputeTaskEvent.dummy("x", stimulus_id="s1"))
    await asyncio.sleep(0)  # Let execute() start
    await w.close(timeout=5)
    assert not recording()
    assert set(w.digested) == {
        ("execute", "x", "n", "count"),
        ("execute", "x", "cancelled", "seconds"),
    }
    assert w.digested["execute", "x", "n", "count"] == 1


@gen_test()
async def test_base_worker_instructions_are_isolated(ws):
    """Instructions don't inherit the metric callbacks of the context that
    triggered them, nor see each other's metrics
    """
    w = MetricsMockWorker(ws)
    w.execute_events["x"] = evx = ExecuteSuccessEvent.dummy("x", 1, stimulus_id="s")
    w.execute_events["y"] = evy = ExecuteSuccessEvent.dummy("y", 1, stimulus_id="s")
    ws.nthreads = 2
    ambient = []
    with context_meter.add_callback(lambda *args: ambient.append(args)):
        w.handle_stimulus(ComputeTaskEvent.dummy("x", stimulus_id="s1"))
        w.handle_stimulus(ComputeTaskEvent.dummy("y", stimulus_id="s1"))
        w.block.set()
        await async_poll_for(lambda: not w._async_instructions, timeout=5)
    assert ambient == []
    assert [m[0] for m in evx.metrics] == ["n", "thread-noncpu", "other"]
    assert [m[0] for m in evy.metrics] == ["n", "thread-noncpu", "other"]
    assert w.digested["execute", "x", "n", "count"] == 1
    assert w.digested["execute", "y", "n", "count"] == 1


@gen_test()
async def test_base_worker_handling_final_event_is_metered(ws):
    """What is metered while the final event of an instruction is handled (e.g.
    spilling the output of a task) belongs to that instruction, and not to the
    instructions that handling the event starts
    """

    class SendMeteringWorker(MetricsMockWorker):
        def batched_send(self, msg):
            if msg["op"] == "task-finished":
                context_meter.digest_metric("send", 1, "count")

    w = SendMeteringWorker(ws)
    w.execute_events["x"] = evx = ExecuteSuccessEvent.dummy("x", 1, stimulus_id="s")
    w.execute_events["y"] = evy = ExecuteSuccessEvent.dummy("y", 1, stimulus_id="s")
    ws.nthreads = 1
    w.block.set()
    w.handle_stimulus(
        ComputeTaskEvent.dummy("x", stimulus_id="s1"),
        ComputeTaskEvent.dummy("y", stimulus_id="s1"),
    )
    # Only one thread: y starts while the final event of x is handled
    assert len(w._async_instructions) == 1
    await async_poll_for(lambda: ws.tasks["y"].state == "memory", timeout=5)
    assert [m[0] for m in evx.metrics] == ["n", "thread-noncpu", "send", "other"]
    assert [m[0] for m in evy.metrics] == ["n", "thread-noncpu", "send", "other"]
    assert w.digested["execute", "x", "send", "count"] == 1
    assert w.digested["execute", "y", "send", "count"] == 1
    assert not recording()


def _recorder():
    return wsm.InstructionMetricsRecorder(("execute", "x"))


def test_recorder_counts_seconds():
    r = _recorder()
    with context_meter.add_callback(r):
        context_meter.digest_metric("a", 1.5, "seconds")
        context_meter.digest_metric("n", 7, "count")
        context_meter.digest_metric("b", 2, "seconds")
    assert r.seconds == 3.5
    assert r.metrics == [
        ("a", 1.5, "seconds"),
        ("n", 7, "count"),
        ("b", 2, "seconds"),
    ]


def test_recorder_is_a_ledger():
    """The worker's recorder is the ledger of distributed.metrics, specialised"""
    r = _recorder()
    assert isinstance(r, DelayedMetricsLedger)
    assert isinstance(r, MeterRoot)
    r.add_phase("deserialize", 2, r.seconds)
    assert [m[0] for m in r.finalize()] == ["deserialize", "other"]
    with pytest.raises(RuntimeError, match="finalized twice"):
        r.finalize()


@gen_test()
async def test_recorder_takes_only_its_own_work():
    """The recorder takes what its own asyncio task digests, and what is digested in
    the callback that handles its final event; not what another asyncio task or
    callback digests in a copy of its context
    """
    r = _recorder()
    ctx = context_meter.new_context(r, root=r)
    started = asyncio.Event()

    async def background():
        context_meter.digest_metric("background", 1, "count")

    async def main():
        context_meter.digest_metric("own", 1, "count")
        asyncio.get_running_loop().call_soon(
            context_meter.digest_metric, "call_soon", 1, "count"
        )
        await asyncio.create_task(background())
        started.set()
        await asyncio.sleep(0)

    handled = asyncio.Event()

    def handle(_):
        # Like BaseWorker._handle_stimulus_from_task: outside of any task
        r.task = None
        context_meter.digest_metric("handling", 1, "count")
        handled.set()

    task = ctx.run(asyncio.create_task, main())
    r.task = task
    task.add_done_callback(handle, context=ctx)
    await handled.wait()
    # Not the instruction's work, even in its context
    ctx.run(context_meter.digest_metric, "from another task", 1, "count")
    assert [m[0] for m in r.metrics] == ["own", "handling"]


class PhaseMockWorker(MetricsMockWorker):
    """A BaseWorker whose execute() measures its own phases, like Worker does"""

    async def execute(self, key, *, stimulus_id):
        recorder = self._instruction_recorder()
        assert recorder is not None
        assert recorder.prefix == ("execute", key)
        mark = recorder.seconds
        context_meter.digest_metric("inner", 0.25, "seconds")
        recorder.add_phase("outer", 1.0, mark)
        with context_meter.meter("block", func=self.clock):
            self.clock.t += 1
        return self.execute_events[key]

    async def retry_busy_worker_later(self, worker):
        # Not metered
        self.retry_recorder = self._instruction_recorder()


@gen_test()
async def test_base_worker_instruction_recorder(ws):
    """The instruction that runs in the current asyncio task can find its recorder,
    and record its own phases there; what it meters reaches the recorder too
    """
    w = PhaseMockWorker(ws)
    w.clock = FakeClock()
    assert w._instruction_recorder() is None
    w.execute_events["x"] = ev = ExecuteSuccessEvent.dummy("x", 1, stimulus_id="s2")
    w.handle_stimulus(ComputeTaskEvent.dummy("x", stimulus_id="s1"))
    await async_poll_for(lambda: not w._async_instructions, timeout=5)
    assert ev.metrics[:3] == [
        ("inner", 0.25, "seconds"),
        ("outer", 0.75, "seconds"),
        ("block", 1, "seconds"),
    ]
    assert [m[0] for m in ev.metrics] == ["inner", "outer", "block", "other"]

    w.retry_recorder = "not set"
    w._start_async_instruction(w.retry_busy_worker_later("w"), "retry", None)
    await async_poll_for(lambda: not w._async_instructions, timeout=5)
    assert w.retry_recorder is None
