"""The fine performance metrics in a real headless Chromium: the dashboard's page
``/individual-fine-performance-metrics`` and the "Fine metrics" tab of a
``performance_report`` file, as a person sees them.

A ``LocalCluster`` of worker processes runs the demonstration workload of
:mod:`distributed.diagnostics.fine_metrics` (it computes, transfers, spills to the
workers' local directories and fails a task). The browser opens the page, or the
report from disk; what bokeh plots is read back with JavaScript and checked against
the scheduler's store, ``Scheduler.cumulative_worker_metrics``, by the checks of the
component tests (:mod:`distributed.dashboard.tests.test_fine_metrics_dashboard`).
Each test keeps a screenshot (:func:`~distributed.tests.utils_browser.save_screenshot`).

They need Debian's ``chromium`` and ``chromium-driver``
(``tools/install-chromium.sh``) and ``selenium``; without them they are skipped,
unless ``CI=true``: then they fail.
"""
from __future__ import annotations

import math
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import pytest

from distributed.tests.utils_ci import skip_or_fail

try:
    import bokeh  # noqa: F401
except ModuleNotFoundError:
    skip_or_fail("bokeh is not installed: `make install` installs it")

from distributed import Client, performance_report
from distributed.dashboard.tests.test_fine_metrics_dashboard import (
    THREAD_STATES,
    Breakdown,
    all_sources,
    assert_breakdown,
    bars,
    many_labels,
    post_as,
    record_report_metrics,
    segments,
    with_threads_of,
)
from distributed.diagnostics.fine_metrics import (
    demo_cluster,
    demo_workload,
    page_url,
    settle,
)
from distributed.tests.test_dashboard_browser import REPORT_TABS
from distributed.tests.utils_browser import (
    bokeh_sources,
    console_errors,
    open_bokeh_page,
    open_html_file,
    root_names,
    run_bokeh_js,
    save_screenshot,
    select_tab,
    tab_titles,
    wait_until,
)

#: The task prefixes of the demonstration workload
DEMO_PREFIXES = {"make-chunk", "crunch", "explode"}


def execute_factors(driver: Any) -> dict[str, list[str]]:
    """The bars of each execute plot (``fine_metrics_execute_UNIT_plot``), by unit,
    as its y range has them: from the bottom up
    """
    return run_bokeh_js(
        driver,
        """
        const found = {};
        for (const m of models()) {
          const match = /^fine_metrics_execute_(.+)_plot$/.exec(m.name ?? "");
          if (match) found[match[1]] = plain(m.y_range.factors);
        }
        return found;
        """,
    )


def units_note(driver: Any) -> str:
    """The text of the note on the units that have no tab of their own
    (``fine_metrics_execute_note``)
    """
    return run_bokeh_js(
        driver,
        """
        const notes = byName("fine_metrics_execute_note");
        if (notes.length !== 1) throw new Error(`${notes.length} notes`);
        return notes[0].text;
        """,
    )


def threads_title(driver: Any) -> str:
    """The title of the bars of the threads' states, with the efficiency"""
    return run_bokeh_js(
        driver, 'return byName("fine_metrics_threads_plot")[0].title.text;'
    )


def plotted(driver: Any) -> Breakdown:
    """What the page plots: the data of its named sources, the bars of execute, the
    note on the units left out, the title of the threads' bars
    """
    return Breakdown(
        bokeh_sources(driver),
        execute_factors(driver),
        units_note(driver),
        threads_title=threads_title(driver),
    )


def scheduler_store(client: Client) -> dict[Hashable, float]:
    """``Scheduler.cumulative_worker_metrics``, read on the scheduler's event loop"""
    return client.run_on_scheduler(
        lambda dask_scheduler: dict(dask_scheduler.cumulative_worker_metrics)
    )


