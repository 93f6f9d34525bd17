"""Testing dashboard pages and ``performance_report`` files in a real browser:
Debian's headless Chromium, driven by Selenium.

A test takes the ``browser`` fixture (registered by the root ``conftest.py``; it
marks the test ``browser``: ``make test-browser`` runs those), opens
a page with :func:`open_bokeh_page` (or a report file with :func:`open_html_file`),
reads back what bokeh holds with :func:`bokeh_sources`, :func:`bokeh_model`,
:func:`renderer_sources` or :func:`tab_titles`, checks :func:`console_errors`, and
keeps a picture with :func:`save_screenshot`::

    def test_page(browser, ...):
        open_bokeh_page(browser, f"http://127.0.0.1:{port}/individual-task-stream")
        assert "task_stream" in root_names(browser)
        (data,) = renderer_sources(browser, "task_stream")
        assert console_errors(browser) == []
        save_screenshot(browser, "task-stream")

The browser is ``/usr/bin/chromium`` and ``/usr/bin/chromedriver``
(``tools/install-chromium.sh``) and the Python package ``selenium``. Where one is
missing the tests are skipped, except under ``CI=true``, where they fail
(:mod:`distributed.tests.utils_ci`). Selenium is given the driver's path, so that
Selenium Manager never tries to download one.

The JavaScript reads BokehJS 2.4's document model (``Bokeh.documents``,
``Document.is_idle``, ``Document._all_models``).
"""
from __future__ import annotations

import os
import re
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

from distributed.tests.utils_ci import skip_or_fail

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

T = TypeVar("T")

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
INSTALL_HINT = (
    "tools/install-chromium.sh installs Debian's chromium and chromium-driver"
)

#: Chromium's options: headless, and what it needs to run as root in a container
#: without a GPU and with a small /dev/shm
CHROMIUM_ARGUMENTS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--window-size=1400,900",
)

#: Seconds to wait for a page to be drawn, by default
TIMEOUT = 30

#: Where :func:`save_screenshot` writes, if set; otherwise ``build/screenshots/``
#: of the repository
SCREENSHOTS_ENV = "FINE_METRICS_SCREENSHOTS"

#: A screenshot with fewer distinct colours than this is blank
MIN_COLOURS = 4

#: Without PIL, a PNG of the browser's window smaller than this is blank (Chromium's
#: of about:blank is 4.8 kB, of one heading 6.2 kB; a drawn bokeh plot 8 kB or more)
MIN_PNG_BYTES = 6_000


# The browser


def browser_unavailable_reason() -> str | None:
    """Why the browser cannot run here, or None if it can

    Returns
    -------
    str or None
        What is missing (selenium, chromium or chromedriver) and how to install it
    """
    try:
        import selenium  # noqa: F401
    except ModuleNotFoundError:
        return (
            "selenium is not installed: `make install` installs it "
            "(continuous_integration/requirements-test.txt)"
        )
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} is not installed: {INSTALL_HINT}"
    return None


def require_browser() -> None:
    """Skip the test if the browser cannot run here; fail it instead under
    ``CI=true``
    """
    reason = browser_unavailable_reason()
    if reason is not None:
        skip_or_fail(reason)


@contextmanager
def chromium_driver() -> Iterator[WebDriver]:
    """A headless Chromium WebDriver that records the browser's console

    Skips the test if the browser is missing (fails it under ``CI=true``). The
    driver is always quit on exit. The browser's temporary files go to a
    directory of their own, removed on exit: quit by the driver, Chromium leaves
    a directory in ``TMPDIR`` (that of its singleton socket), one per browser.

    Yields
    ------
    selenium.webdriver.remote.webdriver.WebDriver
    """
    require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    for argument in CHROMIUM_ARGUMENTS:
        options.add_argument(argument)
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    with tempfile.TemporaryDirectory(
        prefix="chromium-", ignore_cleanup_errors=True
    ) as tmp:
        service = Service(
            executable_path=CHROMEDRIVER, env={**os.environ, "TMPDIR": tmp}
        )
        driver = webdriver.Chrome(options=options, service=service)
        try:
            driver.set_script_timeout(TIMEOUT)
            yield driver
        finally:
            driver.quit()


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    """A headless Chromium WebDriver for one test (see :func:`chromium_driver`)"""
    with chromium_driver() as driver:
        yield driver


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "browser: needs a real browser (tools/install-chromium.sh). Automatically "
        "applied to all tests that use the 'browser' fixture.",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # As upstream's conftest marks the tests that use its 'ws' fixture
    for item in items:
        if "browser" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.browser)


