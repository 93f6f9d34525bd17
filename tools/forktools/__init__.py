"""Keep the fine-metrics fork as a patch series over a pinned distributed sdist.

One small module per job:

- :mod:`forktools.project`: where things are, and the pinned base (read from
  ``pyproject.toml``);
- :mod:`forktools.base`: fetch the sdist through pip and verify its hash;
- :mod:`forktools.series`: read and check ``patches/series``;
- :mod:`forktools.overlay`: the files the fork adds, laid over the tree as they are;
- :mod:`forktools.tree`: materialize ``build/tree`` and turn it back into patches;
- :mod:`forktools.backend`: the in-tree PEP 517 backend behind ``pip install .``;
- :mod:`forktools.cli`: the command line used by the Makefile.
"""
from __future__ import annotations


class ForkError(Exception):
    """A problem the user must fix; the CLI prints it and exits non-zero."""
