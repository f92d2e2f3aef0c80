"""`nvpair cluster …`: identity, pins and invites on this node's cluster dir."""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import sys
from pathlib import Path
from typing import Any

from agent.cli.calls import duration
from certs import CertsError, ClusterDir, create_invite, default_cluster_dir
from certs.identity import load_cert

__all__ = ["add_commands"]


def add_commands(commands: Any) -> Any:
    """Register `nvpair cluster` and its subcommands; returns the subcommand parser."""
    cluster = commands.add_parser("cluster", help="cluster identity, members and invites")
    sub = cluster.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = sub.add_parser(name, help=help_text)
        parser.add_argument(
            "--cluster-dir",
            type=Path,
            default=None,
            help="cluster dir (default $NVPAIR_HOME/cluster, NVPAIR_HOME defaults to ~/.nvpair)",
        )
        return parser

    init = command("init", "create the cluster CA and this node's identity")
    init.add_argument("--name", default="nvpair", help="cluster name (default nvpair)")
    init.add_argument("--node-name", default=None, help="this node's name (default: hostname)")
    init.add_argument(
        "--san", action="append", default=[], help="extra DNS name or IP (repeatable)"
    )
    init.set_defaults(run=_init)

    rotate = command("rotate", "re-issue this node's certificate with the same key")
    rotate.add_argument("--san", action="append", default=None, help="replace the DNS names / IPs")
    rotate.set_defaults(run=_rotate)

    members = command("members", "list members: node id, name, pin, added, removed")
    members.add_argument("--json", action="store_true", help="JSON instead of a table")
    members.set_defaults(run=_members)

    pin = command("pin", "pin a member's certificate (low level)")
    pin.add_argument("cert", type=Path, metavar="CERT.pem")
    pin.set_defaults(run=_pin)

    unpin = command("unpin", "remove a member's pin and leave a tombstone (low level)")
    unpin.add_argument("node_id", metavar="NODE_ID")
    unpin.set_defaults(run=_unpin)

    issue = command("issue", "write a complete cluster dir for another machine (offline admission)")
    issue.add_argument("name", metavar="NAME")
    issue.add_argument("--out", type=Path, required=True, metavar="DIR")
    issue.add_argument("--san", action="append", default=[], help="DNS name or IP (repeatable)")
    issue.set_defaults(run=_issue)

    invite = command("invite", "print a one-time join token")
    invite.add_argument("--ttl", type=duration, default=datetime.timedelta(minutes=15))
    invite.set_defaults(run=_invite)
    return sub


def _cluster(args: argparse.Namespace) -> ClusterDir:
    return ClusterDir(args.cluster_dir or default_cluster_dir())


def _fail(exc: Exception) -> int:
    print(f"nvpair: {exc}", file=sys.stderr)
    return 1


def _init(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    try:
        info = cluster.init(args.name, args.node_name or socket.gethostname(), args.san)
    except CertsError as exc:
        return _fail(exc)
    print(f"initialised cluster {args.name!r} in {cluster.path}")
    print(f"node id: {info.node_id}")
    print(f"pin:     {info.pin.hex()}")
    return 0


def _rotate(args: argparse.Namespace) -> int:
    try:
        info = _cluster(args).rotate(args.san)
    except CertsError as exc:
        return _fail(exc)
    print(f"re-issued the certificate of {info.node_id}, valid until {info.not_after:%Y-%m-%d}")
    return 0


def _members(args: argparse.Namespace) -> int:
    try:
        members = _cluster(args).pins.members()
    except CertsError as exc:
        return _fail(exc)
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "nodeId": m.node_id,
                        "name": m.name,
                        "pin": m.pin,
                        "added": m.added.isoformat() if m.added else None,
                        "removed": m.removed.isoformat() if m.removed else None,
                    }
                    for m in members
                ],
                indent=2,
            )
        )
        return 0
    rows = [("NODE ID", "NAME", "PIN", "ADDED", "REMOVED")]
    rows += [
        (
            m.node_id,
            m.name,
            m.pin[:16],
            f"{m.added:%Y-%m-%d %H:%M}" if m.added else "-",
            f"{m.removed:%Y-%m-%d %H:%M}" if m.removed else "-",
        )
        for m in members
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    return 0


def _pin(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    try:
        cert = load_cert(args.cert.read_bytes())
        ca = load_cert(cluster.ca_crt.read_bytes())
        member = cluster.pins.pin(cert, ca=ca)
    except (OSError, ValueError, CertsError) as exc:
        return _fail(exc)
    print(f"pinned {member.node_id} ({member.name})")
    return 0


def _unpin(args: argparse.Namespace) -> int:
    try:
        member = _cluster(args).pins.unpin(args.node_id)
    except CertsError as exc:
        return _fail(exc)
    print(f"unpinned {member.node_id} ({member.name}); a tombstone keeps it out")
    return 0


def _issue(args: argparse.Namespace) -> int:
    try:
        info = _cluster(args).issue(args.name, args.out, args.san)
    except CertsError as exc:
        return _fail(exc)
    print(f"wrote a cluster dir for {info.node_id} ({args.name}) to {args.out}")
    print("copy it to the new machine as its cluster dir; it is pinned here already")
    return 0


def _invite(args: argparse.Namespace) -> int:
    try:
        invite = create_invite(_cluster(args), ttl=args.ttl)
    except (CertsError, ValueError) as exc:
        return _fail(exc)
    expires = datetime.datetime.fromtimestamp(invite.expires_at, datetime.UTC)
    print(invite.token())
    print(f"one use, expires {expires:%Y-%m-%d %H:%M:%S} UTC", file=sys.stderr)
    return 0
