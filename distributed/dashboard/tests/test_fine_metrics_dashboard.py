"""The fine performance metrics on the scheduler's dashboard
(``/individual-fine-performance-metrics``, ``FineMetricsBreakdown``) and in the
"Fine metrics" tab of ``performance_report``.

The data sources are checked against the scheduler's store,
``Scheduler.cumulative_worker_metrics``, with expectations computed here from the
store itself by the documented rules (docs/fine_metrics.rst), not with the
component's own helpers.
"""
from __future__ import annotations

import asyncio
import html
import json
import math
import os
import re
import subprocess
import sys
from collections import defaultdict
from collections.abc import Hashable, Mapping
from types import MappingProxyType, SimpleNamespace
from typing import Any

import pytest

from distributed.tests.utils_ci import import_or_skip

import_or_skip("bokeh")
from bokeh.core.validation import check_integrity
from bokeh.models import DatetimeTickFormatter, HoverTool, NoOverlap
from tornado.httpclient import AsyncHTTPClient

from distributed import Event, Worker, performance_report, wait
from distributed.core import Status
from distributed.dashboard.components.scheduler import (
    FINE_METRICS_ACTIVITY_COLORS,
    FINE_METRICS_COLORS,
    FINE_METRICS_OTHER_PREFIXES,
    FINE_METRICS_PALETTE,
    FINE_METRICS_SPILL_LABELS,
    FINE_METRICS_THREAD_COLORS,
    FineMetricsBreakdown,
    ThreadsOverTimePlugin,
    fine_metrics_color,
)
from distributed.metrics import context_meter, time
from distributed.scheduler import Scheduler
from distributed.utils import open_port
from distributed.utils_test import async_poll_for, captured_logger, gen_cluster, inc

ACTIVITIES = [
    "execute",
    "gather-dep",
    "get-data",
    "memory-monitor",
    "gather",
    "update-data",
]
UNITS = ["seconds", "bytes", "count"]
#: The states of the workers' threads (docs/fine_metrics.rst), in their order
THREAD_STATES = [
    "busy",
    "idle-paused",
    "idle-constrained",
    "idle-fetching-inputs",
    "idle-no-tasks",
]

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


def drawable(value: Any) -> bool:
    """The values that the plots show: finite floats (ints included) above zero"""
    if not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:  # an int too large for a float
        return False


def execute_expected(store: Mapping, unit: str) -> dict[tuple[str, str], float]:
    """{(prefix, label): value} of execute in one unit, the values not drawn left
    out
    """
    out: dict[tuple[str, str], float] = defaultdict(int)
    for key, value in store.items():
        if key[0] == "execute" and key[3] == unit and drawable(value):
            out[key[1], text(key[2])] += value
    return dict(out)


def activity_expected(store: Mapping, activity: str) -> dict[tuple[str, str], float]:
    """{(label, unit): value} of an activity, added up over the task prefixes"""
    out: dict[tuple[str, str], float] = defaultdict(int)
    for key, value in store.items():
        if key[0] == activity and drawable(value):
            out[text(key[-2]), key[-1]] += value
    return dict(out)


def threads_expected(store: Mapping) -> dict[str, float]:
    """{state: seconds} of the workers' threads, every state of THREAD_STATES
    included (0 if the store has none), then any other label
    """
    out: dict[str, float] = dict.fromkeys(THREAD_STATES, 0)
    for key, value in store.items():
        if key[0] == "threads" and key[-1] == "seconds" and drawable(value):
            out[text(key[1])] = out.get(text(key[1]), 0) + value
    return out


def efficiency_title(store: Mapping) -> str:
    """The title of the bars of the threads: the share of busy threads' seconds"""
    seconds = threads_expected(store)
    total = sum(seconds.values())
    if not total:
        return "The workers' threads, by state"
    return (
        f"The workers' threads: busy {100 * seconds['busy'] / total:.1f}% of the time"
    )


def other_bar(store: Mapping) -> str:
    """The name of the "(other)" bar: the first of (other), (other 2), ... that no
    task prefix has
    """
    prefixes = {k[1] for k, v in store.items() if k[0] == "execute" and drawable(v)}
    name, n = FINE_METRICS_OTHER_PREFIXES, 1
    while name in prefixes:
        n += 1
        name = f"(other {n})"
    return name


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
        assert value > 0
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
    """What the checks read: the data of the sources by name, the factors of the
    execute plots by unit and the note on the units left out, from a component or
    from a report's document
    """

    def __init__(
        self,
        sources: Mapping[str, Mapping[str, list]],
        factors: Mapping[str, list[str]],
        note: str,
        max_prefixes: int = 20,
        max_units: int = 8,
        threads_title: str | None = None,
    ):
        self.sources = sources
        self.factors = factors
        self.note = note
        #: The title of the bars of the threads' states, if read
        self.threads_title = threads_title
        self.max_prefixes = max_prefixes
        self.max_units = max_units

    @classmethod
    def of(cls, fm: FineMetricsBreakdown) -> Breakdown:
        for unit, fig in fm.execute_plots.items():
            assert fig.name == f"fine_metrics_execute_{unit}_plot"
            assert fm.execute_sources[unit].name == f"fine_metrics_execute_{unit}"
        assert fm.units_note.name == "fine_metrics_execute_note"
        assert fm.units_note.visible == bool(fm.units_note.text)
        return cls(
            {source.name: source.data for source in all_sources(fm)},
            {u: list(fig.y_range.factors) for u, fig in fm.execute_plots.items()},
            fm.units_note.text,
            fm.max_prefixes,
            fm.max_units,
            fm.threads_plot.title.text,
        )

    def execute(self) -> dict[str, Mapping[str, list]]:
        prefix = "fine_metrics_execute_"
        return {
            name[len(prefix) :]: data
            for name, data in self.sources.items()
            if name.startswith(prefix)
        }


def assert_units(fm: Breakdown, store: Mapping) -> None:
    """A tab for seconds, bytes and count, and for the units that tasks post, at
    most max_units of them; the others named in the note
    """
    units = {k[3] for k, v in store.items() if k[0] == "execute" and drawable(v)}
    tabs = set(fm.execute())
    assert set(UNITS) <= tabs
    assert len(tabs - set(UNITS)) <= fm.max_units
    left_out = units - tabs
    if left_out:
        assert len(tabs - set(UNITS)) == fm.max_units
        assert fm.note.startswith(f"Not shown: {len(left_out)} more unit")
    else:
        assert fm.note == ""


def assert_execute(
    fm: Breakdown, store: Mapping, prefixes: set[str] | None = None
) -> None:
    """Every unit of execute holds the store's values, prefixes largest first, in
    at most max_prefixes bars: with more prefixes, the max_prefixes - 1 largest and
    "(other)", the rest added up
    """
    assert_units(fm, store)
    other = other_bar(store)
    for unit, data in fm.execute().items():
        assert_stacked(data, "prefix")
        expect = execute_expected(store, unit)
        if prefixes:
            expect = {k: v for k, v in expect.items() if k[0] in prefixes}
        totals: dict[str, float] = defaultdict(int)
        for (prefix, _), value in expect.items():
            totals[prefix] += value
        order = sorted(totals, key=lambda p: (-totals[p], p))
        shown = bars(data, "prefix")
        assert len(shown) <= fm.max_prefixes
        if len(order) > fm.max_prefixes:
            assert shown == order[: fm.max_prefixes - 1] + [other]
            rest: dict[tuple[str, str], float] = defaultdict(int)
            for (prefix, label), value in expect.items():
                if prefix not in shown:
                    rest[other, label] += value
            expect = {k: v for k, v in expect.items() if k[0] in shown}
            expect.update(rest)
        else:
            assert shown == order
        assert segments(data, "prefix") == approx(expect)
        # The largest on top: categorical factors go from the bottom up
        assert fm.factors[unit] == shown[::-1]
        assert len(set(fm.factors[unit])) == len(fm.factors[unit])


def assert_activities(data: Mapping[str, list], store: Mapping) -> None:
    assert data["activity"] == ACTIVITIES
    expect = {
        a: sum(v for (_, u), v in activity_expected(store, a).items() if u == "seconds")
        for a in ACTIVITIES
    }
    assert dict(zip(data["activity"], data["seconds"])) == approx(expect)
    assert data["color"] == [FINE_METRICS_ACTIVITY_COLORS[a] for a in ACTIVITIES]
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


