from __future__ import annotations

import pytest

from distributed.tests.utils_ci import import_or_skip

import_or_skip("lz4")

import dask

from distributed.comm.utils import from_frames, to_frames
from distributed.metrics import context_meter, meter
from distributed.protocol import (
    deserialize_bytes,
    dumps,
    loads,
    serialize_bytelist,
    serialize_bytes,
    to_serialize,
)
from distributed.protocol.serialize import ToPickle
from distributed.utils_test import gen_test

# Compressible, and large enough to be compressed (but in a single frame)
DATA = b"0" * 100_000


@pytest.fixture
def lz4():
    with dask.config.set({"distributed.comm.compression": "lz4"}):
        yield


@pytest.fixture
def metrics():
    out = []
    with context_meter.add_callback(lambda *args: out.append(args)):
        yield out


def labels(metrics):
    assert all(unit == "seconds" for _, _, unit in metrics)
    assert all(value >= 0 for _, value, _ in metrics)
    return [label for label, _, _ in metrics]


def test_spill_roundtrip(lz4, metrics):
    frames = serialize_bytelist(DATA, on_error="raise")
    # The frame that is compressed, then the rest of the time that
    # serialize_bytelist spent on compression
    assert labels(metrics) == ["serialize", "compress", "compress"]
    del metrics[:]

    assert deserialize_bytes(b"".join(frames)) == DATA
    assert labels(metrics) == ["decompress", "decompress", "deserialize"]


def test_spill_roundtrip_not_compressed(metrics):
    """serialize_bytelist and deserialize_bytes, which are used for spilling, emit the
    same labels whether or not the data is compressed: the time spent deciding not to
    compress, and finding nothing to decompress
    """
    with dask.config.set({"distributed.comm.compression": False}):
        b = serialize_bytes(DATA)
    assert deserialize_bytes(b) == DATA
    b = serialize_bytes(b"123")
    assert deserialize_bytes(b) == b"123"
    assert labels(metrics) == ["serialize", "compress", "decompress", "deserialize"] * 2


def test_dumps_loads(lz4, metrics):
    msg = {"op": "x", "data": to_serialize(DATA), "other": to_serialize(b"123")}
    frames = dumps(msg, context={"compression": "lz4"})
    # One serialize per object; compress only for the one large enough to bother
    assert labels(metrics) == ["serialize", "compress", "serialize"]
    del metrics[:]

    assert loads(frames) == {"op": "x", "data": DATA, "other": b"123"}
    assert labels(metrics) == ["decompress", "deserialize", "deserialize"]


def test_dumps_loads_pickled(lz4, metrics):
    frames = dumps({"op": "x", "data": ToPickle(123)})
    assert labels(metrics) == ["serialize"]
    del metrics[:]
    assert loads(frames) == {"op": "x", "data": 123}
    assert labels(metrics) == ["deserialize"]


def test_loads_no_deserialize(lz4, metrics):
    frames = dumps({"op": "x", "data": to_serialize(DATA)})
    del metrics[:]
    loads(frames, deserialize=False)
    assert metrics == []


def test_serialize_error(metrics):
    class C:
        def __reduce__(self):
            raise ValueError("nope")

    with pytest.raises(TypeError, match="Could not serialize"):
        serialize_bytelist(C(), on_error="raise")
    assert labels(metrics) == ["serialize"]


@pytest.mark.parametrize("allow_offload", [False, True])
@gen_test()
async def test_to_frames_from_frames(lz4, allow_offload):
    """Messages large enough to be (de)serialized in the offload thread are
    metered too.
    """
    out = []
    msg = {"op": "x", "data": to_serialize(DATA)}
    with dask.config.set({"distributed.comm.offload": 1}):
        with context_meter.add_callback(lambda *args: out.append(args)):
            frames = await to_frames(msg, allow_offload=allow_offload)
            assert labels(out) == ["serialize", "compress"]
            del out[:]
            res = await from_frames(frames, allow_offload=allow_offload)
            assert labels(out) == ["decompress", "deserialize"]
    assert res == {"op": "x", "data": DATA}


def test_additive(lz4, metrics):
    """Nested meters are not double counted"""
    with meter() as m:
        with context_meter.meter("outer"):
            deserialize_bytes(serialize_bytes(DATA))
    assert labels(metrics) == [
        "serialize",
        "compress",
        "compress",
        "decompress",
        "decompress",
        "deserialize",
        "outer",
    ]
    assert sum(value for _, value, _ in metrics) <= m.delta


def test_output_unchanged():
    """Metering does not alter what is serialized"""
    b = serialize_bytes(b"123")
    assert b.hex() == (
        "020000000000000097000000000000000300000000000000"
        "88aa7375622d68656164657280a474797065a56279746573af747970652d7365726961"
        "6c697a6564c42180059516000000000000008c086275696c74696e73948c05627974"
        "65739493942eaa73657269616c697a6572a46461736bb473706c69742d6e756d2d73"
        "75622d6672616d65739101ad73706c69742d6f6666736574739100ab636f6d707265"
        "7373696f6e91c0a5636f756e7401313233"
    )
    frames = dumps({"op": "x", "data": to_serialize(b"abc")})
    assert [bytes(f).hex() for f in frames] == [
        "82a26f70a178a46461746181ae5f5f53657269616c697a65645f5f01",
        "88aa7375622d68656164657280a474797065a56279746573af747970652d73657269"
        "616c697a6564c42180059516000000000000008c086275696c74696e73948c056279"
        "7465739493942eaa73657269616c697a6572a46461736bb473706c69742d6e756d2d"
        "7375622d6672616d65739101ad73706c69742d6f6666736574739100ab636f6d7072"
        "657373696f6e91c0ae6e756d2d7375622d6672616d657301",
        "616263",
    ]


@pytest.mark.parametrize("compression", [False, "lz4"])
def test_output_unchanged_with_callbacks(compression):
    """Installing callbacks does not alter what is serialized"""
    msg = {"op": "x", "data": to_serialize(DATA), "p": ToPickle([1, 2])}
    with dask.config.set({"distributed.comm.compression": compression}):
        b1 = serialize_bytes(DATA)
        f1 = [bytes(f) for f in dumps(msg)]
        with context_meter.add_callback(lambda *args: None):
            b2 = serialize_bytes(DATA)
            f2 = [bytes(f) for f in dumps(msg)]
    assert b1 == b2
    assert f1 == f2
    assert (len(b1) < len(DATA)) == bool(compression)