# The console

#: What each driver's console said so far: the driver hands each entry out once
_console: weakref.WeakKeyDictionary[
    Any, list[dict[str, Any]]
] = weakref.WeakKeyDictionary()


def console_log(driver: WebDriver) -> list[dict[str, Any]]:
    """Everything the browser's console said since the driver started, on every
    page it opened

    Parameters
    ----------
    driver : WebDriver

    Returns
    -------
    list of dict
        Selenium's entries: ``level`` (``SEVERE``, ``WARNING``, ``INFO``, ...),
        ``message``, ``source``, ``timestamp``
    """
    log = _console.setdefault(driver, [])
    log.extend(driver.get_log("browser"))
    return list(log)


def is_favicon_404(entry: dict[str, Any]) -> bool:
    """Whether a console entry is the browser failing to load a favicon: the
    dashboard has none, and a report's is on the internet
    """
    return entry.get("source") == "network" and "favicon.ico" in entry["message"]


def console_errors(driver: WebDriver) -> list[str]:
    """The messages of the console's ``SEVERE`` entries since the driver started,
    but the favicon's

    Parameters
    ----------
    driver : WebDriver

    Returns
    -------
    list of str
    """
    return [
        entry["message"]
        for entry in console_log(driver)
        if entry["level"] == "SEVERE" and not is_favicon_404(entry)
    ]


def format_console(driver: WebDriver) -> str:
    """The console's log, one entry a line, for error messages"""
    try:
        entries = console_log(driver)
    except Exception as e:  # The browser itself may be gone
        return f"(no console log: {e!r})"
    lines = [f"{e['level']} {e['source']}: {e['message']}" for e in entries]
    return "\n".join(lines) or "(empty)"


# Waiting


def wait_until(
    driver: WebDriver,
    check: Callable[[], T],
    timeout: float = TIMEOUT,
    what: str = "the condition",
    interval: float = 0.1,
) -> T:
    """Call ``check`` until it returns something true without raising
    AssertionError; return that

    Parameters
    ----------
    driver : WebDriver
        The browser, whose console goes into the error
    check : callable
        Without arguments
    timeout : float
        Seconds
    what : str
        What is waited for, for the error
    interval : float
        Seconds between two calls

    Raises
    ------
    TimeoutError
        After ``timeout`` seconds, with ``check``'s last result or error and the
        browser's console
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            last: Any = check()
            if last:
                return last
        except AssertionError as e:
            last = e
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{what} did not hold within {timeout} s at {driver.current_url}; "
                f"last: {last!r}\nbrowser console:\n{format_console(driver)}"
            )
        time.sleep(interval)


# Reading BokehJS' documents

#: Defines ``plain(value)`` (a value as JSON: typed arrays as arrays, NaN and
#: infinities as {"$float": "NaN"}, models as references), ``ref(model)``,
#: ``docs()``, ``models()`` (every model of every document), ``byName(name)``,
#: ``allRoots()`` (a Set of the documents' roots) and ``tabsNamed(name)`` (see
#: :func:`tab_titles`)
_JS_PRELUDE = r"""
const ref = (m) => ({"$model": m.type, "id": m.id, "name": m.name ?? null});
const isModel = (v) => typeof v.id === "string" && v.properties !== undefined;
const entries = (o) => Object.entries(o).map(([k, x]) => [k, plain(x)]);
const plain = (v) => {
  if (v === null || v === undefined) return null;
  if (typeof v === "number") return Number.isFinite(v) ? v : {"$float": String(v)};
  if (typeof v === "string" || typeof v === "boolean") return v;
  if (typeof v === "bigint") return Number(v);
  if (typeof v === "function") return null;
  if (ArrayBuffer.isView(v)) return Array.from(v, plain);
  if (Array.isArray(v)) return v.map(plain);
  if (v instanceof Set) return [...v].map(plain);
  if (v instanceof Map) return Object.fromEntries([...v].map(([k, x]) => [String(k), plain(x)]));
  if (isModel(v)) return ref(v);
  if (Object.getPrototypeOf(v) === Object.prototype) return Object.fromEntries(entries(v));
  return String(v);
};
const docs = () => (window.Bokeh && window.Bokeh.documents) || [];
const models = () => docs().flatMap((d) => d._all_models
  ? [...d._all_models.values()]
  : d.roots().flatMap((r) => [r, ...r.references()]));
