from __future__ import annotations

import logging
import os
import shutil
import time
from typing import cast

import pytest

import dask
import zict

from distributed.metrics import DelayedMetricsLedger, context_meter
from distributed.sizeof import sizeof
from distributed.spill import SpillBuffer, SpilledSize, has_zict_220
from distributed.tests.utils_ci import import_or_skip
from distributed.utils_test import captured_logger

SPILL_LABELS = {
    "memory-read",
    "disk-read",
    "disk-write",
    "serialize",
    "compress",
    "deserialize",
    "decompress",
}


def disk_bytes(path: str | os.PathLike) -> int:
    """Total size of the spill files"""
    return sum(os.path.getsize(os.path.join(path, fn)) for fn in os.listdir(path))


def non_seconds(metrics):
    """Strip the seconds, which vary from run to run"""
    if isinstance(metrics, dict):
        return {k: v for k, v in metrics.items() if k[1] != "seconds"}
    return [m for m in metrics if m[2] != "seconds"]


def seconds_labels(metrics):
    if isinstance(metrics, dict):
        return {label for label, unit in metrics if unit == "seconds"}
    return {label for label, _, unit in metrics if unit == "seconds"}


class Bad:
    """Fails to pickle"""

    def __init__(self, size: int):
        self.size = size

    def __reduce__(self):
        raise TypeError("Bad cannot be pickled")

    def __sizeof__(self):
        return self.size


def test_disk_write(tmp_path):
    a = "a" * 100
    b = "b" * 100
    buf = SpillBuffer(str(tmp_path), target=sizeof(a) + sizeof(b) - 1)
    assert buf.cumulative_metrics == {}

    buf["a"] = a
    assert buf.cumulative_metrics == {}
    out = []
    with context_meter.add_callback(lambda *args: out.append(args)):
        buf["b"] = b  # Evicts a
    assert set(buf.disk) == {"a"}

    nbytes = disk_bytes(tmp_path)
    assert nbytes == buf.spilled_total.disk
    assert non_seconds(out) == [
        ("disk-write", 1, "count"),
        ("disk-write", nbytes, "bytes"),
    ]
    # Too small to be compressed, but compress is there all the same: the time spent
    # deciding not to
    assert seconds_labels(out) == {"serialize", "compress", "disk-write"}
    assert all(v >= 0 for _, v, _ in out)

    # The same metrics, aggregated
    expect = {}
    for label, value, unit in out:
        expect[label, unit] = expect.get((label, unit), 0) + value
    assert buf.cumulative_metrics == expect


class Referenced:
    """A value that a weak reference can point to"""

    def __sizeof__(self) -> int:
        return 1000


@pytest.mark.skipif(not has_zict_220, reason="zict's cache of spilled values")
def test_memory_read_of_a_spilled_value_still_in_memory(tmp_path):
    """A value spilled while something still holds it is read back from zict's
    cache, not from disk: it is a memory-read, with the size it had in memory
    """
    buf = SpillBuffer(str(tmp_path), target=1500)
    buf["x"] = x = Referenced()
    buf["y"] = Referenced()  # pushes x out, which this test still holds
    assert set(buf.disk) == {"x"}
    assert "x" in buf.slow.cache  # type: ignore[attr-defined]

    out = []
    with context_meter.add_callback(lambda *args: out.append(args)):
        assert buf["x"] is x  # evicts y, which nothing else holds: from disk
    assert non_seconds(out)[:2] == [
        ("memory-read", 1, "count"),
        ("memory-read", sizeof(x), "bytes"),
    ]
    assert not [m for m in out if m[0] == "disk-read"]
    # Upstream's own metrics of the fast mapping are unchanged
    assert buf.fast_metrics.read_count_total == 0


