"""Materialize ``build/tree`` from base + series + overlay, and turn it back.

``build/tree`` is a git repository: the first commit is the pristine sdist
(tagged ``upstream``), then one commit per patch in series order, then one
commit with the overlay. ``refs/fork/built`` marks the commit that the last
``tree`` or ``refresh`` agreed with, so that ``tree`` never throws away work
that ``refresh`` has not saved yet.
"""
from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from forktools import ForkError
from forktools.base import fetch, unpack, upstream_paths
from forktools.git import git, out, show
from forktools.overlay import (
    check_shadowing,
    copy_overlay,
    is_overlay_path,
    overlay_files,
)
from forktools.project import Project
from forktools.series import read_series, write_series

BUILT = "refs/fork/built"
# Written by installs and test runs inside the tree; never part of a patch.
EXCLUDE = [
    "build/",
    "dist/",
    "__pycache__/",
    "*.pyc",
    ".pytest_cache/",
    ".mypy_cache/",
    "dask-worker-space/",
    "dask-scratch-space/",
    "test_cluster_dump/",
    ".eggs/",
]


def materialize(project: Project, dest: Path, log=print) -> None:
    """Build the tree in a sibling folder, then swap it in.

    Every check runs before ``dest`` is touched, so a failure leaves the
    previous tree (or none) as it was.
    """
    patches = read_series(project.patches)
    files = overlay_files(project.root)
    sdist = fetch(project)
    check_shadowing(files, upstream_paths(sdist))
    if dest.exists():
        check_saved(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".tree-") as tmp:
        new = Path(tmp) / "tree"
        unpack(sdist, new)
        _commit_base(project, new)
        for i, patch in enumerate(patches, 1):
            log(f"* Applying {patch.name} ({i}/{len(patches)})")
            _apply(new, patch)
        copy_overlay(project.root, files, new)
        git(new, "add", "--all", "--force", "--", *files)
        if git(new, "diff", "--cached", "--quiet", check=False).returncode:
            git(
                new, "commit", "--quiet", "-m", "Lay the fork's own files over the tree"
            )
        git(new, "update-ref", BUILT, "HEAD")
        if dest.exists():
            shutil.rmtree(dest)
        new.rename(dest)


def _commit_base(project: Project, tree: Path) -> None:
    git(tree, "init", "--quiet", "--initial-branch=main")
    (tree / ".git" / "info" / "exclude").write_text("\n".join(EXCLUDE) + "\n")
    git(tree, "add", "--all", "--force")
    msg = f"{project.name} {project.version}, pristine sdist (sha256 {project.sha256})"
    git(tree, "commit", "--quiet", "-m", msg)
    git(tree, "tag", "upstream")
    # Installing the tree rewrites the sdist's egg-info: not a change of ours.
    info = out(tree, "ls-files", "*.egg-info/*").split()
    if info:
        git(tree, "update-index", "--skip-worktree", *info)


def _apply(tree: Path, patch: Path) -> None:
    proc = git(
        tree,
        "am",
        "--quiet",
        "--committer-date-is-author-date",
        str(patch),
        check=False,
    )
    if proc.returncode:
        git(tree, "am", "--abort", check=False)
        detail = [
            line
            for line in (proc.stdout + proc.stderr).splitlines()
            if line.startswith("error:")
        ]
        files = sorted(
            {
                m
                for line in detail
                for m in re.findall(r"error: (?:patch failed: )?([^:\s]+)", line)
            }
        )
        raise ForkError(
            f"patch {patch.name} does not apply"
            + (f" to {', '.join(files)}" if files else "")
            + ":\n"
            + "\n".join(f"  {line}" for line in detail or proc.stderr.splitlines())
        )


def check_saved(tree: Path) -> None:
    """Refuse to replace a tree holding edits that ``refresh`` has not saved."""
    if not (tree / ".git").exists():
        raise ForkError(f"{tree} exists but is not a git repository; remove it")
    if out(tree, "status", "--porcelain", "--untracked-files=normal"):
        raise ForkError(
            f"{tree} has uncommitted changes: commit them and run `make refresh`, "
            "or discard them (git -C build/tree stash)"
        )
    built = git(tree, "rev-parse", "--verify", "--quiet", BUILT, check=False)
    if built.stdout.strip() != out(tree, "rev-parse", "HEAD"):
        raise ForkError(
            f"{tree} has commits that are not in patches/ yet: run `make refresh` "
            "first, or reset them (git -C build/tree reset --hard refs/fork/built)"
        )


def refresh(project: Project) -> list[str]:
    """Write the tree's commits back to ``patches/`` and its overlay to the checkout.

    Each commit after ``upstream`` becomes one patch, restricted to upstream
    paths; a commit touching only overlay files becomes none. The overlay
    folders of the checkout are made to mirror the tree's.
    """
    tree = project.tree
    if not (tree / ".git").exists():
        raise ForkError(f"{tree} does not exist: run `make tree` first")
    if out(tree, "status", "--porcelain", "--untracked-files=normal"):
        raise ForkError(f"{tree} has uncommitted changes: commit them first")
    added = out(tree, "diff", "--name-only", "--diff-filter=A", "upstream", "HEAD")
    new_files = [p for p in added.splitlines() if p]
    stray = [p for p in new_files if not is_overlay_path(p)]
    if stray:
        raise ForkError(
            "new files outside the overlay (distributed/, conftest.py); "
            "patches only change upstream files:\n" + "\n".join(f"  {p}" for p in stray)
        )
    touched = out(tree, "log", "--name-only", "--format=", "upstream..HEAD").split("\n")
    upstream = set(out(tree, "ls-tree", "-r", "--name-only", "upstream").split("\n"))
    names = _format_patches(project, sorted({p for p in touched if p} - upstream))
    _mirror_overlay(project, new_files)
    git(tree, "update-ref", BUILT, "HEAD")
    return names


def _format_patches(project: Project, overlay: list[str]) -> list[str]:
    """One patch per commit, leaving out every path that upstream does not have."""
    with tempfile.TemporaryDirectory() as tmp:
        pathspec = ["."] + [f":(exclude,literal){p}" for p in overlay]
        git(
            project.tree,
            "format-patch",
            "--quiet",
            "--zero-commit",
            "--no-numbered",
            "--no-signature",
            "--no-renames",
            "--output-directory",
            tmp,
            "upstream..HEAD",
            "--",
            *pathspec,
        )
        made = sorted(Path(tmp).glob("*.patch"))
        project.patches.mkdir(exist_ok=True)
        for old in project.patches.glob("*.patch"):
            if old.name not in {p.name for p in made}:
                old.unlink()
        for patch in made:
            target = project.patches / patch.name
            if not target.exists() or target.read_bytes() != patch.read_bytes():
                shutil.copyfile(patch, target)
    names = [p.name for p in made]
    write_series(project.patches, names)
    return names


def _mirror_overlay(project: Project, overlay: list[str]) -> None:
    for rel in overlay:
        data = show(project.tree, f"HEAD:{rel}")
        target = project.root / rel
        if not target.exists() or target.read_bytes() != data:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    for rel in set(overlay_files(project.root)) - set(overlay):
        (project.root / rel).unlink()
