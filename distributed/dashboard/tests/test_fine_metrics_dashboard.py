"""The fine performance metrics on the scheduler's dashboard
(``/individual-fine-performance-metrics``, ``FineMetricsBreakdown``) and in the
"Fine metrics" tab of ``performance_report``.

The data sources are checked against the scheduler's store,
``Scheduler.cumulative_worker_metrics``, with expectations computed here from the
store itself by the documented rules (docs/fine_metrics.rst), not with the
component's own helpers.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Hashable, Mapping
from typing import Any

import pytest

pytest.importorskip("bokeh")
from tornado.httpclient import AsyncHTTPClient

from distributed import performance_report
from distributed.dashboard.components.scheduler import (
    FINE_METRICS_COLORS,
    FINE_METRICS_OTHER_PREFIXES,
    FINE_METRICS_SPILL_LABELS,
    FineMetricsBreakdown,
    fine_metrics_color,
)
from distributed.metrics import context_meter
from distributed.utils_test import async_poll_for, gen_cluster, inc

ACTIVITIES = ["execute", "gather-dep", "get-data", "memory-monitor"]

SPILL = {
    "worker_kwargs": {"memory_limit": "1 GiB"},
    "config": {
        # Spill anything larger than ~1 MiB as soon as it's in memory
        "distributed.worker.memory.target": 0.001,
        "distributed.worker.memory.spill": False,
        "distributed.worker.memory.pause": False,
    },
}


# --- Expectations, from the store -------------------------------------------------


def text(label: Hashable) -> str:
    """A label as the dashboard shows it: a tuple's elements joined with "/" """
    if isinstance(label, tuple):
        return "/".join(map(str, label))
    return str(label)


def execute_expected(store: Mapping, unit: str) -> dict[tuple[str, str], float]:
    """{(prefix, label): value} of execute in one unit, zeros left out"""
    out: dict[tuple[str, str], float] = defaultdict(int)
    for key, value in store.items():
        if key[0] == "execute" and key[3] == unit and value:
            out[key[1], text(key[2])] += value
    return dict(out)


def activity_expected(store: Mapping, activity: str) -> dict[tuple[str, str], float]:
    """{(label, unit): value} of an activity, added up over the task prefixes"""
    out: dict[tuple[str, str], float] = defaultdict(int)
    for key, value in store.items():
        if key[0] == activity and value:
            out[text(key[-2]), key[-1]] += value
    return dict(out)


def approx(expect: Mapping) -> Any:
    return pytest.approx(expect, rel=1e-12, abs=1e-12)


# --- Reading the sources ------------------------------------------------------------


def segments(data: Mapping[str, list], y: str) -> dict[tuple[str, str], float]:
    """{(bar, label): value} of a stacked source; each segment appears once"""
    out = {}
    for name, label, value in zip(data[y], data["label"], data["value"]):
        assert (name, label) not in out
        out[name, label] = value
    return out


def bars(data: Mapping[str, list], y: str) -> list[str]:
    """The bars of a stacked source, in order"""
    return list(dict.fromkeys(data[y]))


def assert_stacked(data: Mapping[str, list], y: str) -> None:
    """Segments touch, from 0, with their share of the bar; the labels in the same
    order in every bar, the largest over all bars first
    """
    lengths = {len(column) for column in data.values()}
    assert len(lengths) == 1
    totals: dict[str, float] = defaultdict(int)
    for name, value in zip(data[y], data["value"]):
        totals[name] += value
    end: dict[str, float] = {}
    for i, name in enumerate(data[y]):
        assert data["left"][i] == pytest.approx(end.get(name, 0))
        assert data["right"][i] - data["left"][i] == pytest.approx(data["value"][i])
        assert data["share"][i] == pytest.approx(100 * data["value"][i] / totals[name])
        assert data["color"][i] == fine_metrics_color(data["label"][i])
        end[name] = data["right"][i]
    overall: dict[str, float] = defaultdict(int)
    for label, value in zip(data["label"], data["value"]):
        overall[label] += value
    order = sorted(overall, key=lambda lb: (-overall[lb], lb))
    for name in bars(data, y):
        labels = [lb for n, lb in zip(data[y], data["label"]) if n == name]
        assert labels == [lb for lb in order if lb in labels]


