"""Fixtures for the tooling's tests: a tiny fake checkout with a fake base."""
from __future__ import annotations

import hashlib
import io
import sys
import tarfile
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1]
REPO = TOOLS.parent
sys.path.insert(0, str(TOOLS))

UPSTREAM = {
    "PKG-INFO": "Name: distributed\n",
    "distributed/__init__.py": "from distributed.core import f\n",
    "distributed/core.py": "".join(
        f"def f{i}():\n    return {i}\n\n\n" for i in range(20)
    ),
    "setup.cfg": "[flake8]\n",
}


def make_sdist(path: Path, files: dict[str, str]) -> str:
    """Write a fake sdist of 'distributed 2023.3.1' and return its sha256."""
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"distributed-2023.3.1/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_pyproject(root: Path, sha256: str) -> None:
    (root / "pyproject.toml").write_text(
        f'[tool.fork]\nbase = "distributed==2023.3.1"\nsha256 = "{sha256}"\n'
    )


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A checkout with a cached fake base, an empty series and one overlay test."""
    root = tmp_path / "fork"
    (root / "build").mkdir(parents=True)
    write_pyproject(
        root, make_sdist(root / "build/distributed-2023.3.1.tar.gz", UPSTREAM)
    )
    (root / "patches").mkdir()
    (root / "patches/series").write_text("")
    (root / "distributed/tests").mkdir(parents=True)
    (root / "distributed/tests/test_new.py").write_text("def test_x():\n    pass\n")
    (root / "conftest.py").write_text("# root conftest\n")
    return root
