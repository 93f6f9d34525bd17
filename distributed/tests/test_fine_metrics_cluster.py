"""The cluster view of the fine performance metrics: delivered by the workers to
the scheduler exactly once, stored there, and read from a client, the command line
and the scheduler's HTTP API.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
from collections import defaultdict
from collections.abc import Mapping

import pytest

import dask

from distributed import (
    Client,
    LocalCluster,
    Nanny,
    Scheduler,
    Worker,
    WorkerPlugin,
    get_fine_metrics,
)
from distributed.client import NoFineMetricsError
from distributed.core import Status
from distributed.diagnostics import fine_metrics as fine_metrics_cli
from distributed.metrics import (
    FineMetrics,
    FineMetricsReceiver,
    FineMetricsSender,
    context_meter,
    is_fine_metric,
    parse_fine_metrics_delivery,
    without_prefix,
)
from distributed.tests.utils_ci import import_or_skip
from distributed.utils import open_port
from distributed.utils_test import (
    async_poll_for,
    captured_logger,
    gen_cluster,
    gen_test,
    inc,
    slowinc,
)


async def fetch(port: int, path: str) -> str:
    """GET a page of a server's HTTP endpoint, with a real HTTP client"""
    from tornado.httpclient import AsyncHTTPClient

    response = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{port}{path}")
    assert response.code == 200
    return response.body.decode()


def worker_totals(*workers) -> dict:
    """The fine metrics of some workers, added up"""
    out: dict = defaultdict(int)
    for w in workers:
        for k, v in w.digests_total.items():
            if is_fine_metric(k):
                out[k] += v
    return dict(out)


def assert_equal_totals(actual: Mapping, expect: Mapping) -> None:
    """Counts and bytes exactly, seconds within rounding"""
    assert set(actual) == set(expect)
    for k, v in expect.items():
        if k[-1] == "seconds":
            assert actual[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
        else:
            assert actual[k] == v, k
            assert type(actual[k]) is type(v), k


async def settle(*workers) -> None:
    """Wait for get_data to post its metrics: it does so after the peer acknowledged
    receipt, which may happen after the peer (e.g. the client) moved on
    """
    await async_poll_for(
        lambda: not any(w.transfer_outgoing_count for w in workers), timeout=5
    )


async def assert_delivered(s, *workers) -> None:
    """Once the workers have posted everything and heartbeated, the scheduler holds
    exactly their totals
    """
    await settle(*workers)
    for w in workers:
        await w.heartbeat()
    assert_equal_totals(s.cumulative_worker_metrics, worker_totals(*workers))


def stop_heartbeats(*workers) -> None:
    for w in workers:
        w.periodic_callbacks["heartbeat"].stop()


def posting(x, n=1):
    context_meter.digest_metric("my-count", n, "count")
    context_meter.digest_metric(("my", "tuple"), 1, "count")
    return x + 1


async def workload(c, a, b) -> None:
    x = c.submit(posting, 1, key="posting-1", workers=[a.address])
    y = c.submit(inc, x, key="inc-1", workers=[b.address])
    assert await y == 3
    await settle(a, b)


@gen_cluster(client=True)
async def test_scheduler_has_the_workers_totals(c, s, a, b):
    await workload(c, a, b)
    fm = await c.get_fine_metrics()
    assert isinstance(fm, FineMetrics)
    expect = worker_totals(a, b)
    assert ("execute", "posting", "my-count", "count") in expect
    assert ("gather-dep", "network", "seconds") in expect
    assert ("get-data", "network", "seconds") in expect
    assert_equal_totals(fm, expect)
    assert_equal_totals(s.cumulative_worker_metrics, expect)
    # Per worker, without the task prefix
    assert set(fm.workers) == {a.address, b.address}
    for w in (a, b):
        short: dict = defaultdict(int)
        for k, v in worker_totals(w).items():
            short[without_prefix(k)] += v
        assert_equal_totals(fm.workers[w.address], short)
        # The same on the scheduler, for its own readers (the dashboard)
        assert_equal_totals(s.fine_metrics_by_worker()[w.address], short)


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_fine_metrics_by_worker_is_a_view(c, s, a):
    stop_heartbeats(a)
    key = ("execute", "x", "my-count", "count")
    a.digest_metric(key, 1)
    await a.heartbeat()
    [(address, view)] = s.fine_metrics_by_worker().items()
    assert address == a.address
    assert view["execute", "my-count", "count"] == 1
    with pytest.raises(TypeError):
        view["execute", "my-count", "count"] = 2  # type: ignore[index]
    # Kept up to date
    a.digest_metric(key, 10)
    await a.heartbeat()
    assert view["execute", "my-count", "count"] == 11
    assert s.fine_metrics_by_worker() is not s.fine_metrics_by_worker()


@gen_cluster(client=True)
async def test_heartbeat_delivers(c, s, a, b):
    """Without any flush, the heartbeats deliver"""
    await workload(c, a, b)
    expect = worker_totals(a, b)
    # The threads' seconds (see test_thread_seconds.py) grow at every delivery
    await async_poll_for(
        lambda: set(expect) <= set(s.cumulative_worker_metrics), timeout=10
    )
    await assert_delivered(s, a, b)


class FailingRPC:
    """Stands in for a method of the worker's rpc to the scheduler"""

    def __init__(self, real, *, apply_first: bool = False, exc=OSError):
        self.real = real
        self.apply_first = apply_first
        self.exc = exc
        self.calls = 0

    async def __call__(self, **kwargs):
        self.calls += 1
        if self.apply_first:
            # The scheduler gets the delivery, but the reply is lost
            await self.real(**kwargs)
        raise self.exc("injected failure")


class PausedRPC:
    """Stands in for a method of the worker's rpc to the scheduler: the call waits
    until ``release`` is set; ``in_flight`` is set once it started. With
    ``apply_first``, the scheduler handles the call at once, and the reply waits.
    """

    def __init__(self, real, *, apply_first: bool = False):
        self.real = real
        self.apply_first = apply_first
        self.in_flight = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, **kwargs):
        if self.apply_first:
            reply = await self.real(**kwargs)
        self.in_flight.set()
        await self.release.wait()
        return reply if self.apply_first else await self.real(**kwargs)


@pytest.mark.parametrize(
    "apply_first,exc",
    [(False, OSError), (True, OSError), (False, asyncio.TimeoutError)],
)
@gen_cluster(client=True)
async def test_failed_delivery_is_merged_into_the_next(c, s, a, b, apply_first, exc):
    """A delivery that fails is kept and merged into the next one; one that reached
    the scheduler but whose reply was lost is not counted twice
    """
    stop_heartbeats(a, b)
    await workload(c, a, b)
    a.scheduler.heartbeat_worker = FailingRPC(
        a.scheduler.heartbeat_worker, apply_first=apply_first, exc=exc
    )
    try:
        with captured_logger("distributed.worker") as log:
            await a.heartbeat()
        assert a.scheduler.heartbeat_worker.calls == 1
        assert "Failed to communicate with scheduler" in log.getvalue()
        # More work while the scheduler is unreachable
        assert await c.submit(posting, 10, key="posting-2", workers=[a.address]) == 11
        await a.heartbeat()
        assert a.scheduler.heartbeat_worker.calls == 2
    finally:
        del a.scheduler.heartbeat_worker
    await settle(a, b)
    await assert_delivered(s, a, b)
    assert a._fine_metrics_sender.sent == {}