class Breakdown:
    """What the checks read: the data of the sources by name, and the factors of the
    execute plots by unit, from a component or from a report's document
    """

    def __init__(
        self,
        sources: Mapping[str, Mapping[str, list]],
        factors: Mapping[str, list[str]],
        max_prefixes: int = 20,
    ):
        self.sources = sources
        self.factors = factors
        self.max_prefixes = max_prefixes

    @classmethod
    def of(cls, fm: FineMetricsBreakdown) -> Breakdown:
        for unit, fig in fm.execute_plots.items():
            assert fig.name == f"fine_metrics_execute_{unit}_plot"
            assert fm.execute_sources[unit].name == f"fine_metrics_execute_{unit}"
        return cls(
            {source.name: source.data for source in all_sources(fm)},
            {u: list(fig.y_range.factors) for u, fig in fm.execute_plots.items()},
            fm.max_prefixes,
        )

    def execute(self) -> dict[str, Mapping[str, list]]:
        prefix = "fine_metrics_execute_"
        return {
            name[len(prefix) :]: data
            for name, data in self.sources.items()
            if name.startswith(prefix)
        }


def assert_execute(
    fm: Breakdown, store: Mapping, prefixes: set[str] | None = None
) -> None:
    """Every unit of execute holds the store's values, prefixes largest first,
    beyond max_prefixes the rest added up in "(other)"
    """
    units = {key[3] for key in store if key[0] == "execute" and store[key]}
    execute = fm.execute()
    assert units <= set(execute)
    assert {"seconds", "bytes", "count"} <= set(execute)
    for unit, data in execute.items():
        assert_stacked(data, "prefix")
        expect = execute_expected(store, unit)
        if prefixes:
            expect = {k: v for k, v in expect.items() if k[0] in prefixes}
        totals: dict[str, float] = defaultdict(int)
        for (prefix, _), value in expect.items():
            totals[prefix] += value
        order = sorted(totals, key=lambda p: (-totals[p], p))
        shown = bars(data, "prefix")
        if len(order) > fm.max_prefixes + 1:
            assert shown == order[: fm.max_prefixes] + [FINE_METRICS_OTHER_PREFIXES]
            rest: dict[tuple[str, str], float] = defaultdict(int)
            for (prefix, label), value in expect.items():
                if prefix not in shown:
                    rest[FINE_METRICS_OTHER_PREFIXES, label] += value
            expect = {k: v for k, v in expect.items() if k[0] in shown}
            expect.update(rest)
        else:
            assert shown == order
        assert segments(data, "prefix") == approx(expect)
        # The largest on top: categorical factors go from the bottom up
        assert fm.factors[unit] == shown[::-1]


def assert_activities(data: Mapping[str, list], store: Mapping) -> None:
    assert data["activity"] == ACTIVITIES
    expect = {
        a: sum(v for (_, u), v in activity_expected(store, a).items() if u == "seconds")
        for a in ACTIVITIES
    }
    assert dict(zip(data["activity"], data["seconds"])) == approx(expect)
    total = sum(expect.values())
    if total:
        assert sum(data["share"]) == pytest.approx(100)
        for a, share in zip(data["activity"], data["share"]):
            assert share == pytest.approx(100 * expect[a] / total)


def assert_labels(data: Mapping[str, list], store: Mapping, activity: str) -> None:
    expect = activity_expected(store, activity)
    assert set(data["label"]) == {label for label, _ in expect}
    for unit in ("seconds", "bytes", "count"):
        actual = {
            lb: v for lb, v in zip(data["label"], data[unit]) if (lb, unit) in expect
        }
        assert actual == approx({lb: v for (lb, u), v in expect.items() if u == unit})
    seconds = data["seconds"]
    assert seconds == sorted(seconds, reverse=True)
    for label, color in zip(data["label"], data["color"]):
        assert color == fine_metrics_color(label)


