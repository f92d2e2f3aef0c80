"""`nvpair agent run`, `nvpair jobs`, `nvpair nodes`, `nvpair cluster join|remove`.

Commands other than `agent run` and `join` find their agent through `NVPAIR_HOME`: the
running agent writes its local API address to `$NVPAIR_HOME/agent.json`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

from agent.cli import calls as cli_http
from agent.config import ConfigError, load_config, nvpair_home
from certs import ClusterDir
from netkit import logs

__all__ = ["add_commands"]

PAGE = 1000  # jobs per local-API call of `nvpair jobs`

_LEVELS = {
    "error": logging.ERROR,
    "warn": logging.WARNING,
    "info": logging.INFO,
    "debug": logging.DEBUG,
}


def add_commands(commands: Any, cluster_sub: Any) -> None:
    """Register the agent's commands on the top-level and `cluster` parsers."""
    agent = commands.add_parser("agent", help="the node daemon")
    agent_sub = agent.add_subparsers(dest="agent_command", metavar="SUBCOMMAND", required=True)
    run = agent_sub.add_parser("run", help="run this node's agent until stopped")
    run.add_argument("--name", help="this node's name (default: the host name)")
    run.add_argument(
        "--advertise",
        metavar="HOST[:M,N,F]",
        help="address peers use (default 127.0.0.1), and the manager, node and facade ports "
        "they use when not the listening ones (NAT, port forwards, containers)",
    )
    for flag in ("manager", "node", "api", "facade"):
        run.add_argument(f"--{flag}-port", type=int, dest=f"{flag}_port", metavar="N")
    run.add_argument("--simulate-gpus", metavar="SPEC", help='e.g. "h100-80gb-sxm:8,l4:2"')
    run.add_argument("--log-level", choices=tuple(_LEVELS))
    run.add_argument(
        "--log-format",
        choices=("text", "json"),
        help="json: one object a line with the request's ids, for log shippers (default text)",
    )
    run.add_argument(
        "--engine",
        action="append",
        metavar="KIND=URL",
        help="a model server, e.g. vllm=http://127.0.0.1:8000 (repeatable)",
    )
    run.set_defaults(run=_agent_run)

    node = commands.add_parser("node", help="cordon, uncordon or drain a member")
    node_sub = node.add_subparsers(dest="node_command", metavar="SUBCOMMAND", required=True)
    for kind, help_text in (
        ("cordon", "stop placing new work on a node"),
        ("uncordon", "place work on a node again"),
        ("drain", "cordon a node and wait for its jobs to finish"),
    ):
        op = node_sub.add_parser(kind, help=help_text)
        op.add_argument("target", metavar="NODE")
        op.add_argument("--reason", default="")
        if kind == "drain":
            op.add_argument("--timeout", type=_seconds, default=600.0, help="e.g. 10m (default)")
            op.add_argument(
                "--force", action="store_true", help="cancel what is left at the timeout"
            )
        op.set_defaults(run=_operation, kind=kind)
    ops = commands.add_parser("ops", help="operations and their phases")
    ops.add_argument("--json", action="store_true")
    ops.set_defaults(run=_ops)

    explain = commands.add_parser(
        "explain",
        help="why a request for MODEL goes where, or why a deployment's replica is not placed",
    )
    explain.add_argument("model", metavar="MODEL", nargs="?")
    explain.add_argument("--deployment", metavar="NAME", help="why (not) on each member")
    explain.add_argument("--node", metavar="NODE", help="with --deployment: only this member")
    explain.add_argument(
        "--prompt-file",
        metavar="F",
        help="where a request like this one goes, by its prompt: an OpenAI request body"
        " (JSON: messages, prompt or input) or plain text (one user message)",
    )
    explain.add_argument("--session", metavar="KEY", default="", help="its X-Session-Id")
    explain.add_argument("--json", action="store_true")
    explain.set_defaults(run=_explain)

    routing = commands.add_parser(
        "routing", help="how this member picks a deployment's replica (prefix, load, round-robin)"
    )
    routing.add_argument(
        "--policy",
        choices=("prefix", "load", "round-robin"),
        help="use this one until the agent restarts ([routing] policy in nvpair.toml)",
    )
    routing.set_defaults(run=_routing)

    jobs = commands.add_parser("jobs", help="the Jobs list, as this member sees it")
    jobs.add_argument("--state", choices=("queued", "running", "completed", "failed", "cancelled"))
    jobs.add_argument("--node", metavar="NODE_ID", help="jobs that run or ran on this node")
    jobs.add_argument("--watch", action="store_true", help="refresh every 2 s")
    jobs.add_argument("--json", action="store_true")
    jobs.add_argument("--all", action="store_true", help="every job, page by page")
    jobs.add_argument(
        "--usage", action="store_true", help="tokens and times ('-': originated elsewhere)"
    )
    jobs.set_defaults(run=_jobs)
    jobs_sub = jobs.add_subparsers(dest="jobs_command", metavar="SUBCOMMAND")
    remove_job = jobs_sub.add_parser("remove", help="remove a job this node originated")
    remove_job.add_argument("job_id", metavar="ID")
    remove_job.set_defaults(run=_remove_job)

    nodes = commands.add_parser("nodes", help="members, reachability and GPUs")
    nodes.add_argument("--json", action="store_true")
    nodes.set_defaults(run=_nodes)

    join = cluster_sub.add_parser("join", help="join a cluster through a member: HOST:PORT TOKEN")
    join.add_argument("address", metavar="HOST:PORT", help="a CA holder's node API (port 14321)")
    join.add_argument("token", metavar="TOKEN")
    join.add_argument("--name", help="this node's name (default: the host name)")
    join.add_argument("--san", action="append", default=[], help="DNS name or IP of this node")
    join.set_defaults(run=_join)

    remove = cluster_sub.add_parser("remove", help="remove a member from every member")
    remove.add_argument("node_id", metavar="NODE")
    remove.set_defaults(run=_remove)

    status = cluster_sub.add_parser(
        "status", help="releases, the wire version the cluster speaks and its feature gate"
    )
    status.add_argument("--json", action="store_true")
    status.set_defaults(run=_status)