@gen_cluster(client=True)
async def test_digests_during_delivery_go_with_the_next(c, s, a, b):
    stop_heartbeats(a, b)
    await workload(c, a, b)
    a.scheduler.heartbeat_worker = rpc = PausedRPC(a.scheduler.heartbeat_worker)
    try:
        hb = asyncio.create_task(a.heartbeat())
        await rpc.in_flight.wait()
        # Digested while the delivery is in flight
        assert await c.submit(posting, 5, key="posting-2", workers=[a.address]) == 6
        rpc.release.set()
        await hb
    finally:
        del a.scheduler.heartbeat_worker
    await settle(a, b)
    assert ("execute", "posting", "my-count", "count") in s.cumulative_worker_metrics
    assert (
        s.cumulative_worker_metrics["execute", "posting", "my-count", "count"]
        < worker_totals(a)["execute", "posting", "my-count", "count"]
    )
    await assert_delivered(s, a, b)


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_duplicated_delivery_applied_once(c, s, a):
    stop_heartbeats(a)
    await c.submit(posting, 1, key="posting-1")
    await settle(a)
    delivery = a._fine_metrics_sender.delivery()
    assert delivery is not None
    assert s.handle_worker_fine_metrics(worker=a.address, delivery=delivery) == 1
    before = dict(s.cumulative_worker_metrics)
    # The same delivery again, e.g. retried by the network layer
    assert s.handle_worker_fine_metrics(worker=a.address, delivery=delivery) == 1
    # An older one arriving late
    stale = dict(delivery, seq=0)
    with captured_logger("distributed.scheduler") as log:
        assert s.handle_worker_fine_metrics(worker=a.address, delivery=stale) is None
    assert "malformed" in log.getvalue()
    assert s.cumulative_worker_metrics == before
    a._fine_metrics_sender.acknowledge(1)
    await assert_delivered(s, a)


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_bad_deliveries_rejected(c, s, a):
    """Entries that are not fine metrics of a known shape with a finite real value
    are dropped with one warning per worker; the rest of the delivery and the
    heartbeat go on
    """
    stop_heartbeats(a)
    good = ("execute", "p", "lbl", "count")
    bad = [
        ["not-a-tuple", 1],
        [("execute", "p", "lbl"), 1],  # too short for execute
        [("gather-dep", "p", "lbl", "seconds"), 1],  # too long for gather-dep
        [("unknown-activity", "lbl", "seconds"), 1],
        [("execute", 1, "lbl", "seconds"), 1],  # prefix not a str
        [("execute", "p", "lbl", 7), 1],  # unit not a str
        [("get-data", ["list"], "seconds"), 1],
        [("get-data", 2**64, "count"), 1],  # an int label beyond int64
        [("get-data", ("id", -(2**63) - 1), "count"), 1],
        [("get-data", "x", "seconds"), math.nan],
        [("get-data", "x", "seconds"), math.inf],
        [("get-data", "x", "count"), True],
        [("get-data", "x", "count"), "1"],
        "not-a-pair",
    ]
    delivery = {"seq": 1, "base": 0, "metrics": [[good, 2], *bad]}
    with captured_logger("distributed.scheduler") as log:
        resp = s.heartbeat_worker(
            address=a.address, metrics=await a.get_metrics(), fine_metrics=delivery
        )
        assert resp["status"] == "OK"
        assert resp["fine-metrics-ack"] == 1
        # A second bad delivery is not logged again
        s.heartbeat_worker(
            address=a.address,
            metrics=await a.get_metrics(),
            fine_metrics={"seq": 2, "base": 1, "metrics": bad},
        )
        s.heartbeat_worker(
            address=a.address, metrics=await a.get_metrics(), fine_metrics="garbage"
        )
    assert log.getvalue().count("Fine metrics from") == 1
    assert f"dropped {len(bad)} entries" in log.getvalue()
    assert dict(s.cumulative_worker_metrics) == {good: 2}


@gen_cluster(client=True, nthreads=[("", 1)] * 2)
async def test_graceful_close_delivers(c, s, a, b):
    stop_heartbeats(a, b)
    await workload(c, a, b)
    await a.close()
    await b.close()
    await async_poll_for(lambda: not s.workers, timeout=5)
    # Everything up to the close, the threads' seconds included
    expect = worker_totals(a, b)
    assert ("threads", "idle-no-tasks", "seconds") in expect
    assert_equal_totals(s.cumulative_worker_metrics, expect)
    # The per-worker view is gone with the workers; the totals stay
    assert s.fine_metrics_by_worker() == {}
    fm = await c.get_fine_metrics()
    assert fm.workers == {}
    assert_equal_totals(fm, expect)


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_close_during_a_flush_counts_once(c, s, a):
    """A worker that closes while a delivery is in flight sends its last delivery
    at once, and nothing after it: a flush that the scheduler asks for as the worker
    closes, once the acknowledgement in flight arrived, would count again what the
    last delivery holds
    """
    stop_heartbeats(a)
    key = ("execute", "x", "my-count", "count")
    a.digest_metric(key, 1)
    await a.flush_fine_metrics()
    a.digest_metric(key, 10)
    a.scheduler.worker_fine_metrics = rpc = PausedRPC(
        a.scheduler.worker_fine_metrics, apply_first=True
    )
    try:
        flush = asyncio.create_task(a.flush_fine_metrics())
        await rpc.in_flight.wait()
        assert s.cumulative_worker_metrics[key] == 11
        a.digest_metric(key, 100)  # Goes with the last delivery
        close = asyncio.create_task(a.close())
        await async_poll_for(lambda: a._fine_metrics_sender.closed, timeout=5)
        rpc.release.set()
        await flush
        # A flush or heartbeat handled while the worker closes sends nothing
        a.digest_metric(key, 1000)
        await a.flush_fine_metrics()
        await close
    finally:
        del a.scheduler.worker_fine_metrics
    await async_poll_for(lambda: not s.workers, timeout=5)
    assert s.cumulative_worker_metrics[key] == 111


@gen_cluster(client=True)
async def test_retire_workers_delivers(c, s, a, b):
    stop_heartbeats(a, b)
    await workload(c, a, b)
    await c.retire_workers([a.address])
    # The scheduler removes a before a closes; a delivers what it holds as it closes
    await async_poll_for(lambda: a.status == Status.closed, timeout=5)
    assert a.address not in s.workers
    assert a.address not in s.fine_metrics_by_worker()
    key = ("execute", "posting", "my-count", "count")
    await async_poll_for(lambda: key in s.cumulative_worker_metrics, timeout=5)
    # What b fetched from a while a was retiring is b's, and delivered by b
    await settle(b)
    await b.heartbeat()
    assert_equal_totals(s.cumulative_worker_metrics, worker_totals(a, b))


class SlowTeardown(WorkerPlugin):
    """Makes a closing worker take its time before its last delivery"""

    async def teardown(self, worker):
        await asyncio.sleep(0.5)