def wait_until_plotted(
    driver: Any, client: Client, prefixes: set[str] | None = None
) -> dict[Hashable, float]:
    """Wait (bounded) until the page plots what the scheduler's store holds, the
    execute plots for ``prefixes`` only (all if None); return the store
    """

    def shows_the_store() -> dict[Hashable, float]:
        store = scheduler_store(client)
        assert_breakdown(plotted(driver), store, prefixes)
        return store

    return wait_until(driver, shows_the_store, what="the page showing the store")


PAGE_PATH = "/individual-fine-performance-metrics"


def page_sources(dask_scheduler: Any) -> list[dict[str, dict[str, list]]]:
    """The data of the named sources of every session of the page, on the server
    (run on the scheduler's event loop, which the bokeh server shares)
    """
    bokeh_app = dask_scheduler.http_application.applications[0]
    context = bokeh_app._applications[PAGE_PATH]
    return [
        {
            source.name: {k: list(v) for k, v in source.data.items()}
            for component in getattr(session.document, "components", ())
            for source in all_sources(component)
        }
        for session in context.sessions
    ]


def stop_heartbeats(dask_worker: Any) -> None:
    """The worker delivers its fine metrics only when asked to (the threads'
    seconds grow at every delivery otherwise)
    """
    dask_worker.periodic_callbacks["heartbeat"].stop()


def threads_points(driver: Any) -> list[dict[str, float]]:
    """The points of the threads over time as the browser has them"""
    data = bokeh_sources(driver)["fine_metrics_threads_over_time"]
    assert set(data) == {"time", *THREAD_STATES}
    assert data["time"] == sorted(data["time"])
    return [
        {state: data[state][i] for state in THREAD_STATES}
        for i in range(len(data["time"]))
    ]


def assert_threads_over_time(points: list[dict[str, float]], nthreads: int) -> None:
    """Finite, not negative, never more threads than the cluster has; all of them
    once both workers delivered; some busy while the workload ran
    """
    for point in points:
        for value in point.values():
            assert math.isfinite(value) and value >= 0, point
        assert sum(point.values()) <= nthreads * (1 + 1e-9), point
    # The first point may precede a worker's first delivery since the page opened
    for point in points[2:]:
        assert sum(point.values()) == pytest.approx(nthreads, rel=1e-6), point
    assert any(point["busy"] > 0 for point in points), points
    assert points[-1]["idle-no-tasks"] == pytest.approx(nthreads, rel=1e-6)


def assert_fits_the_window(driver: Any) -> None:
    """No horizontal scrollbar: the plots and their legends fit the window, also
    once the page's vertical scrollbar took its share
    """
    widths = run_bokeh_js(
        driver,
        "const e = document.documentElement; return [e.scrollWidth, e.clientWidth];",
    )
    assert widths[0] <= widths[1], f"the page is {widths[0]} px wide in {widths[1]}"


def assert_demo_shown(shown: Breakdown) -> None:
    """What the demonstration workload did is there: every prefix, the failure,
    spilling and unspilling, the tasks' own labels, both sides of the transfers
    """
    execute = shown.execute()
    seconds = segments(execute["seconds"], "prefix")
    assert set(bars(execute["seconds"], "prefix")) == DEMO_PREFIXES
    for prefix, label in [
        ("make-chunk", "thread-cpu"),
        ("make-chunk", "disk-write"),
        ("crunch", "thread-noncpu"),
        ("crunch", "disk-read"),
        ("crunch", "crunch"),
        ("explode", "failed"),
    ]:
        assert seconds[prefix, label] > 0, (prefix, label)
    assert segments(execute["count"], "prefix")["crunch", "pairs"] > 0
    assert segments(execute["bytes"], "prefix")["make-chunk", "disk-write"] > 0
    threads = shown.sources["fine_metrics_threads"]
    assert dict(zip(threads["state"], threads["seconds"]))["busy"] > 0
    activities = shown.sources["fine_metrics_activities"]
    activity_seconds = dict(zip(activities["activity"], activities["seconds"]))
    for activity in ("execute", "gather-dep", "get-data"):
        assert activity_seconds[activity] > 0, activity
    assert sum(activities["share"]) == pytest.approx(100)
    for name in ("fine_metrics_gather_dep", "fine_metrics_get_data"):
        assert "network" in shown.sources[name]["label"], name
    spilled = segments(shown.sources["fine_metrics_spill_bytes"], "activity")
    assert spilled["execute", "disk-write"] > 0
    assert spilled["execute", "disk-read"] > 0