const byName = (name) => models().filter((m) => m.name === name);
const allRoots = () => new Set(docs().flatMap((d) => d.roots()));
const tabsNamed = (name) => {
  const tabs = models().filter((m) => m.type === "Tabs");
  if (name !== null) return tabs.filter((m) => m.name === name);
  return tabs.length > 1 ? tabs.filter((m) => allRoots().has(m)) : tabs;
};
"""


def _decode(value: Any) -> Any:
    """A value that :data:`_JS_PRELUDE`'s ``plain`` made, with NaN and infinities
    as floats again
    """
    if isinstance(value, dict):
        if value.keys() == {"$float"}:
            return float(value["$float"])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def run_bokeh_js(driver: WebDriver, body: str, *args: Any) -> Any:
    """Run JavaScript in the page, with helpers to read BokehJS' documents

    Parameters
    ----------
    driver : WebDriver
    body : str
        The body of a function, which ``return`` s its result; it may call
        ``docs()`` (BokehJS' documents), ``models()`` (all their models),
        ``byName(name)`` (the models of that name), ``allRoots()`` (a ``Set`` of
        the documents' roots), ``tabsNamed(name)`` (the ``Tabs`` of
        :func:`tab_titles`), ``ref(model)`` and ``plain(value)`` (a value as
        JSON: typed arrays as arrays, NaN and infinities kept, models as
        ``{"$model": type, "id": ..., "name": ...}``); ``arguments`` holds
        ``args``
    *args
        JSON values

    Returns
    -------
    The JavaScript's result, with NaN and infinities back as floats
    """
    return _decode(driver.execute_script(_JS_PRELUDE + body, *args))


#: The state of the page, for :func:`open_bokeh_page`: drawn, when every document
#: has roots, every document's views have finished drawing (``is_idle``, what
#: bokeh's own export_png waits for) and, if there is a plot, a canvas is there
_JS_PAGE_STATE = r"""
const state = {
  title: document.title,
  text: (document.body ? document.body.innerText : "").slice(0, 200),
  bokeh: window.Bokeh !== undefined,
  documents: docs().length,
  roots: docs().map((d) => d.roots().length),
  idle: docs().map((d) => d.is_idle !== false),
  plots: models().filter((m) => /Plot$/.test(m.type)).length,
  canvases: document.querySelectorAll(".bk-root canvas").length,
};
state.drawn = state.documents > 0
  && state.roots.every((n) => n > 0) && state.idle.every((x) => x)
  && (state.plots == 0 || state.canvases > 0);
return state;
"""


def page_state(driver: WebDriver) -> dict[str, Any]:
    """How far bokeh got with drawing the page: ``drawn`` (bool), and the number
    of ``documents``, their ``roots`` and whether each is ``idle``, the number of
    ``plots`` and ``canvases``, the page's ``title`` and the start of its ``text``
    """
    return run_bokeh_js(driver, _JS_PAGE_STATE)


def wait_until_drawn(driver: WebDriver, timeout: float = TIMEOUT) -> None:
    """Wait until bokeh has drawn the page (see :func:`page_state`)

    Raises
    ------
    TimeoutError
        With the page's state and the browser's console
    """

    def drawn() -> bool:
        state = page_state(driver)
        assert state["drawn"], state
        return True

    wait_until(driver, drawn, timeout, what="bokeh drawing the page")


def open_bokeh_page(driver: WebDriver, url: str, timeout: float = TIMEOUT) -> None:
    """Load ``url`` and wait until bokeh has drawn it

    A page served by bokeh draws only once its websocket delivered the document;
    one that embeds its document (a ``performance_report``) once BokehJS loaded.

    Parameters
    ----------
    driver : WebDriver
    url : str
    timeout : float
        Seconds

    Raises
    ------
    TimeoutError
        If the page is not drawn within ``timeout``, with its state and the
        browser's console
    """
    driver.get(url)
    wait_until_drawn(driver, timeout)


#: A script that a bokeh HTML file made with the default resources loads
_CDN_SCRIPT = re.compile(r"""<script[^>]*\ssrc=["']https?://cdn\.bokeh\.org/""")


def open_html_file(
    driver: WebDriver, path: str | os.PathLike[str], timeout: float = TIMEOUT
) -> None:
    """Open a local HTML file made by bokeh, such as a ``performance_report``, and
    wait until bokeh has drawn it

    The file must embed BokehJS (``performance_report(..., mode="inline")``): by
    default it loads BokehJS from the internet.

    Raises
    ------
    ValueError
        If the file loads BokehJS from bokeh's CDN
    TimeoutError
        As :func:`open_bokeh_page`
    """
    path = Path(path).resolve()
    if _CDN_SCRIPT.search(path.read_text(errors="replace")):
        raise ValueError(
            f"{path} loads BokehJS from cdn.bokeh.org; "
            'make it with performance_report(..., mode="inline")'
        )
    open_bokeh_page(driver, path.as_uri(), timeout)


def bokeh_roots(driver: WebDriver) -> list[dict[str, Any]]:
    """The roots of the page's documents, as ``{"$model": type, "id": ...,
    "name": ...}``
    """
    return run_bokeh_js(driver, "return docs().flatMap((d) => d.roots()).map(ref);")


def root_names(driver: WebDriver) -> list[str | None]:
    """The names of the roots of the page's documents, in order"""
    return [root["name"] for root in bokeh_roots(driver)]


def bokeh_sources(driver: WebDriver) -> dict[str, dict[str, list[Any]]]:
    """The data of every ``ColumnDataSource`` (or subclass) of the page that has a
    name

    Returns
    -------
    dict
        ``{name: {column: list}}``; typed arrays as lists (a 2-D array flattened),
        NaN as ``float("nan")``

    Raises
    ------
    AssertionError
        If two sources have the same name
    """
    pairs = run_bokeh_js(
        driver,
        """
        return models()
          .filter((m) => m.name && m.data !== undefined && m.get_length !== undefined)
          .map((m) => [m.name, plain(m.data)]);
        """,
    )
    names = [name for name, _ in pairs]
    assert len(set(names)) == len(names), f"sources of the same name: {names}"
    return dict(pairs)


def bokeh_model(driver: WebDriver, name: str) -> dict[str, Any]:
    """The model named ``name``: its type, id and attributes

    Returns
    -------
    dict
        ``{"$model": type, "id": ..., "name": ..., "attributes": {...}}``; in the
        attributes, other models are references ``{"$model": type, "id": ...,
        "name": ...}``, typed arrays are lists, NaN is ``float("nan")``

    Raises
    ------
    AssertionError
        If there is no such model, or more than one
    """
    found = run_bokeh_js(
        driver,
        "return byName(arguments[0]).map((m) => ({...ref(m), attributes: "
        "Object.fromEntries(entries(m.attributes))}));",
        name,
    )
    assert len(found) == 1, f"{len(found)} models named {name!r}"
    return found[0]


def renderer_sources(driver: WebDriver, plot: str) -> list[dict[str, list[Any]]]:
    """The data of the sources of the glyph renderers of the plot named ``plot``
    (the dashboard names its figures, not their sources), each source once, in
    the order of the renderers

    Returns
    -------
    list of dict
        ``{column: list}`` as in :func:`bokeh_sources`
    """
    return run_bokeh_js(
        driver,
        """
        const plots = byName(arguments[0]);
        if (plots.length != 1) throw new Error(`${plots.length} models named ${arguments[0]}`);
        const sources = plots[0].renderers
          .map((r) => r.data_source).filter((s) => s && s.data !== undefined);
        return [...new Set(sources)].map((s) => plain(s.data));
        """,
        plot,
    )


def tab_titles(driver: WebDriver, name: str | None = None) -> list[str]:
    """The titles of the tabs of the ``Tabs`` named ``name``; without a name, of
    the page's only ``Tabs``, or, if it has several (a report's tab holding tabs
    of its own), of the one that is a root of its document

    Raises
    ------
    AssertionError
        If there is no such ``Tabs``, or more than one
    """
    found = run_bokeh_js(
        driver,
        "return tabsNamed(arguments[0]).map((m) => m.tabs.map((t) => t.title));",
        name,
    )
    assert len(found) == 1, f"{len(found)} Tabs named {name!r}"
    return found[0]


def select_tab(
    driver: WebDriver, title: str, name: str | None = None, timeout: float = TIMEOUT
) -> None:
    """Show the tab ``title`` of the ``Tabs`` named ``name`` (without a name, as
    in :func:`tab_titles`), as a click on it would, and wait until it is drawn
    """
    titles = tab_titles(driver, name)
    assert titles.count(title) == 1, f"{title!r} not once in {titles}"
    run_bokeh_js(
        driver,
        "tabsNamed(arguments[0])[0].active = arguments[1];",
        name,
        titles.index(title),
    )
    # Bokeh lays the tab out and paints it in the next animation frames
    driver.execute_async_script(
        "const done = arguments[0];"
        "requestAnimationFrame(() => requestAnimationFrame(() => done(null)));"
    )
    wait_until_drawn(driver, timeout)


# Screenshots


def screenshots_dir() -> Path:
    """Where :func:`save_screenshot` writes: ``$FINE_METRICS_SCREENSHOTS`` if set;
    otherwise ``build/screenshots/`` of the repository (the folder holding
    ``patches/series`` above this file, which runs from ``build/tree``); otherwise
    ``dask-screenshots/`` in the temporary folder
    """
    if os.environ.get(SCREENSHOTS_ENV):
        return Path(os.environ[SCREENSHOTS_ENV])
    for parent in Path(__file__).resolve().parents:
        if (parent / "patches" / "series").is_file():
            return parent / "build" / "screenshots"
    return Path(tempfile.gettempdir()) / "dask-screenshots"


def png_colours(path: str | os.PathLike[str]) -> int | None:
    """The number of distinct colours of a PNG, up to :data:`MIN_COLOURS`; None
    without PIL (pillow, which bokeh needs, is normally there)
    """
    try:
        from PIL import Image
    except ModuleNotFoundError:
        return None
    with Image.open(path) as image:
        colours = image.convert("RGB").getcolors(MIN_COLOURS)
    return MIN_COLOURS if colours is None else len(colours)


def is_blank_png(path: str | os.PathLike[str]) -> bool:
    """Whether a screenshot shows (nearly) nothing: fewer than
    :data:`MIN_COLOURS` colours; or, without PIL, fewer than
    :data:`MIN_PNG_BYTES` bytes
    """
    colours = png_colours(path)
    if colours is None:
        return os.path.getsize(path) < MIN_PNG_BYTES
    return colours < MIN_COLOURS


def save_screenshot(driver: WebDriver, name: str) -> Path:
    """Save a screenshot of the browser's window as ``NAME.png`` in
    :func:`screenshots_dir`, replacing one of the same name

    Parameters
    ----------
    driver : WebDriver
    name : str
        Letters, digits, ``-``, ``_`` and ``.``

    Returns
    -------
    pathlib.Path
        The PNG

    Raises
    ------
    AssertionError
        If the screenshot is blank (it is kept, to be looked at)
    """
    if not re.fullmatch(r"[\w.-]+", name):
        raise ValueError(f"not a file name: {name!r}")
    folder = screenshots_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    assert driver.save_screenshot(str(path)), f"no screenshot of {driver.current_url}"
    assert not is_blank_png(path), f"blank screenshot of {driver.current_url}: {path}"
    return path