@gen_cluster(client=True)
async def test_flush_waits_for_the_last_delivery_of_a_retired_worker(c, s, a, b):
    """get_fine_metrics(flush=True) right after retire_workers has what the retired
    worker delivers as it closes, after the scheduler removed it
    """
    stop_heartbeats(a, b)
    await workload(c, a, b)
    await c.register_worker_plugin(SlowTeardown(), name="slow-teardown")
    await c.retire_workers([a.address])
    assert a.address not in s.workers
    assert a.status != Status.closed
    fm = await c.get_fine_metrics()
    assert fm["execute", "posting", "my-count", "count"] == 1


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_flush_waits_for_the_stream_of_a_worker_closing_itself(c, s, a):
    """A worker that closes itself is still among the scheduler's workers when it
    has sent its last delivery on its stream: a flush then waits for that stream,
    and has the delivery, however slowly the stream carries it
    """
    stop_heartbeats(a)
    await c.submit(posting, 1, key="posting-1")
    a.digest_metric(("execute", "posting", "my-count", "count"), 99)
    held = []
    send = a.batched_send

    def hold(msg):
        if msg["op"] in ("worker-fine-metrics", "close-stream"):
            held.append(msg)
        else:
            send(msg)

    a.batched_send = hold  # type: ignore[method-assign]
    close_stream = a.batched_stream.close

    async def slow_close(timeout=None):
        await asyncio.sleep(0.5)  # The stream is slower than the flush's reply
        for msg in held:
            send(msg)
        return await close_stream(timeout)

    a.batched_stream.close = slow_close  # type: ignore[method-assign]
    closing = asyncio.create_task(a.close())
    await async_poll_for(lambda: a._fine_metrics_sender.closed, timeout=5)
    assert a.address in s.workers
    with captured_logger("distributed.scheduler") as log:
        fm = await c.get_fine_metrics()
    assert fm["execute", "posting", "my-count", "count"] == 100
    assert "did not deliver" not in log.getvalue()
    await closing


@gen_cluster(client=True, nthreads=[])
async def test_late_delivery_after_another_worker_took_the_address(c, s):
    """A flush's or heartbeat's delivery that reaches the scheduler after another
    worker started at the same address names the worker that sent it: it is
    applied as that worker's, once, and the new worker's own deliveries go on
    """
    key = ("execute", "posting", "my-count", "count")
    port = open_port()
    async with Worker(s.address, port=port, nthreads=1) as a:
        stop_heartbeats(a)
        for _ in range(5):
            a.digest_metric(key, 1)
            await a.flush_fine_metrics()
        a.digest_metric(key, 10)
        # A flush's delivery, still in flight when a closes
        late = a._fine_metrics_delivery()
        assert late is not None
        assert late["server_id"] == a.id
    await async_poll_for(lambda: not s.workers, timeout=5)
    # a's last delivery, on its stream, had the 10 too
    assert s.cumulative_worker_metrics[key] == 15
    async with Worker(s.address, port=port, nthreads=1) as b:
        stop_heartbeats(b)
        s.handle_worker_fine_metrics(worker=a.address, delivery=late)
        for _ in range(3):
            b.digest_metric(key, 100)
            await b.flush_fine_metrics()
        assert s.cumulative_worker_metrics[key] == 315
        assert (
            s.fine_metrics_by_worker()[b.address][("execute", "my-count", "count")]
            == 300
        )


@gen_cluster(client=True, nthreads=[])
async def test_last_delivery_after_another_worker_took_the_address(c, s):
    """A closing worker's last delivery may reach the scheduler, on its stream,
    after another worker started at its address (a nanny restarting it on a fixed
    port, say): it is applied once, as the departed worker's, and the new worker's
    own deliveries go on
    """
    port = open_port()
    held = []
    async with Worker(s.address, port=port, nthreads=1) as a:
        stop_heartbeats(a)
        for i in range(3):  # a's deliveries get ahead of those of the next one
            await c.submit(posting, i, key=f"posting-{i}")
            await a.heartbeat()
        a.digest_metric(("execute", "posting", "my-count", "count"), 100)
        send = a.batched_send

        def hold_fine_metrics(msg):
            if msg["op"] == "worker-fine-metrics":
                held.append(msg)
            else:
                send(msg)

        a.batched_send = hold_fine_metrics  # type: ignore[method-assign]
    await async_poll_for(lambda: not s.workers, timeout=5)
    [msg] = held
    assert msg["delivery"]["server_id"] == a.id
    assert msg["delivery"]["seq"] > 3

    async with Worker(s.address, port=port, nthreads=1) as b:
        assert b.address == a.address
        stop_heartbeats(b)
        await c.submit(posting, 10, key="posting-10")
        await b.heartbeat()
        # a's last delivery arrives now
        s.handle_worker_fine_metrics_stream(worker=a.address, delivery=msg["delivery"])
        await c.submit(posting, 11, key="posting-11")
        await settle(b)
        await b.heartbeat()
        assert_equal_totals(s.cumulative_worker_metrics, worker_totals(a, b))
        short: dict = defaultdict(int)
        for k, v in worker_totals(b).items():
            short[without_prefix(k)] += v
        assert_equal_totals(s.fine_metrics_by_worker()[b.address], short)


@pytest.mark.slow
@gen_cluster(client=True, Worker=Nanny, nthreads=[("", 1)])
async def test_worker_killed_keeps_up_to_last_delivery(c, s, a):
    """A worker process killed with SIGKILL: the scheduler keeps everything it
    delivered, and loses only what it gathered since
    """

    def stop_hb(dask_worker):
        dask_worker.periodic_callbacks["heartbeat"].stop()

    def totals(dask_worker):
        return {k: v for k, v in dask_worker.digests_total.items() if is_fine_metric(k)}

    await c.submit(posting, 1, key="posting-1")
    await c.get_fine_metrics()  # Flush
    await c.run(stop_hb)
    delivered = dict(s.cumulative_worker_metrics)
    [before] = (await c.run(totals)).values()
    assert_equal_totals(delivered, before)

    # More work, never delivered
    await c.submit(posting, 1, 100, key="posting-2")
    [after] = (await c.run(totals)).values()
    assert after["execute", "posting", "my-count", "count"] == 101
    assert s.cumulative_worker_metrics["execute", "posting", "my-count", "count"] == 1

    pid = a.process.pid
    addr = a.worker_address
    os.kill(pid, signal.SIGKILL)
    await async_poll_for(lambda: addr not in s.workers, timeout=20)
    assert addr not in s.fine_metrics_by_worker()
    assert_equal_totals(s.cumulative_worker_metrics, delivered)


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_memory_grows_with_keys_not_heartbeats(c, s, a):
    stop_heartbeats(a)
    for i in range(50):
        await c.submit(posting, 1, key=f"posting-{i}")
        await a.heartbeat()
    receiver = s._fine_metrics_receivers[a.address]
    n_keys = len(worker_totals(a))
    assert len(s.cumulative_worker_metrics) == n_keys
    assert len(receiver.last) <= n_keys
    assert len(a._fine_metrics_sender.acked) == n_keys
    assert a._fine_metrics_sender.sent == {}
    # A scheduler that can't be reached: the worker remembers a bounded number of
    # deliveries
    a.scheduler.heartbeat_worker = FailingRPC(a.scheduler.heartbeat_worker)
    try:
        for i in range(FineMetricsSender.MAX_IN_FLIGHT * 2):
            await c.submit(posting, 1, key=f"posting-more-{i}")
            with captured_logger("distributed.worker"):
                await a.heartbeat()
        assert len(a._fine_metrics_sender.sent) == FineMetricsSender.MAX_IN_FLIGHT
    finally:
        del a.scheduler.heartbeat_worker
    await assert_delivered(s, a)


