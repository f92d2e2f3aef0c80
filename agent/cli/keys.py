"""`nvpair keys create|list|revoke`: the cluster's API keys through the running agent's local
API (any member: a key issued or revoked on one reaches every member within seconds)."""

from __future__ import annotations

import argparse
import json
import re
import time
import urllib.parse
from typing import Any, Final

from agent.cli import calls as cli_http

__all__ = ["add_commands", "parse_duration"]

_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> int:
    """`30d`, `12h`, `90m`, `45s`, `2w` in seconds; `ArgumentTypeError` for anything else."""
    found = re.fullmatch(r"\s*(\d{1,9})\s*([smhdw])\s*", text)
    if found is None or int(found[1]) == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration such as 30d, 12h or 90m")
    return int(found[1]) * _UNITS[found[2]]


def add_commands(commands: Any) -> None:
    """Register `nvpair keys` on the top-level parser."""
    keys = commands.add_parser(
        "keys",
        help="API keys for the inference facade (cluster-wide)",
        description="Keys every member's facade takes: scoped to models, limited per minute.",
    )
    sub = keys.add_subparsers(dest="keys_command", metavar="SUBCOMMAND", required=True)
    create = sub.add_parser("create", help="issue a key; its secret is printed once")
    create.add_argument("name", help="who uses it: the requesterId of its jobs")
    create.add_argument("--models", default="", help="models it may use, a,b (default: all)")
    create.add_argument("--rpm", type=int, default=0, help="requests per minute (0: no limit)")
    create.add_argument("--tpm", type=int, default=0, help="tokens per minute (0: no limit)")
    create.add_argument("--expires", type=parse_duration, help="e.g. 30d, 12h (default: never)")
    create.set_defaults(run=_create)
    listing = sub.add_parser("list", help="every key: models, limits, expiry, state")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(run=_list)
    revoke = sub.add_parser("revoke", help="revoke a key on every member")
    revoke.add_argument("name")
    revoke.set_defaults(run=_revoke)


def _create(args: argparse.Namespace) -> int:
    body = {
        "name": args.name,
        "models": [m.strip() for m in args.models.split(",") if m.strip()],
        "rpm": args.rpm,
        "tpm": args.tpm,
        "expiresInS": args.expires or 0,
    }
    made = cli_http.post("/v1/keys", body)
    print(made["secret"])
    print(
        f"key {made['name']} ({made['fingerprint']}): {_models(made)}, {_limits(made)}, "
        f"{_expiry(made)}. The secret above is shown only now.",
    )
    return 0


def _list(args: argparse.Namespace) -> int:
    keys = cli_http.get("/v1/keys")
    if args.json:
        print(json.dumps(keys, indent=2))
        return 0
    rows = [["NAME", "FINGERPRINT", "MODELS", "RPM", "TPM", "EXPIRES", "STATE"]]
    for k in keys:
        rows.append(
            [k["name"], k["fingerprint"] or "-", ",".join(k["models"]) or "all",
             str(k["rpm"] or "-"), str(k["tpm"] or "-"), _when(k["expiresAt"]), k["state"]]
        )  # fmt: skip
    print(cli_http.table(rows))
    return 0


def _revoke(args: argparse.Namespace) -> int:
    made = cli_http.post(f"/v1/keys/{urllib.parse.quote(args.name, safe='')}/revoke", {})
    print(f"key {made['revoked']} revoked (version {made['version']})")
    return 0


def _models(key: dict[str, Any]) -> str:
    return "models " + ",".join(key["models"]) if key["models"] else "every model"


def _limits(key: dict[str, Any]) -> str:
    return f"{key['rpm'] or 'unlimited'} requests/min, {key['tpm'] or 'unlimited'} tokens/min"


def _expiry(key: dict[str, Any]) -> str:
    return f"expires {_when(key['expiresAt'])}" if key["expiresAt"] else "never expires"


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ms / 1000)) if ms else "never"
