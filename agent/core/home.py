"""What `NVPAIR_HOME` may be: a directory only its owner can change, holding files only its
owner can read when they hold secrets.

Whoever can write the home can plant a `nvpair.toml` (its engine URLs receive prompts) or
replace `agent.json` (where the CLI sends its calls); whoever can read `nvpair.toml` or
`plane.json` has the API keys or the plane token in them. So a home that group or others can
write, a configuration file they can write, and one holding a secret that they can read are
refused at start, naming the file and the fix. The files the agent writes itself are made
0600 and its directories 0700 whatever the umask (`certs.write_atomic`,
`certs.make_private_dir`).
"""

from __future__ import annotations

import logging
import stat
from pathlib import Path

__all__ = ["forget_state", "shared_file_problem", "shared_home_problem"]

log = logging.getLogger(__name__)

_WRITE_OTHERS = stat.S_IWGRP | stat.S_IWOTH
_READ_OTHERS = stat.S_IRGRP | stat.S_IROTH


def shared_home_problem(home: Path) -> str | None:
    """Why `home` must not be used (group or others can write it), or None."""
    try:
        mode = home.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None  # the agent or `cluster init` creates it 0700 (or says why it cannot)
    if mode & _WRITE_OTHERS:
        return (
            f"NVPAIR_HOME={home} can be written by other users (mode {stat.S_IMODE(mode):04o}): "
            f"they could plant its nvpair.toml; fix it with: chmod 700 {home}"
        )
    return None


def shared_file_problem(path: Path, *, holds_secret: str | None) -> str | None:
    """Why the configuration file `path` must not be used, or None.

    Refused when group or others can write it, or, when `holds_secret` names what it holds
    ("API keys", "a plane token"), when they can read it.
    """
    mode = path.stat().st_mode
    if mode & _WRITE_OTHERS:
        why = "can be written by other users"
    elif holds_secret and mode & _READ_OTHERS:
        why = f"holds {holds_secret} and can be read by other users"
    else:
        return None
    return f"{path} {why} (mode {stat.S_IMODE(mode):04o}); fix it with: chmod 600 {path}"


def forget_state(state: Path) -> None:
    """Remove the agent's state file on stopping (moved here from `daemon`, which is full)."""
    # On a home turned read-only the unlink fails: a stale state file is harmless (its pid
    # is gone), a traceback and exit status 1 on a clean stop are not.
    try:
        state.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not remove %s on stopping: %s", state.name, exc.strerror)