# The page


@pytest.mark.slow
def test_page(browser: Any, loop: Any) -> None:
    """The page plots the scheduler's store, and its prefix filter works from the
    browser, through the bokeh server
    """
    with demo_cluster(loop=loop) as (cluster, client):
        nthreads = sum(ws.nthreads for ws in cluster.scheduler.workers.values())
        assert nthreads == 4
        open_bokeh_page(browser, page_url(client))
        assert root_names(browser) == ["fine_metrics"]
        assert tab_titles(browser, "fine_metrics_execute_tabs")[:3] == [
            "seconds",
            "bytes",
            "count",
        ]
        # The threads over time, while the workers idle, work, and idle again
        wait_until(browser, lambda: len(threads_points(browser)) >= 2)
        demo_workload(client)
        settle(client)
        n = len(threads_points(browser))
        wait_until(browser, lambda: len(threads_points(browser)) >= n + 3)
        client.run(stop_heartbeats)
        client.get_fine_metrics(flush=True)

        def same_as_the_server() -> list[dict[str, float]]:
            points = threads_points(browser)
            [on_server] = client.run_on_scheduler(page_sources)
            shown = bokeh_sources(browser)
            for name in ("fine_metrics_threads_over_time", "fine_metrics_threads"):
                assert shown[name] == on_server[name], name
            return points

        store = wait_until_plotted(browser, client)
        points = wait_until(browser, same_as_the_server, what="the server's data")
        assert_threads_over_time(points, nthreads)
        assert threads_title(browser).startswith("The workers' threads: busy ")
        assert_demo_shown(plotted(browser))
        prefixes = sorted({key[1] for key in store if key[0] == "execute"})
        filter_options = run_bokeh_js(
            browser,
            'return plain(byName("fine_metrics_prefix_filter")[0].options)'
            ".map((o) => (Array.isArray(o) ? o[0] : o));",
        )
        assert filter_options == prefixes
        assert_fits_the_window(browser)
        assert console_errors(browser) == []
        save_screenshot(browser, "fine-metrics-page")

        # Reloaded, the page shows the same points at once: they are the
        # scheduler's, and nothing changed since
        open_bokeh_page(browser, page_url(client))
        assert threads_points(browser) == points
        assert console_errors(browser) == []

        # As if a person chose "crunch" in the filter
        run_bokeh_js(
            browser, 'byName("fine_metrics_prefix_filter")[0].value = ["crunch"];'
        )
        wait_until_plotted(browser, client, prefixes={"crunch"})
        assert bars(plotted(browser).execute()["seconds"], "prefix") == ["crunch"]
        select_tab(browser, "bytes", "fine_metrics_execute_tabs")
        assert console_errors(browser) == []
        save_screenshot(browser, "fine-metrics-page-crunch-bytes")


# performance_report


def make_bytes(n: int) -> bytes:
    return b"x" * n


def work_before_the_block(client: Client) -> None:
    """Compute with prefixes of their own, and transfer between the workers"""
    a, b = sorted(client.scheduler_info()["workers"])
    x = client.submit(make_bytes, 1000, key="early-0", workers=[a])
    assert client.submit(len, x, key="early-len-0", workers=[b]).result() == 1000


def report_on_demo(client: Client, path: Path) -> None:
    """A function of its own, so that the report's calling code is this one"""
    with performance_report(filename=path, mode="inline"):
        demo_workload(client)
        # Everything the block did is posted before the report's end flushes it
        settle(client)


