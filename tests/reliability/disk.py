"""Disks for one member's home: a small tmpfs that can be filled to ENOSPC and emptied
again, and an ext4 image the kernel turns read-only under a running agent.

Why not `mount -o remount,ro` for the read-only disk: the kernel refuses it (EBUSY) while
any file on the mount is open for writing, and a running agent always holds jobs.db, its
WAL and its shared memory file open. A disk goes read-only under a running writer only when
the kernel forces it: ext4 mounted `errors=remount-ro` does on an error, and
`/sys/fs/ext4/DEV/trigger_fs_error` raises one. That read-only state is sticky until the
file system is unmounted (its `remount,rw` keeps the emergency read-only flag), so getting
the disk back is stop, unmount, `e2fsck`, mount, start -- what an operator does too.

Every helper runs `mount` and friends as subprocesses; a refusal (not root, no loop
devices, no tmpfs) skips the scenario with the reason (CI runs as root).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Final, NoReturn

import pytest

__all__ = ["Ext4Disk", "SmallDisk", "disks", "integrity", "unmount"]

CHUNK: Final = 64 * 1024


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)


def _must(*argv: str) -> None:
    done = _run(*argv)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: {done.returncode} {done.stderr.strip()}")


def _cannot(reason: str) -> NoReturn:
    # This machine cannot run the scenario: a skip, or a failure where `.ci/run` found it can
    # mount (NVPAIR_REQUIRE_DISK=1), so CI never skips it quietly.
    if os.environ.get("NVPAIR_REQUIRE_DISK") == "1":
        pytest.fail(reason + " and NVPAIR_REQUIRE_DISK=1")
    pytest.skip(reason)


def _mount_or_skip(*argv: str) -> None:
    # The first mount of a scenario: a refusal means this machine cannot run it.
    if os.geteuid() != 0:
        _cannot("disk faults need root (mount)")
    done = _run(*argv)
    if done.returncode != 0:
        _cannot(f"{' '.join(argv)} was refused: {done.stderr.strip()}")


def unmount(path: Path) -> None:
    """Unmount `path`; lazily (`umount -l`) when it is busy, so nothing stays mounted."""
    if not os.path.ismount(path):
        return
    if _run("umount", str(path)).returncode != 0:
        _must("umount", "-l", str(path))


class SmallDisk:
    """A tmpfs of `size` on `path`: `fill()` it until a write fails with ENOSPC, `empty()` it."""

    def __init__(self, path: Path, size: str) -> None:
        self.path = path
        self.size = size
        self.filler = path / "filler"

    def mount(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        _mount_or_skip(
            "mount", "-t", "tmpfs", "-o", f"size={self.size},mode=0700", "tmpfs", str(self.path)
        )

    def fill(self) -> int:
        """Write the filler until the disk is full; the bytes it took."""
        written = 0
        with self.filler.open("ab", buffering=0) as out:
            block = b"\0" * CHUNK
            while True:
                try:
                    written += out.write(block) or 0
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    if len(block) == 1:
                        return written
                    block = block[: len(block) // 2]  # the last pages, to the last byte

    def empty(self) -> None:
        """Space returns: the filler is deleted."""
        self.filler.unlink()

    def unmount(self) -> None:
        unmount(self.path)


class Ext4Disk:
    """An ext4 image under `image`, mounted `errors=remount-ro` on `path` through a loop
    device; `force_read_only()` makes the kernel turn it read-only under its writers."""

    def __init__(self, path: Path, image: Path, size_mib: int = 64) -> None:
        self.path = path
        self.image = image
        self.size_mib = size_mib

    def mount(self) -> None:
        """Make the image (first time) and mount it; the mount point stays 0700."""
        self.path.mkdir(parents=True, exist_ok=True)
        if not self.image.exists():
            if shutil.which("mkfs.ext4") is None or shutil.which("e2fsck") is None:
                _cannot("a read-only disk needs mkfs.ext4 and e2fsck (e2fsprogs)")
            with self.image.open("wb") as image:
                image.truncate(self.size_mib * 2**20)  # sparse
            _must("mkfs.ext4", "-q", "-F", str(self.image))
        _mount_or_skip("mount", "-o", "loop,errors=remount-ro", str(self.image), str(self.path))
        self.path.chmod(0o700)

    @property
    def device(self) -> str:
        """The loop device's name (`loop3`), as /sys/fs/ext4 names it."""
        done = _run("findmnt", "-no", "SOURCE", str(self.path))
        assert done.returncode == 0, f"{self.path} is not mounted: {done.stderr}"
        return Path(done.stdout.strip()).name

    def force_read_only(self) -> None:
        """An ext4 error on purpose: the kernel remounts the file system read-only at once,
        open files and all; every write on it fails with EROFS from then on."""
        trigger = Path("/sys/fs/ext4") / self.device / "trigger_fs_error"
        if not trigger.exists():
            _cannot(f"this kernel has no {trigger}")
        trigger.write_text("nvpair fault harness: read-only disk\n")

    def read_only(self) -> bool:
        """Whether a file can be created on it now fails with EROFS. (Asked by trying: an
        emergency read-only ext4 lists `rw` among its options and in statvfs.)"""
        probe = self.path / ".read-only-probe"
        try:
            probe.touch()
        except OSError as exc:
            if exc.errno == errno.EROFS:
                return True
            raise
        probe.unlink()
        return False

    def repair(self) -> str:
        """Unmounted: what `e2fsck -fy` says (it fixes what the error left; 0 or 1 is fine)."""
        assert not os.path.ismount(self.path), "unmount before e2fsck"
        done = _run("e2fsck", "-fy", str(self.image))
        assert done.returncode in (0, 1), f"e2fsck: {done.returncode} {done.stdout}{done.stderr}"
        return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""

    def unmount(self) -> None:
        unmount(self.path)


@contextlib.contextmanager
def disks() -> Iterator[list[SmallDisk | Ext4Disk]]:
    """Collects the disks a scenario mounts; unmounts every one on the way out (after the
    agents on them have stopped), lazily where still busy."""
    mounted: list[SmallDisk | Ext4Disk] = []
    try:
        yield mounted
    finally:
        for disk in mounted:
            disk.unmount()


def integrity(db: Path) -> str:
    """`PRAGMA integrity_check` of a Jobs store, opened read-only (WAL lets it read beside a
    running agent): "ok", or what SQLite found wrong."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as conn:
        rows = conn.execute("PRAGMA integrity_check").fetchall()
    return "; ".join(str(row[0]) for row in rows)
