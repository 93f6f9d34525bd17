"""The fine performance metrics on Prometheus, end to end: a real Prometheus server
scraping a real cluster, and ``promtool check metrics`` on its endpoints.

The tests need Debian's ``prometheus`` package (``tools/install-prometheus.sh``).
Without it they are skipped, unless the environment variable ``CI`` is ``true``:
then they fail, so that CI cannot silently lose them.
"""
from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from distributed import Client, LocalCluster, wait
from distributed.metrics import THREAD_STATES, context_meter
from distributed.tests import utils_ci
from distributed.tests.utils_ci import loopback_process_cluster, skip_or_fail
from distributed.utils import open_port

PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"

#: The families of the fine performance metrics, without the namespace and the
#: subsystem, and the unit of their series (None: the series' ``unit`` label)
FAMILIES: dict[str, str | None] = {
    "fine_metrics_seconds_total": "seconds",
    "fine_metrics_bytes_total": "bytes",
    "fine_metrics_count_total": "count",
    "fine_metrics_other_units_total": None,
}

#: What ``promtool check metrics`` finds in pristine distributed 2023.3.1's
#: endpoints, by metric: the worker's gauges named ``..._count``. The fork must not
#: add any finding.
PRISTINE_FINDINGS = {
    "dask_worker_transfer_incoming_count": 'should not have "_count" suffix',
    "dask_worker_transfer_outgoing_count": 'should not have "_count" suffix',
}

#: Relative tolerance on seconds: the workers' sums are added up in another order
SECONDS_REL = 1e-9


def require_executable(path: str) -> str:
    """``path``, if it is an executable; otherwise skip the test (fail it on CI)"""
    return utils_ci.require_executable(
        path, "tools/install-prometheus.sh installs Debian's prometheus package"
    )


try:
    import prometheus_client  # noqa: F401
except ModuleNotFoundError:
    skip_or_fail("prometheus_client is not installed")


# Workload


def make_data(n: int) -> bytes:
    return b"x" * n


def post_metrics(data: bytes) -> int:
    # Metrics that the task posts itself: a count, a tuple label and another unit
    context_meter.digest_metric("my-count", 3, "count")
    context_meter.digest_metric(("my", "tuple"), 2, "count")
    context_meter.digest_metric("my-widgets", 5, "widgets")
    return len(data)


def inc(x: int) -> int:
    return x + 1


def spill_all(dask_worker: Any) -> int:
    """Spill every key of the worker to disk; how many"""
    n = 0
    while dask_worker.data.fast and dask_worker.data.evict() > 0:
        n += 1
    return n


def run_workload(c: Client) -> None:
    """Compute some tasks, with a dependency between the two workers (gather-dep on
    one, get-data on the other, which unspills it), a task that unspills its input
    and a task that posts metrics of its own
    """
    a, b = sorted(c.scheduler_info()["workers"])
    source = c.submit(make_data, 100_000, key="source-0", workers=[a])
    wait(source, timeout=60)
    assert c.run(spill_all, workers=[a]) == {a: 1}
    assert c.submit(len, source, key="size-0", workers=[a]).result() == 100_000
    assert c.run(spill_all, workers=[a])[a] >= 1
    sink = c.submit(post_metrics, source, key="sink-0", workers=[b])
    incs = c.map(inc, range(10), key=[f"inc-{i}" for i in range(10)])
    wait([sink, *incs], timeout=60)
    assert sink.result() == 100_000
    assert c.gather(incs) == list(range(1, 11))


def metrics_endpoints(cluster: LocalCluster, c: Client) -> dict[str, str]:
    """host:port of the /metrics endpoints, read back from the cluster:
    ``{"scheduler": ..., worker address: ...}``
    """
    c.wait_for_workers(2, timeout=60)
    endpoints = {"scheduler": f"127.0.0.1:{cluster.scheduler.http_server.port}"}
    for addr, info in sorted(c.scheduler_info()["workers"].items()):
        endpoints[addr] = f"127.0.0.1:{info['services']['dashboard']}"
    return endpoints


def http_get(url: str, timeout: float = 10) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        assert response.status == 200, url
        return response.read()


def label_text(label: Any) -> str:
    """A label of the metrics as it is on Prometheus"""
    if isinstance(label, tuple):
        return "/".join(map(str, label))
    return str(label)


# The real Prometheus server


