"""`python -m agent.mock mock-engine ...`: the mock engine alone, without the rest of the
command line (`nvpair mock-engine` takes the same flags). The `mock` engine template starts
it this way: a replica's process imports only its HTTP server, not every command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from agent.mock.engine import add_command
from agent.mock.rpc import add_worker_command


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command: `mock-engine`, or `mock-rpc-worker` (a worker part)."""
    parser = argparse.ArgumentParser(prog="python -m agent.mock")
    commands = parser.add_subparsers(dest="command", required=True)
    add_command(commands)
    add_worker_command(commands)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.run(args))


if __name__ == "__main__":
    raise SystemExit(main())