def assert_spill(fm: Breakdown, store: Mapping) -> None:
    for unit in ("seconds", "bytes"):
        data = fm.sources[f"fine_metrics_spill_{unit}"]
        assert_stacked(data, "activity")
        expect = {}
        for activity, labels in FINE_METRICS_SPILL_LABELS.items():
            totals = activity_expected(store, activity)
            for label in labels:
                if (label, unit) in totals:
                    expect[activity, label] = totals[label, unit]
        assert segments(data, "activity") == approx(expect)
        for activity, label, count in zip(
            data["activity"], data["label"], data["count"]
        ):
            assert count == activity_expected(store, activity).get((label, "count"), 0)


def assert_breakdown(
    fm: FineMetricsBreakdown | Breakdown,
    store: Mapping,
    prefixes: set[str] | None = None,
) -> None:
    """All the sources hold what the store says"""
    if isinstance(fm, FineMetricsBreakdown):
        fm = Breakdown.of(fm)
    assert_execute(fm, store, prefixes)
    assert_activities(fm.sources["fine_metrics_activities"], store)
    assert_labels(fm.sources["fine_metrics_gather_dep"], store, "gather-dep")
    assert_labels(fm.sources["fine_metrics_get_data"], store, "get-data")
    assert_spill(fm, store)


def all_sources(fm: FineMetricsBreakdown) -> list[Any]:
    return [
        *fm.execute_sources.values(),
        fm.activities_source,
        fm.gather_dep_source,
        fm.get_data_source,
        *fm.spill_sources.values(),
    ]


# --- Workloads ----------------------------------------------------------------------


def make_big(i: int = 0) -> bytes:
    return b"0" * 2_000_000


def posting(x: Any) -> int:
    """A task posting metrics of its own: a new unit, a tuple and an int label"""
    context_meter.digest_metric("rows", 10, "rows")
    context_meter.digest_metric(("ping", "x"), 2, "count")
    context_meter.digest_metric(7, 3, "count")
    with context_meter.meter("download"):
        pass
    return len(x)


def fail(x: Any) -> None:
    raise ValueError("boom")


async def settle(*workers: Any) -> None:
    """get_data posts its metrics after the peer acknowledged receipt"""
    await async_poll_for(
        lambda: not any(w.transfer_outgoing_count for w in workers), timeout=5
    )


async def flush(c: Any, *workers: Any) -> None:
    """Everything the workers did is in the scheduler's store"""
    await settle(*workers)
    await c.get_fine_metrics(flush=True)


async def spilling_workload(c: Any, a: Any, b: Any, n: int = 1) -> None:
    """Compute with several prefixes, spill, unspill, transfer a spilled key,
    post custom metrics, fail a task; the keys end with ``-n``
    """
    x = c.submit(make_big, key=f"big-{n}", workers=[a.address])
    y = c.submit(len, x, key=f"local-{n}", workers=[a.address])
    z = c.submit(posting, x, key=f"remote-{n}", workers=[b.address])
    assert await y == await z == 2_000_000
    f = c.submit(fail, 1, key=f"fail-{n}", workers=[b.address])
    with pytest.raises(ValueError, match="boom"):
        await f
    await flush(c, a, b)


# --- The component ------------------------------------------------------------------


