"""The helpers of :mod:`distributed.tests.utils_browser`, against upstream's own
dashboard pages and ``performance_report`` files in a real headless Chromium.

The tests that run the browser need Debian's ``chromium`` and ``chromium-driver``
(``tools/install-chromium.sh``) and ``selenium``; without them they are skipped,
unless ``CI=true``: then they fail.
"""
from __future__ import annotations

import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from distributed import Client, Event, LocalCluster, performance_report, wait
from distributed.diagnostics.task_stream import rectangles
from distributed.tests import utils_browser
from distributed.tests.utils_browser import (
    bokeh_model,
    bokeh_sources,
    chromium_driver,
    console_errors,
    is_blank_png,
    open_bokeh_page,
    open_html_file,
    renderer_sources,
    root_names,
    run_bokeh_js,
    save_screenshot,
    select_tab,
    tab_titles,
    wait_until,
)
from distributed.tests.utils_ci import (
    import_or_skip,
    loopback_process_cluster,
    skip_or_fail,
)

# The tests without a browser too: they test the browser's helpers
pytestmark = pytest.mark.browser

try:
    import bokeh  # noqa: F401
except ModuleNotFoundError:
    skip_or_fail("bokeh is not installed: `make install` installs it")

#: The tabs of the fork's performance_report, in order: upstream's, with "Fine
#: metrics" (a tab holding tabs of its own) after "Task Stream"
REPORT_TABS = [
    "Summary",
    "Task Stream",
    "Fine metrics",
    "System",
    "Scheduler Logs",
    "Worker Profile (compute)",
    "Worker Profile (administrative)",
    "Scheduler Profile (administrative)",
    "Bandwidth (Workers)",
    "Bandwidth (Types)",
]


def dashboard_url(cluster: LocalCluster, page: str) -> str:
    return f"http://127.0.0.1:{cluster.scheduler.http_server.port}/{page}"


def make_data(n: int) -> bytes:
    return b"x" * n


def inc(x: int) -> int:
    return x + 1


def run_workload(c: Client) -> int:
    """Compute a few tasks, one of them with a dependency on the other worker (a
    transfer); return the number of tasks
    """
    c.wait_for_workers(2, timeout=60)
    a, b = sorted(c.scheduler_info()["workers"])
    source = c.submit(make_data, 1000, key="source-0", workers=[a])
    sink = c.submit(len, source, key="sink-0", workers=[b])
    incs = c.map(inc, range(10), key=[f"inc-{i}" for i in range(10)])
    wait([sink, *incs], timeout=60)
    assert sink.result() == 1000
    return 2 + len(incs)


def rectangle_keys(data: dict[str, list[Any]]) -> Counter[str]:
    """The keys of a task stream's rectangles, but of the placeholder that
    upstream's figure starts with (transparent, key ``start``)
    """
    return Counter(
        key
        for key, alpha in zip(data["key"], data["alpha"])
        if not (key == "start" and alpha == 0)
    )


# The skip-or-fail policy, without a browser


@pytest.mark.parametrize("missing", ["CHROMIUM", "CHROMEDRIVER"])
def test_missing_browser_skips_or_fails_on_ci(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, missing: str
) -> None:
    absent = str(tmp_path / "absent")
    monkeypatch.setattr(utils_browser, missing, absent)
    # Only the one under test is missing, also where neither is installed
    present = tmp_path / "present"
    present.write_text("")
    present.chmod(0o755)
    other = "CHROMEDRIVER" if missing == "CHROMIUM" else "CHROMIUM"
    monkeypatch.setattr(utils_browser, other, str(present))

    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=f"{absent} is not installed"):
        utils_browser.require_browser()
    with pytest.raises(pytest.skip.Exception, match="install-chromium.sh"):
        with chromium_driver():
            pass  # pragma: nocover

    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true, so this fails"):
        utils_browser.require_browser()
    with pytest.raises(pytest.fail.Exception, match=f"{absent} is not installed"):
        with chromium_driver():
            pass  # pragma: nocover


