"""Private files: atomic writes with a mode, and refusing files others can read."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from certs.errors import InsecurePermissions

__all__ = [
    "check_private",
    "ensure_private_dir",
    "file_stamp",
    "make_private_dir",
    "write_atomic",
]

# Any permission bit for group or others.
_OTHERS = stat.S_IRWXG | stat.S_IRWXO


def make_private_dir(path: Path) -> None:
    """Create `path` and any missing parents as 0700, whatever the umask.

    `mkdir(parents=True)` gives the parents it creates 0777 less the umask: under
    `umask 000` an `NVPAIR_HOME` made on the way to its cluster dir was world-writable, and
    another user could plant a `nvpair.toml` in it. A directory that exists is left alone.
    """
    missing = []
    for candidate in (path, *path.parents):
        if candidate.exists():
            break
        missing.append(candidate)
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            continue  # made by someone else meanwhile: theirs, not ours to chmod
        os.chmod(directory, 0o700)  # mkdir's mode is narrowed by the umask; say it exactly


def ensure_private_dir(path: Path) -> None:
    """Create `path` (and parents) as 0700 if missing; refuse it if others can use it."""
    make_private_dir(path)
    check_private(path)


def check_private(path: Path) -> None:
    """Refuse a key or directory that group or others can read, write or enter."""
    mode = path.stat().st_mode
    if mode & _OTHERS:
        want = "700" if stat.S_ISDIR(mode) else "600"
        raise InsecurePermissions(
            f"{path} is accessible by other users (mode {stat.S_IMODE(mode):04o}); "
            f"fix it with: chmod {want} {path}"
        )


def write_atomic(path: Path, data: bytes, *, mode: int = 0o600) -> None:
    """Write a file so readers see the old or the new content, never half of it.

    The temporary file is created with `mode` from the start (no window where a key is
    readable by others) and renamed over the target, which also gives it a new inode:
    caches keyed on (inode, mtime) notice the change even within one mtime tick.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, mode)  # the umask may have changed it: the mode is exactly `mode`
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def file_stamp(path: Path) -> tuple[int, int, int, int] | None:
    """(inode, mtime ns, ctime ns, size) of a file, or None when it does not exist.

    ctime is in it so a `chmod` (fixing a key's mode) counts as a change too.
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
