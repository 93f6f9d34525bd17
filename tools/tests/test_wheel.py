"""``pip install`` of the fork, for real: PEP 517, in a fresh virtual environment."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

CONSTRAINTS = REPO / "continuous_integration" / "constraints-py3.11.txt"


def run(*cmd: str | Path, **kwargs) -> str:
    proc = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, **kwargs
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_pip_install_builds_labelled_wheel(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for entry in ("pyproject.toml", "conftest.py", "README.rst"):
        if (REPO / entry).exists():
            shutil.copy(REPO / entry, src / entry)
    for entry in ("tools", "patches", "distributed", "continuous_integration"):
        shutil.copytree(
            REPO / entry, src / entry, ignore=shutil.ignore_patterns("__pycache__")
        )
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    # Build isolation on, as for any user; dependencies resolve under the pins
    env = dict(os.environ, PIP_CONSTRAINT=str(CONSTRAINTS))
    run(python, "-m", "pip", "install", "--quiet", src, env=env, cwd=tmp_path)

    script = (
        "import distributed, dask, importlib.metadata as m;"
        "print(distributed.__version__, m.version('distributed'), dask.__version__);"
        "from distributed.metrics import context_meter;"
        "print(distributed.__file__)"
    )
    version, dist_version, dask_version, path = run(
        python, "-c", script, cwd=tmp_path
    ).split()
    assert version == dist_version
    assert version.startswith("2023.3.1+fm")
    assert dask_version == "2023.3.1"
    assert Path(path).is_relative_to(venv)
    # The fork's own files are in the wheel too (but not its tests)
    assert (Path(path).parent / "metrics.py").exists()


@pytest.mark.slow
def test_pip_install_from_git_url(tmp_path: Path) -> None:
    """``pip install git+URL@BRANCH`` of the committed state of this checkout"""
    proc = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--abbrev-ref", "HEAD"],
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        pytest.skip("not a git checkout with commits")
    branch = proc.stdout.strip()
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    env = dict(os.environ, PIP_CONSTRAINT=str(CONSTRAINTS))
    url = f"git+file://{REPO}@{branch}"
    run(python, "-m", "pip", "install", "--quiet", url, env=env, cwd=tmp_path)
    version = run(
        python, "-c", "import distributed; print(distributed.__version__)", cwd=tmp_path
    ).strip()
    assert version.startswith("2023.3.1+fm")