def assert_threads(fm: Breakdown, store: Mapping) -> None:
    """The bars of the threads' states hold the store's threads' seconds, the five
    states always and first, with their shares; the title says the busy share
    """
    data = fm.sources["fine_metrics_threads"]
    expect = threads_expected(store)
    assert data["state"][:5] == THREAD_STATES
    assert dict(zip(data["state"], data["seconds"])) == approx(expect)
    total = sum(expect.values())
    for state, share in zip(data["state"], data["share"]):
        assert share == pytest.approx(100 * expect[state] / total if total else 0)
    assert data["color"][:5] == [FINE_METRICS_THREAD_COLORS[s] for s in THREAD_STATES]
    if fm.threads_title is not None:
        assert fm.threads_title == efficiency_title(store)


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
        assert_valid(fm)
        fm = Breakdown.of(fm)
    assert_execute(fm, store, prefixes)
    assert_activities(fm.sources["fine_metrics_activities"], store)
    assert_labels(fm.sources["fine_metrics_gather_dep"], store, "gather-dep")
    assert_labels(fm.sources["fine_metrics_get_data"], store, "get-data")
    assert_spill(fm, store)
    assert_threads(fm, store)


def assert_valid(fm: FineMetricsBreakdown) -> None:
    """Bokeh's own checks of the document pass (e.g. no duplicate factors)"""
    issues = check_integrity(list(fm.root.references()))
    assert not issues.error, issues.error