@pytest.mark.slow
def test_performance_report_tab(browser: Any, loop: Any, tmp_path: Path) -> None:
    """The report's "Fine metrics" tab, opened from disk, plots what the store
    gained during the block, and nothing from before it
    """
    report = tmp_path / "report.html"
    # Without the memory monitor, nothing spills but the tasks and transfers:
    # between the snapshots below, nothing runs but the block
    no_monitor = {"distributed.worker.memory.spill": False}
    with demo_cluster(no_monitor, loop=loop) as (cluster, client):
        work_before_the_block(client)
        settle(client)
        received = record_report_metrics(cluster.scheduler)
        before = client.get_fine_metrics(flush=True)
        report_on_demo(client, report)
        after = client.get_fine_metrics(flush=True)
    # The threads' seconds grow at every delivery, the report's own too: those of
    # the block are what the report measured
    [block] = received
    delta = with_threads_of(after - before, block)
    assert ("execute", "early", "thread-cpu", "seconds") in before
    assert ("execute", "early", "thread-cpu", "seconds") not in delta

    open_html_file(browser, report)
    assert tab_titles(browser) == REPORT_TABS
    select_tab(browser, "Fine metrics")
    shown = plotted(browser)
    assert_breakdown(shown, delta)
    assert_demo_shown(shown)
    # A delta has no history: the bars of the threads' states, no area
    assert "fine_metrics_threads_over_time" not in shown.sources
    assert shown.threads_title is not None
    assert shown.threads_title.startswith("The workers' threads: busy ")
    # The block's, not the totals: the transfer before the block is not in
    network = ("gather-dep", "network", "seconds")
    assert 0 < delta[network] < after[network]
    [network_shown] = [
        seconds
        for label, seconds in zip(
            shown.sources["fine_metrics_gather_dep"]["label"],
            shown.sources["fine_metrics_gather_dep"]["seconds"],
        )
        if label == "network"
    ]
    assert network_shown == pytest.approx(delta[network])
    assert_fits_the_window(browser)
    assert console_errors(browser) == []
    save_screenshot(browser, "fine-metrics-report")

    # In a narrow window, every tab of the report fits it: the tabs share one
    # cell, so a minimum width of the Fine metrics tab would widen them all
    browser.set_window_size(800, 900)
    open_html_file(browser, report)
    for tab in REPORT_TABS:
        select_tab(browser, tab)
        assert_fits_the_window(browser)


# Names that come from task code


#: Markup that would make an element with this id, if parsed as HTML
MARKUP = "<img id='{}' src='nonexistent.png'>"


def injected(driver: Any) -> list[str]:
    """The ids of the elements that markup in names made"""
    return run_bokeh_js(
        driver,
        """
        return ["inunit", "inlabel", "inprefix"].filter(
          (id) => document.getElementById(id) !== null
        );
        """,
    )


def legends_cut(driver: Any) -> list[str]:
    """The plots whose legend goes beyond the bottom of their plot area, where
    bokeh cuts it (bokeh 2.4's views: the legend's box and the plot's frame)
    """
    return run_bokeh_js(
        driver,
        """
        const cut = [];
        const walk = (view) => {
          for (const child of view.child_views ?? []) walk(child);
          for (const rv of view.renderer_views?.values() ?? []) {
            if (rv.model.type !== "Legend") continue;
            const box = rv.compute_legend_bbox();
            if (box.y + box.height > view.frame.bbox.bottom)
              cut.push(view.model.name);
          }
        };
        for (const view of Object.values(Bokeh.index)) walk(view);
        return cut;
        """,
    )


