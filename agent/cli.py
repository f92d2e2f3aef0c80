"""The `nvpair` command line."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]

USAGE = """usage: nvpair COMMAND [ARGS...]

commands:
  workload-manager   run the workload manager (same flags as python -m workload_manager)
  version            print the version
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a subcommand."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "workload-manager":
        from workload_manager.cli import main as manager_main

        return manager_main(rest, prog="nvpair workload-manager")
    if command in ("version", "--version"):
        from workload_manager import VERSION

        print(VERSION)
        return 0
    print(f"nvpair: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2