@contextmanager
def run_prometheus(
    tmp_path: Path, targets: Mapping[str, str], timeout: float = 30
) -> Iterator[str]:
    """Run Prometheus on a free port of 127.0.0.1, scraping each of ``targets``
    (``{job: host:port}``) every second, with its configuration and its data under
    ``tmp_path``. Yield the URL of its HTTP API; stop it with SIGTERM on exit.
    """
    prometheus = require_executable(PROMETHEUS)
    config = {
        "global": {
            "scrape_interval": "1s",
            "scrape_timeout": "1s",
            "evaluation_interval": "1s",
        },
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [target]}]}
            for job, target in targets.items()
        ],
    }
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    log_file = tmp_path / "prometheus.log"

    for _ in range(3):  # The free port may be taken before Prometheus binds it
        port = open_port("127.0.0.1")
        assert port != 9090
        url = f"http://127.0.0.1:{port}"
        args = [
            prometheus,
            f"--config.file={config_file}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ]
        with open(log_file, "wb") as log, subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT
        ) as proc:
            try:
                deadline = time.monotonic() + timeout
                while proc.poll() is None:
                    try:
                        http_get(f"{url}/-/ready", timeout=1)
                        break
                    except (OSError, urllib.error.URLError):
                        assert time.monotonic() < deadline, "Prometheus is not ready"
                        time.sleep(0.1)
                else:
                    output = log_file.read_text()
                    if "address already in use" in output:
                        continue
                    pytest.fail(f"Prometheus exited with {proc.returncode}:\n{output}")
                yield url
                return
            finally:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait(timeout=10)
    pytest.fail(f"No free port for Prometheus:\n{log_file.read_text()}")


def prometheus_query(url: str, query: str) -> list[dict[str, Any]]:
    """The result of an instant query, a vector"""
    body = json.loads(
        http_get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": query}))
    )
    assert body["status"] == "success", body
    assert body["data"]["resultType"] == "vector", body
    return body["data"]["result"]


def series_unit(name: str, labels: Mapping[str, str]) -> str:
    """The unit of a series of a fine metrics family, by its name and labels"""
    for family, unit in FAMILIES.items():
        if name.endswith("_" + family):
            return labels["unit"] if unit is None else unit
    raise AssertionError(f"not a family of fine metrics: {name}")


def scraped_scheduler_metrics(url: str) -> dict[tuple[str, str, str, str], float]:
    """The fine metrics of the scheduler's job on Prometheus, as
    ``{(activity, task prefix or "", label, unit): value}``
    """
    out = {}
    query = '{__name__=~"dask_scheduler_fine_metrics_.+_total", job="scheduler"}'
    for series in prometheus_query(url, query):
        labels = series["metric"]
        key = (
            labels["activity"],
            # Prometheus drops the labels whose value is empty
            labels.get("task_prefix_name", ""),
            labels["label"],
            series_unit(labels["__name__"], labels),
        )
        assert key not in out, series
        out[key] = float(series["value"][1])
    return out


def scraped_worker_metrics(url: str) -> dict[str, dict[tuple[str, str, str], float]]:
    """The fine metrics of each worker's job on Prometheus, as
    ``{job: {(activity, label, unit): value}}``
    """
    out: dict[str, dict[tuple[str, str, str], float]] = {}
    query = '{__name__=~"dask_worker_fine_metrics_.+_total", job=~"worker-.+"}'
    for series in prometheus_query(url, query):
        labels = series["metric"]
        key = (
            labels["activity"],
            labels["label"],
            series_unit(labels["__name__"], labels),
        )
        metrics = out.setdefault(labels["job"], {})
        assert key not in metrics, series
        metrics[key] = float(series["value"][1])
    return out


def summed_worker_metrics(url: str) -> dict[tuple[str, str, str], float]:
    """The fine metrics of the workers' jobs on Prometheus, added up by Prometheus
    by activity and label: ``{(activity, label, unit): value}``
    """
    out = {}
    for family, unit in FAMILIES.items():
        by = "activity, label" if unit else "activity, label, unit"
        query = f'sum by ({by}) (dask_worker_{family}{{job=~"worker-.+"}})'
        for series in prometheus_query(url, query):
            labels = series["metric"]
            key = (labels["activity"], labels["label"], unit or labels["unit"])
            assert key not in out, series
            out[key] = float(series["value"][1])
    return out


