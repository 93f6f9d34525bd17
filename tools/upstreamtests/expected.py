"""The list of upstream tests that are not expected to pass against the fork.

One entry a line, ``TEST KIND: REASON``; blank lines and lines starting with ``#``
are ignored::

    distributed/tests/test_worker.py::test_digests  fork: the fork removes ...

``TEST`` is a pytest node id relative to the suite's root. Without a parameter
part (``[...]``) it stands for every parametrization of that test. ``KIND`` says
what the entry means on each side (see :data:`KINDS`), and ``REASON`` is
mandatory. Only the standard library is used, so that any python can read it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SIDES = ("fork", "pristine")

#: What each kind of entry means, and what it does on each side: ``xfail`` (a
#: strict expected failure: the run fails if the test passes), ``deselect`` (not
#: run), or ``None`` (run as usual, and expected to pass).
KINDS: dict[str, tuple[str, dict[str, str | None]]] = {
    "fork": (
        "fails against the fork for a change the fork makes on purpose; "
        "passes on pristine 2023.3.1",
        {"fork": "xfail", "pristine": None},
    ),
    "env": (
        "fails in this environment, on pristine 2023.3.1 as well",
        {"fork": "xfail", "pristine": "xfail"},
    ),
    "deselect": (
        "not run on either side, for the reason given (e.g. flaky here)",
        {"fork": "deselect", "pristine": "deselect"},
    ),
}

_LINE = re.compile(r"(?P<test>\S+::\S+)\s+(?P<kind>[a-z]+):(?P<reason>.*)")


class ListError(Exception):
    """The list is malformed; the message names the file and line."""


@dataclass(frozen=True)
class Entry:
    test: str
    kind: str
    reason: str
    line: int = 0

    @property
    def path(self) -> str:
        """The test module's path, relative to the suite's root."""
        return self.test.split("::", 1)[0]

    def matches(self, nodeid: str) -> bool:
        if nodeid == self.test:
            return True
        return "[" not in self.test and nodeid.split("[", 1)[0] == self.test

    def action(self, side: str) -> str | None:
        """``"xfail"``, ``"deselect"`` or ``None`` (expected to pass) on ``side``."""
        return KINDS[self.kind][1][side]

    def describe(self) -> str:
        return f"{self.kind}: {self.reason}"


def parse(text: str, source: str = "<list>") -> list[Entry]:
    entries: list[Entry] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{number}"
        m = _LINE.fullmatch(line)
        if not m:
            raise ListError(f"{where}: expected 'TEST KIND: REASON', got {raw!r}")
        test, kind, reason = m["test"], m["kind"], m["reason"].strip()
        if kind not in KINDS:
            known = ", ".join(KINDS)
            raise ListError(f"{where}: unknown kind {kind!r} (one of {known})")
        if not reason:
            raise ListError(f"{where}: {test} has no reason")
        function = test.split("[", 1)[0]
        for other in (test, function):
            if other in seen:
                raise ListError(
                    f"{where}: {test} is already covered by line {seen[other]}"
                )
        if function == test and any(t.startswith(test + "[") for t in seen):
            raise ListError(f"{where}: {test} overlaps an entry for one parameter")
        seen[test] = number
        entries.append(Entry(test, kind, reason, number))
    return entries


def load(path: Path) -> list[Entry]:
    return parse(path.read_text(), str(path))


def lookup(entries: list[Entry], nodeid: str) -> Entry | None:
    for entry in entries:
        if entry.matches(nodeid):
            return entry
    return None