def test_sender_receiver_exactly_once():
    """Lost deliveries, lost acknowledgements, a duplicate and a delivery that
    arrives after a newer one: the receiver's totals end equal to the sender's
    """
    totals: dict = {}
    sender = FineMetricsSender(totals)
    receiver = FineMetricsReceiver()
    cluster: dict = defaultdict(int)

    def add(key, value):
        cluster[key] += value

    def post(n):
        key = ("execute", "p", "x", "count")
        totals[key] = totals.get(key, 0) + n

    # Lost on the way, lost on the way back, delivered twice, out of order
    post(1)
    d1 = sender.delivery()
    post(2)
    d2 = sender.delivery()  # Same base as d1
    ack = receiver.receive(*parse_fine_metrics_delivery(d2)[:3], add)
    # d2's reply is lost; d1 arrives late
    assert receiver.receive(*parse_fine_metrics_delivery(d1)[:3], add) == ack
    post(4)
    d3 = sender.delivery()  # Still on base 0: includes d2
    sender.acknowledge(receiver.receive(*parse_fine_metrics_delivery(d3)[:3], add))
    assert receiver.receive(*parse_fine_metrics_delivery(d3)[:3], add) == d3["seq"]
    assert dict(cluster) == {("execute", "p", "x", "count"): 7}
    assert sender.delivery() is None
    post(1)
    d4 = sender.delivery()
    assert d4["base"] == d3["seq"]
    sender.acknowledge(receiver.receive(*parse_fine_metrics_delivery(d4)[:3], add))
    assert dict(cluster) == {("execute", "p", "x", "count"): 8}
    assert receiver.totals == {("execute", "x", "count"): 8}


def test_receiver_delivery_on_an_unknown_base():
    """A delivery on a base that is neither the last delivery nor its base, which
    the worker never sends (see FineMetricsReceiver): applied as it is, with a
    warning, rather than refused, which would leave the worker on that base
    """
    receiver = FineMetricsReceiver()
    cluster: dict = defaultdict(int)

    def add(key, value):
        cluster[key] += value

    key = ("execute", "p", "x", "count")
    assert receiver.receive(2, 0, {key: 1}, add) == 2
    with captured_logger("distributed.metrics") as log:
        assert receiver.receive(4, 1, {key: 5}, add) == 4
    assert "delivery 4 on base 1 does not follow delivery 2 on base 0" in (
        log.getvalue()
    )
    assert dict(cluster) == {key: 6}
    # Then on as usual
    assert receiver.receive(5, 4, {key: 1}, add) == 5
    assert dict(cluster) == {key: 7}


def test_sender_last_delivery():
    totals = {("execute", "p", "x", "count"): 1}
    sender = FineMetricsSender(totals)
    d1 = sender.delivery()
    totals["execute", "p", "x", "count"] = 3
    last = sender.last_delivery()
    # On the base of the delivery in flight, which it includes
    assert (last["seq"], last["base"], last["metrics"]) == (
        2,
        0,
        [[("execute", "p", "x", "count"), 3]],
    )
    sender.acknowledge(d1["seq"])  # The reply in flight arrives
    totals["execute", "p", "x", "count"] = 4
    assert sender.delivery() is None
    assert sender.last_delivery() is None


def test_sender_portable_keys():
    """Labels that msgpack or JSON can't carry are sent as their str(); a label
    that is an int beyond int64 too, as msgpack can't carry it either
    """
    totals = {
        ("execute", "p", frozenset({1}), "count"): 1,
        ("execute", "p", ("a", 1, 2.5), "count"): 1,
        ("execute", "p", ("id", 2**64, -(2**63)), "count"): 1,
        ("execute", "p", 2**63, "count"): 1,
        ("execute", "p", 2**63 - 1, "count"): 1,
        "not-a-fine-metric": 1,
    }
    d = FineMetricsSender(totals).delivery()
    assert sorted(map(tuple, d["metrics"]), key=str) == sorted(
        [
            (("execute", "p", "frozenset({1})", "count"), 1),
            (("execute", "p", ("a", 1, 2.5), "count"), 1),
            (("execute", "p", ("id", str(2**64), -(2**63)), "count"), 1),
            (("execute", "p", str(2**63), "count"), 1),
            (("execute", "p", 2**63 - 1, "count"), 1),
        ],
        key=str,
    )


def test_fine_metrics_snapshot():
    fm = FineMetrics(
        {
            ("execute", "sum", "thread-cpu", "seconds"): 1.5,
            ("execute", "sum", ("my", "label"), "count"): 3,
            ("gather-dep", "network", "seconds"): 0.5,
        },
        {"w1": {("execute", "thread-cpu", "seconds"): 1.5}},
    )
    assert fm["execute", "sum", "thread-cpu", "seconds"] == 1.5
    assert len(fm) == 3
    assert fm.records()[1] == {
        "activity": "execute",
        "task_prefix": "sum",
        "label": ("my", "label"),
        "unit": "count",
        "value": 3,
    }
    assert fm.records()[2]["task_prefix"] is None
    table = fm.table()
    assert "thread-cpu" in table and "my/label" in table and "network" in table
    # Counts are exact, however large
    assert "1234567" in FineMetrics({("get-data", "x", "count"): 1234567}).table()
    later = FineMetrics(
        {**fm, ("gather-dep", "network", "seconds"): 2.5},
        {"w1": {("execute", "thread-cpu", "seconds"): 1.5}, "w2": {("a", "b", "c"): 1}},
    )
    delta = later - fm
    assert dict(delta) == {("gather-dep", "network", "seconds"): 2.0}
    assert delta.workers == {"w1": {}, "w2": {("a", "b", "c"): 1}}
    # A worker at the address of one before it gained all it has
    before = FineMetrics({}, {"w1": {("a", "b", "c"): 5}}, {"w1": "Worker-1"})
    after = FineMetrics({}, {"w1": {("a", "b", "c"): 2}}, {"w1": "Worker-2"})
    assert (after - before).workers == {"w1": {("a", "b", "c"): 2}}
    assert (after - before).worker_ids == {"w1": "Worker-2"}
    again = FineMetrics({}, {"w1": {("a", "b", "c"): 7}}, {"w1": "Worker-1"})
    assert (again - before).workers == {"w1": {("a", "b", "c"): 2}}
    # A snapshot that doesn't know the ids (from an earlier scheduler) takes the
    # worker as the same
    unknown = FineMetrics({}, {"w1": {("a", "b", "c"): 5}})
    assert (again - unknown).workers == {"w1": {("a", "b", "c"): 2}}
    assert (unknown - again).workers == {"w1": {("a", "b", "c"): -2}}


def test_fine_metrics_to_dataframe():
    pd = import_or_skip("pandas")
    fm = FineMetrics(
        {
            ("execute", "sum", "thread-cpu", "seconds"): 1.5,
            ("get-data", "network", "seconds"): 0.5,
        }
    )
    df = fm.to_dataframe()
    assert list(df.columns) == ["activity", "task_prefix", "label", "unit", "value"]
    assert len(df) == 2
    assert df["value"].sum() == 2.0
    assert pd.isna(df.loc[1, "task_prefix"])
    assert list(FineMetrics({}).to_dataframe().columns) == list(df.columns)