def assert_metrics_equal(
    actual: Mapping[Any, float], expected: Mapping[Any, float]
) -> None:
    """Exactly equal, but seconds (the last element of the keys) within
    ``SECONDS_REL``
    """
    assert sorted(actual) == sorted(expected)

    def split(m: Mapping[Any, float]) -> tuple[dict, dict]:
        # Sorted: pytest 7.2 reports the differences of two mappings by position
        seconds = {k: m[k] for k in sorted(m) if k[-1] == "seconds"}
        others = {k: m[k] for k in sorted(m) if k[-1] != "seconds"}
        return seconds, others

    actual_seconds, actual_others = split(actual)
    expected_seconds, expected_others = split(expected)
    assert actual_others == expected_others
    assert actual_seconds == pytest.approx(expected_seconds, rel=SECONDS_REL)


def wait_for(check: Callable[[], None], timeout: float, interval: float = 0.5) -> None:
    """Call ``check`` until it does not raise AssertionError; after ``timeout``
    seconds, let its AssertionError through
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        time.sleep(interval)


def work_metrics(metrics: Mapping[Any, float]) -> dict[Any, float]:
    """The fine metrics of the work, without the ``threads`` keys: those grow at
    every delivery and every scrape of a worker, and have a family of their own
    """
    return {k: v for k, v in metrics.items() if k[0] != "threads"}


def thread_seconds(metrics: Mapping[Any, float]) -> dict[str, float]:
    """``{state: seconds}`` of the ``("threads", state, "seconds")`` keys, with every
    state that the families publish
    """
    out = dict.fromkeys(THREAD_STATES, 0.0)
    out.update({k[1]: v for k, v in metrics.items() if k[0] == "threads"})
    return out


def scraped_thread_seconds(url: str, query: str) -> dict[str, float]:
    """``{state: value}`` of a query on Prometheus, one series per state"""
    out = {}
    for series in prometheus_query(url, query):
        state = series["metric"]["state"]
        assert state not in out, series
        out[state] = float(series["value"][1])
    return out


def scalar_query(url: str, query: str) -> float:
    """The value of a query whose result is one series"""
    [series] = prometheus_query(url, query)
    return float(series["value"][1])


def stop_heartbeats(dask_worker: Any) -> None:
    """Stop the worker's heartbeats, and with them its deliveries of fine metrics"""
    dask_worker.periodic_callbacks["heartbeat"].stop()


@pytest.mark.slow
def test_prometheus_scrapes_fine_metrics(loop: Any, tmp_path: Path) -> None:
    """A real Prometheus server scrapes the scheduler and the workers; what it holds
    equals the scheduler's store of fine metrics, after a flush; the threads'
    seconds grow by the number of threads per second
    """
    require_executable(PROMETHEUS)
    with loopback_process_cluster(loop) as cluster, Client(cluster, loop=loop) as c:
        endpoints = metrics_endpoints(cluster, c)
        workers = [addr for addr in endpoints if addr != "scheduler"]
        jobs = {"scheduler": endpoints["scheduler"]}
        worker_jobs = {}
        for i, addr in enumerate(workers):
            jobs[f"worker-{i}"] = endpoints[addr]
            worker_jobs[f"worker-{i}"] = addr
        nthreads = c.nthreads()

        with run_prometheus(tmp_path, jobs) as url:
            # Prometheus takes 5-6 s to scrape its targets for the first time
            run_workload(c)
            snapshot = c.get_fine_metrics()  # flushes the workers first

            # The threads' seconds move at every heartbeat; the work's don't
            store = c.run_on_scheduler(
                lambda dask_scheduler: dict(dask_scheduler.cumulative_worker_metrics)
            )
            assert work_metrics(snapshot) == work_metrics(store)
            assert snapshot["execute", "sink", "my-count", "count"] == 3
            assert snapshot["execute", "sink", ("my", "tuple"), "count"] == 2
            assert snapshot["execute", "sink", "my-widgets", "widgets"] == 5
            assert any(k[0] == "execute" and k[1] == "inc" for k in snapshot)
            assert any(k[0] == "gather-dep" for k in snapshot)
            assert any(k[0] == "get-data" for k in snapshot)
            assert set(snapshot.workers) == set(workers)

            expected_scheduler: dict[tuple[str, str, str, str], float] = {}
            expected_sum: dict[tuple[str, str, str], float] = {}
            for key, value in work_metrics(snapshot).items():
                if len(key) == 4:
                    activity, prefix, label, unit = key
                else:
                    (activity, label, unit), prefix = key, ""
                skey = (activity, prefix, label_text(label), unit)
                assert skey not in expected_scheduler
                expected_scheduler[skey] = value
                wkey = (activity, label_text(label), unit)
                expected_sum[wkey] = expected_sum.get(wkey, 0) + value
            expected_workers = {
                job: {
                    (activity, label_text(label), unit): value
                    for (activity, label, unit), value in snapshot.workers[addr].items()
                    if activity != "threads"
                }
                for job, addr in worker_jobs.items()
            }

            def check() -> None:
                targets = json.loads(http_get(f"{url}/api/v1/targets"))["data"]
                active = {
                    t["labels"]["job"]: (t["health"], t["lastError"])
                    for t in targets["activeTargets"]
                }
                assert active == {job: ("up", "") for job in jobs}

                assert_metrics_equal(scraped_scheduler_metrics(url), expected_scheduler)
                assert_metrics_equal(summed_worker_metrics(url), expected_sum)
                scraped = scraped_worker_metrics(url)
                assert sorted(scraped) == sorted(expected_workers)
                for job, metrics in scraped.items():
                    assert_metrics_equal(metrics, expected_workers[job])

            wait_for(check, timeout=40)
            # rate() needs two scrapes of a series
            wait_for(lambda: check_example_queries(url, worker_jobs), timeout=20)
            check_thread_seconds_rates(url, worker_jobs, nthreads)

            # Once the workers deliver nothing more, the scheduler's threads'
            # seconds on Prometheus are the store's
            c.run(stop_heartbeats)
            final = c.get_fine_metrics()
            assert work_metrics(final) == work_metrics(snapshot)
            expected_threads = thread_seconds(final)
            assert expected_threads["busy"] > 0
            assert expected_threads["idle-no-tasks"] > 0

            def check_threads() -> None:
                scraped = scraped_thread_seconds(
                    url, 'dask_scheduler_thread_seconds_total{job="scheduler"}'
                )
                assert scraped == pytest.approx(expected_threads, rel=SECONDS_REL)
                check()

            wait_for(check_threads, timeout=20)

            # Nothing changed on the cluster meanwhile
            assert c.get_fine_metrics(flush=False) == final


