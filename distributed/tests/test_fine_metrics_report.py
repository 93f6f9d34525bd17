from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import urllib.request
from types import SimpleNamespace

import pytest

from distributed import Worker
from distributed.compatibility import WINDOWS
from distributed.diagnostics.fine_metrics import (
    cluster_fine_metrics,
    demo,
    demo_cluster,
    demo_workload,
    format_table,
    format_thread_seconds,
    is_fine_metric,
    page_url,
    thread_seconds_add_up,
    views_agree,
    wait_for_enter,
    workers_fine_metrics,
)
from distributed.utils_test import async_poll_for, gen_cluster, inc, poll_for


def test_is_fine_metric():
    assert is_fine_metric(("execute", "inc", "thread-cpu", "seconds"))
    assert is_fine_metric(("gather-dep", "network", "seconds"))
    assert is_fine_metric(("memory-monitor", "disk-write", "bytes"))
    assert not is_fine_metric("latency")
    assert not is_fine_metric(("execute",))
    assert not is_fine_metric(("other", "x", "seconds"))


#: The words of the table's header, but for the tasks' own units
HEADER = ["activity", "task", "prefix", "label", "seconds", "bytes", "count"]


def test_format_table():
    metrics = {
        ("execute", "inc", "thread-cpu", "seconds"): 1.5,
        ("execute", "inc", "thread-noncpu", "seconds"): 0.25,
        ("execute", "inc", "disk-read", "bytes"): 3 * 2**20,
        ("execute", "inc", "disk-read", "count"): 3,
        ("execute", "inc", ("ping", "x"), "count"): 2,
        ("execute", "inc", "download", "rows"): 7,
        ("execute", "dec", "failed", "seconds"): 0.5,
        ("gather-dep", "network", "seconds"): 2.0,
        ("get-data", "serialize", "seconds"): 0.125,
        "latency": 123.0,  # not a fine metric: ignored
    }
    lines = format_table(metrics).splitlines()
    header = lines[0].split()
    assert header == [*HEADER, "rows"]
    assert set(lines[1]) == {"-", " "}
    rows = [line.split() for line in lines[2:]]
    # execute first, prefixes in order, then gather-dep, get-data
    assert [r[0] for r in rows] == ["execute"] * 8 + [
        "gather-dep",
        "gather-dep",
        "get-data",
        "get-data",
    ]
    assert rows[0] == ["execute", "dec", "failed", "0.500"]
    assert rows[1] == ["execute", "dec", "(total)", "0.500"]
    # Largest seconds first; labels without seconds after them
    assert rows[2] == ["execute", "inc", "thread-cpu", "1.500"]
    assert rows[3] == ["execute", "inc", "thread-noncpu", "0.250"]
    assert rows[4] == ["execute", "inc", "disk-read", "3.00", "MiB", "3"]
    assert rows[5] == ["execute", "inc", "download", "7"]
    assert rows[6] == ["execute", "inc", "ping/x", "2"]
    assert rows[7] == ["execute", "inc", "(total)", "1.750"]
    assert rows[8:] == [
        ["gather-dep", "network", "2.000"],
        ["gather-dep", "(total)", "2.000"],
        ["get-data", "serialize", "0.125"],
        ["get-data", "(total)", "0.125"],
    ]


def test_format_table_names_on_one_line():
    """Prefixes, labels and units that hold a newline, a tab or another character
    that is not printable stay on their line, escaped as in a repr; the rest of the
    text is as it is
    """
    metrics = {
        ("execute", "new\nline", "my\tsleep", "seconds"): 0.5,
        ("execute", "ünï", 'q"uo\\te\x00', 'u"nit\n'): 1,
        ("gather-dep", "a\rb", "seconds"): 0.25,
    }
    lines = format_table(metrics).splitlines()
    assert lines[0].split() == [*HEADER, 'u"nit\\n']
    rows = [line.split() for line in lines[2:]]
    assert rows == [
        ["execute", "new\\nline", "my\\tsleep", "0.500"],
        ["execute", "new\\nline", "(total)", "0.500"],
        ["execute", "ünï", 'q"uo\\te\\x00', "1"],
        ["execute", "ünï", "(total)", "0.000"],
        ["gather-dep", "a\\rb", "0.250"],
        ["gather-dep", "(total)", "0.250"],
    ]
    # Every line as wide as the header's rule, but for trailing blanks
    assert all(len(line) <= len(lines[1]) for line in lines)


