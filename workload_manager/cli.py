"""`python -m workload_manager`: the seed's command line, exactly its flags.

Logs go to stderr; stdout carries nothing but frames when the channel is stdio. Exit status:
0 when the channel closed or a signal stopped it; 2 for the operator's mistakes restarting
cannot fix -- a bad flag or setting, a port or socket path in use -- with one line on stderr
naming it and no traceback (the broker reads that line: `errors.port_in_use_from`); 1 when
the channel broke under us.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final

from certs import CertsError, ClusterDir
from netkit import logs
from workload_manager._version import VERSION
from workload_manager.errors import (
    CannotListen,
    ChannelFailed,
    ConfigurationError,
    IpcPathInUse,
    WorkloadManagerError,
)
from workload_manager.local import BrokerLink, serve_stdio, serve_unix
from workload_manager.manager import Manager
from workload_manager.relay import RelayCore
from workload_manager.view_loader import ViewLoader

__all__ = ["build_parser", "main"]

DEFAULT_PORT: Final = 14320
LOG_LEVELS: Final = {
    "error": logging.ERROR,
    "warn": logging.WARNING,
    "info": logging.INFO,
    "debug": logging.DEBUG,
}
PRUNE_INTERVAL_S: Final = 30.0

log = logging.getLogger("workload_manager")


def build_parser(prog: str = "workload_manager") -> argparse.ArgumentParser:
    """The seed 002 flags: --port, --ipc, --cluster-dir, --log-level, --version."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Relay workload lifecycle events between the broker and cluster peers.",
    )
    parser.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        metavar="N",
        help=f"inter-node port to listen on and advertise (default {DEFAULT_PORT}; "
        "0 picks a free one, which manager:status reports)",
    )
    parser.add_argument(
        "--ipc",
        type=Path,
        metavar="PATH",
        help="Unix socket for the broker channel (default: stdio)",
    )
    parser.add_argument(
        "--cluster-dir",
        type=Path,
        metavar="PATH",
        help="cluster dir (node.crt / node.key + trusted/); without it there is no "
        "cluster identity and no inter-node traffic",
    )
    parser.add_argument(
        "--log-level",
        choices=tuple(LOG_LEVELS),
        default="info",
        help="one of error / warn / info / debug (default info)",
    )
    parser.add_argument("--version", action="version", version=VERSION)
    return parser


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port out of range 0-65535: {value}")
    return value


def main(argv: Sequence[str] | None = None, *, prog: str = "workload_manager") -> int:
    """Parse the flags and run until the channel closes or a signal arrives."""
    args = build_parser(prog).parse_args(argv)
    logs.configure(LOG_LEVELS[args.log_level], os.environ.get(logs.ENV, "text"))
    if args.ipc is not None and sys.platform == "win32":
        print(f"{prog}: --ipc named pipes are not supported yet", file=sys.stderr)
        return 2
    try:
        relay = relay_from_env(os.environ)
    except ConfigurationError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    failure: WorkloadManagerError | None = None
    status = 0
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_run(args, relay))
    except* (CannotListen, IpcPathInUse, ConfigurationError) as group:
        failure, status = _first(group), 2  # the operator's to fix: restarting cannot help
    except* ChannelFailed as group:
        failure, status = _first(group), 1
    if failure is not None:
        print(f"{prog}: {failure}", file=sys.stderr)
    return status


def _first(group: BaseExceptionGroup[WorkloadManagerError]) -> WorkloadManagerError:
    # Raised from a task of a task group, the error comes wrapped, maybe more than once.
    first: BaseException = group
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    assert isinstance(first, WorkloadManagerError)
    return first


def relay_from_env(environ: Mapping[str, str]) -> RelayCore:
    """The relay's retention and cap, from `NVPAIR_WM_RETENTION_S` / `NVPAIR_WM_MAX_WORKLOADS`.

    Environment rather than flags: the seed fixes the flags exactly.
    """
    try:
        retention = float(environ.get("NVPAIR_WM_RETENTION_S", "3600"))
        cap = int(environ.get("NVPAIR_WM_MAX_WORKLOADS", "100000"))
        return RelayCore(retention_s=retention, max_workloads=cap)
    except ValueError as exc:  # a number that does not parse, or a ConfigurationError
        raise ConfigurationError(
            "NVPAIR_WM_RETENTION_S must be seconds >= 0 and NVPAIR_WM_MAX_WORKLOADS "
            f"an integer >= 1 ({exc})"
        ) from None


async def _run(args: argparse.Namespace, relay: RelayCore) -> None:
    # The parts are built first and the manager last, given every sink it will use; nothing
    # re-points them later. The broker's side: its connection, if any (local.py attaches
    # each one), and the loader that asks again for pages of its view that fail.
    cluster = ClusterDir(args.cluster_dir) if args.cluster_dir is not None else None
    broker = BrokerLink()
    loader = ViewLoader()
    built = functools.partial(
        Manager,
        version=VERSION,
        port=args.port,
        relay=relay,
        identity=_identity(cluster),
        send_to_broker=broker.send,
        broker_ready=broker.has_room,
        on_snapshot_answer=loader.on_answer,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with contextlib.AsyncExitStack() as stack:
        if cluster is None:
            log.info("no --cluster-dir: no cluster identity, no inter-node traffic")
            manager = built()
        else:
            # Imported here: the mTLS server and broadcaster (aiohttp, ~0.15 s of start-up)
            # are needed only by a manager with a cluster identity to speak for.
            from workload_manager.broadcaster import Broadcaster
            from workload_manager.inter_node import start_inter_node

            # The peers' side: the broadcaster, whose senders the manager feeds, then the
            # server that hands the manager what peers send.
            peers = await stack.enter_async_context(Broadcaster(cluster, relay))
            manager = built(**peers.manager_hooks())
            await start_inter_node(manager, cluster, stack)
        gc.freeze()  # what start-up made lives as long as we do: kept out of every collection
        async with asyncio.TaskGroup() as tasks:
            pruner = tasks.create_task(_prune_forever(manager))
            serving = tasks.create_task(
                serve_stdio(manager, broker, loader)
                if args.ipc is None
                else serve_unix(manager, broker, loader, args.ipc)
            )
            stopping = tasks.create_task(stop.wait())
            await asyncio.wait((serving, stopping), return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                log.info("stopping on signal")
            for task in (pruner, serving, stopping):
                task.cancel()


def _identity(cluster: ClusterDir | None) -> Callable[[], str | None]:
    def node_id() -> str | None:
        if cluster is None:
            return None
        try:
            return cluster.node_id()
        except (OSError, ValueError, CertsError):
            return None

    return node_id


async def _prune_forever(manager: Manager) -> None:
    while True:
        await asyncio.sleep(PRUNE_INTERVAL_S)
        manager.relay.prune(manager.clock())