def test_disk_read_and_memory_read(tmp_path):
    a = "a" * 100
    b = "b" * 100
    buf = SpillBuffer(str(tmp_path), target=sizeof(a) + sizeof(b) - 1)
    buf["a"] = a
    buf["b"] = b
    a_disk = disk_bytes(tmp_path)

    out = []
    with context_meter.add_callback(lambda *args: out.append(args)):
        assert buf["b"] == b  # memory read
        assert buf["a"] == a  # disk read; evicts b
    b_disk = disk_bytes(tmp_path)
    assert set(buf.disk) == {"b"}

    assert non_seconds(out) == [
        ("memory-read", 1, "count"),
        ("memory-read", sizeof(b), "bytes"),
        ("disk-read", 1, "count"),
        ("disk-read", a_disk, "bytes"),
        ("disk-write", 1, "count"),
        ("disk-write", b_disk, "bytes"),
    ]
    assert seconds_labels(out) == {
        "disk-read",
        "decompress",
        "deserialize",
        "serialize",
        "compress",
        "disk-write",
    }

    assert non_seconds(buf.cumulative_metrics) == {
        ("memory-read", "count"): 1,
        ("memory-read", "bytes"): sizeof(b),
        ("disk-read", "count"): 1,
        ("disk-read", "bytes"): a_disk,
        ("disk-write", "count"): 2,
        ("disk-write", "bytes"): a_disk + b_disk,
    }
    assert seconds_labels(buf.cumulative_metrics) == {
        "disk-read",
        "decompress",
        "deserialize",
        "serialize",
        "compress",
        "disk-write",
    }


def test_int_stays_int(tmp_path):
    buf = SpillBuffer(str(tmp_path), target=1)
    buf["a"] = "a" * 100
    buf["b"] = "b" * 100
    assert buf["a"] == "a" * 100
    buf["a"] = "c" * 100
    assert buf["a"] == "c" * 100
    for (_, unit), value in buf.cumulative_metrics.items():
        if unit == "seconds":
            assert type(value) is float
        else:
            assert type(value) is int


def test_compression(tmp_path):
    a = b"0" * 100_000
    buf = SpillBuffer(str(tmp_path), target=sizeof(a) - 1)
    with dask.config.set({"distributed.comm.compression": "lz4"}):
        ledger = DelayedMetricsLedger()
        with ledger.record():
            buf["a"] = a
        written = ledger.finalize()
        nbytes = disk_bytes(tmp_path)
        assert nbytes < 100_000  # compressed

        ledger = DelayedMetricsLedger()
        with ledger.record():
            assert buf["a"] == a
        read = ledger.finalize()

    assert non_seconds(written) == [
        ("disk-write", 1, "count"),
        ("disk-write", nbytes, "bytes"),
    ]
    assert seconds_labels(written) == {"serialize", "compress", "disk-write", "other"}
    assert non_seconds(read) == [
        ("disk-read", 1, "count"),
        ("disk-read", nbytes, "bytes"),
    ]
    assert seconds_labels(read) == {"disk-read", "decompress", "deserialize", "other"}
    assert seconds_labels(buf.cumulative_metrics) == {
        "serialize",
        "compress",
        "disk-write",
        "disk-read",
        "decompress",
        "deserialize",
    }
    # Everything the buffer did is in cumulative_metrics, and nothing more
    expect = {}
    for label, value, unit in written + read:
        if label != "other":
            expect[label, unit] = expect.get((label, unit), 0) + value
    assert buf.cumulative_metrics == pytest.approx(expect)


