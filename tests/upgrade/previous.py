"""The previous release, built from this repository's own history into an environment of
its own: the commit named in `tests/upgrade/PREVIOUS` is checked out with `git worktree`,
installed (not editable) into `.upgrade/<commit>/venv` and the worktree removed again.
Nothing is downloaded but the packages the release depends on, from the package index as
for any install. The environment is kept and reused while it answers with the release's
version."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = ["Previous", "build_previous", "named_previous"]

ROOT: Final = Path(__file__).resolve().parents[2]
NAMED: Final = Path(__file__).with_name("PREVIOUS")


@dataclass(frozen=True)
class Previous:
    """The previous release: its commit, the version it reports, its Python."""

    commit: str
    version: str
    python: str


def named_previous() -> tuple[str, str]:
    """(commit, version) from `tests/upgrade/PREVIOUS` (its first line that is not a
    comment)."""
    for line in NAMED.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            commit, version = line.split()[:2]
            return commit, version
    raise ValueError(f"{NAMED} names no commit")


def _run(*args: str, cwd: Path = ROOT) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def _reports(python: Path, version: str) -> bool:
    if not python.exists():
        return False
    try:
        said = _run(str(python), "-m", "agent", "--version", cwd=python.parent).strip()
    except RuntimeError:
        return False
    return said == version


def _have(commit: str) -> bool:
    try:
        _run("git", "cat-file", "-e", f"{commit}^{{commit}}")
    except RuntimeError:
        return False
    return True


def _fetch(commit: str) -> None:
    """Make `commit` present in a clone that lacks it (a shallow one): from its origin."""
    for args in (("fetch", "--quiet", "origin", commit), ("fetch", "--quiet", "--unshallow")):
        if _have(commit):
            return
        try:
            _run("git", *args)
        except RuntimeError:
            continue
    if not _have(commit):
        raise RuntimeError(
            f"{commit} (tests/upgrade/PREVIOUS) is not in this clone and its origin did not "
            "give it: clone with history (not --depth 1)"
        )


def build_previous() -> Previous:
    """The previous release's environment, built unless a good one is there."""
    commit, version = named_previous()
    home = ROOT / ".upgrade" / commit
    python = home / "venv" / "bin" / "python"
    if not _reports(python, version):
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        source = home / "src"
        _fetch(commit)
        _run("git", "worktree", "add", "--detach", str(source), commit)
        try:
            _run(sys.executable, "-m", "venv", str(home / "venv"))
            _run(str(python), "-m", "pip", "install", "-q", str(source), cwd=home)
        finally:
            _run("git", "worktree", "remove", "--force", str(source))
        if not _reports(python, version):
            raise RuntimeError(f"the build of {commit} does not report {version}")
    return Previous(commit, version, str(python))
