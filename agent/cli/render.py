"""`nvpair plane render NAME --format dynamo|dynamo-json [--image IMAGE]`: a deployment, as
the local agent holds it (`GET /v1/deployments`), rendered as a Dynamo
`DynamoGraphDeployment` (`plane.render.dynamo`) for `kubectl apply -f -`, as YAML or JSON.

With `--plane URL`, NAME is one of the plane's deployments instead -- its `dep_` id, or the
workload's name when it has one deployment (else `--cluster` says which) -- rendered by the
plane as its cluster receives it (`GET /v1/deployments/{id}/dynamo`)."""

from __future__ import annotations

import argparse
import json
import urllib.parse
from typing import Any

import msgspec

from agent.cli import calls as cli_http
from agent.cli.calls import CliError
from agent.cli.plane_call import plane_call
from facts.deployments import Deployment
from plane.core.ids import is_id
from plane.render.dynamo import DynamoSettings, RenderInput, RenderRefused, render
from plane.render.yaml_text import dump

__all__ = ["add_render", "render_text"]

FORMATS = ("dynamo", "dynamo-json")


def add_render(sub: Any) -> None:
    """Register `nvpair plane render` under the `plane` subcommands `sub`."""
    cmd = sub.add_parser("render", help="a deployment as an NVIDIA Dynamo DynamoGraphDeployment")
    cmd.add_argument("name", metavar="DEPLOYMENT")
    cmd.add_argument("--format", choices=FORMATS, required=True, help="dynamo: YAML; or JSON")
    cmd.add_argument("--image", default="", help="the runtime image (default: Dynamo's own)")
    cmd.add_argument(
        "--frontend-type",
        default=DynamoSettings().frontend_type,
        help="the Frontend's componentType (operators before its rename: main)",
    )
    cmd.add_argument("--plane", metavar="URL", help="render one of this plane's deployments")
    cmd.add_argument("--cluster", default="", help="with --plane: the cluster (name or id)")
    cmd.set_defaults(run=_render)


def render_text(
    views: Any, name: str, fmt: str, *, image: str = "", frontend_type: str = "frontend"
) -> str:
    """The rendered text of deployment `name` among `views` (the answer of
    `GET /v1/deployments`); `CliError` when it is not there or cannot be rendered."""
    found = next((v for v in views if isinstance(v, dict) and v.get("name") == name), None)
    if found is None:
        raise CliError(f"no deployment {name!r} (`nvpair deployments` lists them)")
    fields = {k: v for k, v in found.items() if k in Deployment.__struct_fields__}
    try:
        deployment = msgspec.convert(fields, Deployment)
    except msgspec.ValidationError as exc:
        raise CliError(
            f"the agent's deployment {name!r} is not one this nvpair reads: {exc}"
        ) from None
    settings = DynamoSettings(frontend_type=frontend_type)
    try:
        rendered = render(RenderInput.from_deployment(deployment), settings, image=image)
    except RenderRefused as exc:
        raise CliError(str(exc)) from None
    if fmt == "dynamo-json":
        return json.dumps(rendered, indent=2) + "\n"
    return dump(rendered)


def _render(args: argparse.Namespace) -> int:
    if args.plane:
        print(_plane_render(args), end="")
        return 0
    text = render_text(
        cli_http.get("/v1/deployments"),
        args.name,
        args.format,
        image=args.image,
        frontend_type=args.frontend_type,
    )
    print(text, end="")
    return 0


def _plane_render(args: argparse.Namespace) -> str:
    """The plane's rendering of deployment `args.name` (a dep_ id, or a workload's name)."""
    deployment = args.name
    if not is_id(deployment, "dep"):
        query = urllib.parse.urlencode(
            {"workload": args.name, **({"cluster": args.cluster} if args.cluster else {})}
        )
        found = plane_call(args, f"/v1/deployments?{query}")["items"]
        if len(found) != 1:
            where = ", ".join(f"{d['clusterName']} ({d['id']})" for d in found) or "none"
            raise CliError(
                f"{args.name!r} has {len(found)} deployments here ({where}): "
                "name one by its dep_ id or --cluster"
            )
        deployment = found[0]["id"]
    query = urllib.parse.urlencode(
        {"format": "json", "image": args.image, "frontendType": args.frontend_type}
    )
    rendered = plane_call(args, f"/v1/deployments/{deployment}/dynamo?{query}")
    if args.format == "dynamo-json":
        return json.dumps(rendered, indent=2) + "\n"
    return dump(rendered)