def test_cumulative_metrics_whatever_the_activity(tmp_path):
    """cumulative_metrics collects everything, whether or not an activity is
    listening and whichever it is
    """
    a = "a" * 100
    b = "b" * 100
    c = "c" * 100
    buf = SpillBuffer(str(tmp_path), target=sizeof(a) + sizeof(b) - 1)
    buf["a"] = a
    ledger1 = DelayedMetricsLedger()
    with ledger1.record():
        buf["b"] = b  # Evicts a
    buf["c"] = c  # Evicts b; nobody is listening
    ledger2 = DelayedMetricsLedger()
    with ledger2.record():
        assert buf.evict() == sizeof(c)
        assert buf["a"] == a  # Unspills a
    assert set(buf.memory) == {"a"}
    assert set(buf.disk) == {"b", "c"}

    m1 = non_seconds(ledger1.finalize())
    a_bytes = m1[1][1]
    assert m1 == [("disk-write", 1, "count"), ("disk-write", a_bytes, "bytes")]
    m2 = non_seconds(ledger2.finalize())
    c_bytes = m2[1][1]
    assert m2 == [
        ("disk-write", 1, "count"),
        ("disk-write", c_bytes, "bytes"),
        ("disk-read", 1, "count"),
        ("disk-read", a_bytes, "bytes"),
    ]
    assert non_seconds(buf.cumulative_metrics) == {
        ("disk-write", "count"): 3,
        # a (since deleted from disk), b and c
        ("disk-write", "bytes"): a_bytes + disk_bytes(tmp_path),
        ("disk-read", "count"): 1,
        ("disk-read", "bytes"): a_bytes,
    }
    assert {label for label, _ in buf.cumulative_metrics} <= SPILL_LABELS


def test_evict(tmp_path):
    buf = SpillBuffer(str(tmp_path), target=1000)
    buf["a"] = "a" * 100
    out = []
    with context_meter.add_callback(lambda *args: out.append(args)):
        assert buf.evict() == sizeof("a" * 100)
    assert set(buf.disk) == {"a"}
    assert non_seconds(out) == [
        ("disk-write", 1, "count"),
        ("disk-write", disk_bytes(tmp_path), "bytes"),
    ]
    assert non_seconds(buf.cumulative_metrics) == {
        ("disk-write", "count"): 1,
        ("disk-write", "bytes"): disk_bytes(tmp_path),
    }


def test_pickle_error_no_disk_write(tmp_path):
    """The time spent trying to serialize is recorded, but nothing is written"""
    buf = SpillBuffer(str(tmp_path), target=100)
    buf["a"] = Bad(10)
    with captured_logger("distributed.spill", level=logging.ERROR) as log:
        assert buf.evict() == -1
    assert "Failed to pickle 'a'" in log.getvalue()
    assert set(buf.memory) == {"a"}
    assert non_seconds(buf.cumulative_metrics) == {}
    assert seconds_labels(buf.cumulative_metrics) == {"serialize"}


def _fail_to_unpickle():
    raise ValueError("cannot be unpickled")


class FailsToUnpickle:
    """Pickles, but fails to unpickle"""

    def __reduce__(self):
        return _fail_to_unpickle, ()


def test_unpickle_error_still_a_disk_read(tmp_path):
    """A key read from the disk that fails to deserialize was read:
    cumulative_metrics counts the disk-read, while get_metrics(), as upstream,
    counts only the reads that succeeded
    """
    buf = SpillBuffer(str(tmp_path), target=1)
    buf["a"] = FailsToUnpickle()
    assert set(buf.disk) == {"a"}
    written = buf.cumulative_metrics["disk-write", "bytes"]
    with pytest.raises(ValueError, match="cannot be unpickled"):
        buf["a"]
    assert non_seconds(buf.cumulative_metrics) == {
        ("disk-write", "count"): 1,
        ("disk-write", "bytes"): written,
        ("disk-read", "count"): 1,
        ("disk-read", "bytes"): written,
    }
    assert {"disk-read", "decompress", "deserialize"} <= seconds_labels(
        buf.cumulative_metrics
    )
    upstream = buf.get_metrics()
    assert upstream["disk_read_count_total"] == 0
    assert upstream["disk_read_bytes_total"] == 0
    assert upstream["disk_write_count_total"] == 1