def test_format_table_empty():
    assert format_table({"latency": 1.0}).splitlines()[0].split()[:3] == [
        "activity",
        "task",
        "prefix",
    ]


@gen_cluster(client=True)
async def test_cluster_fine_metrics(c, s, a, b):
    x = c.submit(inc, 1, workers=[a.address])
    y = c.submit(inc, x, workers=[b.address])
    assert await y == 3
    # get_data posts its metrics once the peer acknowledged the data
    await async_poll_for(
        lambda: not a.transfer_outgoing_count and not b.transfer_outgoing_count, 5
    )
    metrics = dict(await cluster_fine_metrics(c))
    assert all(is_fine_metric(k) for k in metrics)
    expected: dict = {}
    for w in (a, b):
        assert isinstance(w, Worker)
        for k, v in w.digests_total.items():
            if is_fine_metric(k):
                expected[k] = expected.get(k, 0) + v
    assert metrics == pytest.approx(expected)
    assert views_agree(metrics, expected)
    assert views_agree(metrics, await workers_fine_metrics(c))
    assert not views_agree(metrics, {**expected, ("get-data", "x", "count"): 1})
    assert metrics[("execute", "inc", "thread-cpu", "seconds")] > 0
    assert metrics[("gather-dep", "network", "seconds")] > 0
    assert metrics[("get-data", "network", "seconds")] > 0


def printed_url(out: str) -> str:
    """The URL of the dashboard's page that the demo printed"""
    [url] = re.findall(r"^The dashboard shows them at (\S+)$", out, flags=re.M)
    return url


def fetch_page(url: str) -> str:
    """GET a page of the dashboard; check it is the page of fine metrics"""
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        body = response.read().decode()
    # With bokeh missing, the dashboard answers every page with a "Dask needs
    # bokeh" page, with status 200 too
    assert re.search(r"<title>\s*Dask: FineMetricsBreakdown\s*</title>", body), body
    assert "bokeh" in body.lower()
    return body


def assert_demo_table(metrics: dict) -> None:
    """The table of the demo's metrics shows every activity, spilling, transfers
    and the failure
    """
    rows = [line.split() for line in format_table(metrics).splitlines()[2:]]
    found = {
        (r[0], r[1] if r[0] == "execute" else "", r[2 if r[0] == "execute" else 1])
        for r in rows
    }
    for expected in [
        ("execute", "make-chunk", "thread-cpu"),
        ("execute", "make-chunk", "disk-write"),
        ("execute", "crunch", "thread-noncpu"),
        ("execute", "crunch", "crunch"),
        ("execute", "crunch", "pairs"),
        ("execute", "crunch", "disk-read"),
        ("execute", "explode", "failed"),
        ("gather-dep", "", "network"),
        ("gather-dep", "", "disk-write"),
        ("get-data", "", "network"),
        ("get-data", "", "disk-read"),
        ("threads", "", "busy"),
        ("threads", "", "idle-no-tasks"),
    ]:
        assert expected in found, expected


@pytest.mark.slow
def test_demo_workload_releases_its_keys(loop):
    """Once the demonstration workload returns, its futures are gone, and the
    workers free its keys, spilled ones included, while they still run
    """
    with demo_cluster(loop=loop) as (_, client):
        demo_workload(client)
        # Released by the client's event loop, once the futures are gone
        poll_for(lambda: not client.futures, timeout=10)
        poll_for(
            lambda: not any(
                client.run(lambda dask_worker: len(dask_worker.data)).values()
            ),
            timeout=10,
        )