@pytest.mark.slow
def test_legend_shows_every_label(browser: Any, loop: Any) -> None:
    """A task that posts 30 labels of its own: the execute plot grows, so that its
    legend shows every one of them
    """
    with demo_cluster(loop=loop) as (cluster, client):
        open_bokeh_page(browser, page_url(client))
        client.submit(many_labels, 30, key="labels-1").result()
        client.get_fine_metrics(flush=True)

        def thirty_one_labels() -> bool:
            source = bokeh_sources(browser)["fine_metrics_execute_seconds"]
            # The task's own labels, and its thread-noncpu (or thread-cpu)
            return len(set(source["label"])) >= 31

        wait_until(browser, thirty_one_labels, what="the task's labels")
        # The page's layout follows the plot's new height
        wait_until(browser, lambda: legends_cut(browser) == [], what="the legends")
        assert console_errors(browser) == []
        save_screenshot(browser, "fine-metrics-page-many-labels")


@pytest.mark.slow
def test_names_from_tasks_are_shown_as_text(browser: Any, loop: Any) -> None:
    """Units, labels and task prefixes come from task code: the page shows them as
    text, and never parses them as HTML
    """
    unit = "~" + MARKUP.format("inunit")
    label = MARKUP.format("inlabel")
    prefix = "x" + MARKUP.format("inprefix")
    with demo_cluster(loop=loop) as (cluster, client):
        open_bokeh_page(browser, page_url(client))
        # Eight units of the tasks' own get a tab; the one sorted last does not,
        # and is named in the note under the tabs
        futures = [
            client.submit(post_as, "x", f"u{i}", key=f"units-{i}") for i in range(8)
        ]
        futures.append(client.submit(post_as, "x", unit, key="units-8"))
        futures.append(client.submit(post_as, label, "seconds", key=f"{prefix}-1"))
        client.gather(futures)
        client.get_fine_metrics(flush=True)
        wait_until(browser, lambda: unit in units_note(browser), what="the note")
        options = run_bokeh_js(
            browser,
            'return plain(byName("fine_metrics_prefix_filter")[0].options)'
            ".map((o) => (Array.isArray(o) ? o[0] : o));",
        )
        assert prefix in options
        # Open the filter's list, as a person would to choose a prefix
        browser.find_element("css selector", ".choices").click()
        wait_until(
            browser,
            lambda: prefix
            in run_bokeh_js(
                browser,
                """
                return [...document.querySelectorAll(".choices__item--choice")]
                  .map((e) => e.textContent.trim());
                """,
            ),
            what="the prefix among the filter's choices",
        )
        assert injected(browser) == []
        assert console_errors(browser) == []
        save_screenshot(browser, "fine-metrics-page-names-as-text")


def filter_options(driver: Any) -> list[str]:
    """The prefixes that the page's filter offers"""
    return run_bokeh_js(
        driver,
        'return plain(byName("fine_metrics_prefix_filter")[0].options)'
        ".map((o) => (Array.isArray(o) ? o[0] : o));",
    )


def first_of(x: int) -> int:
    return x


@pytest.mark.slow
def test_typing_in_the_filter_while_prefixes_arrive(browser: Any, loop: Any) -> None:
    """A person types in the prefix filter while tasks of a new prefix end: what
    they typed stays, and so does the focus; the new prefix is offered once the
    filter has lost it
    """
    with demo_cluster(loop=loop) as (cluster, client):
        open_bokeh_page(browser, page_url(client))
        client.submit(first_of, 1, key="alpha-1").result()
        client.get_fine_metrics(flush=True)
        wait_until(browser, lambda: filter_options(browser) == ["alpha"], what="alpha")
        browser.find_element("css selector", ".choices").click()
        browser.find_element("css selector", ".choices__input--cloned").send_keys("alp")
        client.submit(first_of, 2, key="beta-1").result()
        client.get_fine_metrics(flush=True)
        wait_until(
            browser,
            lambda: bokeh_sources(browser)["fine_metrics_prefix_options"]["value"]
            == ["alpha", "beta"],
            what="the new prefix in the browser",
        )
        typing = run_bokeh_js(
            browser,
            """
            const active = document.activeElement;
            return [active.value, active.closest(".choices") != null];
            """,
        )
        assert typing == ["alp", True]
        assert filter_options(browser) == ["alpha"]
        # The person moves on
        run_bokeh_js(browser, "document.activeElement.blur();")
        wait_until(
            browser,
            lambda: filter_options(browser) == ["alpha", "beta"],
            what="the new prefix in the filter",
        )
        assert console_errors(browser) == []