def all_sources(fm: FineMetricsBreakdown) -> list[Any]:
    over_time = fm.threads_over_time_source
    return [
        *([] if over_time is None else [over_time]),
        fm.threads_source,
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


async def spilling_workload(
    c: Any, a: Any, b: Any, n: int = 1, deliver: bool = True
) -> None:
    """Compute with several prefixes, spill, unspill, transfer a spilled key,
    post custom metrics, fail a task; the keys end with ``-n``. Then, if
    ``deliver``, have the workers deliver their metrics to the scheduler.
    """
    x = c.submit(make_big, key=f"big-{n}", workers=[a.address])
    y = c.submit(len, x, key=f"local-{n}", workers=[a.address])
    z = c.submit(posting, x, key=f"remote-{n}", workers=[b.address])
    assert await y == await z == 2_000_000
    f = c.submit(fail, 1, key=f"fail-{n}", workers=[b.address])
    with pytest.raises(ValueError, match="boom"):
        await f
    if deliver:
        await flush(c, a, b)
    else:
        await settle(a, b)


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
    assert prefix_choices(fm) == ["big", "fail", "local", "remote"]


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
    # The tasks' own labels: from the palette (see also
    # test_colors_are_the_same_in_every_process)
    assert colors["download"] <= set(FINE_METRICS_PALETTE)

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
    assert fm.activities_source.data["seconds"] == [0] * len(ACTIVITIES)
    assert fm.activities_source.data["share"] == [0] * len(ACTIVITIES)
    assert fm.threads_source.data["state"] == THREAD_STATES
    assert fm.threads_source.data["seconds"] == [0] * 5
    assert fm.threads_plot.title.text == "The workers' threads, by state"
    assert points(fm) == []
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


def prefix_choices(fm: FineMetricsBreakdown) -> list[str]:
    """The prefixes that the filter offers, checking that each is labelled by
    itself, as HTML-escaped text (Choices.js parses labels as HTML)
    """
    assert fm.prefix_filter is not None
    data = fm.prefix_options_source.data
    options = list(zip(data["value"], data["label"]))
    assert all(label == html.escape(value) for value, label in options), options
    return [value for value, _ in options]


def post_as(label: str, unit: str) -> int:
    context_meter.digest_metric(label, 1.0, unit)
    return 1


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_names_from_tasks_are_text(c, s, a):
    """Prefixes and units come from task code: the widgets that bokeh renders as
    HTML get them as text (see test_names_from_tasks_are_shown_as_text in a real
    browser)
    """
    await c.submit(post_as, "x", "<b>unit</b>", key="x<b>y</b>-1")
    await flush(c, a)
    fm = FineMetricsBreakdown(s, max_units=0)
    fm.update()
    assert fm.prefix_filter is not None
    assert fm.prefix_filter.options == [("x<b>y</b>", "x&lt;b&gt;y&lt;/b&gt;")]
    assert fm.prefix_options_source.data == {
        "value": ["x<b>y</b>"],
        "label": ["x&lt;b&gt;y&lt;/b&gt;"],
    }
    assert "(<b>unit</b>)" in fm.units_note.text
    assert fm.units_note.render_as_text


@gen_cluster(client=True)
async def test_prefix_filter(c, s, a, b):
    for name in ("alpha", "beta", "gamma"):
        await c.submit(inc, 1, key=f"{name}-1")
    await flush(c, a, b)
    fm = FineMetricsBreakdown(s)
    fm.update()
    assert fm.prefix_filter is not None
    assert fm.prefix_filter.name == "fine_metrics_prefix_filter"
    assert prefix_choices(fm) == ["alpha", "beta", "gamma"]
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
    assert prefix_choices(fm) == ["alpha", "beta", "delta", "gamma"]
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


def seconds(prefix: str, label: str = "thread-cpu") -> tuple[str, str, str, str]:
    return ("execute", prefix, label, "seconds")


def execute_bars(fm: FineMetricsBreakdown, unit: str = "seconds") -> list[str]:
    return bars(fm.execute_sources[unit].data, "prefix")


def test_a_hundred_prefixes():
    metrics: dict[tuple, float] = {}
    for i in range(100):
        metrics[seconds(f"prefix{i:03d}")] = 1.0 + i
        metrics[seconds(f"prefix{i:03d}", "deserialize")] = 0.5
        if i % 3 == 0:
            metrics["execute", f"prefix{i:03d}", "memory-read", "bytes"] = 100 - i
    fm = FineMetricsBreakdown(None, metrics, max_prefixes=20)
    fm.update()
    # 20 bars: the 19 largest, then the other 81 added up
    shown = execute_bars(fm)
    assert shown == [f"prefix{i:03d}" for i in range(99, 80, -1)] + ["(other)"]
    data = segments(fm.execute_sources["seconds"].data, "prefix")
    assert data["(other)", "thread-cpu"] == pytest.approx(
        sum(1.0 + i for i in range(81))
    )
    assert data["(other)", "deserialize"] == pytest.approx(81 * 0.5)
    total = sum(v for k, v in metrics.items() if k[3] == "seconds")
    assert sum(data.values()) == pytest.approx(total)
    # 34 prefixes have bytes: the largest are the smallest in seconds
    assert execute_bars(fm, "bytes") == [f"prefix{i:03d}" for i in range(0, 57, 3)] + [
        "(other)"
    ]
    assert_breakdown(fm, metrics)

    # A prefix that was in "(other)" grows into the largest
    metrics[seconds("prefix005")] = 1000.0
    fm.update()
    assert execute_bars(fm)[0] == "prefix005"
    assert_breakdown(fm, metrics)

    # The filter picks prefixes that the limit hides; beyond it, "(other)" again
    hidden = [f"prefix{i:03d}" for i in range(10, 35)]
    assert fm.prefix_filter is not None
    fm.prefix_filter.value = hidden
    assert execute_bars(fm) == hidden[::-1][:19] + ["(other)"]
    assert_breakdown(fm, metrics, prefixes=set(hidden))
    # Exactly max_prefixes: all shown
    fm.prefix_filter.value = hidden[:20]
    assert execute_bars(fm) == hidden[:20][::-1]
    assert_breakdown(fm, metrics, prefixes=set(hidden[:20]))
    # One more: 19 and "(other)", of two
    fm.prefix_filter.value = hidden[:21]
    assert execute_bars(fm) == hidden[2:21][::-1] + ["(other)"]
    data = segments(fm.execute_sources["seconds"].data, "prefix")
    assert data["(other)", "thread-cpu"] == pytest.approx(11.0 + 12.0)
    assert_breakdown(fm, metrics, prefixes=set(hidden[:21]))


@pytest.mark.parametrize("max_prefixes", [1, 2, 3])
def test_max_prefixes_is_the_most_bars(max_prefixes):
    for n in range(6):
        metrics = {seconds(f"p{i}"): 1.0 + i for i in range(n)}
        fm = FineMetricsBreakdown(None, metrics, max_prefixes=max_prefixes)
        fm.update()
        shown = execute_bars(fm)
        if n <= max_prefixes:
            assert shown == [f"p{i}" for i in reversed(range(n))]
        else:
            largest = [f"p{i}" for i in reversed(range(n))][: max_prefixes - 1]
            assert shown == largest + ["(other)"]
        assert_breakdown(fm, metrics)


def test_max_prefixes_and_units_must_be_positive():
    with pytest.raises(ValueError, match="max_prefixes"):
        FineMetricsBreakdown(None, {}, max_prefixes=0)
    with pytest.raises(ValueError, match="max_units"):
        FineMetricsBreakdown(None, {}, max_units=-1)


def test_a_prefix_named_other():
    """The bar of the rest has a name of its own: a factor appears once on an axis"""
    metrics = {seconds(f"p{i}"): 1.0 + i for i in range(5)}
    metrics[seconds("(other)")] = 100.0
    fm = FineMetricsBreakdown(None, metrics, max_prefixes=3)
    fm.update()
    assert execute_bars(fm) == ["(other)", "p4", "(other 2)"]
    assert fm.execute_plots["seconds"].y_range.factors == ["(other 2)", "p4", "(other)"]
    assert_breakdown(fm, metrics)  # bokeh's checks included: no duplicate factors

    metrics[seconds("(other 2)")] = 50.0
    fm.update()
    assert execute_bars(fm) == ["(other)", "(other 2)", "(other 3)"]
    assert_breakdown(fm, metrics)

    # In every unit, the same name
    metrics["execute", "p0", "memory-read", "bytes"] = 1
    metrics["execute", "p1", "memory-read", "bytes"] = 2
    metrics["execute", "p2", "memory-read", "bytes"] = 3
    fm.update()
    assert execute_bars(fm, "bytes") == ["p2", "p1", "p0"]
    metrics["execute", "p3", "memory-read", "bytes"] = 4
    fm.update()
    assert execute_bars(fm, "bytes") == ["p3", "p2", "(other 3)"]
    assert_breakdown(fm, metrics)


def test_units_are_bounded():
    """200 units that tasks post: tabs for max_units of them, the rest in a note"""
    metrics: dict[tuple, float] = {
        ("execute", "p", "label", f"unit{i:03d}"): 1 for i in range(200)
    }
    metrics[seconds("p")] = 1.0
    fm = FineMetricsBreakdown(None, metrics)
    fm.update()
    assert fm.max_units == 8
    assert list(fm.execute_sources) == UNITS + [f"unit{i:03d}" for i in range(8)]
    assert len(fm.execute_tabs.tabs) == 11
    note = fm.units_note.text
    assert note.startswith("Not shown: 192 more units that tasks post (unit008, ")
    assert "unit017, ...)" in note
    assert "unit018" not in note
    assert fm.units_note.visible
    assert_breakdown(fm, metrics)


def test_units_with_the_most_keys_first_and_tabs_stay():
    metrics: dict[tuple, float] = {("execute", "p", "a", "rows"): 1}
    fm = FineMetricsBreakdown(None, metrics, max_units=2)
    fm.update()
    assert list(fm.execute_sources) == UNITS + ["rows"]
    assert not fm.units_note.visible

    # Three units appear at once, one tab left: the most keys win, not the values
    metrics.update({("execute", p, "a", "items"): 1 for p in "pqr"})
    metrics.update({("execute", p, "a", "files"): 1 for p in "pq"})
    metrics["execute", "p", "a", "widgets"] = 1000
    fm.execute_tabs.active = 3
    panels = list(fm.execute_tabs.tabs)
    fm.update()
    assert list(fm.execute_sources) == UNITS + ["rows", "items"]
    assert list(fm.execute_tabs.tabs[:4]) == panels
    assert fm.execute_tabs.active == 3
    assert fm.units_note.text.startswith(
        "Not shown: 2 more units that tasks post (files, widgets)"
    )
    assert fm.units_note.visible
    assert_breakdown(fm, metrics)

    # A unit goes: its tab stays, empty, and takes no other
    del metrics["execute", "p", "a", "rows"]
    fm.update()
    assert list(fm.execute_sources) == UNITS + ["rows", "items"]
    assert fm.execute_sources["rows"].data["prefix"] == []
    assert fm.units_note.text.startswith("Not shown: 2 more units")
    assert_breakdown(fm, metrics)

    # The units left out go: no note
    del metrics["execute", "p", "a", "widgets"]
    for p in "pq":
        del metrics["execute", p, "a", "files"]
    fm.update()
    assert fm.units_note.text == ""
    assert not fm.units_note.visible

    # No tabs for the tasks' units at all
    fm = FineMetricsBreakdown(None, metrics, max_units=0)
    fm.update()
    assert list(fm.execute_sources) == UNITS
    assert fm.units_note.text.startswith("Not shown: 1 more unit that tasks post")
    assert_breakdown(fm, metrics)


def test_values_that_are_not_finite():
    """NaN, the infinities (and what is not a number, or too large for a float)
    are left out; they neither crash the component nor hide the rest
    """
    nan, inf = float("nan"), float("inf")
    metrics: dict[Any, Any] = {
        seconds("p"): 1.5,
        seconds("p", "thread-noncpu"): nan,
        ("execute", "p", "disk-read", "bytes"): inf,
        ("execute", "p", "memory-read", "bytes"): 100,
        seconds("q"): -inf,
        ("execute", "q", "rows", "rows"): nan,
        ("execute", "r", "label", "count"): "7",  # not even a number
        ("execute", "r", "huge", "count"): 10**400,  # too large for a float
        ("gather-dep", "network", "seconds"): inf,
        ("gather-dep", "network", "bytes"): nan,
        ("get-data", "network", "seconds"): 0.25,
        ("memory-monitor", "disk-write", "bytes"): nan,
        ("memory-monitor", "disk-write", "seconds"): inf,
    }
    fm = FineMetricsBreakdown(None, metrics)
    fm.update()
    assert segments(fm.execute_sources["seconds"].data, "prefix") == {
        ("p", "thread-cpu"): 1.5
    }
    assert segments(fm.execute_sources["bytes"].data, "prefix") == {
        ("p", "memory-read"): 100
    }
    assert fm.execute_sources["count"].data["prefix"] == []
    assert list(fm.execute_sources) == UNITS
    assert fm.prefix_filter is not None
    assert prefix_choices(fm) == ["p"]
    assert fm.gather_dep_source.data["label"] == []
    assert fm.activities_source.data["seconds"] == [1.5, 0, 0.25, 0, 0, 0]
    assert fm.activities_source.data["text"][2] == "250.00 ms"
    for source in fm.spill_sources.values():
        assert source.data["activity"] == []
    assert_breakdown(fm, metrics)


def test_sums_that_overflow():
    """Finite values whose sum is not: drawn as they are, formatted as inf"""
    inf = float("inf")
    metrics: dict[tuple, float] = {}
    for unit in ("seconds", "bytes", "count", "rows"):
        # Two labels with the same text, added up
        metrics["execute", "p", ("a", "b"), unit] = 1e308
        metrics["execute", "p", "a/b", unit] = 1e308
    metrics["gather-dep", ("net", "work"), "seconds"] = 1e308
    metrics["gather-dep", "net/work", "seconds"] = 1e308
    fm = FineMetricsBreakdown(None, metrics)
    fm.update()
    for unit, formatted in [
        ("seconds", "inf seconds"),
        ("bytes", "inf bytes"),
        ("count", "inf"),
        ("rows", "inf rows"),
    ]:
        data = fm.execute_sources[unit].data
        assert data["value"] == [inf]
        assert data["text"] == [formatted]
    assert fm.gather_dep_source.data["text"] == ["inf seconds"]
    assert fm.activities_source.data["text"][:2] == ["inf seconds", "inf seconds"]


def test_negative_values():
    """A negative value (digest_metric takes them) is left out: in a stacked bar,
    it would overlap its neighbours
    """
    metrics = {
        seconds("p"): 2.0,
        seconds("p", "mine"): -1.5,
        seconds("p", "disk-read"): 0.5,
        seconds("q", "mine"): -3.0,
        ("execute", "q", "mine", "rows"): -4,
        ("gather-dep", "network", "seconds"): -1.0,
        ("memory-monitor", "disk-write", "bytes"): -10,
        ("memory-monitor", "disk-write", "seconds"): 0.125,
    }
    fm = FineMetricsBreakdown(None, metrics)
    fm.update()
    data = fm.execute_sources["seconds"].data
    assert data["prefix"] == ["p", "p"]
    assert data["label"] == ["thread-cpu", "disk-read"]
    assert data["left"] == [0, 2.0]
    assert data["right"] == [2.0, 2.5]
    assert data["share"] == [80.0, 20.0]
    assert list(fm.execute_sources) == UNITS
    assert fm.prefix_filter is not None
    assert prefix_choices(fm) == ["p"]
    assert fm.gather_dep_source.data["label"] == []
    assert fm.activities_source.data["seconds"] == [2.5, 0, 0, 0.125, 0, 0]
    assert fm.spill_sources["bytes"].data["activity"] == []
    assert segments(fm.spill_sources["seconds"].data, "activity") == {
        ("execute", "disk-read"): 0.5,
        ("memory-monitor", "disk-write"): 0.125,
    }
    assert_breakdown(fm, metrics)


def test_a_change_that_keeps_length_and_sum():
    metrics = {seconds("a"): 1.0, seconds("b"): 2.0}
    fm = FineMetricsBreakdown(None, metrics)
    fm.update()
    assert execute_bars(fm) == ["b", "a"]
    data = [source.data for source in all_sources(fm)]
    fm.update()
    assert all(source.data is d for source, d in zip(all_sources(fm), data))

    # Two values swapped
    metrics[seconds("a")], metrics[seconds("b")] = 2.0, 1.0
    fm.update()
    assert execute_bars(fm) == ["a", "b"]
    assert fm.execute_plots["seconds"].y_range.factors == ["b", "a"]
    assert_breakdown(fm, metrics)

    # A key replaced by another, with the same value
    del metrics[seconds("a")]
    metrics[seconds("c")] = 2.0
    fm.update()
    assert execute_bars(fm) == ["c", "b"]
    assert_breakdown(fm, metrics)

    # A label replaced by another of the same prefix
    del metrics[seconds("c")]
    metrics[seconds("c", "disk-read")] = 2.0
    fm.update()
    assert fm.execute_sources["seconds"].data["label"][0] == "disk-read"
    assert_breakdown(fm, metrics)


def test_a_prefix_goes_away():
    metrics = {
        seconds("alpha"): 1.0,
        seconds("beta"): 2.0,
        ("execute", "beta", "memory-read", "bytes"): 10,
        seconds("gamma"): 3.0,
    }
    fm = FineMetricsBreakdown(None, metrics)
    fm.update()
    assert execute_bars(fm) == ["gamma", "beta", "alpha"]
    assert execute_bars(fm, "bytes") == ["beta"]

    del metrics[seconds("beta")]
    del metrics["execute", "beta", "memory-read", "bytes"]
    fm.update()
    assert execute_bars(fm) == ["gamma", "alpha"]
    assert execute_bars(fm, "bytes") == []
    assert fm.execute_plots["bytes"].y_range.factors == []
    assert fm.prefix_filter is not None
    assert prefix_choices(fm) == ["alpha", "gamma"]
    assert_breakdown(fm, metrics)

    # Under the filter: the prefix chosen goes; it stays an option, so that the
    # choice shows and can be undone
    fm.prefix_filter.value = ["alpha"]
    assert execute_bars(fm) == ["alpha"]
    del metrics[seconds("alpha")]
    fm.update()
    assert execute_bars(fm) == []
    assert fm.execute_plots["seconds"].y_range.factors == []
    assert prefix_choices(fm) == ["alpha", "gamma"]
    assert_breakdown(fm, metrics, prefixes={"alpha"})
    # ...and comes back
    metrics[seconds("alpha")] = 5.0
    fm.update()
    assert execute_bars(fm) == ["alpha"]
    del metrics[seconds("alpha")]
    fm.update()
    # Undone: all prefixes, and the one gone is no option any more
    fm.prefix_filter.value = []
    assert execute_bars(fm) == ["gamma"]
    assert prefix_choices(fm) == ["gamma"]
    assert_breakdown(fm, metrics)


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


def many_labels(n: int) -> int:
    for i in range(n):
        context_meter.digest_metric(f"label-{i:02d}", 0.01, "seconds")
    return n


def test_execute_plot_grows_with_its_legend():
    """bokeh cuts a legend at the bottom of its plot: an execute plot grows taller
    when its labels need it, and shrinks back when they are gone
    """
    metrics: dict[tuple, float] = {
        ("execute", "p", f"label-{i:02d}", "seconds"): 1.0 for i in range(30)
    }
    metrics[("execute", "p", "thread-cpu", "seconds")] = 1.0
    metrics[("execute", "p", "rows", "count")] = 3
    fm = FineMetricsBreakdown(None, metrics)
    fm.update()
    # 31 labels, of 20 pixels each, and the title and axis
    assert fm.execute_plots["seconds"].height >= 31 * 20 + 60
    assert fm.execute_plots["count"].height == fm.EXECUTE_HEIGHT
    assert fm.execute_plots["bytes"].height == fm.EXECUTE_HEIGHT
    for i in range(30):
        del metrics[("execute", "p", f"label-{i:02d}", "seconds")]
    fm.update()
    assert fm.execute_plots["seconds"].height == fm.EXECUTE_HEIGHT


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
    assert prefix_choices(fm) == ["compute", "download"]
    assert segments(fm.spill_sources["bytes"].data, "activity") == {
        ("memory-monitor", "disk-write"): 100
    }
    assert fm.spill_sources["bytes"].data["count"] == [1]
    assert fm.activities_source.data["seconds"] == [1.5, 0, 0, 0.125, 0, 0]
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


def test_spilling_by_get_data():
    """get-data's unspilling, and the spilling of the keys that it pushes out, are
    in the spilling plots; its serialize and compress, which add up the data sent
    and the keys pushed out, are not
    """
    metrics = {
        ("get-data", "disk-read", "bytes"): 300,
        ("get-data", "disk-read", "count"): 3,
        ("get-data", "disk-read", "seconds"): 0.5,
        ("get-data", "disk-write", "bytes"): 200,
        ("get-data", "disk-write", "count"): 2,
        ("get-data", "disk-write", "seconds"): 0.25,
        ("get-data", "serialize", "seconds"): 0.125,
        ("get-data", "compress", "seconds"): 0.0625,
        ("get-data", "network", "seconds"): 1.0,
    }
    fm = FineMetricsBreakdown(None, metrics)
    fm.update()
    assert segments(fm.spill_sources["bytes"].data, "activity") == {
        ("get-data", "disk-read"): 300,
        ("get-data", "disk-write"): 200,
    }
    assert segments(fm.spill_sources["seconds"].data, "activity") == {
        ("get-data", "disk-read"): 0.5,
        ("get-data", "disk-write"): 0.25,
    }
    assert sorted(fm.spill_sources["bytes"].data["count"]) == [2, 3]
    assert_breakdown(fm, metrics)


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

    # Nothing delivered meanwhile (every delivery brings the threads' seconds)
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


# --- The threads ------------------------------------------------------------------


def points(fm: FineMetricsBreakdown) -> list[dict[str, float]]:
    """The points of the threads over time: {state: threads} each, in order"""
    assert fm.threads_over_time_source is not None
    data = fm.threads_over_time_source.data
    assert set(data) == {"time", *THREAD_STATES}
    assert data["time"] == sorted(data["time"])
    return [
        {state: data[state][i] for state in THREAD_STATES}
        for i in range(len(data["time"]))
    ]


def assert_points_drawable(fm: FineMetricsBreakdown, most_threads: int) -> None:
    """Every value of the threads over time is finite and not negative, and no
    point has more threads than the cluster
    """
    for point in points(fm):
        for value in point.values():
            assert isinstance(value, float) and math.isfinite(value), point
            assert value >= 0, point
        assert sum(point.values()) <= most_threads * (1 + 1e-9), point


def threads_page(s: Any, **kwargs: Any) -> FineMetricsBreakdown:
    """A page of the scheduler ``s`` whose threads over time get a point only at
    the test's :func:`tick`: the scheduler's own reads of the store, a second
    apart, are stopped, so that the test knows how many points to expect
    """
    fm = FineMetricsBreakdown(s, **kwargs)
    s.periodic_callbacks[ThreadsOverTimePlugin.name].stop()
    return fm


def tick(fm: FineMetricsBreakdown) -> None:
    """What the scheduler's plugin does every second, then an update of the page:
    a read of the store, which adds a point if it changed, and the page shows it
    """
    assert fm.scheduler is not None
    fm.scheduler.plugins[ThreadsOverTimePlugin.name].update()
    fm.update()


async def deliver(fm: FineMetricsBreakdown, *workers: Any, n: int = 1) -> None:
    """n times: a real while, a delivery of every worker, a read of the store by
    the scheduler, an update of the page
    """
    for _ in range(n):
        await asyncio.sleep(0.1)
        for w in workers:
            await w.heartbeat()
        tick(fm)


def block(event: Event) -> None:
    event.wait()


@gen_cluster(
    client=True,
    nthreads=[("", 1), ("", 2)],
    # So that the memory monitor does not unpause a worker that the test paused
    config={"distributed.worker.memory.pause": False},
)
async def test_threads_over_time(c, s, a, b):
    """The points add up to the cluster's threads, and show the busy ones"""
    nthreads = sum(ws.nthreads for ws in s.workers.values())
    assert nthreads == 3
    fm = threads_page(s)
    # The time axis shows the clock's time at every span, also under a second,
    # where bokeh's default shows milliseconds alone ("400ms")
    assert fm.threads_over_time_plot is not None
    formatter = fm.threads_over_time_plot.xaxis[0].formatter
    assert isinstance(formatter, DatetimeTickFormatter)
    spans = ("microseconds", "milliseconds", "seconds", "minsec", "minutes")
    for span in (*spans, "hourmin", "hours"):
        assert getattr(formatter, span)[0].startswith("%H:%M"), span
    # Bokeh asks for as many ticks in a narrow plot: labels that would overlap
    # are left out
    policy = fm.threads_over_time_plot.xaxis[0].major_label_policy
    assert isinstance(policy, NoOverlap)
    tick(fm)
    # The first update reads where the totals start: no point yet
    assert points(fm) == []
    await deliver(fm, a, b, n=2)
    assert len(points(fm)) == 2
    for point in points(fm):
        assert sum(point.values()) == pytest.approx(nthreads, rel=0.03)
        assert point["idle-no-tasks"] == pytest.approx(nthreads, rel=0.03)

    # A task holds one of b's threads
    event = Event()
    x = c.submit(block, event, key="block-1", workers=[b.address])
    await async_poll_for(lambda: b.state.executing_count, timeout=5)
    await deliver(fm, a, b)  # the delivery that covers the task's start
    await deliver(fm, a, b, n=3)
    for point in points(fm)[-3:]:
        assert sum(point.values()) == pytest.approx(nthreads, rel=0.03)
        assert point["busy"] == pytest.approx(1, rel=0.03)
        assert point["idle-no-tasks"] == pytest.approx(2, rel=0.03)

    # a is paused: its thread idles for that cause
    a.status = Status.paused
    await deliver(fm, a, b, n=3)
    assert points(fm)[-1]["idle-paused"] == pytest.approx(1, rel=0.03)
    assert points(fm)[-1]["busy"] == pytest.approx(1, rel=0.03)
    a.status = Status.running
    await event.set()
    await x
    await deliver(fm, a, b, n=3)
    assert points(fm)[-1]["idle-no-tasks"] == pytest.approx(nthreads, rel=0.03)
    assert_points_drawable(fm, nthreads)

    # The bars: the store's threads' seconds, and the busy share in the title
    assert_breakdown(fm, s.cumulative_worker_metrics)
    data = fm.threads_source.data
    busy = dict(zip(data["state"], data["seconds"]))["busy"]
    assert busy > 0.3
    assert fm.threads_plot.title.text == efficiency_title(s.cumulative_worker_metrics)
    assert "busy" in fm.threads_plot.title.text


@gen_cluster(client=True, nthreads=[("", 1), ("", 1)])
async def test_threads_over_time_at_the_heartbeats_pace(c, s, a, b):
    """The workers deliver at their own pace, between updates or not at all: each
    point still has the cluster's threads
    """
    for w in (a, b):
        w.periodic_callbacks["heartbeat"].stop()
    fm = threads_page(s)
    tick(fm)
    await deliver(fm, a, b)
    for workers in [(a,), (a, a, a), (b,), (), (a, b, b)]:
        await asyncio.sleep(0.1)
        for w in workers:
            await w.heartbeat()
        tick(fm)
    for point in points(fm):
        assert sum(point.values()) == pytest.approx(2, rel=1e-6)
    # No point without a change of the store
    assert len(points(fm)) == 5
    assert_points_drawable(fm, 2)


@gen_cluster(client=True)
async def test_threads_over_time_no_work_without_change(c, s, a, b):
    for w in (a, b):
        w.periodic_callbacks["heartbeat"].stop()
    fm = threads_page(s)
    tick(fm)
    await deliver(fm, a, b, n=2)
    assert fm.threads_over_time_source is not None
    data = fm.threads_over_time_source.data
    before = {k: list(v) for k, v in data.items()}
    version = s.cumulative_worker_metrics_version
    for _ in range(3):
        await asyncio.sleep(0.05)
        tick(fm)
    # The prefix filter redraws the bars, but adds no point
    assert fm.prefix_filter is not None
    fm.prefix_filter.value = ["inc"]
    assert s.cumulative_worker_metrics_version == version
    assert fm.threads_over_time_source.data is data
    assert {k: list(v) for k, v in data.items()} == before


class FakeScheduler:
    """What the threads over time read of a scheduler: the store's version, the
    live workers (their number of threads and server_id) and their totals without
    the task prefix; and its plugins, which keep the points, read at each
    :func:`tick`.
    """

    def __init__(self, **nthreads: int):
        self.cumulative_worker_metrics: dict = {}
        self.cumulative_worker_metrics_version = 0
        self.workers: dict[str, SimpleNamespace] = {}
        self.totals: dict[str, dict[tuple, float]] = {}
        self.plugins: dict[str, Any] = {}
        # Its plugin's periodic callback is never started: the tests read the
        # store with tick()
        self.periodic_callbacks: dict[str, Any] = {}
        self.io_loop = SimpleNamespace(
            asyncio_loop=None, add_callback=lambda *args: None
        )
        self._ids = 0
        for worker, n in nthreads.items():
            self.join(worker, n)

    def join(self, worker: str, nthreads: int) -> None:
        """A worker joins (a new server, also at an address seen before)"""
        self._ids += 1
        self.workers[worker] = SimpleNamespace(
            nthreads=nthreads, server_id=f"id-{self._ids}"
        )
        self.totals[worker] = {}

    def leave(self, worker: str) -> None:
        del self.workers[worker]
        del self.totals[worker]

    def fine_metrics_by_worker(self) -> dict[str, Mapping[tuple, float]]:
        return {w: MappingProxyType(t) for w, t in self.totals.items()}

    def add_plugin(self, plugin: Any) -> None:
        self.plugins[plugin.name] = plugin


def post_threads(s: FakeScheduler, worker: str, **seconds: float) -> None:
    """A delivery of threads' seconds by a worker (keyword: state, "_" for "-")"""
    totals = s.totals[worker]
    for state, value in seconds.items():
        key = ("threads", state.replace("_", "-"), "seconds")
        totals[key] = totals.get(key, 0) + value
    s.cumulative_worker_metrics_version += 1


def threads(**states: float) -> dict[str, float]:
    """A point of the threads over time (keyword: state, "_" for "-")"""
    return {
        **dict.fromkeys(THREAD_STATES, 0),
        **{k.replace("_", "-"): v for k, v in states.items()},
    }


def test_threads_over_time_never_draws_bad_values():
    """Not finite, negative, a worker that comes back, goes, or delivers nothing
    new: every point finite, not negative, at most the cluster's threads
    """
    nan, inf = float("nan"), float("inf")
    s = FakeScheduler(a=2, b=4)
    fm = FineMetricsBreakdown(s)
    tick(fm)
    post_threads(s, "a", busy=1.0, idle_no_tasks=1.0)
    post_threads(s, "b", busy=4.0)
    tick(fm)
    assert points(fm) == [threads(busy=5.0, idle_no_tasks=1.0)]
    # b delivers nothing new: it keeps its last states
    post_threads(s, "a", idle_paused=2.0)
    tick(fm)
    assert points(fm)[-1]["busy"] == 4.0
    assert points(fm)[-1]["idle-paused"] == 2.0

    # A label of threads that the workers do not post is neither counted nor
    # drawn: b's gain is all idle-no-tasks
    post_threads(s, "b", idle_no_tasks=1.0, mystery=1.0)
    tick(fm)
    assert points(fm)[-1] == threads(idle_paused=2.0, idle_no_tasks=4.0)

    # a's totals so far: busy 1, idle-no-tasks 1, idle-paused 2
    totals = s.totals["a"]
    for busy, gained in [
        (nan, {}),  # not finite: left out, and nothing else gained
        (inf, {"idle_no_tasks": 1.0}),
        (-inf, {}),
        (1.0, {}),  # finite again
        (0.5, {"idle_paused": 1.0}),  # a total that goes down
        (1e308, {"idle_no_tasks": 1e308}),  # a sum that overflows
        (1e308, {"idle_no_tasks": 0.0}),  # nothing new
    ]:
        totals["threads", "busy", "seconds"] = busy
        post_threads(s, "a", **gained)
        tick(fm)
        assert_points_drawable(fm, 6)
    assert len(points(fm)) == 10

    # b comes back, with new totals from zero; a leaves
    s.leave("b")
    s.join("b", 4)
    post_threads(s, "b", idle_no_tasks=2.0)
    s.leave("a")
    tick(fm)
    assert points(fm)[-1] == threads(idle_no_tasks=4.0)
    # Totals of a worker that the scheduler no longer has
    s.totals["c"] = {}
    post_threads(s, "c", busy=5.0)
    tick(fm)
    assert points(fm)[-1] == threads(idle_no_tasks=4.0)
    # No workers at all
    s.leave("b")
    tick(fm)
    assert points(fm)[-1] == threads()
    assert_points_drawable(fm, 6)


def test_threads_over_time_follow_the_live_workers():
    """A point as soon as a worker joins or leaves, also when the store did not
    change (a worker removed without a last delivery)
    """
    s = FakeScheduler(a=1, b=2)
    fm = FineMetricsBreakdown(s)
    tick(fm)
    post_threads(s, "a", busy=1.0)
    post_threads(s, "b", idle_no_tasks=2.0)
    tick(fm)
    assert points(fm) == [threads(busy=1.0, idle_no_tasks=2.0)]
    version = s.cumulative_worker_metrics_version

    s.leave("b")
    tick(fm)
    assert points(fm)[-1] == threads(busy=1.0)
    s.join("c", 4)  # no delivery yet: no threads to show for it
    tick(fm)
    assert points(fm)[-1] == threads(busy=1.0)
    s.leave("a")
    s.leave("c")
    tick(fm)
    assert points(fm)[-1] == threads()
    assert s.cumulative_worker_metrics_version == version
    # Nothing changed since: no point
    tick(fm)
    assert len(points(fm)) == 4


def test_threads_over_time_worker_restarted_at_its_address():
    """A new worker at the address of one that left counts from zero, also when its
    totals are smaller than the old one's
    """
    s = FakeScheduler(a=2)
    fm = FineMetricsBreakdown(s)
    tick(fm)
    post_threads(s, "a", idle_no_tasks=100.0)
    tick(fm)
    assert points(fm)[-1] == threads(idle_no_tasks=2.0)
    # Restarted: its first delivery covers its whole life, half of it busy
    # (taken as a gain from the old totals, idle-no-tasks would be negative and
    # left out: all busy)
    s.leave("a")
    s.join("a", 2)
    post_threads(s, "a", busy=1.0, idle_no_tasks=1.0)
    tick(fm)
    assert points(fm)[-1] == threads(busy=1.0, idle_no_tasks=1.0)
    # Restarted again, with nothing delivered yet: nothing of the old one is left
    s.leave("a")
    s.join("a", 2)
    s.cumulative_worker_metrics_version += 1
    tick(fm)
    assert points(fm)[-1] == threads()


@gen_cluster(client=True, nthreads=[("", 1), ("", 2)])
async def test_threads_over_time_worker_removed(c, s, a, b):
    """A worker that the scheduler removes leaves the plot at once"""
    fm = threads_page(s)
    tick(fm)
    await deliver(fm, a, b, n=2)
    assert sum(points(fm)[-1].values()) == pytest.approx(3, rel=1e-6)
    await s.remove_worker(b.address, stimulus_id="test")
    tick(fm)
    assert sum(points(fm)[-1].values()) == pytest.approx(1, rel=1e-6)
    assert_points_drawable(fm, 3)


@gen_cluster(client=True, nthreads=[])
async def test_threads_over_time_real_worker_restarted_at_its_address(c, s):
    """A worker restarted at the address of one with more threads and more
    seconds: the page, updated only once the new one delivered, counts it from
    zero
    """
    port = open_port()
    fm = threads_page(s)
    tick(fm)
    async with Worker(s.address, port=port, nthreads=4) as w:
        w.periodic_callbacks["heartbeat"].stop()
        await deliver(fm, w, n=3)
        address = w.address
    async with Worker(s.address, port=port, nthreads=1) as w:
        w.periodic_callbacks["heartbeat"].stop()
        assert w.address == address
        await asyncio.sleep(0.1)
        await w.heartbeat()
        tick(fm)
        assert sum(points(fm)[-1].values()) == pytest.approx(1, rel=1e-6)
    assert_points_drawable(fm, 4)


def test_threads_over_time_never_go_back(monkeypatch):
    """The points' times follow the wall clock as the page opened, and keep their
    order when the wall clock is set back (by NTP, say)
    """
    from distributed.dashboard.components import scheduler as module

    wall = time()
    s = FakeScheduler(a=1)
    fm = FineMetricsBreakdown(s)
    tick(fm)
    for i in range(3):
        monkeypatch.setattr(module, "time", lambda i=i: wall - 3600 * (i + 1))
        post_threads(s, "a", busy=1.0)
        tick(fm)
    assert fm.threads_over_time_source is not None
    times = fm.threads_over_time_source.data["time"]
    assert len(times) == 3
    assert times == sorted(times)
    assert times[0] == pytest.approx(wall * 1000, abs=60_000)


def test_threads_history_is_bounded():
    s = FakeScheduler(a=1)
    fm = FineMetricsBreakdown(s, threads_history=3)
    tick(fm)
    for i in range(10):
        post_threads(s, "a", busy=1.0 * i, idle_no_tasks=1.0)
        tick(fm)
    assert [p["busy"] for p in points(fm)] == pytest.approx([7 / 8, 8 / 9, 9 / 10])
    with pytest.raises(ValueError, match="threads_history"):
        FineMetricsBreakdown(s, threads_history=1)


def test_threads_over_time_are_the_schedulers(monkeypatch):
    """The points belong to the scheduler: a page opened later, or reloaded,
    starts with them (the last ``threads_history``), every page shows the same
    points, and updating a page adds none; the scheduler keeps the last
    ``MAX_POINTS``
    """
    monkeypatch.setattr(ThreadsOverTimePlugin, "MAX_POINTS", 5)
    s = FakeScheduler(a=2)
    first = FineMetricsBreakdown(s)
    [plugin] = s.plugins.values()
    assert isinstance(plugin, ThreadsOverTimePlugin)
    assert s.periodic_callbacks == {plugin.name: plugin._pc}
    tick(first)
    for i in range(3):
        post_threads(s, "a", busy=2.0 * i, idle_no_tasks=2.0)
        tick(first)
    assert len(points(first)) == 3

    # Opened later: the same points at once, and their times
    second = FineMetricsBreakdown(s)
    assert s.plugins == {plugin.name: plugin}
    assert points(second) == points(first)
    assert second.threads_over_time_source is not None
    assert first.threads_over_time_source is not None
    times = first.threads_over_time_source.data["time"]
    assert second.threads_over_time_source.data["time"] == times
    # Pages only show the scheduler's points: a change of the store is a point
    # once the scheduler read it, on every page, once
    post_threads(s, "a", busy=4.0)
    first.update()
    second.update()
    assert len(points(first)) == len(points(second)) == 3
    plugin.update()
    first.update()
    first.update()
    second.update()
    assert points(first) == points(second)
    assert points(first)[-1] == threads(busy=2.0)
    assert len(points(first)) == 4

    # No more than threads_history from the scheduler's points
    shown = points(FineMetricsBreakdown(s, threads_history=2))
    assert [p["busy"] for p in shown] == pytest.approx([4 / 3, 2.0])
    # The scheduler keeps the last MAX_POINTS; a page that fell further behind
    # gets those
    for i in range(7):
        post_threads(s, "a", idle_paused=2.0 * (i + 1))
        tick(second)
    assert len(plugin.buffer) == 5
    assert plugin.index == 11
    assert len(points(second)) == 11
    first.update()
    assert len(points(first)) == 4 + 5
    assert points(first)[-5:] == points(second)[-5:]
    assert points(FineMetricsBreakdown(s)) == points(second)[-5:]


def test_threads_over_time_plugin_removed():
    """A plugin removed from the scheduler stops reading the store, and a page
    opened later makes a new one, whose periodic callback replaces the old one's
    """
    s = FakeScheduler(a=1)
    fm = FineMetricsBreakdown(s)
    old = s.plugins.pop(ThreadsOverTimePlugin.name)
    stopped = []
    old._pc.stop = lambda: stopped.append("update")
    post_threads(s, "a", busy=1.0)
    old.update()
    assert stopped == ["update"]
    assert old.index == 0
    old._pc.stop = lambda: stopped.append("replaced")
    FineMetricsBreakdown(s)
    assert stopped == ["update", "replaced"]
    new = s.plugins[ThreadsOverTimePlugin.name]
    assert new is not old
    assert s.periodic_callbacks == {new.name: new._pc}
    assert fm.threads_over_time_source is not None


@gen_cluster(client=True, nthreads=[("", 1), ("", 2)])
async def test_threads_over_time_while_no_page_updates(c, s, a, b):
    """Once a page opened, the scheduler reads its store every ``INTERVAL``
    seconds, on its own: a page opened later shows the threads of the time when
    no page updated. It stops when the scheduler closes.
    """
    fm = FineMetricsBreakdown(s)
    plugin = s.plugins[ThreadsOverTimePlugin.name]
    pc = s.periodic_callbacks[plugin.name]
    assert pc.is_running()
    assert pc.callback_time == ThreadsOverTimePlugin.INTERVAL * 1000
    del fm
    start = plugin.index
    await async_poll_for(lambda: plugin.index >= start + 3, timeout=10)
    later = FineMetricsBreakdown(s)
    shown = points(later)
    assert len(shown) >= 3
    assert shown[-1] == pytest.approx(threads(idle_no_tasks=3.0), rel=0.03)
    # Updating a page, however often, adds no point
    index = plugin.index
    for w in (a, b):
        await w.heartbeat()
    for _ in range(5):
        later.update()
    assert plugin.index == index
    await s.close()
    assert not pc.is_running()
    assert plugin.name not in s.periodic_callbacks


def test_threads_bars():
    """The five states always, in their order, then the others; the efficiency in
    the title
    """
    metrics = {
        ("threads", "idle-no-tasks", "seconds"): 3.0,
        ("threads", "busy", "seconds"): 1.0,
        ("threads", "mystery", "seconds"): 0.5,
        ("threads", "other", "seconds"): 1.5,
        ("threads", "idle-paused", "seconds"): -1.0,
        ("threads", "idle-constrained", "seconds"): float("nan"),
        seconds("p"): 7.0,
    }
    fm = FineMetricsBreakdown(None, metrics)
    assert fm.threads_plot.title.text == "The workers' threads, by state"
    fm.update()
    data = fm.threads_source.data
    assert data["state"] == THREAD_STATES + ["other", "mystery"]
    assert data["seconds"] == [1.0, 0, 0, 0, 3.0, 1.5, 0.5]
    assert fm.threads_plot.y_range.factors == data["state"][::-1]
    assert fm.threads_plot.title.text == "The workers' threads: busy 16.7% of the time"
    assert_breakdown(fm, metrics)
    # Not the activities' seconds: those partition the work, not the threads
    assert fm.activities_source.data["seconds"] == [7.0, 0, 0, 0, 0, 0]
    # With a mapping, no history: no threads over time
    assert fm.threads_over_time_source is None
    assert fm.threads_over_time_plot is None
    assert [getattr(p, "name", None) for p in fm.root.children[0].children] == [
        "fine_metrics_threads_plot"
    ]


# --- Colours ----------------------------------------------------------------------

#: The labels that the workers post (docs/fine_metrics.rst, "Labels")
WORKER_LABELS = [
    "thread-cpu",
    "thread-noncpu",
    "executor",
    "seceded",
    "serialize",
    "deserialize",
    "compress",
    "decompress",
    "disk-write",
    "disk-read",
    "memory-read",
    "gc",
    "network",
    "failed",
    "cancelled",
    "busy",
    "missing",
    "other",
]


def test_fixed_colors():
    """Every label that the workers post has a colour of its own; the tasks'
    labels take the palette's, which none of those has; the activities have
    colours that no label has
    """
    colors = [fine_metrics_color(label) for label in WORKER_LABELS]
    assert colors == [FINE_METRICS_COLORS[label] for label in WORKER_LABELS]
    assert len(set(colors)) == len(colors)
    assert fine_metrics_color("thread-cpu") == "#1f77b4"
    assert fine_metrics_color("network") == "#9467bd"
    assert fine_metrics_color("disk-write") == "#d62728"
    assert not set(colors) & set(FINE_METRICS_PALETTE)
    for label in ("download", "rows", "ping/x", "7", ""):
        assert fine_metrics_color(label) in FINE_METRICS_PALETTE
    activities = [FINE_METRICS_ACTIVITY_COLORS[a] for a in ACTIVITIES]
    assert len(set(activities)) == 6
    assert not set(activities) & (set(colors) | set(FINE_METRICS_PALETTE))
    threads = [FINE_METRICS_THREAD_COLORS[s] for s in THREAD_STATES]
    assert list(FINE_METRICS_THREAD_COLORS) == THREAD_STATES
    assert len(set(threads)) == 5
    assert not set(threads) & (
        set(colors) | set(FINE_METRICS_PALETTE) | set(activities)
    )


def test_colors_are_the_same_in_every_process():
    """The tasks' labels take a colour by a hash of their text that does not
    depend on the process, as Python's hash() of a str does
    """
    labels = ["download", "rows", "ping/x", "7", "a/1/2.5", "ünï-cödé", "thread-cpu"]
    code = (
        "import json, sys\n"
        "from distributed.dashboard.components.scheduler import fine_metrics_color\n"
        "labels = json.loads(sys.argv[1])\n"
        "print(json.dumps([[fine_metrics_color(x) for x in labels], hash(labels[0])]))"
    )
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(labels)],
        env={**os.environ, "PYTHONHASHSEED": seed},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    colors, salted = json.loads(out.stdout)
    assert salted != hash(labels[0])  # another salt
    assert colors == [fine_metrics_color(x) for x in labels]
    assert len(set(colors[:-1])) > 1


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
        "fine_metrics_threads_over_time",
        "fine_metrics_threads",
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
    note = doc.get_model_by_name("fine_metrics_execute_note")
    assert note is not None
    assert not note.visible
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
    HTML file embeds: the data of its named ColumnDataSources, the factors of the
    y ranges of the execute plots and the note on the units left out
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
    notes = []
    titles = []
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
        if name == "fine_metrics_execute_note":
            notes.append(attrs.get("text", ""))
        if name == "fine_metrics_threads_plot":
            titles.append(models[attrs["title"]["id"]]["attributes"]["text"])
    assert set(factors) == {
        n[len("fine_metrics_execute_") :]
        for n in sources
        if n.startswith("fine_metrics_execute_")
    }
    assert len(notes) == (1 if factors else 0)
    assert len(titles) == (1 if factors else 0)
    return Breakdown(
        sources, factors, "".join(notes), threads_title=titles[0] if titles else None
    )