@gen_cluster(client=True, nthreads=[("", 1), ("", 1)], **SPILL)
async def test_breakdown_of_a_workload(c, s, a, b):
    await spilling_workload(c, a, b)
    store = s.cumulative_worker_metrics
    fm = FineMetricsBreakdown(s)
    fm.update()
    assert_breakdown(fm, store)

    # What the workload did is all there
    seconds = segments(fm.execute_sources["seconds"].data, "prefix")
    assert {"big", "local", "remote", "fail"} == {p for p, _ in seconds}
    assert ("fail", "failed") in seconds
    assert ("big", "disk-write") in seconds
    assert ("local", "disk-read") in seconds
    assert ("remote", "download") in seconds
    counts = segments(fm.execute_sources["count"].data, "prefix")
    assert counts["remote", "ping/x"] == 2
    assert counts["remote", "7"] == 3
    assert list(fm.execute_sources) == ["seconds", "bytes", "count", "rows"]
    assert segments(fm.execute_sources["rows"].data, "prefix") == {
        ("remote", "rows"): 10
    }
    assert [p.title for p in fm.execute_tabs.tabs] == list(fm.execute_sources)
    spill_bytes = segments(fm.spill_sources["bytes"].data, "activity")
    assert spill_bytes["execute", "disk-write"] > 0
    assert spill_bytes["execute", "disk-read"] > 0
    assert spill_bytes["gather-dep", "disk-write"] > 0
    assert spill_bytes["get-data", "disk-read"] > 0
    assert "network" in fm.gather_dep_source.data["label"]
    assert "network" in fm.get_data_source.data["label"]
    assert fm.prefix_filter is not None
    assert fm.prefix_filter.options == ["big", "fail", "local", "remote"]


@gen_cluster(client=True, nthreads=[("", 1), ("", 1)], **SPILL)
async def test_colors_are_the_same_everywhere(c, s, a, b):
    await spilling_workload(c, a, b)
    fm = FineMetricsBreakdown(s)
    fm.update()
    colors: dict[str, set[str]] = defaultdict(set)
    for source in all_sources(fm):
        if "label" in source.data:
            for label, color in zip(source.data["label"], source.data["color"]):
                colors[label].add(color)
    assert {"disk-write", "disk-read", "network", "failed"} <= set(colors)
    assert all(len(c) == 1 for c in colors.values())
    for label in FINE_METRICS_COLORS:
        if label in colors:
            assert colors[label] == {FINE_METRICS_COLORS[label]}
    # The tasks' own labels: from a stable hash, not Python's salted one
    assert fine_metrics_color("download") == fine_metrics_color("download")
    assert colors["download"] == {fine_metrics_color("download")}

    # ...and stay after more work
    await spilling_workload(c, a, b, n=2)
    fm.update()
    for source in all_sources(fm):
        if "label" in source.data:
            for label, color in zip(source.data["label"], source.data["color"]):
                assert colors[label] == {color}


@gen_cluster(nthreads=[])
async def test_empty_cluster(s):
    fm = FineMetricsBreakdown(s)
    fm.update()
    assert list(fm.execute_sources) == ["seconds", "bytes", "count"]
    for source in fm.execute_sources.values():
        assert all(column == [] for column in source.data.values())
    for source in [
        fm.gather_dep_source,
        fm.get_data_source,
        *fm.spill_sources.values(),
    ]:
        assert all(column == [] for column in source.data.values())
    assert fm.activities_source.data["activity"] == ACTIVITIES
    assert fm.activities_source.data["seconds"] == [0, 0, 0, 0]
    assert fm.activities_source.data["share"] == [0, 0, 0, 0]
    assert_breakdown(fm, s.cumulative_worker_metrics)


@gen_cluster(client=True)
async def test_prefix_appears(c, s, a, b):
    fm = FineMetricsBreakdown(s)
    fm.update()
    await c.submit(inc, 1, key="alpha-1")
    await flush(c, a, b)
    fm.update()
    assert bars(fm.execute_sources["seconds"].data, "prefix") == ["alpha"]
    await c.submit(inc, 2, key="beta-1")
    await flush(c, a, b)
    fm.update()
    assert set(bars(fm.execute_sources["seconds"].data, "prefix")) == {"alpha", "beta"}
    assert_breakdown(fm, s.cumulative_worker_metrics)


