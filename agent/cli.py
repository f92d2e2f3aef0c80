"""The `nvpair` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import agent_cli, cluster_cli, demo, mock_engine, plane_cli
from .cli_http import CliError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """All `nvpair` commands."""
    parser = argparse.ArgumentParser(
        prog="nvpair", description="Peer-to-peer GPU inference cluster node."
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser(
        "workload-manager",
        help="run the workload manager (the flags of python -m workload_manager)",
        add_help=False,
    )
    commands.add_parser("version", help="print the version")
    cluster_sub = cluster_cli.add_commands(commands)
    agent_cli.add_commands(commands, cluster_sub)
    mock_engine.add_command(commands)
    demo.add_command(commands)
    plane_cli.add_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a subcommand; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "workload-manager":
        # The manager owns its flags (seed 002); pass them through untouched.
        from workload_manager.cli import main as manager_main

        return manager_main(args_list[1:], prog="nvpair workload-manager")
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.version or args.command == "version":
        from workload_manager import VERSION

        print(VERSION)
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    try:
        result: int = args.run(args)
    except CliError as exc:
        # One line saying what is wrong, no traceback: the commands' library code raises
        # CliError instead of exiting.
        print(f"nvpair: {exc}", file=sys.stderr)
        return 1
    return result
