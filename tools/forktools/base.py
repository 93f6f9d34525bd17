"""Fetch the upstream sdist through pip and verify it against the pinned hash."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from forktools import ForkError
from forktools.project import Project


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify(project: Project, path: Path) -> None:
    """Raise unless ``path`` has the pinned hash."""
    actual = sha256_of(path)
    if actual != project.sha256:
        raise ForkError(
            f"{path.name}: sha256 mismatch\n"
            f"  expected {project.sha256} (pyproject.toml [tool.fork])\n"
            f"  actual   {actual}"
        )


def fetch(project: Project) -> Path:
    """Return the path of the verified sdist, downloading it if needed.

    The download goes through ``pip download``, so it uses whatever index this
    machine's pip is configured with. A file that fails verification is never
    left in the cache.
    """
    if project.sdist.exists():
        try:
            verify(project, project.sdist)
        except ForkError:
            project.sdist.unlink()
            raise
        return project.sdist
    project.build.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=project.build) as tmp:
        spec = f"{project.name}=={project.version}"
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        cmd += ["--no-binary", ":all:", "--dest", tmp, spec]
        env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        got = Path(tmp) / project.sdist.name
        if proc.returncode or not got.exists():
            raise ForkError(f"pip download {spec} failed:\n{proc.stderr.strip()}")
        verify(project, got)
        os.replace(got, project.sdist)
    return project.sdist


def unpack(sdist: Path, dest: Path) -> None:
    """Unpack the sdist's one top-level folder as ``dest``, which must not exist."""
    with tarfile.open(sdist) as tar:
        members = tar.getmembers()
        top = {m.name.split("/", 1)[0] for m in members}
        if len(top) != 1:
            raise ForkError(f"{sdist.name}: expected one top-level folder, got {top}")
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(tmp, filter="data")  # type: ignore[call-arg]
            else:  # Python < 3.11.4
                tar.extractall(tmp)
            os.replace(Path(tmp) / top.pop(), dest)


def upstream_paths(sdist: Path) -> set[str]:
    """Relative paths of the files in the sdist, without its top-level folder."""
    with tarfile.open(sdist) as tar:
        return {
            m.name.split("/", 1)[1]
            for m in tar.getmembers()
            if m.isfile() and "/" in m.name
        }
