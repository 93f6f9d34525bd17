#!/usr/bin/env python3
"""Entry point of the upstream-suite harness; see ``tools/upstreamtests``."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from upstreamtests.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
