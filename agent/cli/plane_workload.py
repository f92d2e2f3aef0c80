"""`nvpair plane explain WORKLOAD [--json]`: why each cluster has its share of a workload, or
none (`GET /v1/workloads/{id|name}/explain`; docs/placement.md)."""

from __future__ import annotations

import argparse
import json
import urllib.parse
from typing import Any

from agent.cli.plane_call import add_plane_flag, plane_call

__all__ = ["add_explain", "explain_text"]


def add_explain(sub: Any) -> None:
    """Register `nvpair plane explain` under the `plane` subcommands `sub`."""
    cmd = sub.add_parser("explain", help="why each cluster was chosen or refused for a workload")
    cmd.add_argument("workload", metavar="WORKLOAD", help="its name or wkl_ id")
    add_plane_flag(cmd)
    cmd.add_argument("--json", action="store_true")
    cmd.set_defaults(run=_explain)


def _explain(args: argparse.Namespace) -> int:
    ref = urllib.parse.quote(args.workload, safe="")
    body = plane_call(args, f"/v1/workloads/{ref}/explain")
    print(
        json.dumps(body, indent=2) if args.json else explain_text(body),
        end="\n" if args.json else "",
    )
    return 0


def explain_text(body: dict[str, Any]) -> str:
    """The explain answer for people: the shares, then one line per cluster."""
    paused = ", paused" if body.get("paused") else ""
    lines = [
        f"{body['name']} ({body['workload']}): {body['placed']} of {body['replicas']} "
        f"replicas placed{paused}"
    ]
    if body.get("refused"):
        lines.append(f"  refused: {body['refused']}")
    for c in sorted(body["clusters"], key=lambda c: (not c["chosen"], c["name"])):
        head = f"  {c['name']} ({c['cluster']}): "
        if c["chosen"]:
            text = f"chosen, share {c['share']}, room for {c['available']} more"
            if c.get("reason"):
                text += f" ({c['note']}: {c['reason']})"
        else:
            text = (
                f"refused by {c['refusedBy']}: {c['reason']}"
                if c.get("reason")
                else (f"eligible, room for {c['available']}, no share")
            )
        lines.append(head + text)
    return "\n".join(lines) + "\n"
