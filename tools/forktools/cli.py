"""Command line of the fork tooling: ``python tools/fork.py COMMAND``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from forktools import ForkError
from forktools.base import fetch, upstream_paths
from forktools.overlay import check_shadowing, overlay_files
from forktools.project import Project
from forktools.series import read_series
from forktools.tree import materialize, refresh


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fork", description=__doc__)
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="checkout")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="download and verify the pinned sdist")
    sub.add_parser("check", help="check series and overlay without building")
    sub.add_parser("tree", help="materialize build/tree")
    sub.add_parser("refresh", help="write build/tree back to patches/ and overlay")
    args = parser.parse_args(argv)
    try:
        project = Project.load(args.root)
        if args.command == "fetch":
            print(fetch(project))
        elif args.command == "check":
            read_series(project.patches)
            upstream = upstream_paths(fetch(project))
            check_shadowing(overlay_files(project.root), upstream)
            print("series and overlay are consistent")
        elif args.command == "tree":
            materialize(project, project.tree)
            print(f"{project.tree.relative_to(project.root)} is ready")
        elif args.command == "refresh":
            names = refresh(project)
            print(f"patches/series: {len(names)} patches; overlay mirrored")
    except ForkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