@gen_cluster(client=True)
async def test_get_fine_metrics_context_manager(c, s, a, b):
    await workload(c, a, b)
    async with get_fine_metrics(c) as fm:
        assert await c.submit(posting, 1, key="block-1", workers=[a.address]) == 2
    assert isinstance(fm, FineMetrics)
    # Only what ran inside the block
    prefixes = {k[1] for k in fm if k[0] == "execute"}
    assert prefixes == {"block"}
    assert fm["execute", "block", "my-count", "count"] == 1
    assert set(fm.workers) == {a.address, b.address}
    assert fm.workers[a.address][("execute", "my-count", "count")] == 1


@gen_cluster(client=True, nthreads=[])
async def test_get_fine_metrics_worker_restarted_at_same_address(c, s):
    """A worker that starts at the address of one that left during the block (a
    nanny restarting it on a fixed port, say) gained all it has, rather than its
    totals less those of the one before it
    """
    port = open_port()
    async with Worker(s.address, port=port, nthreads=1) as w:
        keys = [f"posting-{i}" for i in range(20)]
        await c.gather(c.map(posting, range(20), key=keys))
        fm = get_fine_metrics(c)
        await fm.__aenter__()
    async with Worker(s.address, port=port, nthreads=1) as w2:
        assert w2.address == w.address
        assert await c.submit(posting, 1, key="posting-20") == 2
        await fm.__aexit__(None, None, None)
    assert fm.worker_ids == {w2.address: w2.id}
    gained = fm.workers[w2.address]
    assert gained["execute", "my-count", "count"] == 1
    assert all(v >= 0 for v in gained.values()), gained


def test_get_fine_metrics_sync(client):
    assert client.submit(posting, 1, key="sync-1").result() == 2
    fm = client.get_fine_metrics()
    assert fm["execute", "sync", "my-count", "count"] == 1
    with get_fine_metrics() as block:
        client.submit(posting, 2, 2, key="sync-2").result()
    assert block["execute", "sync", "my-count", "count"] == 2
    assert client.get_fine_metrics()["execute", "sync", "my-count", "count"] == 3
    rows = [line.split() for line in block.table().splitlines()]
    assert ["execute", "sync", "my-count", "2"] in rows


@gen_cluster(
    client=True,
    config={
        "distributed.scheduler.http.routes": [
            "distributed.http.scheduler.api",
            "distributed.http.scheduler.prometheus",
        ]
    },
)
async def test_http_route(c, s, a, b):
    """The store as JSON, read with a plain HTTP client, whatever the labels"""

    def odd_labels():
        context_meter.digest_metric(("a", "tuple"), 1, "count")
        context_meter.digest_metric(frozenset({"x"}), 2, "count")
        context_meter.digest_metric(42, 3, "count")

    await c.submit(odd_labels, key="odd-1")
    await workload(c, a, b)
    await c.get_fine_metrics()
    body = await fetch(s.http_server.port, "/api/v1/fine_metrics")
    records = json.loads(body)
    assert isinstance(records, list)
    assert len(records) == len(s.cumulative_worker_metrics)
    by_key = {
        (r["activity"], r["task_prefix"], json.dumps(r["label"]), r["unit"]): r["value"]
        for r in records
    }
    assert by_key["execute", "odd", '["a", "tuple"]', "count"] == 1
    assert by_key["execute", "odd", "\"frozenset({'x'})\"", "count"] == 2
    assert by_key["execute", "odd", "42", "count"] == 3
    network = s.cumulative_worker_metrics["get-data", "network", "seconds"]
    assert network > 0
    assert by_key["get-data", None, '"network"', "seconds"] == network
    for r in records:
        assert set(r) == {"activity", "task_prefix", "label", "unit", "value"}


def huge_float():
    context_meter.digest_metric("huge", 1e308, "bytes")
    context_meter.digest_metric("huge", 1e308, "seconds")
    context_meter.digest_metric("fine", 1, "count")


@gen_cluster(
    client=True,
    config={"distributed.scheduler.http.routes": ["distributed.http.scheduler.api"]},
)
async def test_store_overflowing_to_inf(c, s, a, b):
    """Each delivery is finite, but their sum overflows: the HTTP route gives null
    for it, rather than failing as a whole, and the table shows it as inf
    """
    await c.submit(huge_float, key="huge-1", workers=[a.address])
    await c.submit(huge_float, key="huge-2", workers=[b.address])
    fm = await c.get_fine_metrics()
    assert fm["execute", "huge", "huge", "bytes"] == math.inf
    body = await fetch(s.http_server.port, "/api/v1/fine_metrics")
    by_key = {(r["task_prefix"], r["label"], r["unit"]): r for r in json.loads(body)}
    assert by_key["huge", "huge", "bytes"]["value"] is None
    assert by_key["huge", "huge", "seconds"]["value"] is None
    assert by_key["huge", "fine", "count"]["value"] == 2
    rows = [line.split() for line in fm.table().splitlines()]
    assert ["execute", "huge", "huge", "inf", "inf"] in rows
    assert ["execute", "huge", "fine", "2"] in rows


def parse_families(body: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(body)}


@gen_cluster(client=True)
async def test_prometheus_scheduler_families(c, s, a, b):
    import_or_skip("prometheus_client")
    await workload(c, a, b)
    await c.get_fine_metrics()
    families = parse_families(await fetch(s.http_server.port, "/metrics"))
    seconds = families["dask_scheduler_fine_metrics_seconds"]
    counts = families["dask_scheduler_fine_metrics_count"]
    assert seconds.type == "counter"
    got = {}
    for unit, fam in [
        ("seconds", seconds),
        ("count", counts),
        ("bytes", families["dask_scheduler_fine_metrics_bytes"]),
    ]:
        for sample in fam.samples:
            lbl = sample.labels
            key = lbl["activity"], lbl["task_prefix_name"], lbl["label"], unit
            got[key] = sample.value
    expect = {}
    for key, value in s.cumulative_worker_metrics.items():
        if key[0] == "threads":
            continue  # A family of their own
        if len(key) == 4:
            activity, prefix, label, unit = key
        else:
            (activity, label, unit), prefix = key, ""
        label = "/".join(map(str, label)) if isinstance(label, tuple) else str(label)
        expect[activity, prefix, label, unit] = value
    assert got == pytest.approx(expect)
    assert got["execute", "posting", "my/tuple", "count"] == 1