def record_report_metrics(s: Scheduler) -> list[dict[tuple, float]]:
    """The fine metrics that the scheduler's performance_report receives, one dict
    per report, as they arrive: the block's delta that the tab shows
    """
    received: list[dict[tuple, float]] = []
    handler = s.handlers["performance_report"]

    async def performance_report(**kwargs: Any) -> Any:
        received.append({tuple(k): v for k, v in kwargs.get("fine_metrics") or ()})
        return await handler(**kwargs)

    s.handlers["performance_report"] = performance_report
    return received


def with_threads_of(store: Mapping, other: Mapping) -> dict:
    """The store, with the threads' seconds of the other: a delta that the test
    measured around a report, with the threads' seconds that the report measured
    (they grow whenever the workers deliver, also at the report's own flushes)
    """
    out = {k: v for k, v in store.items() if k[0] != "threads"}
    out.update({k: v for k, v in other.items() if k[0] == "threads"})
    return out


async def report_on_workload(c: Any, a: Any, b: Any, path: Any) -> None:
    """A function of its own, so that the report's calling code is this one. The
    block does not deliver the workers' metrics: the report must, at its end.
    """
    async with performance_report(filename=str(path), mode="inline"):
        await spilling_workload(c, a, b, n=2, deliver=False)


@gen_cluster(client=True, nthreads=[("", 1), ("", 1)], **SPILL)
async def test_performance_report_tab(c, s, a, b, tmp_path):
    # Without heartbeats, the workers deliver their metrics only when asked to
    for w in (a, b):
        w.periodic_callbacks["heartbeat"].stop()
    # Before the block: the same prefixes, delivered...
    await spilling_workload(c, a, b, n=1)
    before = dict(s.cumulative_worker_metrics)
    # ...and a prefix of its own, not delivered yet: the report's delivery at its
    # start brings it in, as before the block
    await wait(c.submit(inc, 1, key="early-1"))
    assert s.cumulative_worker_metrics == before

    fn = tmp_path / "report.html"
    received = record_report_metrics(s)
    before_time = time()
    await report_on_workload(c, a, b, fn)
    after_time = time()
    # What the block did is in the store: the report's delivery at its end
    after = dict(s.cumulative_worker_metrics)
    early = {k for k in after if k[0] == "execute" and k[1] == "early"}
    assert early
    delta = {
        k: v - before.get(k, 0)
        for k, v in after.items()
        if k not in early and v != before.get(k, 0)
    }
    assert delta
    # ...all of it: nothing of execute was left to deliver
    await flush(c, a, b)
    assert {
        k: v for k, v in s.cumulative_worker_metrics.items() if k[0] == "execute"
    } == {k: v for k, v in after.items() if k[0] == "execute"}

    html = fn.read_text()
    assert "Fine metrics" in html
    assert "cdn.bokeh.org" not in html
    report = report_breakdown(html)
    sources = report.sources
    seconds = sources["fine_metrics_execute_seconds"]
    assert set(seconds["prefix"]) == {"big", "local", "remote", "fail"}
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
    spill = segments(sources["fine_metrics_spill_bytes"], "activity")
    assert spill["gather-dep", "disk-write"] > 0
    assert spill["get-data", "disk-read"] > 0
    # The threads' seconds of the block: the report's own delta, which the test
    # cannot measure from outside (the report's flushes deliver them too)
    [block] = received
    assert {k: v for k, v in block.items() if k[0] != "threads"} == approx(
        {k: v for k, v in delta.items() if k[0] != "threads"}
    )
    threads = {k: v for k, v in block.items() if k[0] == "threads"}
    assert threads[("threads", "busy", "seconds")] > 0
    # Two workers of one thread: at most two threads' seconds a second
    assert 0 < sum(threads.values()) <= 2 * (after_time - before_time)
    assert_breakdown(report, with_threads_of(delta, block))
    assert report.threads_title.startswith("The workers' threads: busy ")
    # A delta has no history: no threads over time in a report
    assert "fine_metrics_threads_over_time" not in sources


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


