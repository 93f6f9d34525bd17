#!/usr/bin/env python3
"""Entry point of the fork tooling; see ``tools/forktools``."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from forktools.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
