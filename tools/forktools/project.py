"""Locations of the fork's pieces and the pinned upstream base."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from forktools import ForkError


@dataclass(frozen=True)
class Project:
    """A checkout of the fork.

    The upstream base is pinned in exactly one place, ``[tool.fork]`` in
    ``pyproject.toml``::

        [tool.fork]
        base = "distributed==2023.3.1"
        sha256 = "..."
    """

    root: Path
    name: str
    version: str
    sha256: str

    @classmethod
    def load(cls, root: Path) -> Project:
        root = root.resolve()
        try:
            with open(root / "pyproject.toml", "rb") as f:
                fork = tomllib.load(f)["tool"]["fork"]
            name, version = fork["base"].split("==")
            sha256 = fork["sha256"]
        except (OSError, KeyError, ValueError, tomllib.TOMLDecodeError) as e:
            raise ForkError(
                f"{root / 'pyproject.toml'}: cannot read [tool.fork] "
                f"base = 'NAME==VERSION' and sha256: {e!r}"
            ) from e
        return cls(root, name.strip(), version.strip(), sha256.strip().lower())

    @property
    def build(self) -> Path:
        return self.root / "build"

    @property
    def sdist(self) -> Path:
        """Where the verified sdist is cached."""
        return self.build / f"{self.name}-{self.version}.tar.gz"

    @property
    def tree(self) -> Path:
        return self.build / "tree"

    @property
    def patches(self) -> Path:
        return self.root / "patches"