# -- agent run ----------------------------------------------------------------------------------


def _agent_run(args: argparse.Namespace) -> int:
    home = nvpair_home()
    try:
        config = load_config(
            home,
            {
                "name": args.name,
                "advertise": args.advertise,
                "manager_port": args.manager_port,
                "node_port": args.node_port,
                "api_port": args.api_port,
                "facade_port": args.facade_port,
                "simulate_gpus": args.simulate_gpus,
                "log_level": args.log_level,
                "log_format": args.log_format,
                "engines": args.engine,
            },
        )
    except ConfigError as exc:
        print(f"nvpair: {exc}", file=sys.stderr)
        return 2
    logs.configure(_LEVELS[config.log_level], config.log_format)
    os.environ[logs.ENV] = config.log_format  # the workload manager child writes it too
    # aiosqlite logs two debug lines per statement (its arguments' reprs): at `debug` they
    # were nine lines in ten of an agent's log, and costly to format. Ours stay at debug.
    logging.getLogger("aiosqlite").setLevel(max(logging.INFO, _LEVELS[config.log_level]))
    # Imported here: the servers' plumbing and the daemon's parts (aiohttp, ~0.4 s of imports)
    # serve `agent run` only; every other command starts without them.
    from agent.app.run import run_agent
    from agent.core.request_identity import log_fields

    logs.add_context(log_fields)  # a line written for a request names it, and its job
    from netkit.sites import Bounds, raise_open_files_limit

    limit = raise_open_files_limit()
    logging.getLogger(__name__).info(
        "open files: %d; each listener holds at most %d connections",
        limit,
        Bounds.from_env().max_connections,
    )
    return run_agent(config)


# -- commands that talk to the running agent ----------------------------------------------------


def _get(path: str) -> Any:
    return cli_http.get(path)


def _jobs(args: argparse.Namespace) -> int:
    filters = (("state", args.state), ("node", args.node))
    query = "".join(f"&{k}={urllib.parse.quote(v)}" for k, v in filters if v)
    while True:
        jobs, more = _job_pages(query, every=args.all)
        if more:  # never stop silently at a page: say how to see the rest
            print(
                f"nvpair: the newest {len(jobs)} jobs shown; there are more (--all for every one)",
                file=sys.stderr,
            )
        usage = _usage_of(jobs) if args.usage else {}
        if args.json:
            for job in jobs if args.usage else ():
                job["usage"] = usage.get(f"{job['runId']}/{job['id']}")
            print(json.dumps(jobs, indent=2))
        else:
            rows = [["ID", "STATE", "MODEL", "FROM", "ON", "CREATED", "ERROR"]]
            rows[0] += USAGE_COLUMNS if args.usage else []
            for job in jobs:
                created = time.strftime("%H:%M:%S", time.localtime(job["createdAt"] / 1000))
                rows.append(
                    [job["id"], job["state"], job["model"], job["originatedFrom"][-8:],
                     (job.get("scheduledOn") or "-")[-8:], created, (job.get("error") or "")[:40]]
                )  # fmt: skip
                if args.usage:
                    held = usage.get(f"{job['runId']}/{job['id']}") or {}
                    rows[-1] += [_count(held.get(k)) for k in USAGE_FIELDS]
            print(cli_http.table(rows))
        if not args.watch:
            return 0
        time.sleep(2)
        print()


