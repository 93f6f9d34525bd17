"""What one delivery of fine metrics costs the scheduler, and its size.

A worker delivers, with its heartbeat, what its fine metrics gained since the
last acknowledged delivery, for the keys that changed. This builds the worst case
of the issue: ``--size`` task prefixes (1,000 by default) with 20 labels each, all
changed since the last delivery, and measures (best of five, with the garbage
collector on, as it is in a scheduler):

- ``deliver_us``: the scheduler's side, from the bytes of the heartbeat's
  ``fine_metrics`` argument to the cluster's totals: msgpack loads, the checks of
  ``parse_fine_metrics_delivery`` and ``FineMetricsReceiver.receive``;
- ``deliver_us_per_key``: the same, per key;
- ``collect_us``: the worker's side, ``FineMetricsSender.delivery()``, which
  scans its totals;
- ``delivery_bytes``: the size of the serialized heartbeat message holding the
  delivery, as it goes over the wire (msgpack, not compressed);
- ``keys``: how many keys it holds.

``--size`` is the number of prefixes. Each delivery in the series follows the last
one, acknowledged, as heartbeats do. Pristine distributed has no such delivery:
there the script prints ``{"applicable": false}``.
"""
from __future__ import annotations

import time
import timeit
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from _common import emit, parse_size

REPEAT = 5
LABELS = 20


def fake_totals(n_prefixes: int, step: int) -> dict[tuple, float]:
    """Totals of ``n_prefixes`` prefixes with ``LABELS`` labels each, in seconds,
    all different for each ``step``
    """
    return {
        ("execute", f"prefix-{p}", f"label-{i}", "seconds"): 0.001
        * (step + 1)
        * (i + 1)
        for p in range(n_prefixes)
        for i in range(LABELS)
    }


def best_us(func: Any) -> float:
    """Best of ``REPEAT`` calls of ``func``, in µs; timeit would turn the garbage
    collector off, which a scheduler does not
    """
    timings = timeit.repeat(func, setup="gc.enable()", number=1, repeat=REPEAT)
    return min(timings) * 1e6


def run(n_prefixes: int, api: Any) -> dict[str, float]:
    from distributed.protocol import dumps, loads

    totals: dict[tuple, float] = {}
    sender = api.FineMetricsSender(totals)
    step = 0

    def next_delivery() -> dict[str, Any]:
        nonlocal step
        step += 1
        totals.update(fake_totals(n_prefixes, step))
        delivery = sender.delivery()
        assert delivery is not None
        sender.acknowledge(delivery["seq"])
        return delivery

    deliveries = [next_delivery() for _ in range(REPEAT + 1)]
    frames = [dumps({"op": "heartbeat_worker", "fine_metrics": d}) for d in deliveries]
    receiver = api.FineMetricsReceiver()
    cluster: defaultdict = defaultdict(int)

    def add(key: tuple, value: float) -> None:
        cluster[key] += value

    def scheduler_side(f: list[bytes]) -> None:
        msg = loads(f)
        seq, base, metrics, rejected = api.parse_fine_metrics_delivery(
            msg["fine_metrics"]
        )
        assert not rejected
        receiver.receive(seq, base, metrics, add)

    pending = iter(frames)
    deliver_us = best_us(lambda: scheduler_side(next(pending)))

    # Every key has changed since the last delivery, for each of these
    collect = []
    for _ in range(REPEAT):
        step += 1
        totals.update(fake_totals(n_prefixes, step))
        t0 = time.perf_counter()
        delivery = sender.delivery()
        collect.append(time.perf_counter() - t0)
        assert delivery is not None
        assert len(delivery["metrics"]) == n_prefixes * LABELS
        sender.acknowledge(delivery["seq"])
    collect_us = min(collect) * 1e6
    assert len(cluster) == n_prefixes * LABELS
    keys = n_prefixes * LABELS
    return {
        "deliver_us": deliver_us,
        "deliver_us_per_key": deliver_us / keys,
        "collect_us": collect_us,
        "delivery_bytes": sum(map(len, frames[0])),
        "keys": keys,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point"""
    n_prefixes = parse_size(__doc__ or "", 1000, argv)
    import distributed.metrics as api

    if not hasattr(api, "FineMetricsReceiver"):
        emit({"applicable": False})
    else:
        emit(run(n_prefixes, api))


if __name__ == "__main__":
    main()
