"""The fine performance metrics on the Prometheus endpoints: the family of the
threads' seconds by state, and the high-water marks that keep every counter from
going down while the store, which is exact, goes down for a while.
"""
from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from unittest import mock

import pytest

from distributed.tests.utils_ci import import_or_skip

import_or_skip("prometheus_client")

import dask.config

from distributed import Scheduler, Worker
from distributed.http.prometheus import HighWaterMarks, high_water
from distributed.http.scheduler.prometheus.core import FineMetricsCollector
from distributed.metrics import THREAD_STATES
from distributed.utils_test import (
    captured_logger,
    fetch_metrics_body,
    gen_cluster,
    gen_test,
    inc,
)

#: The families of the fine metrics and of the threads' seconds, by the prefix of
#: their names
PREFIXES = (
    "dask_scheduler_fine_metrics_",
    "dask_scheduler_thread_seconds",
    "dask_worker_fine_metrics_",
    "dask_worker_thread_seconds",
)

NONCPU = ("execute", "late", "thread-noncpu", "seconds")


class FakeScheduler:
    """What FineMetricsCollector reads of a scheduler"""

    def __init__(self, metrics: dict[tuple, float]):
        self.cumulative_worker_metrics = metrics


def collected(collector: FineMetricsCollector) -> dict[tuple, float]:
    """The samples of a collector, as ``{(name, *label values): value}``"""
    out = {}
    for family in collector.collect():
        for sample in family.samples:
            key = (sample.name, *(v for _, v in sorted(sample.labels.items())))
            assert key not in out
            out[key] = sample.value
    return out


def test_high_water():
    marks: dict = {}
    values = [1, 3, 2.5, 5, math.nan, 4, 6.0]
    published = [high_water(marks, "x", v) for v in values]
    assert published == [1, 3, 3, 5, 5, 5, 6.0]
    # A counter starts at 0
    assert high_water(marks, "y", -2) == 0
    assert high_water(marks, "y", -1) == 0
    assert high_water(marks, "y", 0.5) == 0.5
    assert marks == {"x": 6.0, "y": 0.5}


def test_high_water_marks_are_per_server():
    marks = HighWaterMarks()
    a, b = FakeScheduler({}), FakeScheduler({})
    assert marks.of(a) is marks.of(a)
    high_water(marks.of(a), "x", 5)
    assert marks.of(b) == {}
    del a
    assert list(marks._marks) == [b]


def test_collector_publishes_the_high_water_mark():
    """A series whose value goes down keeps its highest value so far, until the
    value is higher again; the store itself is not changed
    """
    store = {
        NONCPU: 2.0,
        ("execute", "late", "failed", "seconds"): 0.0,
        ("threads", "busy", "seconds"): 3.0,
        ("threads", "idle-no-tasks", "seconds"): 1.0,
    }
    collector = FineMetricsCollector(FakeScheduler(store))  # type: ignore[arg-type]
    noncpu = (
        "dask_scheduler_fine_metrics_seconds_total",
        "execute",
        "thread-noncpu",
        "late",
    )
    failed = noncpu[:2] + ("failed", "late")
    busy = ("dask_scheduler_thread_seconds_total", "busy")
    idle = ("dask_scheduler_thread_seconds_total", "idle-no-tasks")

    first = collected(collector)
    assert first[noncpu] == 2.0
    assert first[busy] == 3.0
    assert first[idle] == 1.0
    # Every state from the start, with zeros
    assert {k[1] for k in first if k[0] == busy[0]} == set(THREAD_STATES)
    assert first["dask_scheduler_thread_seconds_total", "idle-paused"] == 0

    # A final post takes back what interim posts gave, lumped into `failed`
    store[NONCPU] = 0.0
    store["execute", "late", "failed", "seconds"] = 2.5
    store["threads", "idle-no-tasks", "seconds"] = 0.5
    second = collected(collector)
    assert second[noncpu] == 2.0
    assert second[failed] == 2.5
    assert second[idle] == 1.0
    assert store[NONCPU] == 0.0

    # ... until the store catches up
    store[NONCPU] = 1.5
    store["threads", "idle-no-tasks", "seconds"] = 1.25
    third = collected(collector)
    assert third[noncpu] == 2.0
    assert third[idle] == 1.25
    store[NONCPU] = 2.25
    assert collected(collector)[noncpu] == 2.25

    # Another scheduler in the same process has marks of its own
    collector.server = FakeScheduler({NONCPU: 0.5})  # type: ignore[assignment]
    assert collected(collector)[noncpu] == 0.5