@gen_cluster(client=True)
async def test_prefix_filter(c, s, a, b):
    for name in ("alpha", "beta", "gamma"):
        await c.submit(inc, 1, key=f"{name}-1")
    await flush(c, a, b)
    fm = FineMetricsBreakdown(s)
    fm.update()
    assert fm.prefix_filter is not None
    assert fm.prefix_filter.name == "fine_metrics_prefix_filter"
    assert fm.prefix_filter.options == ["alpha", "beta", "gamma"]
    store = s.cumulative_worker_metrics

    # As if a user chose them in the browser: the callback runs
    fm.prefix_filter.value = ["beta", "gamma"]
    assert set(bars(fm.execute_sources["seconds"].data, "prefix")) == {"beta", "gamma"}
    assert_breakdown(fm, store, prefixes={"beta", "gamma"})
    # The other plots are the whole cluster's
    assert_activities(fm.activities_source.data, store)

    # The prefix goes, and comes back
    fm.prefix_filter.value = ["gamma"]
    assert bars(fm.execute_sources["seconds"].data, "prefix") == ["gamma"]
    fm.prefix_filter.value = []
    assert set(bars(fm.execute_sources["seconds"].data, "prefix")) == {
        "alpha",
        "beta",
        "gamma",
    }
    assert_breakdown(fm, store)

    # New work under a filter
    fm.prefix_filter.value = ["alpha"]
    await c.submit(inc, 2, key="alpha-2")
    await c.submit(inc, 2, key="delta-2")
    await flush(c, a, b)
    fm.update()
    assert fm.prefix_filter.options == ["alpha", "beta", "delta", "gamma"]
    assert_breakdown(fm, store, prefixes={"alpha"})


@gen_cluster(client=True)
async def test_new_unit(c, s, a, b):
    def custom(x):
        context_meter.digest_metric("rows", 5, "rows")
        return x

    await c.submit(inc, 1, key="inc-1")
    await flush(c, a, b)
    fm = FineMetricsBreakdown(s)
    fm.update()
    assert list(fm.execute_sources) == ["seconds", "bytes", "count"]
    fm.execute_tabs.active = 1
    panels = list(fm.execute_tabs.tabs)

    await c.submit(custom, 1, key="custom-1")
    await flush(c, a, b)
    fm.update()
    # A tab for the new unit, after the others, which are unchanged
    assert list(fm.execute_sources) == ["seconds", "bytes", "count", "rows"]
    assert list(fm.execute_tabs.tabs[:3]) == panels
    assert fm.execute_tabs.tabs[3].title == "rows"
    assert fm.execute_tabs.tabs[3].name == "fine_metrics_execute_rows_tab"
    assert fm.execute_tabs.active == 1
    assert segments(fm.execute_sources["rows"].data, "prefix") == {
        ("custom", "rows"): 5
    }
    assert fm.execute_sources["rows"].data["text"] == ["5 rows"]
    assert_breakdown(fm, s.cumulative_worker_metrics)


@pytest.mark.slow
@gen_cluster(client=True, nthreads=[("", 2)])
async def test_a_hundred_prefixes(c, s, a):
    futures = [c.submit(inc, i, key=f"prefix{i:03d}-1") for i in range(100)]
    await c.gather(futures)
    await flush(c, a)
    fm = FineMetricsBreakdown(s, max_prefixes=20)
    fm.update()
    store = s.cumulative_worker_metrics
    shown = bars(fm.execute_sources["seconds"].data, "prefix")
    assert len(shown) == 21
    assert shown[-1] == FINE_METRICS_OTHER_PREFIXES
    assert_breakdown(fm, store)

    # The rest, added up, holds everything not shown
    seconds = segments(fm.execute_sources["seconds"].data, "prefix")
    total = sum(v for k, v in store.items() if k[0] == "execute" and k[3] == "seconds")
    assert sum(seconds.values()) == pytest.approx(total)

    # A prefix that was in "(other)" grows into the largest
    small = sorted(set(store_prefixes(store)) - set(shown))[0]
    await c.submit(slow_task, key=f"{small}-2")
    await flush(c, a)
    fm.update()
    assert bars(fm.execute_sources["seconds"].data, "prefix")[0] == small
    assert_breakdown(fm, store)

    # The filter picks prefixes that the limit hides; beyond it, (other) again
    hidden = sorted(set(store_prefixes(store)) - set(shown))[:25]
    assert fm.prefix_filter is not None
    fm.prefix_filter.value = hidden
    shown = bars(fm.execute_sources["seconds"].data, "prefix")
    assert len(shown) == 21
    assert set(shown[:-1]) < set(hidden)
    assert_breakdown(fm, store, prefixes=set(hidden))

    # Exactly max_prefixes + 1: all shown, rather than one in "(other)"
    fm.prefix_filter.value = hidden[:21]
    assert set(bars(fm.execute_sources["seconds"].data, "prefix")) == set(hidden[:21])