@gen_cluster(client=True, nthreads=[])
async def test_performance_report_of_odd_values(c, s):
    """Values that the tab cannot draw, from the client over RPC, and a prefix
    named "(other)" among more than 20: a report, with bokeh's checks passing
    """
    nan, inf = float("nan"), float("inf")
    metrics: list[tuple[tuple, float]] = [
        (seconds(f"p{i:02d}"), 1.0 + i) for i in range(30)
    ]
    metrics += [
        (seconds("(other)"), 100.0),
        (seconds("p00", "thread-noncpu"), nan),
        (("execute", "p01", "disk-read", "bytes"), inf),
        (seconds("p02", "mine"), -1.0),
        (("execute", "p03", "rows", "rows"), -inf),
        (("gather-dep", "network", "seconds"), nan),
        (("memory-monitor", "disk-write", "bytes"), inf),
    ]
    with captured_logger("bokeh.core.validation.check") as log:
        html = await c.scheduler.performance_report(
            start=0, last_count=0, mode="inline", fine_metrics=metrics
        )
    assert "E-1019" not in log.getvalue()
    report = report_breakdown(html)
    shown = bars(report.sources["fine_metrics_execute_seconds"], "prefix")
    assert shown == ["(other)"] + [f"p{i:02d}" for i in range(29, 11, -1)] + [
        "(other 2)"
    ]
    assert_breakdown(report, dict(metrics))

    # Sums that overflow: drawn, as "Infinity" in the document
    html = await c.scheduler.performance_report(
        start=0,
        last_count=0,
        mode="inline",
        fine_metrics=[(seconds("p", ("a", "b")), 1e308), (seconds("p", "a/b"), 1e308)],
    )
    data = report_breakdown(html).sources["fine_metrics_execute_seconds"]
    assert data["value"] == ["Infinity"]
    assert data["text"] == ["inf seconds"]