@pytest.mark.parametrize(
    "config,prefix",
    [
        ({"distributed.scheduler.fine-metrics.prometheus.task-prefix": False}, None),
        (
            {"distributed.scheduler.fine-metrics.prometheus.max-task-prefixes": 1},
            "(other)",
        ),
    ],
)
def test_collector_high_water_with_the_cardinality_switches(config, prefix):
    """Without the prefix label, and for the prefixes added up under ``(other)``, a
    series is the sum of several keys: the mark is that of the sum
    """
    store = {
        ("execute", "big", "thread-noncpu", "seconds"): 10.0,
        ("execute", "small", "thread-noncpu", "seconds"): 1.0,
        ("execute", "tiny", "thread-noncpu", "seconds"): 0.5,
        ("threads", "busy", "seconds"): 11.5,
    }
    with dask.config.set(config):
        collector = FineMetricsCollector(FakeScheduler(store))  # type: ignore
        first = collected(collector)
        store["execute", "small", "thread-noncpu", "seconds"] = 0.0
        second = collected(collector)
        store["execute", "tiny", "thread-noncpu", "seconds"] = 3.0
        third = collected(collector)

    name = "dask_scheduler_fine_metrics_seconds_total"
    if prefix is None:
        series = (name, "execute", "thread-noncpu")
        assert (first[series], second[series], third[series]) == (11.5, 11.5, 13.0)
    else:
        series = (name, "execute", "thread-noncpu", prefix)
        big = (name, "execute", "thread-noncpu", "big")
        assert (first[series], second[series], third[series]) == (1.5, 1.5, 3.0)
        assert first[big] == third[big] == 10.0
    for samples in (first, second, third):
        # The thread family has its own labels, whatever the switches
        assert samples["dask_scheduler_thread_seconds_total", "busy"] == 11.5
        assert not any(len(k) == 4 and k[1] == "threads" for k in samples)


class FakeWorker:
    """What WorkerMetricCollector.collect_fine_metrics reads of a worker"""

    def __init__(self, metrics: dict[tuple, float]):
        self.digests_total = metrics


@pytest.mark.parametrize("subsystem", ["scheduler", "worker"])
def test_marks_are_updated_under_their_lock(subsystem):
    """Two readers of the registry at once, in two threads, can't interleave their
    updates of the marks (which could lower one): a collector waits for the lock
    """
    from distributed.http.worker.prometheus.core import WorkerMetricCollector

    collector: FineMetricsCollector | WorkerMetricCollector
    if subsystem == "scheduler":
        collector = FineMetricsCollector(FakeScheduler({NONCPU: 1.0}))  # type: ignore[arg-type]
        collect = collector.collect
    else:
        collector = WorkerMetricCollector(FakeWorker({NONCPU: 1.0}))  # type: ignore[arg-type]
        collect = collector.collect_fine_metrics
    lock = OwnedLock()
    collector._marks.lock = lock  # type: ignore[assignment]
    updated = []

    def checked_high_water(marks, series, value):
        # Every mark is updated by the thread that holds the lock
        assert lock.owner == threading.get_ident()
        updated.append(series)
        return high_water(marks, series, value)

    done = threading.Event()

    def read() -> None:
        list(collect())
        done.set()

    reader = threading.Thread(target=read)
    with mock.patch("distributed.http.prometheus.high_water", checked_high_water):
        with lock:
            reader.start()
            assert not done.wait(0.2)
        reader.join(timeout=5)
    assert done.is_set()
    assert updated