@gen_cluster(
    client=True,
    config={"distributed.scheduler.fine-metrics.prometheus.task-prefix": False},
)
async def test_prometheus_without_prefix(c, s, a, b):
    import_or_skip("prometheus_client")
    await workload(c, a, b)
    await c.get_fine_metrics()
    families = parse_families(await fetch(s.http_server.port, "/metrics"))
    samples = families["dask_scheduler_fine_metrics_seconds"].samples
    assert samples
    assert all(set(x.labels) == {"activity", "label"} for x in samples)
    got = {(x.labels["activity"], x.labels["label"]): x.value for x in samples}
    expect: dict = defaultdict(int)
    for k, v in s.cumulative_worker_metrics.items():
        if k[-1] == "seconds" and k[0] != "threads":
            short = without_prefix(k)
            expect[short[0], short[1]] += v
    assert got == pytest.approx(dict(expect))


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    config={"distributed.scheduler.fine-metrics.prometheus.max-task-prefixes": 2},
)
async def test_prometheus_max_task_prefixes(c, s, a):
    import_or_skip("prometheus_client")
    # A task prefix may be called "other": it is not the prefixes that don't fit
    await c.submit(slowinc, 1, delay=0.2, key="other-1")
    await c.submit(slowinc, 1, delay=0.1, key="medium-1")
    await c.submit(inc, 1, key="small-1")
    await c.get_fine_metrics()
    families = parse_families(await fetch(s.http_server.port, "/metrics"))
    prefixes = {
        x.labels["task_prefix_name"]
        for x in families["dask_scheduler_fine_metrics_seconds"].samples
        if x.labels["activity"] == "execute"
    }
    assert prefixes == {"other", "medium", "(other)"}
    # A prefix shown stays shown, even when a bigger one comes later
    await c.submit(slowinc, 1, delay=0.5, key="huge-1")
    await c.get_fine_metrics()
    families = parse_families(await fetch(s.http_server.port, "/metrics"))
    samples = families["dask_scheduler_fine_metrics_seconds"].samples

    def published(prefix: str) -> float:
        return sum(
            x.value
            for x in samples
            if x.labels["task_prefix_name"] == prefix
            and x.labels["activity"] == "execute"
        )

    def stored(*prefixes: str) -> float:
        return sum(
            v
            for k, v in s.cumulative_worker_metrics.items()
            if k[0] == "execute" and k[1] in prefixes and k[3] == "seconds"
        )

    assert published("(other)") == pytest.approx(stored("small", "huge"))
    assert published("other") == pytest.approx(stored("other"))
    assert published("other") > 0.2


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_cli_reads_the_scheduler(c, s, a):
    """The command line includes the workers that have gone"""
    await c.submit(posting, 1, key="gone-1")
    await a.close()
    await async_poll_for(lambda: not s.workers, timeout=5)
    returncode, table, _ = await run_cli_async(s.address)
    assert returncode == 0
    assert "gone" in table and "my-count" in table


async def run_cli_async(*args: str) -> tuple[int | None, str, str]:
    """Run the command line without blocking the event loop: its exit status,
    output and error output
    """
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "distributed.diagnostics.fine_metrics",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    return proc.returncode, out.decode(), err.decode()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distributed.diagnostics.fine_metrics", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "1s"},
    )


def test_cli_scheduler_unreachable():
    """A scheduler that cannot be reached, or an address that is none, is said so
    in a line, not a traceback
    """
    # A port that is taken, and where nothing listens: the connection is refused
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        closed = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        refused = run_cli(closed)
    for proc, given in [(refused, closed), (run_cli("127.0.0.1"), "127.0.0.1")]:
        assert proc.returncode == 1
        assert proc.stderr.startswith(
            f"Could not read the fine metrics of the scheduler at {given}: "
        )
        assert "Traceback" not in proc.stderr


@gen_test()
async def test_cli_scheduler_without_fine_metrics():
    """A scheduler of a version of distributed without fine metrics is said so in a
    line, not a traceback
    """
    async with Scheduler(dashboard_address=":0") as s:
        del s.handlers["get_fine_metrics"]
        returncode, out, err = await run_cli_async(s.address)
    assert returncode == 1
    assert not out
    assert err == (
        f"Could not read the fine metrics of the scheduler at {s.address}: The "
        "scheduler gives no fine performance metrics: it runs a version of "
        "distributed without them\n"
    )


def test_cli_names_an_exception_without_a_message(monkeypatch, capsys):
    """A failure whose exception says nothing (a timeout) is named"""

    def timeout(address):
        raise asyncio.TimeoutError()

    monkeypatch.setattr(fine_metrics_cli, "Client", timeout)
    with pytest.raises(SystemExit) as info:
        fine_metrics_cli.main(["tcp://127.0.0.1:1"])
    assert info.value.code == 1
    assert capsys.readouterr().err == (
        "Could not read the fine metrics of the scheduler at tcp://127.0.0.1:1: "
        "TimeoutError\n"
    )


@gen_cluster(client=True, nthreads=[])
async def test_get_fine_metrics_block_of_an_asynchronous_client(c, s):
    """An asynchronous client needs ``async with``: a plain ``with`` says so"""
    with pytest.raises(TypeError, match="use `async with`"):
        with get_fine_metrics(c):
            pass
    async with get_fine_metrics(c) as fm:
        pass
    assert not fm


def test_cli_help_keeps_the_example():
    proc = run_cli("--help")
    assert proc.returncode == 0
    example = "    python -m distributed.diagnostics.fine_metrics tcp://scheduler:8786"
    assert example in proc.stdout.splitlines()


@gen_cluster(client=True)
async def test_flush_tolerates_a_failing_worker(c, s, a, b):
    """A worker whose flush fails doesn't fail get_fine_metrics; the others'
    metrics are in
    """
    stop_heartbeats(a, b)
    await workload(c, a, b)

    async def broken():
        raise OSError("boom")

    a.handlers["fine_metrics_flush"] = broken
    with captured_logger("distributed.scheduler") as log:
        fm = await c.get_fine_metrics()
    assert_flushed_but(fm, b, a)
    # One warning that names the worker, no error
    [line] = log.getvalue().splitlines()
    assert "Fine metrics: 1 worker(s) did not deliver within" in line
    assert a.address in line
    assert b.address not in line


def assert_flushed_but(fm, flushed, failed) -> None:
    """The snapshot has all that ``flushed`` gathered, and not what ``failed`` did
    since its last heartbeat (the task posting-1, which posts my-count)
    """
    short: dict = defaultdict(int)
    for k, v in worker_totals(flushed).items():
        short[without_prefix(k)] += v
    assert_equal_totals(fm.workers[flushed.address], short)
    assert fm["execute", "inc", "other", "seconds"] > 0  # flushed's task
    assert failed.digests_total["execute", "posting", "my-count", "count"] == 1
    assert ("execute", "posting", "my-count", "count") not in fm


@gen_cluster(client=True, config={"distributed.comm.timeouts.connect": "1s"})
async def test_flush_skips_a_worker_that_does_not_answer(c, s, a, b):
    """A worker that does not answer within distributed.comm.timeouts.connect is
    skipped; it delivers again once it answers
    """
    stop_heartbeats(a, b)
    await workload(c, a, b)
    release = asyncio.Event()

    async def hang():
        await release.wait()

    a.handlers["fine_metrics_flush"] = hang
    with captured_logger("distributed.scheduler") as log:
        fm = await c.get_fine_metrics()
    assert_flushed_but(fm, b, a)
    [line] = log.getvalue().splitlines()
    assert "1 worker(s) did not deliver within 1.00 s: " + a.address in line
    release.set()
    a.handlers["fine_metrics_flush"] = a.flush_fine_metrics
    fm = await c.get_fine_metrics()
    assert fm["execute", "posting", "my-count", "count"] == 1


async def deliver_task_metrics(c, s, a, func, key: str) -> Mapping:
    """Run ``func`` as task ``key`` on worker ``a``, deliver what it posted with a
    heartbeat, and return the scheduler's store; ``a`` must keep running
    """
    stop_heartbeats(a)
    await c.submit(func, key=key)
    await settle(a)
    await a.heartbeat()
    assert a.status == Status.running
    return s.cumulative_worker_metrics


def big_int():
    context_meter.digest_metric("rows", 2**70, "count")
    context_meter.digest_metric(None, 1, "count")
    context_meter.digest_metric(("flag", True), 1, "count")
    context_meter.digest_metric(2**64, 1, "count")  # A hash, an id


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_metrics_msgpack_cannot_carry(c, s, a):
    """A value too large for msgpack travels as a float, a label too large for it
    and labels that the scheduler would reject (None, bool) as their str(); the
    heartbeat goes on
    """
    m = await deliver_task_metrics(c, s, a, big_int, "big-1")
    assert m["execute", "big", "rows", "count"] == float(2**70)
    assert m["execute", "big", "None", "count"] == 1
    assert m["execute", "big", ("flag", "True"), "count"] == 1
    assert m["execute", "big", str(2**64), "count"] == 1