def test_missing_selenium_skips_or_fails_on_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "selenium", None)  # type: ignore[misc]
    reason = utils_browser.browser_unavailable_reason()
    assert reason is not None and reason.startswith("selenium is not installed")

    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="selenium is not installed"):
        utils_browser.require_browser()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="selenium is not installed"):
        utils_browser.require_browser()


def test_missing_library_skips_or_fails_on_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # type: ignore[misc]
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="prometheus_client can't be"):
        import_or_skip("prometheus_client")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="make install installs it"):
        import_or_skip("prometheus_client")
    monkeypatch.undo()
    assert import_or_skip("prometheus_client") is sys.modules["prometheus_client"]


def test_decode_nan_and_infinities() -> None:
    decoded = utils_browser._decode(
        {"x": [1, 2.5, {"$float": "NaN"}, {"$float": "-Infinity"}], "y": ["NaN"]}
    )
    assert decoded["x"][:2] == [1, 2.5]
    assert decoded["x"][2] != decoded["x"][2]
    assert decoded["x"][3] == float("-inf")
    assert decoded["y"] == ["NaN"]


def test_html_file_from_the_cdn_is_refused(tmp_path: Path) -> None:
    report = tmp_path / "report.html"
    report.write_text(
        '<script src="https://cdn.bokeh.org/bokeh/release/bokeh-2.4.3.min.js">'
    )
    with pytest.raises(ValueError, match='mode="inline"'):
        open_html_file(None, report)  # type: ignore[arg-type]


# The helpers in the browser


@pytest.mark.slow
def test_js_values_come_back(browser: Any) -> None:
    """Typed arrays, NaN and infinities, nested arrays and models, as JSON"""
    browser.get("data:text/html,<p>no bokeh here</p>")
    value = run_bokeh_js(
        browser,
        """
        return plain({f: new Float64Array([1.5, NaN, -Infinity]),
                      i: new Int32Array([1, 2]), nested: [[1, NaN], ["a"]],
                      map: new Map([[1, "one"]]), none: undefined});
        """,
    )
    assert value["f"][0] == 1.5
    assert value["f"][1] != value["f"][1]
    assert value["f"][2] == float("-inf")
    assert value["i"] == [1, 2]
    assert value["nested"][1] == ["a"]
    assert value["map"] == {"1": "one"}
    assert value["none"] is None