def test_max_spill_no_disk_write(tmp_path):
    buf = SpillBuffer(str(tmp_path), target=1, max_spill=1)
    # Note: the warning is rate-limited, so it may not be logged here
    buf["a"] = "a" * 100
    assert set(buf.memory) == {"a"}
    assert non_seconds(buf.cumulative_metrics) == {}
    assert seconds_labels(buf.cumulative_metrics) == {"serialize", "compress"}


def test_oserror_no_disk_write_count(tmp_path):
    buf = SpillBuffer(str(tmp_path / "spill"), target=1000)
    buf["a"] = "a" * 100
    # Simulate a disk failure
    shutil.rmtree(tmp_path / "spill")
    with captured_logger("distributed.spill", level=logging.ERROR) as log:
        assert buf.evict() == -1
    assert "Spill to disk failed" in log.getvalue()
    assert set(buf.memory) == {"a"}
    assert non_seconds(buf.cumulative_metrics) == {}
    # Failed writes are not metered
    assert seconds_labels(buf.cumulative_metrics) == {"serialize", "compress"}


def test_metrics_callback_error(tmp_path):
    """A metrics callback that raises does not corrupt the buffer"""
    a = "a" * 100
    b = "b" * 100
    buf = SpillBuffer(str(tmp_path), target=sizeof(a) + sizeof(b) - 1)
    buf["a"] = a

    def cb(label, value, unit):
        if label in ("disk-write", "memory-read"):
            raise RuntimeError("cb failed")

    with context_meter.add_callback(cb):
        # Failure while reading from memory; there was no change
        with pytest.raises(RuntimeError, match="cb failed"):
            buf["a"]
        assert_buf(buf, {"a": a}, {})

        # Failure after spilling a to disk
        with captured_logger("distributed.spill", level=logging.ERROR) as log:
            buf["b"] = b
        assert "Failed to digest spill metrics" in log.getvalue()
        assert_buf(buf, {"b": b}, {"a": a})

    assert buf["a"] == a
    assert_buf(buf, {"a": a}, {"b": b})
    # The failing callback did not deprive cumulative_metrics of anything
    assert buf.cumulative_metrics["disk-write", "count"] == 2
    assert buf.cumulative_metrics["disk-write", "bytes"] == 2 * disk_bytes(tmp_path)


############################################################################
# Upstream SpillBuffer behaviour, which must not change
############################################################################


def assert_buf(buf: SpillBuffer, expect_fast: dict, expect_slow: dict) -> None:
    directory = cast(zict.File, buf._slow_uncached.d).directory
    assert dict(buf.fast) == expect_fast
    assert dict(buf.slow) == expect_slow
    assert buf.fast.total_weight == sum(sizeof(v) for v in expect_fast.values())
    assert buf.spilled_total.memory == sum(sizeof(v) for v in expect_slow.values())
    assert buf.spilled_total.disk == disk_bytes(directory)


def test_spillbuffer(tmp_path):
    buf = SpillBuffer(str(tmp_path), target=300)
    # Convenience aliases
    assert buf.memory is buf.fast
    assert buf.disk is buf.slow

    assert_buf(buf, {}, {})

    a, b, c, d = "a" * 100, "b" * 99, "c" * 98, "d" * 97
    # Test assumption made by this test, mostly for non CPython implementations
    assert 100 < sizeof(a) < 200
    assert (sizeof(a) + sizeof(b) + sizeof(c)) > 300 > (sizeof(a) + sizeof(b))

    buf["a"] = a
    assert_buf(buf, {"a": a}, {})
    assert buf["a"] == a

    buf["b"] = b
    assert_buf(buf, {"a": a, "b": b}, {})

    buf["c"] = c
    assert_buf(buf, {"b": b, "c": c}, {"a": a})

    assert buf["a"] == a
    assert_buf(buf, {"a": a, "c": c}, {"b": b})

    buf["d"] = d
    assert_buf(buf, {"a": a, "d": d}, {"b": b, "c": c})

    # Deleting an in-memory key does not automatically move spilled keys back to
    # memory
    del buf["a"]
    assert_buf(buf, {"d": d}, {"b": b, "c": c})
    with pytest.raises(KeyError):
        buf["a"]

    # Deleting a spilled key updates the metadata
    del buf["b"]
    assert_buf(buf, {"d": d}, {"c": c})
    with pytest.raises(KeyError):
        buf["b"]

    # Updating a spilled key moves it to the top of the LRU and to memory
    c2 = "C" * 98
    buf["c"] = c2
    assert_buf(buf, {"d": d, "c": c2}, {})

    # Single key is larger than target and goes directly into slow
    e = "e" * 500
    buf["e"] = e
    assert_buf(buf, {"d": d, "c": c2}, {"e": e})

    # Updating a spilled key with another larger than target updates slow directly
    d = "d" * 500
    buf["d"] = d
    assert_buf(buf, {"c": c2}, {"d": d, "e": e})