def undecodable_names():
    # A file name that is not UTF-8, as os.fsdecode gives it: with lone surrogates
    context_meter.digest_metric(os.fsdecode(b"read-\xff.csv"), 1, "count")
    context_meter.digest_metric("wait", 5, "ticks-" + os.fsdecode(b"\xfe"))


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_names_that_utf8_cannot_encode(c, s, a):
    """Labels and units with lone surrogates travel, and are published on both
    /metrics endpoints, with them escaped: msgpack, JSON and Prometheus' text
    format need UTF-8. The heartbeat goes on.
    """
    import_or_skip("prometheus_client")
    m = await deliver_task_metrics(c, s, a, undecodable_names, "names-1")
    assert m["execute", "names", "read-\\udcff.csv", "count"] == 1
    assert m["execute", "names", "wait", "ticks-\\udcfe"] == 5
    for server, family in [
        (s, "dask_scheduler_fine_metrics_count"),
        (a, "dask_worker_fine_metrics_count"),
    ]:
        families = parse_families(await fetch(server.http_server.port, "/metrics"))
        labels = {x.labels["label"] for x in families[family].samples}
        assert "read-\\udcff.csv" in labels
        other = families[family.replace("_count", "_other_units")].samples
        assert {x.labels["unit"] for x in other} == {"ticks-\\udcfe"}


def deeply_nested(label: object = "x") -> object:
    """A label of tuples nested as deeply as the recursion limit"""
    for _ in range(sys.getrecursionlimit()):
        label = (label,)
    return label


def deeply_nested_label():
    context_meter.digest_metric(deeply_nested(), 1, "count")
    context_meter.digest_metric("shallow", 1, "count")


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_label_nested_too_deeply(c, s, a):
    """A label of tuples nested too deeply for Python's recursion can't be
    delivered, nor written out: it is left out of the deliveries, with a warning,
    and of the worker's /metrics, and the rest goes on. The scheduler rejects one
    that it receives.
    """
    import_or_skip("prometheus_client")
    stop_heartbeats(a)
    await c.submit(deeply_nested_label, key="deep-1")
    await settle(a)
    with captured_logger("distributed.metrics") as log:
        await a.heartbeat()
    assert "nested too deeply to deliver" in log.getvalue()
    assert a.status == Status.running
    assert s.cumulative_worker_metrics["execute", "deep", "shallow", "count"] == 1
    families = parse_families(await fetch(a.http_server.port, "/metrics"))
    samples = families["dask_worker_fine_metrics_count"].samples
    assert "shallow" in {x.labels["label"] for x in samples}

    key = ("execute", "deep", deeply_nested(), "count")
    delivery = {"seq": 100, "base": 0, "metrics": [[key, 1]]}
    with captured_logger("distributed.scheduler") as log:
        resp = s.heartbeat_worker(
            address=a.address, metrics=await a.get_metrics(), fine_metrics=delivery
        )
    assert resp["status"] == "OK"
    assert "dropped 1 entries" in log.getvalue()


@gen_cluster(client=True)
async def test_flush_while_a_worker_leaves(c, s, a, b):
    """A worker that leaves after a flush asked the workers, but before it asked
    this one, is skipped without harm
    """
    flush = asyncio.ensure_future(s._flush_fine_metrics())
    # The flush asks the workers, in tasks that start at the loop's next turn...
    await asyncio.sleep(0)
    # ... after the worker has left (remove_worker forgets it at once)
    await s.remove_worker(a.address, stimulus_id="test")
    await flush


def numpy_metrics():
    np = import_or_skip("numpy")
    # What a task often has at hand: np.int64, np.float64
    context_meter.digest_metric("rows", np.arange(5).sum(), "count")
    context_meter.digest_metric("wait", np.float64(0.25), "seconds")


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_numpy_values_delivered(c, s, a):
    """A value that is a real number but not an int or a float (a numpy scalar)
    travels as an int or a float: msgpack can't carry it, and the scheduler accepts
    nothing else. The worker keeps running.
    """
    stop_heartbeats(a)
    await c.submit(numpy_metrics, key="np-1")
    await settle(a)
    with captured_logger("distributed.scheduler") as log:
        await a.heartbeat()
    assert a.status == Status.running
    assert not log.getvalue()
    m = s.cumulative_worker_metrics
    assert m["execute", "np", "rows", "count"] == 10
    assert type(m["execute", "np", "rows", "count"]) is int
    assert m["execute", "np", "wait", "seconds"] == 0.25
    assert type(m["execute", "np", "wait", "seconds"]) is float


@gen_test()
async def test_numpy_values_delivered_inproc():
    """In process (inproc://), where nothing is serialized, the scheduler gets plain
    ints and floats too
    """
    async with LocalCluster(
        processes=False,
        n_workers=1,
        threads_per_worker=1,
        asynchronous=True,
        dashboard_address=":0",
    ) as cluster, Client(cluster, asynchronous=True) as c:
        assert cluster.scheduler_address.startswith("inproc://")
        await c.submit(numpy_metrics, key="np-1")
        fm = await c.get_fine_metrics()
        assert fm["execute", "np", "rows", "count"] == 10
        assert fm["execute", "np", "wait", "seconds"] == 0.25


NAN = math.nan  # one object: one key in the worker's digests


def non_finite_labels():
    context_meter.digest_metric(("le", math.inf), 1, "count")
    context_meter.digest_metric(("bucket", NAN), 1, "count")


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    config={"distributed.scheduler.http.routes": ["distributed.http.scheduler.api"]},
)
async def test_non_finite_float_labels(c, s, a):
    """A nan or infinite label travels as its str(): a nan would be a new key at each
    delivery (it is not equal to itself), and JSON has no infinities
    """
    stop_heartbeats(a)
    for i in range(3):
        await c.submit(non_finite_labels, key=f"nonfinite-{i}")
        await settle(a)
        await a.heartbeat()
    tuple_labels = {
        k: v for k, v in s.cumulative_worker_metrics.items() if isinstance(k[2], tuple)
    }
    assert tuple_labels == {
        ("execute", "nonfinite", ("le", "inf"), "count"): 3,
        ("execute", "nonfinite", ("bucket", "nan"), "count"): 3,
    }
    records = json.loads(await fetch(s.http_server.port, "/api/v1/fine_metrics"))
    assert {
        "activity": "execute",
        "task_prefix": "nonfinite",
        "label": ["le", "inf"],
        "unit": "count",
        "value": 3,
    } in records


def huge_count():
    context_meter.digest_metric("ids", 2**62, "count")  # within int64


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_store_beyond_int64(c, s, a):
    """The scheduler's sum of deliveries may grow beyond int64, which msgpack can't
    carry to a client: it is sent as a float
    """
    stop_heartbeats(a)
    for i in range(5):
        await c.submit(huge_count, key=f"huge-{i}")
        await settle(a)
        await a.heartbeat()
    assert s.cumulative_worker_metrics["execute", "huge", "ids", "count"] == 5 * 2**62
    fm = await c.get_fine_metrics()
    assert fm["execute", "huge", "ids", "count"] == float(5 * 2**62)
    assert fm.workers[a.address]["execute", "ids", "count"] == float(5 * 2**62)