def old_performance_report(s: Scheduler) -> Any:
    """The handler of a scheduler of an earlier version: no keyword fine_metrics"""

    async def performance_report(start, last_count, code="", mode=None):
        return await Scheduler.performance_report(s, start, last_count, code, mode)

    return performance_report


async def report_on_inc(c: Any, path: Any) -> str:
    async with performance_report(filename=str(path), mode="inline"):
        await c.submit(inc, 1, key="inside-1")
    html = path.read_text()
    assert "Dask Performance Report" in html
    return html


@gen_cluster(client=True)
async def test_performance_report_older_scheduler(c, s, a, b, tmp_path):
    """A scheduler of an earlier version, with no handler get_fine_metrics and no
    keyword fine_metrics: the report, without the tab
    """
    del s.handlers["get_fine_metrics"]
    s.handlers["performance_report"] = old_performance_report(s)
    with captured_logger("distributed.client") as log:
        html = await report_on_inc(c, tmp_path / "report.html")
    assert "Fine metrics" not in html
    assert "The scheduler gives no fine performance metrics" in log.getvalue()


@gen_cluster(client=True)
async def test_performance_report_scheduler_without_the_keyword(c, s, a, b, tmp_path):
    """A scheduler with get_fine_metrics, but whose performance_report does not
    take fine_metrics: the report, without the tab
    """
    s.handlers["performance_report"] = old_performance_report(s)
    with captured_logger("distributed.client") as log:
        html = await report_on_inc(c, tmp_path / "report.html")
    assert "Fine metrics" not in html
    assert "The scheduler takes no fine performance metrics" in log.getvalue()


