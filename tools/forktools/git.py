"""Run git in the materialized tree with a fixed identity."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from forktools import ForkError

_ENV = {
    "GIT_AUTHOR_NAME": "Fine metrics fork",
    "GIT_AUTHOR_EMAIL": "fork@localhost",
    "GIT_COMMITTER_NAME": "Fine metrics fork",
    "GIT_COMMITTER_EMAIL": "fork@localhost",
    "GIT_CONFIG_NOSYSTEM": "1",
}


def git(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, **_ENV)
    proc = subprocess.run(
        ["git", "-c", "core.autocrlf=false", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    if check and proc.returncode:
        raise ForkError(f"git {' '.join(args)} failed in {cwd}:\n{proc.stderr}")
    return proc


def out(cwd: Path, *args: str) -> str:
    return git(cwd, *args).stdout.strip()


def show(cwd: Path, obj: str) -> bytes:
    """The raw bytes of a blob, e.g. ``show(tree, "HEAD:conftest.py")``."""
    proc = subprocess.run(["git", "show", obj], cwd=cwd, capture_output=True)
    if proc.returncode:
        raise ForkError(f"git show {obj} failed in {cwd}:\n{proc.stderr.decode()}")
    return proc.stdout