# Narrow windows and long names


def titles_cut(driver: Any) -> list[str]:
    """The plots whose title goes beyond the right edge of the plot, where bokeh
    cuts it (bokeh 2.4's views: the title starts at the frame's left edge)
    """
    return run_bokeh_js(
        driver,
        """
        const ctx = document.createElement("canvas").getContext("2d");
        const cut = [];
        const walk = (view) => {
          for (const child of view.child_views ?? []) walk(child);
          const title = view.model.title;
          if (view.frame === undefined || !title || !title.text) return;
          ctx.font = `${title.text_font_style} ${title.text_font_size} ${title.text_font}`;
          const right = view.frame.bbox.left + title.offset
            + ctx.measureText(title.text).width;
          if (right > view.canvas_view.bbox.width) cut.push(view.model.name);
        };
        for (const view of Object.values(Bokeh.index)) walk(view);
        return cut;
        """,
    )


def axis_labels(driver: Any, plot: str) -> list[str]:
    """The labels that bokeh draws on the categorical axis of a plot"""
    return run_bokeh_js(
        driver,
        """
        const name = arguments[0];
        let labels = null;
        const walk = (view) => {
          for (const child of view.child_views ?? []) walk(child);
          if (view.model.name !== name) return;
          for (const rv of view.renderer_views?.values() ?? []) {
            if (rv.model.type === "CategoricalAxis")
              labels = rv._get_factor_info()[0][0].items.map((box) => box.text);
          }
        };
        for (const view of Object.values(Bokeh.index)) walk(view);
        return labels;
        """,
        plot,
    )


def page_width(driver: Any) -> int:
    """The width of the page's layout, in pixels"""
    return run_bokeh_js(
        driver, "return document.querySelector('.bk-root > div').scrollWidth;"
    )


#: A task prefix longer than the axis of execute shows (PREFIX_AXIS_CHARS)
LONG_PREFIX = "read_parquet-fused-assign-getitem-groupby-sum-chunk"


@pytest.mark.slow
def test_narrow_window_and_long_names(browser: Any, loop: Any) -> None:
    """In a window narrower than the page's minimum width, the page scrolls
    sideways, and no title is cut; a long task prefix is shortened on the axis of
    execute, and whole in its source (and tooltip)
    """
    from distributed.dashboard.components.scheduler import (
        PREFIX_AXIS_CHARS,
        FineMetricsBreakdown,
    )

    with demo_cluster(loop=loop) as (cluster, client):
        demo_workload(client)
        client.submit(first_of, 1, key=f"{LONG_PREFIX}-0").result()
        settle(client)
        client.get_fine_metrics(flush=True)
        plot = "fine_metrics_execute_seconds_plot"
        for width in (800, 1024):
            browser.set_window_size(width, 900)
            open_bokeh_page(browser, page_url(client))
            wait_until(
                browser,
                lambda: len(axis_labels(browser, plot) or []) == 4,
                what="the execute plot's prefixes",
            )
            if width < FineMetricsBreakdown.MIN_WIDTH:
                assert page_width(browser) >= FineMetricsBreakdown.MIN_WIDTH
            else:
                assert_fits_the_window(browser)
            assert titles_cut(browser) == []
            # The demonstration's prefixes as they are, and the long one shortened
            [short] = set(axis_labels(browser, plot)) - DEMO_PREFIXES
            assert len(short) == PREFIX_AXIS_CHARS
            head, tail = short.split("\u2026")
            assert LONG_PREFIX.startswith(head) and LONG_PREFIX.endswith(tail)
            source = bokeh_sources(browser)["fine_metrics_execute_seconds"]
            assert LONG_PREFIX in source["prefix"]
            assert console_errors(browser) == []
            save_screenshot(browser, f"fine-metrics-page-{width}-wide")
