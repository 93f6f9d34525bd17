"""The files the fork adds to upstream, laid over the tree unchanged.

The overlay is ``distributed/`` (new modules, the fork's tests) and the root
``conftest.py``. A path that upstream already has must be changed by a patch,
so an overlay file that shadows one is an error.
"""
from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from forktools import ForkError

OVERLAY_DIRS = ("distributed",)
OVERLAY_FILES = ("conftest.py",)
_JUNK = ("__pycache__", ".pytest_cache", ".mypy_cache")


def is_overlay_path(rel: str) -> bool:
    return rel in OVERLAY_FILES or rel.split("/", 1)[0] in OVERLAY_DIRS


def overlay_files(root: Path) -> list[str]:
    """Relative paths of the overlay files in a checkout of the fork."""
    found = [name for name in OVERLAY_FILES if (root / name).is_file()]
    for top in OVERLAY_DIRS:
        for path in sorted((root / top).rglob("*")):
            rel = path.relative_to(root)
            if path.is_file() and not any(p in _JUNK for p in rel.parts):
                if path.suffix not in (".pyc", ".pyo"):
                    found.append(rel.as_posix())
    return found


def check_shadowing(files: Iterable[str], upstream: set[str]) -> None:
    shadowing = sorted(set(files) & upstream)
    if shadowing:
        raise ForkError(
            "overlay files shadow upstream paths (change those with a patch):\n"
            + "\n".join(f"  {rel}" for rel in shadowing)
        )


def copy_overlay(root: Path, files: Iterable[str], dest: Path) -> None:
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / rel, target)