def test_spillbuffer_get_metrics(tmp_path):
    """The pre-existing metrics keep working next to cumulative_metrics"""
    a = "a" * 100
    b = "b" * 100
    buf = SpillBuffer(str(tmp_path), target=sizeof(a) + sizeof(b) - 1)
    buf["a"] = a
    buf["b"] = b
    assert buf["b"] == b
    assert buf["a"] == a
    m = buf.get_metrics()
    assert m["memory_count"] == 1
    assert m["disk_count"] == 1
    assert m["memory_read_count_total"] == 1
    assert m["memory_read_bytes_total"] == sizeof(b)
    assert m["disk_read_count_total"] == 1
    assert m["disk_write_count_total"] == 2
    assert m["disk_write_bytes_total"] == buf.cumulative_metrics["disk-write", "bytes"]
    assert m["disk_read_bytes_total"] == buf.cumulative_metrics["disk-read", "bytes"]
    assert m["disk_bytes"] == disk_bytes(tmp_path)


def test_spillbuffer_maxlim(tmp_path):
    buf = SpillBuffer(str(tmp_path), target=200, max_spill=600)

    a, b, c, d, e = "a" * 200, "b" * 100, "c" * 99, "d" * 199, "e" * 98

    # size of a is bigger than target and is smaller than max_spill;
    # key should be in slow
    buf["a"] = a
    assert_buf(buf, {}, {"a": a})
    assert buf["a"] == a

    # size of b is smaller than target key should be in fast
    buf["b"] = b
    assert_buf(buf, {"b": b}, {"a": a})

    # size of c is smaller than target but b+c > target, c should stay in fast and b
    # move to slow since the max_spill limit has not been reached yet
    buf["c"] = c
    assert_buf(buf, {"c": c}, {"a": a, "b": b})

    # size of e < target but e+c > target, this will trigger movement of c to slow
    # but the max spill limit prevents it. Resulting in e remaining in fast
    # Note: the warning is rate-limited, so it may not be logged here
    buf["e"] = e
    assert_buf(buf, {"c": c, "e": e}, {"a": a, "b": b})

    # size of d > target, d should go to slow but slow reached the max_spill limit
    # then d will end up on fast with c (which can't be move to slow because it won't
    # fit either)
    buf["d"] = d
    assert_buf(buf, {"c": c, "d": d, "e": e}, {"a": a, "b": b})

    # Overwrite a key that was in slow, but the size of the new key is larger than
    # max_spill. Deleting the old a from disk made room for c.
    a_large = "a" * 500
    assert sizeof(a_large) + sizeof(b) > 600
    buf["a"] = a_large
    assert_buf(buf, {"a": a_large, "d": d, "e": e}, {"b": b, "c": c})