def slow_task() -> None:
    import time

    time.sleep(0.2)


def store_prefixes(store: Mapping) -> list[str]:
    return sorted({k[1] for k in store if k[0] == "execute"})


def test_labels_that_are_not_str():
    """A label is any hashable; it is shown as text, and labels with the same text
    are added up
    """
    metrics = {
        ("execute", "p", ("ping", "x"), "count"): 2,
        ("execute", "p", "ping/x", "count"): 3,
        ("execute", "p", 7, "count"): 1,
        ("execute", "p", ("a", 1, 2.5), "count"): 4,
        ("execute", "p", "thread-cpu", "seconds"): 0.5,
        ("gather-dep", ("net", "work"), "seconds"): 0.25,
    }
    fm = FineMetricsBreakdown(None, metrics)
    fm.update()
    assert segments(fm.execute_sources["count"].data, "prefix") == {
        ("p", "ping/x"): 5,
        ("p", "a/1/2.5"): 4,
        ("p", "7"): 1,
    }
    assert fm.gather_dep_source.data["label"] == ["net/work"]
    assert_breakdown(fm, metrics)


def test_prefix_with_only_bytes():
    metrics = {
        ("execute", "download", "fetch", "bytes"): 2**20,
        ("execute", "compute", "thread-cpu", "seconds"): 1.5,
        ("execute", "compute", "zero", "seconds"): 0,
        ("memory-monitor", "disk-write", "bytes"): 100,
        ("memory-monitor", "disk-write", "count"): 1,
        ("memory-monitor", "disk-write", "seconds"): 0.125,
        "not-a-fine-metric": 1.0,
        ("execute", "too", "short"): 1.0,
    }
    fm = FineMetricsBreakdown(None, metrics)
    fm.update()
    assert bars(fm.execute_sources["seconds"].data, "prefix") == ["compute"]
    assert segments(fm.execute_sources["bytes"].data, "prefix") == {
        ("download", "fetch"): 2**20
    }
    assert fm.execute_sources["bytes"].data["text"] == ["1.00 MiB"]
    assert fm.prefix_filter is not None
    assert fm.prefix_filter.options == ["compute", "download"]
    assert segments(fm.spill_sources["bytes"].data, "activity") == {
        ("memory-monitor", "disk-write"): 100
    }
    assert fm.spill_sources["bytes"].data["count"] == [1]
    assert fm.activities_source.data["seconds"] == [1.5, 0, 0, 0.125]
    valid = {k: v for k, v in metrics.items() if isinstance(k, tuple) and len(k) != 3}
    valid[("memory-monitor", "disk-write", "bytes")] = 100
    valid[("memory-monitor", "disk-write", "count")] = 1
    valid[("memory-monitor", "disk-write", "seconds")] = 0.125
    assert_breakdown(fm, valid)

    # A mapping that changes is read again
    metrics["execute", "download", "fetch", "seconds"] = 0.75
    fm.update()
    assert bars(fm.execute_sources["seconds"].data, "prefix") == [
        "compute",
        "download",
    ]


def test_needs_a_scheduler_or_metrics():
    with pytest.raises(ValueError):
        FineMetricsBreakdown(None)