@pytest.mark.slow
def test_browser_leaves_no_temporary_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chromium's temporary files, which it leaves when the driver quits it, are
    in a directory of the driver's, removed with it
    """
    # Not pytest's tmp_path: Chromium's socket is in there, and the path of a
    # socket is limited to about 100 characters
    with tempfile.TemporaryDirectory() as name:
        base = Path(name)
        monkeypatch.setattr(tempfile, "tempdir", name)
        with chromium_driver() as driver:
            driver.get("about:blank")
            (tmp,) = base.iterdir()
            assert any(p.name.startswith("org.chromium.") for p in tmp.iterdir())
        assert list(base.iterdir()) == []


@pytest.mark.slow
def test_page_without_bokeh_times_out_with_the_console(browser: Any) -> None:
    browser.get("data:text/html,<script>console.error('boom')</script>")
    with pytest.raises(TimeoutError) as info:
        utils_browser.wait_until_drawn(browser, timeout=0.5)
    message = str(info.value)
    assert "bokeh drawing the page did not hold within 0.5 s" in message
    assert "'bokeh': False" in message
    assert "boom" in message
    assert any("boom" in error for error in console_errors(browser))


@pytest.mark.slow
def test_blank_screenshot_is_refused(
    browser: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(utils_browser.SCREENSHOTS_ENV, str(tmp_path))
    browser.get("about:blank")
    with pytest.raises(AssertionError, match="blank screenshot"):
        save_screenshot(browser, "blank")
    assert is_blank_png(tmp_path / "blank.png")
    with pytest.raises(ValueError, match="not a file name"):
        save_screenshot(browser, "../elsewhere")


@pytest.mark.slow
def test_named_sources_come_back(
    browser: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A standalone bokeh file with named sources (numpy arrays travel as typed
    arrays) and tabs within tabs: every named source, NaN included; a model by
    name; the tabs of the root, or by name
    """
    import numpy as np
    from bokeh.embed import file_html
    from bokeh.models import ColumnDataSource, Div, Tabs
    from bokeh.plotting import figure
    from bokeh.resources import INLINE

    from distributed.dashboard.core import TabPanel

    fruit = ColumnDataSource(
        {"x": np.array([1.0, np.nan, 3.0]), "n": [1, 2, 3], "f": ["a", "b", "c"]},
        name="fruit",
    )
    plot = figure(name="plot", title="Fruit", x_range=["a", "b", "c"])
    plot.vbar(x="f", top="x", width=0.5, source=fruit)
    unnamed = ColumnDataSource({"x": ["b"], "y": [0.5]})
    plot.circle(x="x", y="y", source=unnamed)
    inner = Tabs(
        tabs=[
            TabPanel(child=Div(text="hello"), title="Hello"),
            TabPanel(child=Div(text="world"), title="World"),
        ],
        name="inner",
    )
    tabs = Tabs(
        tabs=[TabPanel(child=inner, title="Text"), TabPanel(child=plot, title="Plot")],
        name="tabs",
    )
    page = tmp_path / "page.html"
    page.write_text(file_html(tabs, INLINE, "test"))

    open_html_file(browser, page)
    assert root_names(browser) == ["tabs"]
    # Without a name, the Tabs that is a root: a report's tab may hold tabs too
    assert tab_titles(browser) == ["Text", "Plot"]
    assert tab_titles(browser, "tabs") == ["Text", "Plot"]
    assert tab_titles(browser, "inner") == ["Hello", "World"]
    sources = bokeh_sources(browser)
    assert list(sources) == ["fruit"]
    x = sources["fruit"].pop("x")
    assert x[0] == 1.0 and x[1] != x[1] and x[2] == 3.0
    assert sources["fruit"] == {"n": [1, 2, 3], "f": ["a", "b", "c"]}
    model = bokeh_model(browser, "fruit")
    assert model["$model"] == "ColumnDataSource"
    assert model["attributes"]["data"]["n"] == [1, 2, 3]
    data = renderer_sources(browser, "plot")
    assert [sorted(d) for d in data] == [["f", "n", "x"], ["x", "y"]]

    select_tab(browser, "World", "inner")
    assert bokeh_model(browser, "inner")["attributes"]["active"] == 1
    assert bokeh_model(browser, "tabs")["attributes"]["active"] == 0
    select_tab(browser, "Plot")
    assert bokeh_model(browser, "tabs")["attributes"]["active"] == 1
    assert console_errors(browser) == []
    monkeypatch.setenv(utils_browser.SCREENSHOTS_ENV, str(tmp_path))
    assert not is_blank_png(save_screenshot(browser, "fruit"))


def test_screenshots_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(utils_browser.SCREENSHOTS_ENV, str(tmp_path / "shots"))
    assert utils_browser.screenshots_dir() == tmp_path / "shots"
    monkeypatch.delenv(utils_browser.SCREENSHOTS_ENV)
    folder = utils_browser.screenshots_dir()
    assert folder.name in ("screenshots", "dask-screenshots")
    if folder.name == "screenshots":
        assert (folder.parent.parent / "patches" / "series").is_file()


# Upstream's dashboard


