"""Read ``patches/series`` (GNU quilt format) and check it against ``patches/``."""
from __future__ import annotations

from pathlib import Path

from forktools import ForkError


def read_series(patches: Path) -> list[Path]:
    """Return the patches in series order.

    Blank lines and ``#`` comments are skipped. A series entry without a file,
    or a ``.patch`` file that the series does not list, is an error.
    """
    series = patches / "series"
    names: list[str] = []
    if series.exists():
        for line in series.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                names.append(line.split()[0])
    problems = []
    for name in names:
        if not (patches / name).is_file():
            problems.append(f"patches/series lists {name}, which does not exist")
    listed = set(names)
    for path in sorted(patches.glob("*.patch")):
        if path.name not in listed:
            problems.append(f"patches/{path.name} is not listed in patches/series")
    if len(listed) != len(names):
        problems.append("patches/series lists a patch twice")
    if problems:
        raise ForkError("\n".join(problems))
    return [patches / name for name in names]


def write_series(patches: Path, names: list[str]) -> None:
    text = "# Applied in this order over the pinned base; see README.rst.\n"
    text += "".join(f"{n}\n" for n in names)
    series = patches / "series"
    if not series.exists() or series.read_text() != text:
        series.write_text(text)