class OwnedLock:
    """A lock that knows which thread holds it"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: int | None = None

    def __enter__(self) -> OwnedLock:
        self._lock.acquire()
        self.owner = threading.get_ident()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.owner = None
        self._lock.release()


def test_shown_prefixes_are_per_scheduler():
    """Two schedulers in one process, scraped in turn: each keeps the prefixes it
    showed, whatever the other showed meanwhile
    """

    def cpu(prefix: str) -> tuple:
        return ("execute", prefix, "thread-cpu", "seconds")

    def prefixes(samples: dict[tuple, float]) -> dict[str, float]:
        return {
            k[3]: v
            for k, v in samples.items()
            if k[0] == "dask_scheduler_fine_metrics_seconds_total"
        }

    first = FakeScheduler({cpu("a"): 3.0, cpu("b"): 2.0, cpu("c"): 1.0})
    second = FakeScheduler({cpu("x"): 5.0})
    with dask.config.set(
        {"distributed.scheduler.fine-metrics.prometheus.max-task-prefixes": 2}
    ):
        collector = FineMetricsCollector(first)  # type: ignore[arg-type]
        assert prefixes(collected(collector)) == {"a": 3.0, "b": 2.0, "(other)": 1.0}
        collector.server = second  # type: ignore[assignment]
        assert prefixes(collected(collector)) == {"x": 5.0}
        # c outgrows a and b: it was not shown, and stays under (other)
        first.cumulative_worker_metrics[cpu("c")] = 10.0
        collector.server = first  # type: ignore[assignment]
        assert prefixes(collected(collector)) == {"a": 3.0, "b": 2.0, "(other)": 10.0}
        # ...and forgets a scheduler that is gone
        collector.server = second  # type: ignore[assignment]
        del first
        assert list(collector._shown) == [second]


def late(seconds: float, fail: bool) -> float:
    time.sleep(seconds)
    if fail:
        raise ValueError("late")
    return seconds


async def fetch_page(port: int, path: str) -> str:
    """GET a page of a server's HTTP endpoint"""
    from tornado.httpclient import AsyncHTTPClient

    response = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{port}{path}")
    assert response.code == 200
    return response.body.decode()


