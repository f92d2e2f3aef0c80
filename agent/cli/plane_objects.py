"""`nvpair plane create | get | patch | delete KIND …` and `nvpair plane tenant-key TENANT`:
the plane's declared objects from the command line (docs/plane-objects.md).

A body is built from `-f FILE.json` (or `-` for stdin) and `field=value` words: the value is
parsed as JSON when it is valid JSON (`3`, `true`, `["eu"]`, `"123"` for the string), else
taken as a string; a dotted field nests (`spec.regions=["eu"]`). The plane's URL comes from
`--plane URL` or `$NVPAIR_PLANE_URL`; a tenant key from `$NVPAIR_PLANE_KEY` when set, else the
admin token from `$NVPAIR_PLANE_ADMIN_TOKEN` (agent/cli/plane_call.py). A refusal prints the
plane's own words.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.parse
from pathlib import Path
from typing import Any, Final

from agent.cli.calls import CliError, table
from agent.cli.plane_call import add_plane_flag, plane_call

__all__ = ["KINDS", "add_objects", "body_of", "kind_path"]

KINDS: Final = {
    "tenant": "/v1/tenants",
    "project": "/v1/projects",
    "quota": "/v1/quotas",
    "priority-class": "/v1/priority-classes",
    "policy": "/v1/policies",
    "pool": "/v1/pools",
    "artifact": "/v1/artifacts",
    "cluster": "/v1/clusters",
    "workload": "/v1/workloads",
    "deployment": "/v1/deployments",
    "endpoint": "/v1/endpoints",
    "operation": "/v1/operations",
    "event": "/v1/events",
    "component": "/v1/components",
    "cache": "/v1/cache",
}
_MAX_FILE: Final = 256 * 1024


def add_objects(sub: Any) -> None:
    """Register the object commands under the `plane` subcommands `sub`."""
    kinds = ", ".join(KINDS)

    def common(cmd: argparse.ArgumentParser) -> None:
        add_plane_flag(cmd)

    create = sub.add_parser("create", help="create a declared object (tenant, project, ...)")
    create.add_argument("kind", metavar="KIND", help=kinds)
    create.add_argument("-f", "--file", metavar="FILE.json", help="the body, or - for stdin")
    create.add_argument("fields", nargs="*", metavar="FIELD=VALUE")
    common(create)
    create.set_defaults(run=_create)
    get = sub.add_parser("get", help="list a kind's objects, or show one")
    get.add_argument("kind", metavar="KIND", help=kinds)
    get.add_argument("id", nargs="?", metavar="ID")
    get.add_argument("--json", action="store_true")
    common(get)
    get.set_defaults(run=_get)
    patch = sub.add_parser("patch", help="change fields of a declared object")
    patch.add_argument("kind", metavar="KIND", help=kinds)
    patch.add_argument("id", metavar="ID")
    patch.add_argument("fields", nargs="+", metavar="FIELD=VALUE")
    common(patch)
    patch.set_defaults(run=_patch)
    delete = sub.add_parser("delete", help="delete a declared object")
    delete.add_argument("kind", metavar="KIND", help=kinds)
    delete.add_argument("id", metavar="ID")
    common(delete)
    delete.set_defaults(run=_delete)
    key = sub.add_parser("tenant-key", help="mint a tenant's API key (printed once)")
    key.add_argument("tenant", metavar="TENANT", help="the tenant's id or name")
    key.add_argument("--name", default="", help="a label for the key")
    key.add_argument("--list", action="store_true", help="list the tenant's keys instead")
    key.add_argument("--revoke", metavar="KEY_ID", help="revoke this key instead")
    common(key)
    key.set_defaults(run=_tenant_key)


def kind_path(kind: str) -> str:
    """The API path of `kind` (singular, or its path's plural: `policies`)."""
    for name, path in KINDS.items():
        if kind in (name, path.rsplit("/", 1)[1]):
            return path
    raise CliError(f"unknown kind {kind!r}; the kinds are {', '.join(KINDS)}")


def body_of(fields: list[str], file: str | None = None) -> dict[str, Any]:
    """The JSON object of `-f FILE` with `field=value` words set over it."""
    body: dict[str, Any] = {}
    if file is not None:
        try:
            text = sys.stdin.read(_MAX_FILE + 1) if file == "-" else Path(file).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"cannot read {file}: {exc}") from None
        try:
            loaded = json.loads(text)
        except ValueError as exc:
            raise CliError(f"{file} is not JSON: {exc}") from None
        if not isinstance(loaded, dict):
            raise CliError(f"{file} holds {type(loaded).__name__}, not a JSON object")
        body = loaded
    for word in fields:
        name, sep, text = word.partition("=")
        if not sep or not name or any(not part for part in name.split(".")):
            raise CliError(f"{word!r} is not FIELD=VALUE (a dotted FIELD nests: spec.regions=…)")
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        *parents, last = name.split(".")
        into = body
        for part in parents:
            nested = into.setdefault(part, {})
            if not isinstance(nested, dict):
                raise CliError(f"{name}: {part} is already set to a value that is not an object")
            into = nested
        into[last] = value
    return body