#: Example queries of docs/fine_metrics.rst
TOP_DISK_PREFIXES = """
topk(5, sum by (task_prefix_name) (rate(
    dask_scheduler_fine_metrics_seconds_total{activity="execute",label=~"disk-.*"}[5m])))
"""
CACHE_HIT_RATIO = """
dask_worker_spill_count_total{activity="memory-read"}
  / ignoring(activity) (dask_worker_spill_count_total{activity="memory-read"}
    + ignoring(activity) dask_worker_spill_count_total{activity="disk-read"})
"""


def check_example_queries(url: str, worker_jobs: Mapping[str, str]) -> None:
    """The example queries of the docs give what they say, on the workload"""
    # The task prefixes that spend most time on disk: the task that unspilled
    # its input; not the unspilling of get-data, which has no prefix (without
    # activity="execute", it would be a series without labels)
    top = prometheus_query(url, TOP_DISK_PREFIXES)
    assert [series["metric"] for series in top] == [{"task_prefix_name": "size"}]
    # The cache hit ratio by keys, of each worker: the worker that spilled read
    # its key from the disk once (size-0), and its keys from memory otherwise; the
    # other only from memory
    ratios = sorted(
        (float(series["value"][1]), series["metric"]["job"])
        for series in prometheus_query(url, CACHE_HIT_RATIO)
        # The scheduler's endpoint also publishes the families of the workers
        # that earlier tests ran in this process (one registry per process, as
        # upstream): not those of this cluster's
        if series["metric"]["job"] != "scheduler"
    )
    assert sorted(job for _, job in ratios) == sorted(worker_jobs)
    assert 0 < ratios[0][0] < 1
    assert [ratio for ratio, _ in ratios[1:]] == [1.0] * (len(ratios) - 1)