async def scrape(s, w) -> dict[tuple, float]:
    """The series of the fine metrics and the threads' seconds on the scheduler's
    and the worker's /metrics, as ``{(name, *sorted labels): value}``

    Both endpoints serve the same registry in a test cluster, but the worker's
    collector publishes the worker that the latest request was for.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for port, subsystem in [
        (s.http_server.port, "scheduler"),
        (w.http_server.port, "worker"),
    ]:
        body = await fetch_metrics_body(port)
        for family in text_string_to_metric_families(body):
            if not family.name.startswith(f"dask_{subsystem}_") or not any(
                family.name.startswith(p) for p in PREFIXES
            ):
                continue
            for sample in family.samples:
                key = (sample.name, *sorted(sample.labels.items()))
                out[key] = sample.value
    return out


async def scrape_while_running(future, s, w) -> list[dict[tuple, float]]:
    """Scrape both endpoints every 50 ms until the future is done, after having
    the worker deliver its fine metrics, so that the scheduler gets interim posts
    """
    scrapes = []
    while not future.done():
        await w.heartbeat()
        scrapes.append(await scrape(s, w))
        await asyncio.sleep(0.05)
    return scrapes


def assert_never_down(scrapes: list[dict[tuple, float]]) -> None:
    for before, after in zip(scrapes, scrapes[1:]):
        for key, value in before.items():
            assert after[key] >= value, key


def noncpu_series(subsystem: str) -> tuple:
    labels = [("activity", "execute"), ("label", "thread-noncpu")]
    if subsystem == "scheduler":
        labels.append(("task_prefix_name", "late"))
    return (f"dask_{subsystem}_fine_metrics_seconds_total", *labels)


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    config={
        "distributed.scheduler.http.routes": [
            "distributed.http.scheduler.api",
            "distributed.http.scheduler.prometheus",
        ]
    },
)
async def test_failed_task_after_interim_posts(c, s, a):
    """A long task posts its thread-noncpu seconds while it runs, then fails and
    lumps them into `failed`: the store takes them back at once, but Prometheus
    shows their high-water mark until the store catches up
    """
    x = c.submit(late, 0.5, True, key="late-1")
    scrapes = await scrape_while_running(x, s, a)
    with pytest.raises(ValueError, match="late"):
        await x
    await c.get_fine_metrics(flush=True)
    scrapes.append(await scrape(s, a))
    assert_never_down(scrapes)

    # Interim posts reached both endpoints
    marks = {}
    for subsystem in ("scheduler", "worker"):
        series = noncpu_series(subsystem)
        marks[subsystem] = max(scr.get(series, 0) for scr in scrapes)
        assert marks[subsystem] > 0.1, subsystem
        # ... and stay there
        assert scrapes[-1][series] == marks[subsystem], subsystem

    # The store, the worker's totals, the client and the HTTP API are exact
    for totals in (s.cumulative_worker_metrics, a.digests_total):
        assert totals[NONCPU] == pytest.approx(0, abs=1e-9)
        assert totals["execute", "late", "failed", "seconds"] >= 0.5
    fm = await c.get_fine_metrics(flush=False)
    assert fm[NONCPU] == s.cumulative_worker_metrics[NONCPU]
    body = await fetch_page(s.http_server.port, "/api/v1/fine_metrics")
    [record] = [
        r
        for r in json.loads(body)
        if (r["activity"], r["task_prefix"], r["label"], r["unit"]) == NONCPU
    ]
    assert record["value"] == s.cumulative_worker_metrics[NONCPU]

    # A task of the same prefix that succeeds brings the store past the mark
    y = c.submit(late, 0.8, False, key="late-2")
    scrapes += await scrape_while_running(y, s, a)
    assert await y == 0.8
    await c.get_fine_metrics(flush=True)
    scrapes.append(await scrape(s, a))
    assert_never_down(scrapes)
    assert s.cumulative_worker_metrics[NONCPU] > marks["scheduler"]
    assert scrapes[-1][noncpu_series("scheduler")] == (
        s.cumulative_worker_metrics[NONCPU]
    )
    assert scrapes[-1][noncpu_series("worker")] == a.digests_total[NONCPU]


def thread_series(scraped: dict[tuple, float], subsystem: str) -> dict[str, float]:
    """``{state: value}`` of the family of the threads' seconds"""
    out = {}
    for key, value in scraped.items():
        if key[0] == f"dask_{subsystem}_thread_seconds_total":
            assert key[1:] == (("state", key[1][1]),)
            out[key[1][1]] = value
    return out


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"distributed.scheduler.fine-metrics.prometheus.task-prefix": False},
        {"distributed.scheduler.fine-metrics.prometheus.max-task-prefixes": 1},
    ],
)
@gen_cluster(client=True, nthreads=[("", 2)])
async def test_thread_seconds_on_both_endpoints(c, s, a, config):
    """The scheduler publishes the store's thread-seconds, the worker its own,
    by state only, whatever the switches of the other families; and the other
    families leave them out
    """
    with dask.config.set(config):
        await c.gather(c.map(inc, range(5)))
        a.periodic_callbacks["heartbeat"].stop()
        await c.get_fine_metrics(flush=True)
        scraped = await scrape(s, a)

    threads = {
        k[1]: v for k, v in s.cumulative_worker_metrics.items() if k[0] == "threads"
    }
    assert set(threads) <= set(THREAD_STATES)
    assert threads["busy"] > 0
    expect = dict.fromkeys(THREAD_STATES, 0.0)
    expect.update(threads)
    assert thread_series(scraped, "scheduler") == expect

    # The worker's endpoint digests what its threads did up to the scrape
    own = {k[1]: v for k, v in a.digests_total.items() if k[0] == "threads"}
    expect = dict.fromkeys(THREAD_STATES, 0.0)
    expect.update(own)
    assert thread_series(scraped, "worker") == expect
    assert own["idle-no-tasks"] > threads["idle-no-tasks"]

    for key in scraped:
        assert ("activity", "threads") not in key, key
        if "task_prefix_name" in dict(key[1:]):
            assert config.get(
                "distributed.scheduler.fine-metrics.prometheus.task-prefix", True
            )


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_reading_the_registry_digests_nothing(c, s, a):
    """The worker's /metrics handler digests what the threads and the running
    tasks did, on the event loop; its collector, which any reader of the registry
    may run from any thread, only reads
    """
    from distributed.http.worker.prometheus.core import WorkerMetricCollector

    a.periodic_callbacks["heartbeat"].stop()
    await c.submit(inc, 1, key="inc-1")
    idle = ("threads", "idle-no-tasks", "seconds")

    def fine_metrics() -> dict[tuple, float]:
        """What the worker's threads did, as digested so far"""
        return {k: v for k, v in a.digests_total.items() if k[0] == "threads"}

    before = fine_metrics()
    await asyncio.sleep(0.05)
    samples = [s for f in WorkerMetricCollector(a).collect() for s in f.samples]
    threads = {
        s.labels["state"]: s.value
        for s in samples
        if s.name == "dask_worker_thread_seconds_total"
    }
    assert threads["idle-no-tasks"] == before.get(idle, 0)
    assert fine_metrics() == before

    await fetch_metrics_body(a.http_server.port)
    assert fine_metrics()[idle] >= before.get(idle, 0) + 0.05


