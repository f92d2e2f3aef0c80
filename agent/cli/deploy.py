"""`nvpair deploy`, `deployments`, `scale`, `undeploy`, `replicas`, `logs`: deployments through
the running agent's local API (any member: a declaration reaches every member; a replica's
log only on the node that runs it)."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
from typing import Any

from agent.cli import calls as cli_http
from agent.cli.calls import duration

__all__ = ["add_commands"]

_GIB = 2**30
FOLLOW_POLL_S = 0.5  # how often `nvpair logs --follow` asks for new lines


def add_commands(commands: Any) -> None:
    """Register the deployment commands on the top-level parser."""
    deploy = commands.add_parser(
        "deploy",
        help="declare a deployment: engines launched on chosen GPUs",
        description="Declare (or change) a deployment; extra engine arguments go after --.",
    )
    deploy.add_argument("name", help="the model name clients use")
    # Required, checked in `_deploy`: argparse alone misses them after NAME (see below).
    deploy.add_argument("--model", help="what the engine loads: a path or an id")
    deploy.add_argument(
        "--artifact",
        default="",
        help="the weights it loads: an artifact (name, art_ id or digest) that members fetch",
    )
    deploy.add_argument(
        "--engine", help="vllm, sglang, llamacpp, mock, or a [templates] name (required)"
    )
    deploy.add_argument("--gpus", type=int, default=1, help="GPUs per replica (default 1)")
    deploy.add_argument("--tp", type=int, default=0, help="tensor-parallel size (default: --gpus)")
    deploy.add_argument(
        "--replicas", type=int, default=None, help="a fixed count (default 1): min = max = N"
    )
    deploy.add_argument("--min-replicas", type=int, default=None, help="scale on load, from N")
    deploy.add_argument("--max-replicas", type=int, default=None, help="... up to M")
    deploy.add_argument(
        "--target-waiting", type=float, default=0.0,
        help="requests per ready replica that may wait before one more starts (default 0)",
    )  # fmt: skip
    deploy.add_argument(
        "--scale-down-after", type=duration, default=None,
        help="quiet this long before a replica goes (default 5m)",
    )  # fmt: skip
    deploy.add_argument(
        "--idle-to-zero", type=duration, default=None,
        help="with --min-replicas 0: idle this long before the last one goes (default 15m)",
    )  # fmt: skip
    deploy.add_argument(
        "--priority", type=int, default=None,
        help="with bounds: its class when GPUs are short, 0-100, higher first (default 0)",
    )  # fmt: skip
    deploy.add_argument(
        "--cold-start-timeout", type=duration, default=None,
        help="with bounds: how long a request may wait while a replica starts from none ready "
        "(default: the members' wait_timeout_s)",
    )  # fmt: skip
    deploy.add_argument(
        "--max-in-flight",
        type=int,
        default=0,
        help="requests one replica takes at once; more wait in line (default 0: no limit)",
    )
    deploy.add_argument(
        "--nodes", type=int, default=1,
        help="members one replica spans, --gpus on each (a model larger than one machine)",
    )  # fmt: skip
    deploy.add_argument("--node", default="", help="keep its replicas on this node (id or name)")
    deploy.add_argument("--device-class", default="", help="e.g. h100-80gb-sxm")
    deploy.add_argument(
        "--one-domain", action="store_true", help="every GPU of a replica in one NVLink domain"
    )
    deploy.add_argument("--min-memory-gib", type=int, default=0, help="memory each GPU must have")
    deploy.add_argument(
        "--observe",
        metavar="URL",
        help="an engine that already runs there: record and watch it, never restart it",
    )
    # REMAINDER takes every word after NAME, flags too: `_deploy` parses those before `--`.
    deploy.add_argument(
        "--engine-key", default="", help="the engine's API key: generate, or file:PATH (0600)"
    )
    deploy.add_argument("engine_args", nargs=argparse.REMAINDER, help="-- ENGINE ARGS...")
    deploy.set_defaults(run=_deploy, parser=deploy)

    listing = commands.add_parser("deployments", help="the declared deployments")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(run=_deployments)

    scale = commands.add_parser("scale", help="change a deployment's replicas")
    scale.add_argument("name")
    scale.add_argument("replicas", type=int)
    scale.set_defaults(run=_scale)

    undeploy = commands.add_parser("undeploy", help="stop a deployment's replicas everywhere")
    undeploy.add_argument("name")
    undeploy.set_defaults(run=_undeploy)

    replicas = commands.add_parser("replicas", help="every member's replicas")
    replicas.add_argument("--json", action="store_true")
    replicas.set_defaults(run=_replicas)

    logs = commands.add_parser(
        "logs",
        help="a replica's engine log (on the node that runs it)",
        description="The engine's output: shown only here, to this node's owner.",
    )
    logs.add_argument("replica", metavar="REPLICA", help="a rep_ id (nvpair replicas)")
    logs.add_argument("--tail", type=int, default=100, help="last N lines (default 100)")
    logs.add_argument("-f", "--follow", action="store_true", help="then print new lines")
    logs.set_defaults(run=_logs)


def _deploy(args: argparse.Namespace) -> int:
    rest = list(args.engine_args)
    cut = rest.index("--") if "--" in rest else len(rest)
    flags, extra = rest[:cut], rest[cut + 1 :]
    parser: argparse.ArgumentParser = args.parser
    if flags:  # the flags written after NAME, parsed as if before it
        args = parser.parse_args([*flags, args.name])
    if not (args.model or args.artifact) or not args.engine:
        parser.error("--engine, and --model or --artifact, are required")
    body = {
        "name": args.name,
        "engine": args.engine,
        "source": args.model or "",
        "artifact": args.artifact,
        "args": extra,
        "gpus": args.gpus,
        "tp": args.tp,
        "nodes": args.nodes,
        "maxInFlight": args.max_in_flight,
        "constraints": {
            "node": args.node,
            "deviceClass": args.device_class,
            "oneDomain": args.one_domain,
            "minMemory": args.min_memory_gib * _GIB,
        },
        "authority": "observed" if args.observe else "managed",
        "url": args.observe or "",
        "engineKey": args.engine_key,
    }
    body |= _scaling(args, parser)
    made = cli_http.post("/v1/deployments", body)
    bounds = made.get("elastic")
    count = f"{made['replicas']} replica(s)"
    if bounds:
        count += f" of {bounds['min']}..{bounds['max']}, on load"
    spans = f" on each of {made['nodes']} members" if made.get("nodes") else ""
    print(f"deployment {made['name']} ({made['id']}) version {made['version']}: "
          f"{count} x {made['gpus']} GPU(s){spans}")  # fmt: skip
    return 0


def _scaling(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The body's count: `--replicas N` (fixed), or bounds and a policy (elastic)."""
    elastic = args.min_replicas is not None or args.max_replicas is not None
    policy = (args.target_waiting, args.scale_down_after, args.idle_to_zero, args.priority,
              args.cold_start_timeout)  # fmt: skip
    if not elastic:
        if policy != (0.0, None, None, None, None):
            parser.error("--target-waiting, --scale-down-after, --idle-to-zero, --priority and "
                         "--cold-start-timeout need --min-replicas or --max-replicas")  # fmt: skip
        return {"replicas": 1 if args.replicas is None else args.replicas}
    if args.replicas is not None:
        parser.error("--replicas is a fixed count: give it, or --min-replicas/--max-replicas")
    body: dict[str, Any] = {
        "minReplicas": args.min_replicas,
        "maxReplicas": args.max_replicas,
        "targetWaiting": args.target_waiting,
    }
    if args.scale_down_after is not None:
        body["scaleDownAfterS"] = args.scale_down_after.total_seconds()
    if args.idle_to_zero is not None:
        body["idleToZeroS"] = args.idle_to_zero.total_seconds()
    if args.priority is not None:
        body["priority"] = args.priority
    if args.cold_start_timeout is not None:
        body["coldStartS"] = args.cold_start_timeout.total_seconds()
    return {k: v for k, v in body.items() if v is not None}