@pytest.mark.slow
def test_individual_task_stream(browser: Any, loop: Any) -> None:
    """The task stream page draws a rectangle per task and transfer that the
    scheduler's task stream holds
    """
    with loopback_process_cluster(loop) as cluster, Client(cluster, loop=loop) as c:
        c.get_task_stream()  # starts recording
        n_tasks = run_workload(c)
        expected = Counter(rectangles(c.get_task_stream())["key"])
        assert sum(expected.values()) > n_tasks  # a transfer too
        assert expected["source-0"] == 2  # computed, then sent

        open_bokeh_page(browser, dashboard_url(cluster, "individual-task-stream"))
        assert root_names(browser) == ["task_stream"]
        assert bokeh_model(browser, "task_stream")["$model"] == "Plot"

        def same_rectangles() -> bool:
            (data,) = renderer_sources(browser, "task_stream")
            assert rectangle_keys(data) == expected
            return True

        wait_until(browser, same_rectangles, what="the scheduler's rectangles")
        assert console_errors(browser) == []
        save_screenshot(browser, "individual-task-stream")


def block(i: int, event: Event) -> int:
    event.wait()
    return i


@pytest.mark.slow
def test_individual_nprocessing(browser: Any, loop: Any) -> None:
    """The page shows each worker's number of processing tasks, as the scheduler
    has it
    """
    with loopback_process_cluster(loop) as cluster, Client(cluster, loop=loop) as c:
        c.wait_for_workers(2, timeout=60)
        event = Event()
        futures = c.map(block, range(5), event=event)

        def processing() -> dict[str, int]:
            counts = c.run_on_scheduler(
                lambda dask_scheduler: {
                    ws.address: len(ws.processing)
                    for ws in dask_scheduler.workers.values()
                }
            )
            assert len(counts) == 2 and all(counts.values())  # both busy
            return counts

        expected = wait_until(browser, processing, what="tasks on the workers")
        try:
            open_bokeh_page(browser, dashboard_url(cluster, "individual-nprocessing"))
            assert root_names(browser) == ["processing"]

            def same_counts() -> bool:
                (data, *_) = renderer_sources(browser, "processing")
                page = dict(zip(data["worker"], data["nprocessing"]))
                assert page == expected == processing()
                return True

            wait_until(browser, same_counts, what="the scheduler's counts")
            assert console_errors(browser) == []
            save_screenshot(browser, "individual-nprocessing")
        finally:
            event.set()
        assert c.gather(futures) == list(range(5))


# Upstream's performance_report


@pytest.mark.slow
def test_performance_report(browser: Any, loop: Any, tmp_path: Path) -> None:
    """A report made with mode="inline" opens from disk: its tabs, and a rectangle
    per task in its task stream
    """
    report = tmp_path / "report.html"
    with loopback_process_cluster(loop) as cluster, Client(cluster, loop=loop) as c:
        c.wait_for_workers(2, timeout=60)
        with performance_report(filename=report, mode="inline"):
            n_tasks = run_workload(c)
        expected = Counter(rectangles(c.get_task_stream())["key"])
        # The default mode loads BokehJS from the internet
        with performance_report(filename=tmp_path / "cdn.html"):
            c.submit(inc, 1).result()

    with pytest.raises(ValueError, match="cdn.bokeh.org"):
        open_html_file(browser, tmp_path / "cdn.html")

    open_html_file(browser, report)
    assert root_names(browser) == [None]
    assert tab_titles(browser) == REPORT_TABS
    (data,) = renderer_sources(browser, "task_stream")
    assert rectangle_keys(data) == expected
    assert sum(expected.values()) > n_tasks  # a transfer too
    # Upstream names none of its sources; the fork's Fine metrics tab names all
    assert bokeh_sources(browser)
    assert all(name.startswith("fine_metrics_") for name in bokeh_sources(browser))
    assert console_errors(browser) == []
    save_screenshot(browser, "performance-report-summary")

    select_tab(browser, "Task Stream")
    (root,) = utils_browser.bokeh_roots(browser)
    assert bokeh_model(browser, "task_stream")["$model"] == "Plot"
    active = run_bokeh_js(
        browser, "return docs()[0].get_model_by_id(arguments[0]).active;", root["id"]
    )
    assert active == REPORT_TABS.index("Task Stream")
    assert console_errors(browser) == []
    save_screenshot(browser, "performance-report-task-stream")