def check_thread_seconds_rates(
    url: str, worker_jobs: Mapping[str, str], nthreads: Mapping[str, int]
) -> None:
    """Prometheus sees the threads' seconds of each worker grow by its number of
    threads per second, and those of the cluster by the cluster's; the efficiency
    of the threads, idle after the workload, is low
    """
    window = "10s"  # 10 scrapes (see run_prometheus)
    workers = 'job=~"worker-.+"'

    def check_rates() -> None:
        # A window full of scrapes
        count = scalar_query(
            url,
            f"min(count_over_time(dask_worker_thread_seconds_total{{{workers}}}"
            f"[{window}]))",
        )
        assert count >= 9
        # rate() does not extrapolate a series back before a sample of 0, so the
        # rates are short while the window holds the first busy second: wait for
        # a window past the workload
        rates = {
            series["metric"]["job"]: float(series["value"][1])
            for series in prometheus_query(
                url,
                f"sum by (job) (rate(dask_worker_thread_seconds_total{{{workers}}}"
                f"[{window}]))",
            )
        }
        assert rates == pytest.approx(
            {job: nthreads[addr] for job, addr in worker_jobs.items()}, rel=0.05
        )
        # The same, as a user would ask for it: the threads' seconds per second
        # over the number of threads
        per_thread = scalar_query(
            url,
            f"sum(rate(dask_worker_thread_seconds_total{{{workers}}}[{window}])) "
            f"/ sum(dask_worker_threads{{{workers}}})",
        )
        assert per_thread == pytest.approx(1, rel=0.05)
        # The scheduler's store gets them at each heartbeat, in steps
        cluster = scalar_query(
            url,
            "sum(rate(dask_scheduler_thread_seconds_total"
            f'{{job="scheduler"}}[{window}]))',
        )
        assert cluster == pytest.approx(sum(nthreads.values()), rel=0.3)

    wait_for(check_rates, timeout=40)

    for family, job in [
        ("dask_scheduler_thread_seconds_total", 'job="scheduler"'),
        ("dask_worker_thread_seconds_total", workers),
    ]:
        efficiency = scalar_query(
            url,
            f'sum(rate({family}{{{job},state="busy"}}[{window}])) '
            f"/ sum(rate({family}{{{job}}}[{window}]))",
        )
        # The workers have been idle for most of the window, and their idle
        # seconds count: were they left out, it would be 1
        assert 0 <= efficiency < 0.5, family


# promtool


def promtool_findings(promtool: str, exposition: bytes) -> list[str]:
    """The lint findings of ``promtool check metrics``, one a line"""
    proc = subprocess.run(
        [promtool, "check", "metrics"],
        input=exposition,
        capture_output=True,
        timeout=60,
    )
    output = (proc.stdout + proc.stderr).decode()
    findings = [line.strip() for line in output.splitlines() if line.strip()]
    # 0: clean, 3: lint findings; anything else (1: unparsable) is an error
    assert proc.returncode in (0, 3), (proc.returncode, output)
    assert bool(findings) == (proc.returncode == 3), (proc.returncode, output)
    return findings


def is_pristine_finding(finding: str) -> bool:
    """Whether promtool finds the same in pristine distributed 2023.3.1"""
    name, _, message = finding.partition(" ")
    return name in PRISTINE_FINDINGS and PRISTINE_FINDINGS[name] in message


def test_promtool_check_metrics(loop: Any) -> None:
    """``promtool check metrics`` finds nothing in the fine metrics families and
    the threads' seconds of the scheduler's and the workers' endpoints, and nothing
    that it does not find in pristine distributed's
    """
    promtool = require_executable(PROMTOOL)
    with loopback_process_cluster(loop) as cluster, Client(cluster, loop=loop) as c:
        endpoints = metrics_endpoints(cluster, c)
        run_workload(c)
        c.get_fine_metrics()
        expositions = {
            name: http_get(f"http://{endpoint}/metrics")
            for name, endpoint in endpoints.items()
        }

    for name, exposition in expositions.items():
        # The families are there, with series
        subsystem = "scheduler" if name == "scheduler" else "worker"
        text = exposition.decode()
        for family in FAMILIES:
            assert f"# TYPE dask_{subsystem}_{family} counter" in text, name
        execute = f'dask_{subsystem}_fine_metrics_seconds_total{{activity="execute"'
        assert execute in text, name
        # The threads' seconds have a family of their own, by state
        assert f"# TYPE dask_{subsystem}_thread_seconds_total counter" in text, name
        for state in THREAD_STATES:
            series = f'dask_{subsystem}_thread_seconds_total{{state="{state}"}} '
            assert series in text, (name, state)
        assert 'activity="threads"' not in text, name

        findings = promtool_findings(promtool, exposition)
        assert [f for f in findings if "fine_metrics" in f] == [], name
        assert [f for f in findings if "thread_seconds" in f] == [], name
        assert [f for f in findings if not is_pristine_finding(f)] == [], name
