"""`nvpair plane serve | enrol-cluster | fleet | join`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import urllib.error
import urllib.request
from typing import Any

from .config import nvpair_home

__all__ = ["add_commands"]


def add_commands(commands: Any) -> None:
    """Register `nvpair plane …`."""
    plane = commands.add_parser("plane", help="the Postgres plane: serve it, enrol, look, join")
    sub = plane.add_subparsers(dest="plane_command", metavar="SUBCOMMAND", required=True)
    serve = sub.add_parser("serve", help="run the plane service")
    serve.add_argument("--dsn", required=True, help="postgresql://…")
    serve.add_argument("--listen", default="127.0.0.1:14330", metavar="HOST:PORT")
    serve.set_defaults(run=_serve)
    enrol = sub.add_parser("enrol-cluster", help="enrol a cluster; prints its hgro1. token once")
    enrol.add_argument("name")
    enrol.add_argument("--plane", required=True, metavar="URL")
    enrol.set_defaults(run=_enrol)
    revoke = sub.add_parser("revoke", help="revoke a cluster's enrolment token")
    revoke.add_argument("cluster", metavar="CLUSTER_ID")
    revoke.add_argument("--plane", required=True, metavar="URL")
    revoke.set_defaults(run=_revoke)
    fleet = sub.add_parser("fleet", help="every cluster's nodes, GPUs and jobs")
    fleet.add_argument("--plane", required=True, metavar="URL")
    fleet.add_argument("--json", action="store_true")
    fleet.set_defaults(run=_fleet)
    join = sub.add_parser("join", help="have this node's agent sync into a plane")
    join.add_argument("url", metavar="URL")
    join.add_argument("token", metavar="TOKEN")
    join.set_defaults(run=_join)


def _serve(args: argparse.Namespace) -> int:
    from psycopg_pool import AsyncConnectionPool

    from plane.migrate import migrate
    from plane.server import PlaneServer
    from plane.store import PlaneStore

    host, _, port = args.listen.rpartition(":")

    async def run() -> None:
        async with AsyncConnectionPool(args.dsn, min_size=1, max_size=10, open=False) as pool:
            async with pool.connection() as conn:
                applied = await migrate(conn)
            if applied:
                print(f"applied migrations {applied}", file=sys.stderr)
            store = PlaneStore(pool)
            fresh = await store.ensure_admin(os.environ.get("NVPAIR_PLANE_ADMIN_TOKEN"))
            if fresh is not None:
                print(f"admin token (shown once, stored hashed): {fresh}", file=sys.stderr)
            server = PlaneServer(store, host=host or "127.0.0.1", port=int(port))
            bound = await server.start()
            print(
                f"plane listening on http://{host or '127.0.0.1'}:{bound}",
                file=sys.stderr,
                flush=True,
            )
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, stop.set)
            try:
                await stop.wait()
            finally:
                await server.aclose()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


def _call(url: str, method: str = "GET", body: Any = None) -> Any:
    token = os.environ.get("NVPAIR_PLANE_ADMIN_TOKEN", "")
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method=method,
    )
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise SystemExit(
            f"nvpair: the plane refused ({exc.code}): {exc.read().decode().strip()}"
        ) from None
    except urllib.error.URLError as exc:
        raise SystemExit(f"nvpair: the plane does not answer ({exc.reason})") from None


def _enrol(args: argparse.Namespace) -> int:
    answer = _call(args.plane.rstrip("/") + "/v1/clusters", "POST", {"name": args.name})
    print(answer["token"])
    print(f"enrolled {answer['name']} as {answer['id']}; the token is shown once", file=sys.stderr)
    return 0


def _revoke(args: argparse.Namespace) -> int:
    _call(f"{args.plane.rstrip('/')}/v1/clusters/{args.cluster}/revoke", "POST")
    print(f"revoked {args.cluster}: its token is refused from now on")
    return 0


def _fleet(args: argparse.Namespace) -> int:
    summary = _call(args.plane.rstrip("/") + "/v1/fleet/summary")
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    for cluster in summary["clusters"]:
        nodes = cluster["nodes"]
        gpus = ", ".join(
            f"{cls}: {sum(by.values())} ({', '.join(f'{n} {h}' for h, n in sorted(by.items()))})"
            for cls, by in sorted(cluster["gpus"].items())
        )
        memory = cluster["memory"]
        print(f"{cluster['name']} ({cluster['id']})")
        reachable, unreachable = nodes["reachable"], nodes["unreachable"]
        cordoned = nodes["cordoned"]
        print(f"  nodes: {reachable} reachable, {unreachable} unreachable, {cordoned} cordoned")
        free, total = memory["free"] / 1024**3, memory["total"] / 1024**3
        print(f"  GPUs: {gpus or 'none'}; memory {free:.0f}/{total:.0f} GiB free")
        states = ", ".join(f"{n} {s}" for s, n in sorted(cluster["jobs"]["byState"].items()))
        print(f"  jobs: {states or 'none'}")
    return 0


def _join(args: argparse.Namespace) -> int:
    from plane.tokens import token_cluster

    if token_cluster(args.token) is None:
        print("nvpair: not a cluster enrolment token (hgro1.…)", file=sys.stderr)
        return 2
    path = nvpair_home() / "plane.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"url": args.url.rstrip("/"), "token": args.token}, out)
    print(f"this node syncs into {args.url} from its next start (token kept in {path}, 0600)")
    return 0