def _deployments(args: argparse.Namespace) -> int:
    deployments = cli_http.get("/v1/deployments")
    if args.json:
        print(json.dumps(deployments, indent=2))
        return 0
    rows = [["NAME", "ENGINE", "MIN", "DESIRED", "READY", "MAX", "WHY", "GPUS", "VERSION", "BY"]]
    for d in deployments:
        states = d.get("replicaStates", {})
        bounds = d.get("elastic") or {"min": d["replicas"], "max": d["replicas"], "reason": "fixed"}
        rows.append(
            [d["name"], d["engine"], str(bounds["min"]), str(d["replicas"]),
             str(states.get("ready", 0)), str(bounds["max"]), bounds["reason"], str(d["gpus"]),
             str(d["version"]), d["by"][-8:]]
        )  # fmt: skip
    print(cli_http.table(rows))
    return 0


def _scale(args: argparse.Namespace) -> int:
    name = urllib.parse.quote(args.name, safe="")
    made = cli_http.post(f"/v1/deployments/{name}/scale", {"replicas": args.replicas})
    print(f"deployment {made['name']}: {made['replicas']} replica(s), version {made['version']}")
    return 0


def _undeploy(args: argparse.Namespace) -> int:
    name = urllib.parse.quote(args.name, safe="")
    made = cli_http.post(f"/v1/deployments/{name}/undeploy", {})
    print(f"deployment {made['undeployed']} undeployed (version {made['version']})")
    return 0