def beyond_float():
    context_meter.digest_metric("rows", 2**1100, "count")
    context_meter.digest_metric("ok", 1, "count")


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_value_beyond_float_range(c, s, a):
    """A task may post an int that no float can hold, and that nothing can carry:
    it is left out of the deliveries and of the worker's Prometheus endpoint, with a
    warning, and everything else goes on
    """
    stop_heartbeats(a)
    await c.submit(beyond_float, key="beyond-1")
    with captured_logger("distributed.metrics") as log:
        await a.heartbeat()
    assert "beyond the range of a float" in log.getvalue()
    assert a.status == Status.running
    m = s.cumulative_worker_metrics
    assert m["execute", "beyond", "ok", "count"] == 1
    assert ("execute", "beyond", "rows", "count") not in m
    # Once acknowledged, it is not tried again until it changes
    with captured_logger("distributed.metrics") as log:
        await a.heartbeat()
    assert not log.getvalue()
    # What it gains later, if a float can hold it, is delivered
    a.digest_metric(("execute", "beyond", "rows", "count"), 5)
    await a.heartbeat()
    assert m["execute", "beyond", "rows", "count"] == 5
    body = await fetch(a.http_server.port, "/metrics")
    assert 'label="ok"' in body
    assert 'label="rows"' not in body


def overflowing_seconds():
    context_meter.digest_metric("huge", 1e308, "seconds")
    context_meter.digest_metric("huge", 1e308, "seconds")
    context_meter.digest_metric("ok", 1, "count")


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_float_sum_that_overflows(c, s, a):
    """A worker's total of floats that overflowed to inf is left out of the
    deliveries, with a warning on the worker's side, rather than rejected by the
    scheduler as if it were not a fine metric; the rest goes on
    """
    stop_heartbeats(a)
    await c.submit(overflowing_seconds, key="overflow-1")
    await settle(a)
    assert a.digests_total["execute", "overflow", "huge", "seconds"] == math.inf
    with captured_logger("distributed.metrics") as worker_log:
        with captured_logger("distributed.scheduler") as scheduler_log:
            await a.heartbeat()
    assert "beyond the range of a float" in worker_log.getvalue()
    assert not scheduler_log.getvalue()
    m = s.cumulative_worker_metrics
    assert m["execute", "overflow", "ok", "count"] == 1
    assert ("execute", "overflow", "huge", "seconds") not in m


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_warnings_forgotten_with_the_worker(c, s, a):
    """The scheduler forgets which workers it warned about bad deliveries once they
    are gone, so that the set doesn't grow with workers coming and going
    """
    s.heartbeat_worker(
        address=a.address, metrics=await a.get_metrics(), fine_metrics="garbage"
    )
    assert a.address in s._fine_metrics_warned
    with dask.config.set({"distributed.scheduler.events-cleanup-delay": "10ms"}):
        await a.close()
        await async_poll_for(lambda: a.address not in s._fine_metrics_departed, 5)
    assert a.address not in s._fine_metrics_warned


@gen_cluster(client=True)
async def test_concurrent_heartbeat_and_flush(c, s, a, b):
    """A flush while a heartbeat's delivery is in flight waits for it: one delivery
    at a time, so that acknowledgements can't arrive out of order
    """
    stop_heartbeats(a, b)
    await workload(c, a, b)
    a.scheduler.heartbeat_worker = rpc = PausedRPC(a.scheduler.heartbeat_worker)
    try:
        hb = asyncio.create_task(a.heartbeat())
        await rpc.in_flight.wait()
        assert await c.submit(posting, 1, key="posting-2", workers=[a.address]) == 2
        await settle(a)
        flush = asyncio.create_task(c.get_fine_metrics())
        await asyncio.sleep(0.2)
        assert not flush.done()
        rpc.release.set()
        await hb
        fm = await flush
    finally:
        del a.scheduler.heartbeat_worker
    # The flush came after the heartbeat's delivery: everything is in
    assert_equal_totals(fm, worker_totals(a, b))
    await assert_delivered(s, a, b)


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_flush_with_non_canonical_address(c, s, a):
    """A worker may give its address in another form than the scheduler's"""
    stop_heartbeats(a)
    await c.submit(posting, 1, key="posting-1")
    await settle(a)
    delivery = a._fine_metrics_sender.delivery()
    other_form = a.address.replace("127.0.0.1", "localhost")
    assert other_form != a.address
    assert s.handle_worker_fine_metrics(worker=other_form, delivery=delivery) == 1
    assert s.cumulative_worker_metrics["execute", "posting", "my-count", "count"] == 1


class _RegistrationReplyOf2023_3_1:
    """A comm whose messages lose what 2023.3.1's reply to a worker's registration
    did not have
    """

    def __init__(self, comm):
        self._comm = comm

    async def write(self, msg, *args, **kwargs):
        if isinstance(msg, dict):
            msg = {k: v for k, v in msg.items() if k != "fine-metrics"}
        return await self._comm.write(msg, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._comm, name)


class SchedulerOf2023_3_1(Scheduler):
    """What a worker of the fork meets in a scheduler of 2023.3.1: no word of fine
    metrics when it registers, a heartbeat that takes no ``fine_metrics``, and no
    stream op ``worker-fine-metrics``, nor any other handler of them
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        del self.stream_handlers["worker-fine-metrics"]
        del self.handlers["worker_fine_metrics"]
        del self.handlers["get_fine_metrics"]
        self.handlers["heartbeat_worker"] = self.heartbeat_of_2023_3_1

    async def add_worker(self, comm, **kwargs):
        return await super().add_worker(_RegistrationReplyOf2023_3_1(comm), **kwargs)

    def heartbeat_of_2023_3_1(
        self,
        comm=None,
        *,
        address,
        resolve_address=True,
        now=None,
        resources=None,
        host_info=None,
        metrics,
        executing=None,
        extensions=None,
    ):
        return self.heartbeat_worker(
            address=address,
            resolve_address=resolve_address,
            now=now,
            resources=resources,
            host_info=host_info,
            metrics=metrics,
            executing=executing,
            extensions=extensions,
        )


@gen_test()
async def test_worker_with_a_scheduler_of_2023_3_1():
    """A worker of the fork keeps its fine metrics to itself with a scheduler that
    does not take them, rather than failing its heartbeat, and closing with it; a
    client asking for them is told that the scheduler has none
    """
    async with SchedulerOf2023_3_1(dashboard_address=":0") as s:
        async with Worker(s.address, nthreads=1) as a:
            assert not a._scheduler_takes_fine_metrics
            async with Client(s.address, asynchronous=True) as c:
                assert await c.submit(posting, 1, key="posting-1") == 2
                with captured_logger("distributed.worker") as log:
                    await a.heartbeat()
                assert not log.getvalue()
                assert a.status == Status.running
                # ...and the client says what it is
                with pytest.raises(NoFineMetricsError, match="without them"):
                    await c.get_fine_metrics()
            key = ("execute", "posting", "my-count", "count")
            assert a.digests_total[key] == 1
        # The closing worker sent no delivery on its stream either
        await async_poll_for(lambda: not s.workers, timeout=5)
        assert a.status == Status.closed
        assert not s.cumulative_worker_metrics
