"""The fork tooling: tree, refresh, and the errors it must give."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TOOLS, make_sdist, write_pyproject
from forktools.cli import main
from forktools.git import git, out
from forktools.overlay import overlay_files
from forktools.project import Project


def fork(root: Path, *args: str) -> int:
    return main(["--root", str(root), *args])


def commit(tree: Path, message: str) -> None:
    git(tree, "add", "--all")
    git(tree, "commit", "--quiet", "-m", message)


def snapshot(root: Path) -> dict[str, bytes]:
    """Bytes of everything the fork keeps: series, patches and overlay."""
    files = [p.relative_to(root).as_posix() for p in (root / "patches").iterdir()]
    files += overlay_files(root)
    return {rel: (root / rel).read_bytes() for rel in sorted(files)}


def add_patch(root: Path, old: str = "return 3", new: str = "return 33") -> None:
    """Change an upstream file in the tree, commit it, and refresh."""
    core = root / "build/tree/distributed/core.py"
    core.write_text(core.read_text().replace(old, new))
    commit(root / "build/tree", f"Change {old!r}\n\nBecause the test says so.")
    assert fork(root, "refresh") == 0


def test_tree_is_base_then_patches_then_overlay(checkout):
    assert fork(checkout, "tree") == 0
    tree = checkout / "build/tree"
    add_patch(checkout)
    assert (checkout / "patches/series").read_text().splitlines()[-1] == (
        "0001-Change-return-3.patch"
    )
    assert fork(checkout, "tree") == 0
    log = out(tree, "log", "--format=%s", "--reverse").splitlines()
    assert log[0].startswith("distributed 2023.3.1, pristine sdist (sha256 ")
    assert log[1:] == ["Change 'return 3'", "Lay the fork's own files over the tree"]
    assert out(tree, "rev-parse", "upstream") == out(
        tree, "rev-list", "--max-parents=0", "HEAD"
    )
    assert "return 33" in (tree / "distributed/core.py").read_text()
    assert (tree / "distributed/tests/test_new.py").exists()
    assert (tree / "conftest.py").read_text() == "# root conftest\n"


def test_round_trip_is_a_no_op(checkout):
    assert fork(checkout, "tree") == 0
    add_patch(checkout)
    add_patch(checkout, "return 7", "return 77")
    before = snapshot(checkout)
    head = out(checkout / "build/tree", "rev-parse", "HEAD^{tree}")
    assert fork(checkout, "tree") == 0
    assert fork(checkout, "refresh") == 0
    assert snapshot(checkout) == before
    assert fork(checkout, "tree") == 0
    assert out(checkout / "build/tree", "rev-parse", "HEAD^{tree}") == head


def test_refresh_keeps_patches_to_upstream_files_and_mirrors_overlay(checkout):
    assert fork(checkout, "tree") == 0
    tree = checkout / "build/tree"
    (tree / "distributed/core.py").write_text("def f0():\n    return 0\n")
    (tree / "distributed/tests/test_new.py").unlink()
    (tree / "distributed/tests/test_other.py").write_text("def test_y():\n    pass\n")
    commit(tree, "Mixed change")
    assert fork(checkout, "refresh") == 0
    (patch,) = (checkout / "patches").glob("*.patch")
    text = patch.read_text()
    assert "distributed/core.py" in text and "tests/" not in text
    assert not (checkout / "distributed/tests/test_new.py").exists()
    assert (checkout / "distributed/tests/test_other.py").exists()


def test_new_file_outside_overlay_is_refused(checkout, capsys):
    assert fork(checkout, "tree") == 0
    (checkout / "build/tree/docs").mkdir()
    (checkout / "build/tree/docs/new.rst").write_text("x\n")
    commit(checkout / "build/tree", "Add docs")
    assert fork(checkout, "refresh") == 1
    assert "docs/new.rst" in capsys.readouterr().err


def test_wrong_hash_stops_and_leaves_nothing(checkout, capsys):
    write_pyproject(checkout, "0" * 64)
    assert fork(checkout, "tree") == 1
    err = capsys.readouterr().err
    assert f"expected {'0' * 64}" in err
    assert "actual   " in err
    assert not (checkout / "build/tree").exists()
    # The file that failed verification is not kept in the cache
    assert not (checkout / "build/distributed-2023.3.1.tar.gz").exists()
    assert list((checkout / "build").iterdir()) == []


def test_patch_that_does_not_apply_names_patch_and_file(checkout, capsys):
    assert fork(checkout, "tree") == 0
    add_patch(checkout)
    head = out(checkout / "build/tree", "rev-parse", "HEAD")
    # Upstream changes under the patch: the same version, another content
    files = dict(make_sdist.__globals__["UPSTREAM"])
    files["distributed/core.py"] = "def g():\n    pass\n"
    write_pyproject(
        checkout, make_sdist(checkout / "build/distributed-2023.3.1.tar.gz", files)
    )
    assert fork(checkout, "tree") == 1
    err = capsys.readouterr().err
    assert (
        "patch 0001-Change-return-3.patch does not apply to distributed/core.py" in err
    )
    # The previous tree is left as it was
    assert out(checkout / "build/tree", "rev-parse", "HEAD") == head


def test_series_entry_without_file(checkout, capsys):
    (checkout / "patches/series").write_text("0001-gone.patch\n")
    assert fork(checkout, "tree") == 1
    assert "patches/series lists 0001-gone.patch, which does not exist" in (
        capsys.readouterr().err
    )
    assert not (checkout / "build/tree").exists()


def test_patch_file_missing_from_series(checkout, capsys):
    (checkout / "patches/0001-stray.patch").write_text("")
    assert fork(checkout, "tree") == 1
    assert "patches/0001-stray.patch is not listed in patches/series" in (
        capsys.readouterr().err
    )


def test_overlay_file_shadowing_upstream(checkout, capsys):
    (checkout / "distributed/core.py").write_text("# not a patch\n")
    assert fork(checkout, "tree") == 1
    err = capsys.readouterr().err
    assert "overlay files shadow upstream paths" in err
    assert "distributed/core.py" in err
    assert fork(checkout, "check") == 1


def test_tree_refuses_to_drop_unsaved_work(checkout, capsys):
    assert fork(checkout, "tree") == 0
    tree = checkout / "build/tree"
    (tree / "distributed/core.py").write_text("edited\n")
    assert fork(checkout, "tree") == 1
    assert "uncommitted changes" in capsys.readouterr().err
    commit(tree, "Edit")
    assert fork(checkout, "tree") == 1
    assert "run `make refresh`" in capsys.readouterr().err
    assert (tree / "distributed/core.py").read_text() == "edited\n"
    assert fork(checkout, "refresh") == 0
    assert fork(checkout, "tree") == 0
    assert (tree / "distributed/core.py").read_text() == "edited\n"


def test_cli_exits_non_zero_on_error(checkout):
    (checkout / "patches/series").write_text("missing.patch\n")
    proc = subprocess.run(
        [sys.executable, str(TOOLS / "fork.py"), "--root", str(checkout), "tree"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: patches/series lists missing.patch")


@pytest.fixture
def copy_of_repo(tmp_path: Path) -> Path:
    """The fork's own series and overlay, with the real cached base."""
    root = tmp_path / "repo"
    root.mkdir()
    for entry in ("pyproject.toml", "conftest.py"):
        shutil.copy(REPO / entry, root / entry)
    for entry in ("patches", "distributed"):
        shutil.copytree(
            REPO / entry, root / entry, ignore=shutil.ignore_patterns("__pycache__")
        )
    project = Project.load(REPO)
    if project.sdist.exists():
        (root / "build").mkdir()
        shutil.copy(project.sdist, root / "build" / project.sdist.name)
    return root


def test_real_series_applies_and_round_trips(copy_of_repo):
    """The series applies to the pinned base, and tree -> refresh -> tree is a no-op."""
    before = snapshot(copy_of_repo)
    assert fork(copy_of_repo, "tree") == 0
    tree = copy_of_repo / "build/tree"
    n = len((copy_of_repo / "patches/series").read_text().split(".patch\n")) - 1
    assert int(out(tree, "rev-list", "--count", "upstream..HEAD")) >= n
    head = out(tree, "rev-parse", "HEAD^{tree}")
    assert fork(copy_of_repo, "refresh") == 0
    assert snapshot(copy_of_repo) == before
    assert fork(copy_of_repo, "tree") == 0
    assert out(tree, "rev-parse", "HEAD^{tree}") == head
    assert '"version": "2023.3.1+fm' in (tree / "distributed/_version.py").read_text()