@pytest.mark.slow
def test_demo(loop, capsys):
    """The demo shows every activity, spilling, transfers and the failure, and
    says where the dashboard's page is; without a terminal, it does not wait
    """
    assert not sys.stdin.isatty()  # pytest's, which raises if read
    metrics, agree = demo(loop=loop)
    assert agree
    assert_demo_table(metrics)
    printed = capsys.readouterr().out
    assert format_table(metrics) in printed
    assert printed_url(printed).endswith("/individual-fine-performance-metrics")
    assert "Press Enter" not in printed
    # Each worker's threads, partitioned
    assert "Each worker's states add up to its threads times its lifetime." in printed
    assert printed.count(": 2 threads x ") == 2
    assert re.search(r"threads were busy \d+\.\d% of the time", printed)


@pytest.mark.slow
@pytest.mark.skipif(WINDOWS, reason="needs a pseudo-terminal")
def test_demo_in_a_terminal(tmp_path):
    """``make demo`` in a terminal says where the dashboard's page is and keeps the
    cluster up until Enter is pressed
    """
    import pty

    stdout = tmp_path / "stdout"
    terminal, terminal_side = pty.openpty()
    with stdout.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "distributed.diagnostics.fine_metrics"],
            stdin=terminal_side,
            stdout=out,
            stderr=subprocess.DEVNULL,
        )
    try:
        poll_for(lambda: "Press Enter" in stdout.read_text(), timeout=120)
        url = printed_url(stdout.read_text())
        fetch_page(url)
        assert proc.poll() is None  # waiting
        os.write(terminal, b"\n")
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        os.close(terminal)
        os.close(terminal_side)
    printed = stdout.read_text()
    assert "The scheduler's view agrees with the workers' own totals" in printed
    assert printed.rstrip().endswith("Press Enter to stop the cluster.")
    # Enter stopped the cluster: the page is gone
    with pytest.raises(OSError):
        fetch_page(url)


@pytest.mark.parametrize(
    "link,url",
    [
        (
            "http://127.0.0.1:8787/status",
            "http://127.0.0.1:8787/individual-fine-performance-metrics",
        ),
        (
            "https://hub.example/user/me/proxy/8787/status",
            "https://hub.example/user/me/proxy/8787/individual-fine-performance-metrics",
        ),
    ],
)
def test_page_url(link, url):
    """The page is beside the dashboard's status page, wherever that is"""
    assert page_url(SimpleNamespace(dashboard_link=link)) == url  # type: ignore


class Terminal(io.StringIO):
    """The standard input of a terminal, where Enter is pressed at once"""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def isatty(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> str:
        self.reads += 1
        return "\n"


class Pipe(io.StringIO):
    """The standard input of a pipe, which nothing may read"""

    def readline(self, size: int | None = -1) -> str:
        raise AssertionError("read from a pipe")


def test_wait_for_enter_only_in_a_terminal(capsys):
    terminal = Terminal()
    wait_for_enter(terminal)
    assert terminal.reads == 1
    assert capsys.readouterr().out == "Press Enter to stop the cluster.\n"

    wait_for_enter(Pipe())
    assert capsys.readouterr().out == ""


def test_format_thread_seconds():
    parts = {
        "tcp://b": {
            "nthreads": 1,
            "elapsed": 2.0,
            "seconds": {"idle-no-tasks": 1.5, "busy": 0.5},
        },
        "tcp://a": {"nthreads": 2, "elapsed": 1.0, "seconds": {"busy": 2.0}},
    }
    text = format_thread_seconds(parts)
    lines = text.splitlines()
    assert lines[0] == "tcp://a: 2 threads x 1.00 s = 2.00 thread-seconds"
    assert lines[1].split() == ["busy", "2.000", "s", "100.0%"]
    assert lines[3] == "tcp://b: 1 threads x 2.00 s = 2.00 thread-seconds"
    # busy first, then the idle causes
    assert lines[4].split() == ["busy", "0.500", "s", "25.0%"]
    assert lines[5].split() == ["idle-no-tasks", "1.500", "s", "75.0%"]
    assert lines[-1] == "The cluster's threads were busy 62.5% of the time."
    assert all(thread_seconds_add_up(part) for part in parts.values())
    parts["tcp://a"]["elapsed"] = 1.1
    assert not thread_seconds_add_up(parts["tcp://a"])
