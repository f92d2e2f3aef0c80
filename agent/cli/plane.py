"""`nvpair plane serve | enrol-cluster | revoke | fleet | join`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import signal
import ssl
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from agent.cli.calls import CliError, request
from agent.cli.plane_objects import add_objects
from agent.cli.plane_workload import add_explain
from agent.cli.render import add_render
from agent.config import nvpair_home
from certs import make_private_dir, write_atomic
from netkit.sites import raise_open_files_limit

__all__ = ["add_commands"]


def add_commands(commands: Any) -> None:
    """Register `nvpair plane …`."""
    plane = commands.add_parser("plane", help="the Postgres plane: serve it, enrol, look, join")
    sub = plane.add_subparsers(dest="plane_command", metavar="SUBCOMMAND", required=True)
    serve = sub.add_parser("serve", help="run the plane service")
    serve.add_argument(
        "--dsn",
        help="postgresql://… (default: a PostgreSQL of its own in $NVPAIR_HOME/plane)",
    )
    serve.add_argument("--listen", default="127.0.0.1:14330", metavar="HOST:PORT")
    serve.add_argument("--cert", metavar="FILE", help="serve HTTPS with this certificate (PEM)")
    serve.add_argument("--key", metavar="FILE", help="the certificate's private key (PEM)")
    serve.add_argument(
        "--insecure-http",
        action="store_true",
        help="serve plain HTTP on a non-loopback address (tokens cross the network in clear)",
    )
    serve.set_defaults(run=_serve)
    enrol = sub.add_parser("enrol-cluster", help="enrol a cluster; prints its hgro1. token once")
    enrol.add_argument("name")
    enrol.add_argument("--plane", required=True, metavar="URL")
    enrol.add_argument(
        "--ca", metavar="FILE", help="bind the cluster's CA (PEM) now, not on its first sync"
    )
    enrol.set_defaults(run=_enrol)
    revoke = sub.add_parser("revoke", help="revoke a cluster's enrolment token")
    revoke.add_argument("cluster", metavar="CLUSTER_ID")
    revoke.add_argument("--plane", required=True, metavar="URL")
    revoke.set_defaults(run=_revoke)
    fleet = sub.add_parser("fleet", help="every cluster's nodes, GPUs and jobs")
    fleet.add_argument("--plane", required=True, metavar="URL")
    fleet.add_argument("--json", action="store_true")
    fleet.set_defaults(run=_fleet)
    psql = sub.add_parser("psql", help="psql on the embedded database ($NVPAIR_HOME/plane)")
    psql.add_argument("psql_args", nargs=argparse.REMAINDER, metavar="PSQL_ARGS")
    psql.set_defaults(run=_psql)
    join = sub.add_parser("join", help="have this node's agent sync into a plane")
    join.add_argument("url", metavar="URL")
    join.add_argument("token", metavar="TOKEN")
    join.add_argument(
        "--ca", metavar="FILE", help="the CA that signed an https plane's certificate"
    )
    join.set_defaults(run=_join)
    add_render(sub)
    add_explain(sub)
    add_objects(sub)  # create | get | patch | delete KIND, tenant-key (agent/cli/plane_objects.py)


def _listen(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        raise CliError(f"--listen is HOST:PORT with a port from 0 to 65535, not {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere


def _tls(args: argparse.Namespace, host: str) -> ssl.SSLContext | None:
    """The server's TLS context from --cert/--key; None for plain HTTP, which only loopback
    gets unless --insecure-http says otherwise (enrolment tokens travel in every call)."""
    if (args.cert is None) != (args.key is None):
        raise CliError("--cert and --key go together")
    if args.cert is None:
        if not _is_loopback(host) and not args.insecure_http:
            raise CliError(
                f"refusing plain HTTP on {host}, which is not a loopback address: "
                "give --cert FILE --key FILE, or --insecure-http"
            )
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(args.cert, args.key)
    except (OSError, ssl.SSLError) as exc:
        raise CliError(f"cannot load --cert {args.cert} / --key {args.key}: {exc}") from None
    return context


def _serve(args: argparse.Namespace) -> int:
    host, port = _listen(args.listen)
    try:
        tls = _tls(args, host)
    except CliError as exc:
        _say(f"nvpair: {exc}")  # a usage error, like a port in use: status 2
        return 2
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger(__name__).debug("open files: %d", raise_open_files_limit())
    with contextlib.suppress(KeyboardInterrupt), contextlib.ExitStack() as database:
        dsn = args.dsn
        if dsn is None:
            from agent.cli.plane_embedded import embedded_database

            dsn = embedded_database(database, nvpair_home(), _say)
            if dsn is None:
                return 1
        return asyncio.run(_run_plane(dsn, host, port, tls))
    return 0


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def _run_plane(dsn: str, host: str, port: int, tls: ssl.SSLContext | None) -> int:
    """Serve until SIGTERM/SIGINT; 2 when the port cannot be bound, 1 when the plane cannot
    start for a reason retrying does not fix (a failing migration, a malformed DSN)."""
    from plane.http.service import PlaneService

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)  # before binding: a signal then stops too
    service = PlaneService(
        dsn,
        host=host,
        port=port,
        admin_token=os.environ.get("NVPAIR_PLANE_ADMIN_TOKEN"),
        on_admin_token=lambda fresh: _say(f"admin token (shown once, stored hashed): {fresh}"),
        on_migrated=lambda applied: _say(f"applied migrations {applied}"),
        ssl_context=tls,
    )
    try:
        bound = await service.start()
    except OSError as exc:
        await service.aclose()
        _say(
            f"nvpair: cannot listen on {host}:{port} ({exc.strerror or exc}); "
            "choose another address with --listen HOST:PORT"
        )
        return 2
    url = f"{'https' if tls else 'http'}://{host}:{bound}"
    _say(f"plane bound to {url}; waiting for its database (calls get 503 until it answers)")
    stopping = asyncio.ensure_future(stop.wait())
    serving = asyncio.ensure_future(service.serving.wait())
    try:
        waits: set[asyncio.Future[Any]] = {stopping, serving, service.failed}
        await asyncio.wait(waits, return_when="FIRST_COMPLETED")
        if serving.done():
            # "listening" once it serves: scripts (and tests) wait for this line.
            _say(f"plane listening on {url}")
            await stopping
    finally:
        stopping.cancel()
        serving.cancel()
        failure = service.failed.result() if service.failed.done() else None
        await service.aclose()
    if failure is not None:
        _say(f"nvpair: {failure}")
        return 1
    return 0


def _call(url: str, method: str = "GET", body: Any = None) -> Any:
    token = os.environ.get("NVPAIR_PLANE_ADMIN_TOKEN", "")
    return request(url, method, body, headers={"Authorization": f"Bearer {token}"}, who="the plane")


def _enrol(args: argparse.Namespace) -> int:
    body = {"name": args.name}
    if args.ca is not None:
        try:
            body["ca"] = Path(args.ca).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"cannot read --ca {args.ca}: {exc}") from None
    answer = _call(args.plane.rstrip("/") + "/v1/clusters", "POST", body)
    print(answer["token"])
    print(f"enrolled {answer['name']} as {answer['id']}; the token is shown once", file=sys.stderr)
    return 0


def _revoke(args: argparse.Namespace) -> int:
    cluster = urllib.parse.quote(args.cluster, safe="")
    _call(f"{args.plane.rstrip('/')}/v1/clusters/{cluster}/revoke", "POST")
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
    usage = summary["jobs"].get("usage") or {}  # none from a plane older than usage
    for kind, table in (("model", usage.get("byModel", {})), ("key", usage.get("byKey", {}))):
        for name, n in sorted(table.items()):
            print(f"tokens by {kind} {name}: {n['promptTokens']} prompt, "
                  f"{n['completionTokens']} completion ({n['jobs']} jobs)")  # fmt: skip
    return 0


def _psql(args: argparse.Namespace) -> int:
    from agent.cli.plane_embedded import psql

    return psql(nvpair_home(), args.psql_args, _say)


def _join(args: argparse.Namespace) -> int:
    from plane.core.tokens import token_cluster

    if token_cluster(args.token) is None:
        print("nvpair: not a cluster enrolment token (hgro1.…)", file=sys.stderr)
        return 2
    path = nvpair_home() / "plane.json"
    make_private_dir(path.parent)  # 0700 whatever the umask: a home others can write is refused
    settings = {"url": args.url.rstrip("/"), "token": args.token}
    if args.ca is not None:
        settings["ca"] = os.path.abspath(args.ca)
    write_atomic(path, json.dumps(settings).encode())  # 0600 even over an older, wider file
    print(f"this node syncs into {args.url} from its next start (token kept in {path}, 0600)")
    return 0