def _replicas(args: argparse.Namespace) -> int:
    replicas = cli_http.get("/v1/replicas")
    if args.json:
        print(json.dumps(replicas, indent=2))
        return 0
    rows = [["REPLICA", "DEPLOYMENT", "NODE", "PART", "STATE", "GPUS", "PORT", "RESTARTS",
             "ERROR"]]  # fmt: skip
    for r in replicas:
        rows.append(
            [r["id"], r["deployment"], r["node"], _part(r), r["state"], str(len(r["devices"])),
             str(r["port"]), str(r["restarts"]), r.get("error", "")[:60]]
        )  # fmt: skip
    table = cli_http.table(rows).split("\n")
    print(table[0])
    for line, r in zip(table[1:], replicas, strict=True):
        print(line)
        for logged in r.get("logTail", []):  # a failed replica of this node: why, in its words
            print(f"    | {logged}")
    return 0


def _part(replica: dict[str, Any]) -> str:
    """A part of a replica across members (issue 32): `head 1/2 grp_...`, else "-"."""
    layout = replica.get("layout")
    if not layout:
        return "-"
    rank = next((i for i, (node, _) in enumerate(layout) if node == replica["nodeId"]), 0)
    role = "head" if rank == 0 else "worker"
    return f"{role} {rank + 1}/{len(layout)} {replica.get('group', '')[-8:]}"


def _logs(args: argparse.Namespace) -> int:
    path = f"/v1/replicas/{urllib.parse.quote(args.replica, safe='')}/log"
    chunk = cli_http.get(f"{path}?tail={max(1, args.tail)}")
    if chunk["truncated"]:
        print(
            "nvpair: earlier lines left out (at most 1 MiB or 10000 lines a call)", file=sys.stderr
        )
    for line in chunk["lines"]:
        print(line)
    if not args.follow:
        if chunk["partial"]:
            print(chunk["partial"])
        return 0
    sys.stdout.flush()
    try:
        while True:
            time.sleep(FOLLOW_POLL_S)
            chunk = cli_http.get(f"{path}?from={chunk['offset']}")
            if chunk["rotated"]:
                print("nvpair: the log was rotated; from its start", file=sys.stderr)
            for line in chunk["lines"]:
                print(line)
            sys.stdout.flush()
    except KeyboardInterrupt:
        return 0