@gen_cluster(client=True)
async def test_no_work_when_nothing_changed(c, s, a, b):
    await c.submit(inc, 1, key="inc-1")
    await flush(c, a, b)
    fm = FineMetricsBreakdown(s)
    reads = []
    read = fm._read
    fm._read = lambda: reads.append(1) or read()  # type: ignore[method-assign]
    fm.update()
    assert len(reads) == 1
    data = [source.data for source in all_sources(fm)]
    factors = list(fm.execute_plots["seconds"].y_range.factors)
    version = s.cumulative_worker_metrics_version

    # Heartbeats go on, with nothing new to deliver
    for w in (a, b):
        await w.heartbeat()
    await c.get_fine_metrics(flush=True)
    assert s.cumulative_worker_metrics_version == version
    for _ in range(3):
        fm.update()
    assert len(reads) == 1
    assert [source.data for source in all_sources(fm)] == data
    assert all(
        source.data is d for source, d in zip(all_sources(fm), data)
    ), "a source's data was replaced"

    # Something changes: the store's version moves, and the plots follow
    await c.submit(inc, 2, key="dec-1")
    await flush(c, a, b)
    assert s.cumulative_worker_metrics_version > version
    fm.update()
    assert len(reads) == 2
    assert fm.execute_sources["seconds"].data is not data[0]
    assert list(fm.execute_plots["seconds"].y_range.factors) != factors
    assert_breakdown(fm, s.cumulative_worker_metrics)


@gen_cluster(client=True)
async def test_version_counts_every_change(c, s, a, b):
    assert s.cumulative_worker_metrics_version == 0
    await c.submit(inc, 1, key="inc-1")
    await flush(c, a, b)
    version = s.cumulative_worker_metrics_version
    assert version > 0
    s._add_fine_metric(("execute", "inc", "thread-cpu", "seconds"), 1.0)
    assert s.cumulative_worker_metrics_version == version + 1


# --- The page -----------------------------------------------------------------------


async def fetch(s: Any, path: str) -> str:
    response = await AsyncHTTPClient().fetch(
        f"http://127.0.0.1:{s.http_server.port}{path}"
    )
    assert response.code == 200
    return response.body.decode()


@gen_cluster(
    client=True, scheduler_kwargs={"dashboard": True, "dashboard_address": ":0"}
)
async def test_page(c, s, a, b):
    await c.submit(inc, 1, key="inc-1")
    await flush(c, a, b)
    body = await fetch(s, "/individual-fine-performance-metrics")
    [title] = re.findall(r"<title>(.*)</title>", body)
    assert title == "Dask: FineMetricsBreakdown"
    assert "bokeh" in body.lower()
    assert not re.search("href=./", body)  # no absolute links

    # The page's document, on the server, holds the component
    bokeh_app = s.http_application.applications[0]
    context = bokeh_app._applications["/individual-fine-performance-metrics"]
    [session] = context.sessions
    doc = session.document
    [root] = doc.roots
    assert root.name == "fine_metrics"
    source = doc.get_model_by_name("fine_metrics_execute_seconds")
    assert "inc" in source.data["prefix"]
    for name in (
        "fine_metrics_activities",
        "fine_metrics_gather_dep",
        "fine_metrics_get_data",
        "fine_metrics_spill_seconds",
        "fine_metrics_spill_bytes",
        "fine_metrics_execute_bytes",
        "fine_metrics_execute_count",
        "fine_metrics_prefix_filter",
        "fine_metrics_execute_tabs",
    ):
        assert doc.get_model_by_name(name) is not None, name
        if name.startswith("fine_metrics_") and "_tabs" not in name:
            if "filter" not in name:
                assert doc.get_model_by_name(name + "_plot") is not None, name
    [component] = [
        comp
        for comp in getattr(doc, "components", ())
        if isinstance(comp, FineMetricsBreakdown)
    ]
    assert_breakdown(component, s.cumulative_worker_metrics)


@gen_cluster(
    client=True, scheduler_kwargs={"dashboard": True, "dashboard_address": ":0"}
)
async def test_more_menu_lists_the_page(c, s, a, b):
    body = await fetch(s, "/status")
    [menu] = re.findall(
        r'<div class="dropdown-content">(.*?)</div>', body, flags=re.DOTALL
    )
    assert (
        '<a href="individual-fine-performance-metrics">Fine Performance Metrics</a>'
        in menu
    )
    plots = json.loads(await fetch(s, "/individual-plots.json"))
    assert (
        plots["Individual Fine Performance Metrics"]
        == "/individual-fine-performance-metrics"
    )


