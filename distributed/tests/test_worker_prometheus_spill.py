from __future__ import annotations

import pytest

from distributed.tests.utils_ci import import_or_skip

import_or_skip("prometheus_client")

from distributed import wait
from distributed.spill import SpillBuffer
from distributed.utils_test import fetch_metrics, gen_cluster

FAMILIES = {
    "dask_worker_spill_bytes": "bytes",
    "dask_worker_spill_count": "count",
    "dask_worker_spill_time_seconds": "seconds",
}


async def fetch_spill_metrics(port: int) -> dict[tuple[str, str], float]:
    """Fetch the spill families from the worker's /metrics endpoint, as
    {(activity, unit): value}
    """
    families = await fetch_metrics(port, prefix="dask_worker_spill")
    assert set(families) == set(FAMILIES)
    out = {}
    for name, family in families.items():
        assert family.type == "counter"
        for sample in family.samples:
            assert sample.name == name + "_total"
            out[sample.labels["activity"], FAMILIES[name]] = sample.value
    return out


@gen_cluster(client=True, nthreads=[("", 1)], worker_kwargs={"memory_limit": "1 GiB"})
async def test_spill_metrics(c, s, a):
    assert isinstance(a.data, SpillBuffer)

    # All the series are published from the start, with zeros
    metrics = await fetch_spill_metrics(a.http_server.port)
    assert metrics == {
        ("memory-read", "count"): 0,
        ("memory-read", "bytes"): 0,
        ("disk-read", "count"): 0,
        ("disk-read", "bytes"): 0,
        ("disk-read", "seconds"): 0,
        ("disk-write", "count"): 0,
        ("disk-write", "bytes"): 0,
        ("disk-write", "seconds"): 0,
        ("serialize", "seconds"): 0,
        ("compress", "seconds"): 0,
        ("deserialize", "seconds"): 0,
        ("decompress", "seconds"): 0,
    }

    x = c.submit(lambda: "x" * 100_000, key="x")
    await wait(x)
    assert a.data.evict() > 0
    assert set(a.data.disk) == {"x"}
    spilled_bytes = a.data.spilled_total.disk

    # Fetching the data from the client unspills it
    assert await x == "x" * 100_000
    assert set(a.data.memory) == {"x"}

    metrics = await fetch_spill_metrics(a.http_server.port)
    assert metrics[("disk-write", "count")] == 1
    assert metrics[("disk-write", "bytes")] == spilled_bytes
    assert metrics[("disk-read", "count")] == 1
    assert metrics[("disk-read", "bytes")] == spilled_bytes
    # Compressible data, large enough to be compressed
    for label in ("serialize", "compress", "disk-write", "disk-read"):
        assert metrics[(label, "seconds")] > 0
    for label in ("deserialize", "decompress"):
        assert (label, "seconds") in a.data.cumulative_metrics
        assert metrics[(label, "seconds")] > 0

    # Exactly what the SpillBuffer says
    assert a.data.cumulative_metrics
    for key, value in a.data.cumulative_metrics.items():
        assert metrics[key] == pytest.approx(value)


@gen_cluster(client=True, nthreads=[("", 1)], worker_kwargs={"memory_limit": "1 GiB"})
async def test_spill_metrics_memory_read(c, s, a):
    """Reading from memory is published too"""
    x = c.submit(lambda: "x" * 100, key="x")
    y = c.submit(lambda x: x + "y", x, key="y")
    assert await y == "x" * 100 + "y"
    assert await x == "x" * 100

    metrics = await fetch_spill_metrics(a.http_server.port)
    # Read x to compute y, read x and y to send them to the client
    assert metrics[("memory-read", "count")] == 3
    assert metrics[("memory-read", "bytes")] > 200
    assert metrics[("disk-write", "count")] == 0
    assert (
        metrics[("memory-read", "count")]
        == a.data.cumulative_metrics[("memory-read", "count")]
    )


@gen_cluster(client=True, nthreads=[("", 1)], worker_kwargs={"memory_limit": 0})
async def test_no_spill_metrics_without_spill_buffer(c, s, a):
    assert not isinstance(a.data, SpillBuffer)
    families = await fetch_metrics(a.http_server.port, prefix="dask_worker_")
    assert not any(name.startswith("dask_worker_spill") for name in families)
    # Other families are still there
    assert "dask_worker_tasks" in families


@gen_cluster(client=True, nthreads=[("", 1)], worker_kwargs={"memory_limit": "1 GiB"})
async def test_removed_families(c, s, a):
    """The families built on the ad-hoc spill digests, superseded by the above,
    are gone
    """
    families = await fetch_metrics(a.http_server.port, prefix="dask_worker_")
    assert "dask_worker_event_loop_blocked_time_seconds" not in families
    assert "dask_worker_event_loop_blocked_time_max_seconds" not in families
    assert "dask_worker_tick_duration_maximum_seconds" in families
