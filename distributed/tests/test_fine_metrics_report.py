from __future__ import annotations

import pytest

from distributed import Worker
from distributed.diagnostics.fine_metrics import (
    cluster_fine_metrics,
    format_table,
    is_fine_metric,
    run_demo,
    views_agree,
    workers_fine_metrics,
)
from distributed.utils_test import async_poll_for, gen_cluster, inc


def test_is_fine_metric():
    assert is_fine_metric(("execute", "inc", "thread-cpu", "seconds"))
    assert is_fine_metric(("gather-dep", "network", "seconds"))
    assert is_fine_metric(("memory-monitor", "disk-write", "bytes"))
    assert not is_fine_metric("latency")
    assert not is_fine_metric(("execute",))
    assert not is_fine_metric(("other", "x", "seconds"))


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
    assert header == [
        "activity",
        "task",
        "prefix",
        "label",
        "seconds",
        "bytes",
        "count",
        "rows",
    ]
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


@pytest.mark.slow
def test_demo(loop):
    """The demo shows every activity, spilling, transfers and the failure"""
    metrics, agree = run_demo(loop=loop)
    assert agree
    out = format_table(metrics)
    rows = [line.split() for line in out.splitlines()[2:]]
    found = {
        (r[0], r[1] if r[0] == "execute" else "", r[2 if r[0] == "execute" else 1])
        for r in rows
    }
    for expected in [
        ("execute", "make-chunk", "thread-cpu"),
        ("execute", "crunch", "thread-noncpu"),
        ("execute", "crunch", "crunch"),
        ("execute", "crunch", "pairs"),
        ("execute", "crunch", "disk-read"),
        ("execute", "explode", "failed"),
        ("gather-dep", "", "network"),
        ("get-data", "", "network"),
    ]:
        assert expected in found, expected
    assert any(r[0] == "execute" and r[2] == "disk-write" for r in rows)
