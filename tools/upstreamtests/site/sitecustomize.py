"""Started by every python process of a run of upstream's suite (on PYTHONPATH).

Installs the shims' import hook (see :mod:`upstreamtests.shims`), so that worker
processes can import upstream's test modules too. Only the harness puts this
folder on PYTHONPATH, and only for the run.
"""
from __future__ import annotations

try:
    from upstreamtests import shims
except ImportError:  # PYTHONPATH without the tools folder: nothing to do
    pass
else:
    shims.install()