@pytest.mark.parametrize(
    "message",
    [
        "something else",
        # Names the keyword, but is not about the handler's signature
        "fine_metrics: the Fine metrics tab could not be built",
    ],
)
@gen_cluster(client=True)
async def test_performance_report_other_type_error(c, s, a, b, tmp_path, message):
    """Only the TypeError of the unexpected keyword means an earlier version"""

    async def performance_report(**kwargs):
        if "fine_metrics" in kwargs:
            raise TypeError(message)
        # Asked again without the keyword, the report would be written
        return await Scheduler.performance_report(s, **kwargs)

    s.handlers["performance_report"] = performance_report
    with pytest.raises(TypeError, match=message):
        await report_on_inc(c, tmp_path / "report.html")


def test_performance_report_sync(client, tmp_path):
    fn = tmp_path / "report.html"
    client.submit(inc, 1, key="before-1").result()
    with performance_report(filename=str(fn), mode="inline"):
        assert client.submit(inc, 1, key="inside-1").result() == 2
    report = report_breakdown(fn.read_text())
    assert set(report.sources["fine_metrics_execute_seconds"]["prefix"]) == {"inside"}


def test_tooltips_say_when_a_label_has_no_metric_in_a_unit():
    """The tooltips of the transfers and of spilling show a label's bytes and
    count, or n/a where it has none, rather than a 0 that would say that nothing
    was transferred or spilled
    """
    metrics = {
        ("gather-dep", "network", "seconds"): 0.75,
        ("gather-dep", "disk-write", "seconds"): 0.25,
        ("gather-dep", "disk-write", "bytes"): 3 * 2**20,
        ("gather-dep", "disk-write", "count"): 3,
        ("gather-dep", "serialize", "seconds"): 0.125,
        ("gather-dep", "retries", "count"): 2,
    }
    fm = FineMetricsBreakdown(None, metrics)
    fm.update()
    data = fm.gather_dep_source.data
    rows = {
        label: (b, c)
        for label, b, c in zip(data["label"], data["bytes_text"], data["count_text"])
    }
    assert rows == {
        "network": ("n/a", "n/a"),
        "disk-write": ("3.00 MiB", "3"),
        "serialize": ("n/a", "n/a"),
        "retries": ("n/a", "2"),
    }
    spill = fm.spill_sources["seconds"].data
    assert dict(zip(spill["label"], spill["count_text"])) == {
        "disk-write": "3",
        "serialize": "n/a",
    }
    for plot in (fm.gather_dep_plot, fm.get_data_plot):
        [hover] = plot.select(HoverTool)
        assert ("bytes", "@bytes_text") in hover.tooltips
        assert ("count", "@count_text") in hover.tooltips
    for plot in fm.spill_plots.values():
        [hover] = plot.select(HoverTool)
        assert ("keys", "@count_text") in hover.tooltips