def _quoted(text: str) -> str:
    return urllib.parse.quote(text, safe="")


def _show(answer: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(answer, indent=2))
        return
    rows = _items(answer)
    if rows is None:
        if not isinstance(answer, dict):
            print(json.dumps(answer))
            return
        for name, value in answer.items():
            shown = json.dumps(value) if isinstance(value, dict | list) else value
            print(f"{name}: {'' if shown is None else shown}")
        return
    if not rows:
        print("none")
        return
    columns = [c for c, v in rows[0].items() if not isinstance(v, dict | list)]
    columns = [c for c in columns if c not in ("createdAt", "updatedAt")][:8]
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    print(table([columns, *cells]))


def _items(answer: Any) -> list[dict[str, Any]] | None:
    """The objects of a list answer (a list, `{"items": [...]}`, or an object whose one list
    field holds them); None for one object."""
    if isinstance(answer, dict):
        if isinstance(answer.get("items"), list):
            answer = answer["items"]
        else:
            lists = [v for v in answer.values() if isinstance(v, list)]
            if "id" in answer or len(lists) != 1:
                return None
            answer = lists[0]
    if isinstance(answer, list):
        return [a for a in answer if isinstance(a, dict)]
    return None


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def _create(args: argparse.Namespace) -> int:
    answer = plane_call(args, kind_path(args.kind), "POST", body_of(args.fields, args.file))
    _show(answer, as_json=False)
    return 0


def _get(args: argparse.Namespace) -> int:
    path = kind_path(args.kind)
    _show(plane_call(args, path if args.id is None else f"{path}/{_quoted(args.id)}"), args.json)
    return 0


def _patch(args: argparse.Namespace) -> int:
    path = f"{kind_path(args.kind)}/{_quoted(args.id)}"
    _show(plane_call(args, path, "PATCH", body_of(args.fields)), as_json=False)
    return 0


def _delete(args: argparse.Namespace) -> int:
    plane_call(args, f"{kind_path(args.kind)}/{_quoted(args.id)}", "DELETE")
    print(f"deleted {args.kind} {args.id}")
    return 0


def _tenant_key(args: argparse.Namespace) -> int:
    tenant = args.tenant
    if not tenant.startswith("ten_"):  # a name: find its id
        found = plane_call(args, f"/v1/tenants?name={_quoted(tenant)}")
        rows = _items(found) or []
        if not rows:
            raise CliError(f"no tenant named {tenant!r}")
        tenant = rows[0]["id"]
    keys = f"/v1/tenants/{_quoted(tenant)}/keys"
    if args.list:
        _show(plane_call(args, keys), as_json=False)
        return 0
    if args.revoke is not None:
        plane_call(args, f"{keys}/{_quoted(args.revoke)}", "DELETE")
        print(f"revoked key {args.revoke} of {tenant}: it is refused from now on")
        return 0
    answer = plane_call(args, keys, "POST", {"name": args.name})
    print(answer["key"])
    print(
        f"key {answer['id']} of {tenant}; shown once, stored hashed "
        "(give it as NVPAIR_PLANE_KEY or a Bearer token)",
        file=sys.stderr,
    )
    return 0