def published_threads(body: str, subsystem: str) -> float:
    """The threads that a /metrics page says its server has: the workers' on the
    scheduler's, the worker's own on a worker's
    """
    name = (
        "dask_scheduler_workers" if subsystem == "scheduler" else "dask_worker_threads"
    )
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(body):
        if family.name == name:
            if subsystem == "scheduler":
                return sum(sample.value for sample in family.samples)
            [sample] = family.samples
            return sample.value
    raise AssertionError(f"{name} not found")


@gen_cluster(client=True, nthreads=[("", 1), ("", 3)])
async def test_concurrent_scrapes_publish_their_own_worker(c, s, a, b):
    """Two workers of a process scraped at once, as a Prometheus server scrapes its
    targets: each page is its own worker's, though the collector is shared, and the
    second request may reach its handler before the first one is served
    """
    for _ in range(20):
        pages = await asyncio.gather(
            fetch_metrics_body(a.http_server.port),
            fetch_metrics_body(b.http_server.port),
        )
        assert [published_threads(p, "worker") for p in pages] == [1, 3]


@gen_test()
async def test_concurrent_scrapes_publish_their_own_scheduler():
    async with Scheduler(dashboard_address=":0") as s1, Scheduler(
        dashboard_address=":0"
    ) as s2, Worker(s2.address, nthreads=1):
        for _ in range(20):
            pages = await asyncio.gather(
                fetch_metrics_body(s1.http_server.port),
                fetch_metrics_body(s2.http_server.port),
            )
            assert [published_threads(p, "scheduler") for p in pages] == [0, 1]


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_a_reader_in_another_thread(c, s, a):
    """A reader of the registry in a thread of its own (``start_http_server`` of
    prometheus_client, say) reads while the event loop digests new keys: here, the
    loop digests one while the reader is in the middle of each store it reads
    """
    from distributed.http.scheduler.prometheus.core import (
        FineMetricsCollector as SchedulerCollector,
    )
    from distributed.http.worker.prometheus.core import WorkerMetricCollector

    a.periodic_callbacks["heartbeat"].stop()
    loop = asyncio.get_running_loop()
    added = []
    called = set()

    def digest_a_new_key() -> None:
        key = ("execute", f"p{len(added)}", "thread-cpu", "seconds")
        a.digest_metric(key, 1.0)
        s.cumulative_worker_metrics[key] = 1.0
        added.append(key)

    def meanwhile(func):
        """``func``, which the collectors call for each key of the store that they
        read, in the reader's thread: the loop digests a new key before it returns
        """

        def wrapper(*args):
            called.add(func.__name__)
            done = threading.Event()
            loop.call_soon_threadsafe(lambda: (digest_a_new_key(), done.set()))
            assert done.wait(5)
            return func(*args)

        return wrapper

    def read() -> None:
        for collector in (WorkerMetricCollector(a), SchedulerCollector(s)):
            for _ in collector.collect():
                pass

    import distributed.http.prometheus as common
    import distributed.http.worker.prometheus.core as worker_core

    with mock.patch.object(
        worker_core, "is_fine_metric", meanwhile(worker_core.is_fine_metric)
    ), mock.patch.object(common, "_label_text", meanwhile(common._label_text)):
        await asyncio.to_thread(read)
    # Both stores changed while they were read
    assert called == {"is_fine_metric", "_label_text"}
    assert added


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_scrape_survives_a_failed_digest(c, s, a):
    """A failure to digest what the threads and the running tasks did is logged,
    and the page still has all the rest
    """
    with mock.patch.object(
        a, "digest_running", side_effect=RuntimeError("broken")
    ), captured_logger("distributed.prometheus.worker") as log:
        body = await fetch_metrics_body(a.http_server.port)
    assert published_threads(body, "worker") == 1
    assert "dask_worker_thread_seconds_total" in body
    assert "Failed to digest" in log.getvalue()
    assert "broken" in log.getvalue()