USAGE_COLUMNS = ["PROMPT", "COMPLETION", "TTFT_MS", "TOTAL_MS"]
USAGE_FIELDS = ("promptTokens", "completionTokens", "ttftMs", "totalMs")


def _usage_of(jobs: list[Any]) -> dict[str, Any]:
    """Usage of the jobs this member originated (kept on the origin only), by `runId/id`."""
    keys = [[j["runId"], j["id"]] for j in jobs]
    found: dict[str, Any] = {}
    for start in range(0, len(keys), 10_000):
        found |= cli_http.post("/v1/usage", {"jobs": keys[start : start + 10_000]})["usage"]
    return found


def _count(value: Any) -> str:
    return "-" if value is None else str(value)


def _job_pages(query: str, *, every: bool) -> tuple[list[Any], bool]:
    """The first page of the Jobs list, or every page when `every`; and whether more remain."""
    page = _get(f"/v1/jobs?page=1&limit={PAGE}{query}")
    jobs: list[Any] = list(page["jobs"])
    while every and page["next"] is not None:
        after = urllib.parse.quote(page["next"])
        page = _get(f"/v1/jobs?limit={PAGE}&after={after}{query}")
        jobs += page["jobs"]
    return jobs, page["next"] is not None


def _remove_job(args: argparse.Namespace) -> int:
    job_id = urllib.parse.quote(args.job_id, safe="")
    answer = cli_http.post(f"/v1/jobs/{job_id}/remove")  # CliError: `main` prints it, exit 1
    done = "was already removed" if answer.get("already") else "removed; the members follow"
    print(f"job {args.job_id} {done}")
    return 0


def _nodes(args: argparse.Namespace) -> int:
    nodes = _get("/v1/nodes")
    if args.json:
        print(json.dumps(nodes, indent=2))
        return 0
    rows = [
        ["NODE ID", "NAME", "RELEASE", "REACHABLE", "CORDONED", "GPUS", "MEMORY FREE/TOTAL", "UTIL"]
    ]
    for node in nodes:
        devices = node.get("devices", [])
        free = sum(d["memoryFree"] for d in devices) / 1024**3
        total = sum(d["memoryTotal"] for d in devices) / 1024**3
        util = [d["utilization"] for d in devices if d.get("utilization") is not None]
        classes = sorted({d["deviceClass"] for d in devices})
        release = node.get("release", node.get("version", "?"))
        rows.append(
            [node["nodeId"], node["name"],
             release + (" REFUSED" if node.get("refused") else ""),
             "yes" if node["reachable"] else "NO",
             "yes" if node.get("cordoned") else "no",
             f"{len(devices)} {','.join(classes)}" if devices else "0",
             f"{free:.0f}/{total:.0f} GiB" if devices else "-",
             f"{sum(util) / len(util):.0f}%" if util else "-"]
        )  # fmt: skip
    print(cli_http.table(rows))
    refused = [n for n in nodes if n.get("refused")]
    for node in refused:
        print(f"refused: {node['refused']}")
    return 0


def _status(args: argparse.Namespace) -> int:
    status = _get("/v1/cluster/status")
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    low, high = status["wire"]
    print(f"this member: nvpair {status['release']} (speaks wire {low}-{high})")
    print(f"cluster wire version: {status['clusterWire']}")
    print(f"features on: {', '.join(status['features']['on']) or '-'}")
    for feature in status["features"]["off"]:
        print(f"feature off: {feature} (needs wire {status['features']['needs'][feature]})")
    for member in status["heldBackBy"]:
        print(
            f"held back by: {member['nodeId']} on nvpair {member['release']} "
            f"(speaks up to wire {member['wire'][1]})"
        )
    for member in status["refused"]:
        print(f"refused: {member['why']}")
    rows = [["NODE ID", "NAME", "RELEASE", "WIRE"]]
    rows += [
        [m["nodeId"], m["name"], m["release"], "-".join(str(v) for v in m["wire"])]
        for m in status["members"]
    ]
    print(cli_http.table(rows))
    return 0


