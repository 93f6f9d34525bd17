"""In-tree PEP 517 backend: ``pip install .`` builds the fork.

The wheel is built by upstream's own ``setup.py`` (through setuptools'
legacy backend) from a tree materialized exactly as ``make tree`` does: the
pinned sdist, the series, then the overlay. Its version carries the fork's
local label, set by the first patch of the series.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from setuptools import build_meta

from forktools.project import Project
from forktools.tree import materialize

# What an sdist of the fork carries: enough to build it again.
_SDIST = [
    "pyproject.toml",
    "README.rst",
    "conftest.py",
    "tools",
    "patches",
    "distributed",
    "continuous_integration",
]


@contextlib.contextmanager
def _materialized() -> Iterator[Path]:
    project = Project.load(Path.cwd())
    with tempfile.TemporaryDirectory(prefix="fork-build-") as tmp:
        tree = Path(tmp) / "tree"
        materialize(project, tree, log=lambda msg: print(msg, file=sys.stderr))
        cwd = os.getcwd()
        os.chdir(tree)
        try:
            yield tree
        finally:
            os.chdir(cwd)


def _version(tree: Path) -> str:
    namespace: dict = {}
    exec((tree / "distributed" / "_version.py").read_text(), namespace)
    return namespace["get_versions"]()["version"]


def get_requires_for_build_wheel(config_settings: dict | None = None) -> list[str]:
    return []


def get_requires_for_build_sdist(config_settings: dict | None = None) -> list[str]:
    return []


def build_wheel(
    wheel_directory: str,
    config_settings: dict | None = None,
    metadata_directory: str | None = None,
) -> str:
    wheel_directory = os.path.abspath(wheel_directory)
    with _materialized():
        return build_meta.__legacy__.build_wheel(wheel_directory, config_settings)


def build_sdist(sdist_directory: str, config_settings: dict | None = None) -> str:
    root = Path.cwd()
    with _materialized() as tree:
        version = _version(tree)
    base = f"distributed-{version}"
    name = f"{base}.tar.gz"
    pkg_info = f"Metadata-Version: 2.1\nName: distributed\nVersion: {version}\n"
    with tarfile.open(Path(sdist_directory) / name, "w:gz") as tar:
        for entry in _SDIST:
            if (root / entry).exists():
                tar.add(root / entry, f"{base}/{entry}", filter=_no_junk)
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        info.size = len(pkg_info)
        tar.addfile(info, fileobj=_bytes(pkg_info))
    return name


def _no_junk(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    parts = info.name.split("/")
    return None if "__pycache__" in parts or info.name.endswith(".pyc") else info


def _bytes(text: str):
    import io

    return io.BytesIO(text.encode())
