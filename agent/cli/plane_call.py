"""How `nvpair plane ...` commands reach the plane's API: the URL from `--plane URL`, else
`$NVPAIR_PLANE_URL`; the credentials from `$NVPAIR_PLANE_KEY` (a tenant's key: it sees its own
tenant's objects) when set, else `$NVPAIR_PLANE_ADMIN_TOKEN` -- the least privilege given
wins. A refusal prints the plane's own words."""

from __future__ import annotations

import argparse
import os
from typing import Any

from agent.cli.calls import CliError, request

__all__ = ["add_plane_flag", "plane_call", "plane_url"]


def add_plane_flag(cmd: Any) -> None:
    """The `--plane URL` option every plane API command takes."""
    cmd.add_argument("--plane", metavar="URL", help="the plane (default $NVPAIR_PLANE_URL)")


def plane_url(args: argparse.Namespace) -> str:
    """The plane's base URL for this command."""
    url = getattr(args, "plane", None) or os.environ.get("NVPAIR_PLANE_URL", "")
    if not url:
        raise CliError("give --plane URL, or set NVPAIR_PLANE_URL")
    return str(url).rstrip("/")


def plane_call(args: argparse.Namespace, path: str, method: str = "GET", body: Any = None) -> Any:
    """One call of the plane's API as the configured caller; the decoded JSON answer."""
    token = os.environ.get("NVPAIR_PLANE_KEY") or os.environ.get("NVPAIR_PLANE_ADMIN_TOKEN", "")
    if not token:
        raise CliError("set NVPAIR_PLANE_KEY (a tenant) or NVPAIR_PLANE_ADMIN_TOKEN (the admin)")
    headers = {"Authorization": f"Bearer {token}"}
    return request(plane_url(args) + path, method, body, headers=headers, who="the plane")
