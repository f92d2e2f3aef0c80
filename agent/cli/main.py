"""The `nvpair` command line."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Final

from agent.cli import agent as agent_cli
from agent.cli import artifact as artifact_cli
from agent.cli import cluster as cluster_cli
from agent.cli import deploy as deploy_cli
from agent.cli import keys as keys_cli
from agent.cli import ui as ui_cli
from agent.cli.calls import CliError

__all__ = ["build_parser", "main"]

# Commands whose modules load aiohttp (servers, the demo): imported only when one of them is
# asked for, or to list every command, so `nvpair cluster invite` or `nvpair jobs` start in
# a fraction of the time.
_HEAVY: Final = {
    "mock-engine": "agent.mock.engine",
    "demo": "agent.cli.demo",
    "plane": "agent.cli.plane",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `nvpair` commands: all of them, or those needed to run `command`."""
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
    deploy_cli.add_commands(commands)
    keys_cli.add_commands(commands)
    artifact_cli.add_commands(commands)
    ui_cli.add_commands(commands)
    if command in commands.choices:
        return parser  # one of the commands above: nothing more to load
    for name, module in _HEAVY.items():
        if command in (None, name) or command not in _HEAVY:  # that one, or all of them
            loaded = importlib.import_module(module)
            register = getattr(loaded, "add_commands", None) or loaded.add_command
            register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a subcommand; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "workload-manager":
        # The manager owns its flags (seed 002); pass them through untouched.
        from workload_manager.cli import main as manager_main

        return manager_main(args_list[1:], prog="nvpair workload-manager")
    first = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(first)
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
