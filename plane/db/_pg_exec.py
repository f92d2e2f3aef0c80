"""`python -m plane.db._pg_exec [--userns] PROGRAM ARGS…`: exec a PostgreSQL program so that it
dies with the process that started it, and, for root, not as root.

- The parent-death signal (Linux `prctl(PR_SET_PDEATHSIG)`) is SIGINT, PostgreSQL's fast
  shutdown: a plane killed with -9 leaves no server behind. It is set here, after the last
  change of credentials (which would clear it), just before `exec`.
- `--userns`: PostgreSQL refuses to run as root. Root runs it in a user namespace of its own
  in which root's uid and gid appear as 1000: the server is not root to itself, yet the
  files it creates are root's on the host (0700, nobody else's), and no user is created and
  no permission widened to let another user reach the binaries.

Nothing but the standard library, so the trampoline costs one interpreter start.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Final

CLONE_NEWUSER: Final = 0x10000000
PR_SET_PDEATHSIG: Final = 1
INSIDE_ID: Final = 1000  # root's uid and gid as the server sees them


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def enter_user_namespace() -> None:
    """Become uid/gid `INSIDE_ID` in a new user namespace that maps them to our own ids."""
    uid, gid = os.geteuid(), os.getegid()
    if _libc().unshare(CLONE_NEWUSER) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare(CLONE_NEWUSER): {os.strerror(errno)}")
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{INSIDE_ID} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{INSIDE_ID} {gid} 1")


def main(argv: list[str]) -> int:
    parent = os.getppid()
    userns = bool(argv) and argv[0] == "--userns"
    if userns:
        argv = argv[1:]
    if not argv:
        print("usage: python -m plane.db._pg_exec [--userns] PROGRAM ARGS…", file=sys.stderr)
        return 2
    try:
        if userns:
            enter_user_namespace()
    except OSError as exc:
        print(
            f"cannot run PostgreSQL as root: {exc} (this machine forbids user namespaces): "
            "run the plane as another user, or give --dsn",
            file=sys.stderr,
        )
        return 126
    if sys.platform == "linux":
        _libc().prctl(PR_SET_PDEATHSIG, signal.SIGINT)
        if os.getppid() != parent:  # the parent died before the signal was armed
            return 1
    os.execv(argv[0], argv)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
