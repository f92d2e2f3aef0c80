"""Whether a process runs: the one check the agent's commands (a stale `agent.json`) and the
plane's embedded PostgreSQL (a stale `postmaster.pid`) both make."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["alive"]


def alive(pid: int) -> bool:
    """Whether process `pid` runs: it exists (another user's counts) and is not a zombie
    (dead, not yet reaped by its parent)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's: it exists
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False  # gone since the signal
    except OSError:
        return True  # no /proc to ask: the signal said it exists
    return stat.rsplit(") ", 1)[-1][:1] not in ("Z", "X")
