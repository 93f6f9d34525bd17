"""Micro-benchmarks of the fork's metering primitives, in µs per call.

Each figure is the best of five timings of ``--size`` calls (timeit's convention:
the minimum is the cost without interference from the rest of the machine).
Figures:

- ``digest_0cb_us``, ``digest_1cb_us``, ``digest_3cb_us``:
  ``context_meter.digest_metric`` with 0, 1 and 3 no-op callbacks installed;
- ``meter_flat_us``: ``with context_meter.meter(...)`` around nothing;
- ``meter_nested3_us``: the same, three blocks nested, per block;
- ``ledger_us``: ``DelayedMetricsLedger`` created, recording one metric in
  ``record()``, then ``finalize()``.

The meters run with one callback installed, as they do in the worker, where a
ledger always listens. Pristine distributed has none of this: there the script
prints ``{"applicable": false}``.
"""
from __future__ import annotations

import timeit
from collections.abc import Hashable, Sequence
from contextlib import ExitStack
from typing import Any

from _common import emit, fine_metrics_api, parse_size

REPEAT = 5


def noop_callback(label: Hashable, value: float, unit: str) -> None:
    """A callback that costs only its call"""


def best_us(stmt: str, names: dict[str, Any], number: int, calls: int = 1) -> float:
    """Best time of ``stmt`` in µs, divided by the ``calls`` it makes each time.

    ``stmt`` is source code rather than a function, so that timeit compiles it
    into its loop and no extra call is measured.
    """
    times = timeit.repeat(stmt, number=number, repeat=REPEAT, globals=names)
    return min(times) / number / calls * 1e6


DIGEST = "digest_metric('x', 1.0, 'seconds')"
FLAT = """
with meter('x'):
    pass
"""
NESTED = """
with meter('x'):
    with meter('y'):
        with meter('z'):
            pass
"""
LEDGER = """
ledger = DelayedMetricsLedger()
with ledger.record():
    digest_metric('x', 1.0, 'seconds')
list(ledger.finalize())
"""


def run(size: int, api: Any) -> dict[str, float]:
    """Time every primitive with ``size`` calls per timing"""
    cm = api.context_meter
    names = {
        "digest_metric": cm.digest_metric,
        "meter": cm.meter,
        "DelayedMetricsLedger": api.DelayedMetricsLedger,
    }
    figures = {}
    for n in (0, 1, 3):
        with ExitStack() as stack:
            for _ in range(n):
                stack.enter_context(cm.add_callback(noop_callback))
            figures[f"digest_{n}cb_us"] = best_us(DIGEST, names, size)

    with cm.add_callback(noop_callback):
        figures["meter_flat_us"] = best_us(FLAT, names, size)
        figures["meter_nested3_us"] = best_us(NESTED, names, size, calls=3)

    figures["ledger_us"] = best_us(LEDGER, names, size)
    return figures


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point"""
    size = parse_size(__doc__ or "", 200_000, argv)
    api = fine_metrics_api()
    if api is None:
        emit({"applicable": False})
    else:
        emit(run(size, api))


if __name__ == "__main__":
    main()