def _seconds(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    if text and text[-1] in units and text[:-1].isdigit():
        return float(int(text[:-1]) * units[text[-1]])
    if text.isdigit():
        return float(text)
    raise argparse.ArgumentTypeError(f"not a duration like 90s, 10m or 1h: {text!r}")


def _post(path: str, body: Any) -> Any:
    return cli_http.post(path, body)


def _operation(args: argparse.Namespace) -> int:
    body = {"kind": args.kind, "target": args.target, "reason": args.reason}
    if args.kind == "drain":
        body |= {"timeoutS": args.timeout, "force": args.force}
    op = _post("/v1/ops", body)
    print(f"{op['id']}: {op['kind']} {op['target']} {op['phase']}")
    last = None
    while op["phase"] in ("pending", "running"):
        time.sleep(0.2)  # a local call; a cordon usually ends within one
        op = next(o for o in _get("/v1/ops") if o["id"] == op["id"])
        line = f"  {op['phase']}: {op.get('waitingFor') or ''}".rstrip()
        if line != last:
            print(line)
            last = line
    print(f"{op['id']}: {op['phase']} - {op.get('result') or ''}")
    return 0 if op["phase"] == "succeeded" else 1


def _ops(args: argparse.Namespace) -> int:
    ops = _get("/v1/ops")
    if args.json:
        print(json.dumps(ops, indent=2))
        return 0
    rows = [["ID", "KIND", "TARGET", "PHASE", "WAITING FOR / RESULT"]]
    rows += [
        [
            o["id"],
            o["kind"],
            o["target"][-8:],
            o["phase"],
            o.get("waitingFor") or o.get("result") or "",
        ]
        for o in ops
    ]
    print(cli_http.table(rows))
    return 0


def _explain(args: argparse.Namespace) -> int:
    if args.deployment:
        return _explain_deployment(args.deployment, args.node or "", as_json=args.json)
    if not args.model:
        raise cli_http.CliError("explain needs a MODEL or --deployment NAME")
    if args.prompt_file:
        return _explain_prompt(args.model, args.prompt_file, args.session, as_json=args.json)
    model = urllib.parse.quote(args.model)
    result = _get("/v1/explain?model=" + model)
    replicas = _get("/v1/explain/replicas?model=" + model)
    if args.json:
        print(json.dumps({**result, "replicas": replicas}, indent=2))
        return 0
    if replicas["deployment"]:  # a deployment's model is routed per replica, on engine load
        rows = [["RANK", "REPLICA", "NODE", "SCORE / REASON", "RUNNING", "WAITING", "SENT"]]
        rows += [
            [str(n + 1), e["replica"], e["node"], f"{e['score']:.3f}", _figure(e["running"]),
             _figure(e["waiting"]), str(e["pending"])]
            for n, e in enumerate(replicas["ranked"])
        ]  # fmt: skip
        rows += [
            ["-", e["replica"], e["node"], e["reason"], "", "", ""] for e in replicas["refused"]
        ]
        print(f"{args.model} is a deployment: each request goes to the best replica")
        print(cli_http.table(rows))
        return 0
    rows = [["RANK", "NODE", "SCORE / REASON"]]
    rows += [
        [str(n + 1), entry["nodeId"], f"{entry['score']:.3f}"]
        for n, entry in enumerate(result["ranked"])
    ]
    rows += [["-", entry["nodeId"], entry["reason"]] for entry in result["refused"]]
    print(cli_http.table(rows))
    return 0


def _explain_prompt(model: str, path: str, session: str, *, as_json: bool) -> int:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise cli_http.CliError(f"cannot read {path}: {exc}") from None
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if not isinstance(body, dict):  # plain text: the prompt of one user message
        body = {"messages": [{"role": "user", "content": text}]}
    sent = {"model": model, "request": body, "session": session}
    result = cli_http.call("POST", "/v1/routing/explain", sent)
    if as_json:
        print(json.dumps(result, indent=2))
        return 0
    anchor = result["anchor"]
    kind = "session key" if result["session"] else "prompt anchor"
    print(f"policy {result['policy']}; " + (f"{kind} {anchor}" if anchor else "no anchor: by load"))
    rows = [["ORDER", "REPLICA", "NODE", "WORK", "LOAD SCORE", "WITHIN BOUND"]]
    rows += [
        [
            "-" if e["order"] is None else str(e["order"] + 1),
            e["replicaId"],
            e["nodeId"],
            f"{e['work']:g}",
            f"{e['loadScore']:.3f}",
            "yes" if e["withinBound"] else "no",
        ]
        for e in result["replicas"]
    ]
    rows += [["-", e["replicaId"], "", "", e["reason"], ""] for e in result["refused"]]
    print(cli_http.table(rows))
    print(f"bound: work + 1 <= {result['bound']:g}")
    choice = result["choice"]
    if choice is None:
        print("no replica can take it now")
    else:
        then = result["then"]
        after = f"; if it fails, {then['replicaId']} on {then['nodeId']}" if then else ""
        print(f"chosen: {choice['replicaId']} on {choice['nodeId']} ({choice['reason']}){after}")
    return 0


def _routing(args: argparse.Namespace) -> int:
    if args.policy:
        answer = cli_http.call("PUT", "/v1/routing", {"policy": args.policy})
    else:
        answer = _get("/v1/routing")
    print(f"policy: {answer['policy']} (of {', '.join(answer['policies'])})")
    return 0


def _explain_deployment(name: str, node: str, *, as_json: bool) -> int:
    query = "?node=" + urllib.parse.quote(node) if node else ""
    result = _get(f"/v1/deployments/{urllib.parse.quote(name, safe='')}/explain{query}")
    if as_json:
        print(json.dumps(result, indent=2))
        return 0
    weights = result.get("weights")
    rows = [["NODE", "ID", "HOLDS", *(["WEIGHTS"] if weights else []), "A REPLICA MORE HERE NOW"]]
    rows += [
        [
            e["node"],
            e["nodeId"],
            str(e["replicas"]),
            *([e.get("weights", "absent")] if weights else []),
            e["reason"] or "can be placed",
        ]
        for e in result["nodes"]
    ]
    print(cli_http.table(rows))
    if weights:
        print(
            f"\nits weights: artifact {weights['artifact'][:19]}; members that hold them are "
            "preferred, any other fetches them before its engine starts"
        )
    for why in result["unplaced"]:
        print(f"\nunplaced in this node's last plan: {why}")
    scaling = result.get("scaling")
    if scaling:
        load = scaling["load"] or {}
        print(
            f"\nscales on load: {load.get('ready', 0)} ready, {_figure(load.get('running'))} "
            f"running, {_figure(load.get('waiting'))} waiting across the members "
            f"({scaling['samples']} samples kept); one replica runs "
            f"{_figure(scaling['capacity'])} at once; decided by {scaling['decider']}"
            + (" (this member)" if scaling["decidesHere"] else "")
        )
        if scaling["lastDecision"]:
            last = scaling["lastDecision"]
            print(f"last decision here: {last['desired']} replica(s), {last['reason']}")
        for event in reversed(scaling.get("events") or []):  # the newest first
            when = time.strftime("%H:%M:%S", time.localtime(event["at"] / 1000))
            if event["kind"] == "cold-start":
                print(f"{when} cold start: a replica ready in {event['seconds']:.1f}s")
            else:
                print(f"{when} {event['kind']} {event['previous']} -> {event['replicas']} "
                      f"({event['reason']})")  # fmt: skip
    return 0


def _figure(value: float | None) -> str:
    return "?" if value is None else f"{value:g}"


def _remove(args: argparse.Namespace) -> int:
    node_id = urllib.parse.quote(args.node_id, safe="")
    cli_http.post(f"/v1/members/{node_id}/remove")  # CliError: `main` prints it, exit 1
    print(f"removed {args.node_id}: every member unpins it within a heartbeat")
    return 0


# -- join ---------------------------------------------------------------------------------------


def _join(args: argparse.Namespace) -> int:
    import socket

    cluster = ClusterDir(nvpair_home() / "cluster")
    if cluster.has_identity():
        print(f"nvpair: {cluster.path} already holds a cluster identity", file=sys.stderr)
        return 1
    # Imported here: the join's HTTP client loads aiohttp, which no other command here needs.
    from agent.cli.join import JoinFailed, join_over_network

    try:
        answer = join_over_network(
            args.address, args.token, args.name or socket.gethostname(), args.san, cluster
        )
    except JoinFailed as exc:
        print(f"nvpair: join failed: {exc}", file=sys.stderr)
        return 1
    print(f"joined as {answer}; start the node with `nvpair agent run`")
    return 0