# --- performance_report -------------------------------------------------------------


def report_breakdown(html: str) -> Breakdown:
    """The fine metrics of a report, from the JSON of the bokeh document that the
    HTML file embeds: the data of its named ColumnDataSources, and the factors of
    the y ranges of the execute plots
    """
    [doc_json] = re.findall(
        r'<script type="application/json" id="[^"]*">\s*(.*?)\s*</script>',
        html,
        flags=re.DOTALL,
    )
    [doc] = json.loads(doc_json).values()
    models = {m["id"]: m for m in doc["roots"]["references"]}
    sources = {}
    factors = {}
    for model in models.values():
        attrs = model["attributes"]
        name = attrs.get("name") or ""
        if model["type"] == "ColumnDataSource" and name:
            assert name not in sources
            sources[name] = attrs["data"]
        match = re.fullmatch("fine_metrics_execute_(.*)_plot", name)
        if match:
            y_range = models[attrs["y_range"]["id"]]["attributes"]
            factors[match.group(1)] = y_range.get("factors", [])
    assert set(factors) == {
        n[len("fine_metrics_execute_") :]
        for n in sources
        if n.startswith("fine_metrics_execute_")
    }
    return Breakdown(sources, factors)


async def report_on_workload(c: Any, a: Any, b: Any, path: Any) -> None:
    """A function of its own, so that the report's calling code is this one"""
    async with performance_report(filename=str(path), mode="inline"):
        await spilling_workload(c, a, b, n=2)


@pytest.mark.slow
@gen_cluster(client=True, nthreads=[("", 1), ("", 1)], **SPILL)
async def test_performance_report_tab(c, s, a, b, tmp_path):
    # Work before the block is not in the report: a prefix of its own, and the
    # same prefixes as in the block
    await c.submit(inc, 1, key="early-1")
    await spilling_workload(c, a, b, n=1)
    before = dict(s.cumulative_worker_metrics)

    fn = tmp_path / "report.html"
    await report_on_workload(c, a, b, fn)
    after = dict(s.cumulative_worker_metrics)
    delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}

    html = fn.read_text()
    assert "Fine metrics" in html
    assert "cdn.bokeh.org" not in html
    report = report_breakdown(html)
    sources = report.sources
    seconds = sources["fine_metrics_execute_seconds"]
    assert set(seconds["prefix"]) == {"big", "local", "remote", "fail"}
    assert ("execute", "early", "thread-cpu", "seconds") in before
    assert "early" not in json.dumps(sources)
    # The delta, not the totals: everything ran twice, the report has it once
    cpu = ("execute", "big", "thread-cpu", "seconds")
    [value] = [
        v
        for p, lb, v in zip(seconds["prefix"], seconds["label"], seconds["value"])
        if (p, lb) == ("big", "thread-cpu")
    ]
    assert value == pytest.approx(delta[cpu])
    assert value < after[cpu]
    assert "failed" in seconds["label"]
    assert sources["fine_metrics_execute_rows"]["value"] == [10]
    assert_breakdown(report, delta)


@gen_cluster(client=True)
async def test_performance_report_old_signature(c, s, a, b):
    """A caller that does not pass fine_metrics gets a report without the tab"""
    await c.submit(inc, 1)
    html = await s.performance_report(start=0, last_count=0, code="", mode="inline")
    assert "Dask Performance Report" in html
    assert "Fine metrics" not in html
    html = await s.performance_report(start=0, last_count=0, fine_metrics=[])
    assert "Fine metrics" in html
    report = report_breakdown(html)
    assert report.sources["fine_metrics_execute_seconds"]["prefix"] == []
    assert_breakdown(report, {})


def test_performance_report_sync(client, tmp_path):
    fn = tmp_path / "report.html"
    client.submit(inc, 1, key="before-1").result()
    with performance_report(filename=str(fn), mode="inline"):
        assert client.submit(inc, 1, key="inside-1").result() == 2
    report = report_breakdown(fn.read_text())
    assert set(report.sources["fine_metrics_execute_seconds"]["prefix"]) == {"inside"}
