"""`nvpair ui [--open]`: a one-time link to the running agent's web page (`agent.apis.page`).

The link's code works once, for two minutes; opening it sets the page's session cookie.
"""

from __future__ import annotations

import argparse
import webbrowser
from typing import Any

from agent.cli import calls as cli_http

__all__ = ["add_commands"]


def add_commands(commands: Any) -> None:
    """Register `nvpair ui` on the top-level parser."""
    ui = commands.add_parser(
        "ui",
        help="print (or open) a one-time link to this agent's web page",
        description="The link works once, within 120 s, on this machine's browser.",
    )
    ui.add_argument("--open", action="store_true", help="open it in the default browser")
    ui.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    answer = cli_http.post("/v1/ui/link")
    url = str(answer["url"])
    print(url)
    if args.open and not webbrowser.open(url):
        print("nvpair: no browser could be opened; open the link above yourself")
    return 0