def test_spillbuffer_fail_to_serialize(tmp_path):
    buf = SpillBuffer(str(tmp_path), target=200, max_spill=600)

    # bad data individually larger than spill threshold target 200
    a = Bad(size=201)

    # Exception caught in the worker
    with pytest.raises(TypeError, match="Could not serialize object of type Bad"):
        with captured_logger("distributed.spill", level=logging.ERROR) as log:
            buf["a"] = a
    # The exception is not logged here; it's the worker's job
    assert not log.getvalue()

    # spill.py must remain silent because we're already logging in worker.py
    assert_buf(buf, {}, {})

    b = Bad(size=100)  # this is small enough to fit in memory/fast
    buf["b"] = b
    assert_buf(buf, {"b": b}, {})

    c = "c" * 100
    with captured_logger("distributed.spill", level=logging.ERROR) as log:
        # This will go to fast and try to kick b out,
        # but keep b in fast since it's not pickable
        buf["c"] = c
    # The pickling error is logged; b stays in memory
    assert "Failed to pickle 'b'" in log.getvalue()
    assert_buf(buf, {"b": b, "c": c}, {})

    # The same key does not cause a second log
    d = "d" * 100
    with captured_logger("distributed.spill", level=logging.ERROR) as log:
        buf["d"] = d
    assert not log.getvalue()
    # c was spilled instead, as b can't be
    assert_buf(buf, {"b": b, "d": d}, {"c": c})


def test_spillbuffer_pop_not_implemented(tmp_path):
    buf = SpillBuffer(str(tmp_path), target=100)
    buf["a"] = "a"
    with pytest.raises(NotImplementedError):
        buf.pop("a", None)
    assert set(buf) == {"a"}


def test_spilled_total(tmp_path):
    buf = SpillBuffer(str(tmp_path), target=1)
    assert buf.spilled_total == SpilledSize(0, 0)
    buf["a"] = "a" * 100
    buf["b"] = "b" * 100
    assert buf.spilled_total == SpilledSize(2 * sizeof("a" * 100), disk_bytes(tmp_path))
    del buf["a"]
    assert buf.spilled_total == SpilledSize(sizeof("b" * 100), disk_bytes(tmp_path))


class SlowSizeof:
    """An object whose sizeof is slow"""

    def __init__(self, delay: float):
        self.delay = delay

    def __sizeof__(self):
        time.sleep(self.delay)
        return 100


def test_disk_write_excludes_sizeof(tmp_path):
    """sizeof, which may be slow, is not disk time, neither in the fine metrics nor
    in get_metrics()
    """
    buf = SpillBuffer(str(tmp_path), target=1_000_000)
    x = SlowSizeof(0)
    buf["x"] = x
    x.delay = 0.2
    out = []
    with context_meter.add_callback(lambda *args: out.append(args)):
        buf.evict()
    assert set(buf.slow) == {"x"}
    seconds = {label: value for label, value, unit in out if unit == "seconds"}
    assert seconds["disk-write"] < 0.1
    assert buf.cumulative_metrics["disk-write", "seconds"] < 0.1
    assert buf.get_metrics()["disk_write_time_total"] < 0.1


@pytest.mark.parametrize("compression", [None, False, "lz4"])
@pytest.mark.parametrize("size", [1, 100_000])
def test_spill_labels_do_not_depend_on_sizes(tmp_path, compression, size):
    """Every spilled key posts serialize, compress and disk-write seconds, and every
    unspilled key disk-read, decompress and deserialize seconds, whether or not the
    payload was big enough, or compressible enough, to be compressed
    """
    if compression == "lz4":
        import_or_skip("lz4")
    value = b"0" * size
    buf = SpillBuffer(str(tmp_path), target=1_000_000)
    with dask.config.set({"distributed.comm.compression": compression}):
        buf["x"] = value
        written = []
        with context_meter.add_callback(lambda *args: written.append(args)):
            buf.evict()
        read = []
        with context_meter.add_callback(lambda *args: read.append(args)):
            assert buf["x"] == value
    assert seconds_labels(written) == {"serialize", "compress", "disk-write"}
    assert seconds_labels(read) == {"disk-read", "decompress", "deserialize"}
