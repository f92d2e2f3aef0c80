"""`nvpair artifact add|list|fetch|warm|rm|forget`: weights as cluster artifacts (issue 28), through
the running agent's local API. `add` hashes local files into this member's store and names
them for every member; `fetch` makes an artifact resident here from the members that hold
it; `list` shows the cluster's artifacts and whether each is resident here."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any, Final

from agent.cli import calls as cli_http
from agent.cli.calls import CliError

__all__ = ["add_commands"]

ADD_TIMEOUT_S: Final = 6 * 3600  # hashing a large model's files takes a while


def add_commands(commands: Any) -> None:
    """Register `nvpair artifact` on the top-level parser."""
    artifact = commands.add_parser(
        "artifact", help="weights as content-addressed artifacts, moved between members"
    )
    sub = artifact.add_subparsers(dest="artifact_command", metavar="SUBCOMMAND", required=True)
    add = sub.add_parser("add", help="hash local files (a file or a folder) into an artifact")
    add.add_argument(
        "path", help="a file or a folder of files on this machine, or an https:// URL of a file"
    )
    add.add_argument("--sha256", default="", help="with a URL: the file's SHA-256 (required)")
    add.add_argument("--name", help="the name deployments use (default: the file's or folder's)")
    add.add_argument(
        "--piece-size",
        type=int,
        default=0,
        help="bytes per piece, 65536 to 67108864 (default 16 MiB)",
    )
    add.set_defaults(run=_add)
    listing = sub.add_parser("list", help="the cluster's artifacts and where they are")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(run=_list)
    fetch = sub.add_parser("fetch", help="make an artifact resident here, from the members")
    fetch.add_argument("name")
    fetch.add_argument("--wait", action="store_true", help="wait until it is resident")
    fetch.set_defaults(run=_fetch)
    warm = sub.add_parser(
        "warm", help="keep artifacts resident on every member (the cluster's warm set)"
    )
    warm.add_argument("names", nargs="+", metavar="NAME")
    warm.add_argument("--off", action="store_true", help="take them out of the warm set")
    warm.set_defaults(run=_warm)
    rm = sub.add_parser("rm", help="drop this member's copy (the others keep theirs)")
    rm.add_argument("name")
    rm.set_defaults(run=_rm)
    forget = sub.add_parser("forget", help="forget an artifact cluster-wide")
    forget.add_argument("name")
    forget.set_defaults(run=_forget)


def _add(args: argparse.Namespace) -> int:
    body: dict[str, Any]
    if "://" in args.path:  # a URL: the agent downloads it, and checks its SHA-256
        if not args.sha256:
            raise CliError("a URL needs --sha256: the file's SHA-256, to check what comes")
        last = urllib.parse.urlsplit(args.path).path.rsplit("/", 1)[-1]
        body = {"url": args.path, "sha256": args.sha256.lower(), "name": args.name or last}
    else:
        source = Path(args.path).resolve()
        body = {"path": str(source), "name": args.name or source.name}
    if args.piece_size:
        body["pieceSize"] = args.piece_size
    made = cli_http.call("POST", "/v1/artifacts", body, timeout_s=ADD_TIMEOUT_S)
    print(f"{made['name']}: {made['id']} {made['digest']} ({_size(made['size'])})")
    return 0


def _list(args: argparse.Namespace) -> int:
    found = cli_http.get("/v1/artifacts")
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    rows = [["NAME", "ID", "DIGEST", "SIZE", "WARM", "HERE", "MEMBERS"]]
    rows += [
        [a["name"], a["id"], a["digest"][:19], _size(a["size"]), "yes" if a.get("warm") else "",
         _here(a), _members(a)]
        for a in found
    ]  # fmt: skip
    print(cli_http.table(rows))
    return 0


def _warm(args: argparse.Namespace) -> int:
    for name in args.names:
        quoted = urllib.parse.quote(name, safe="")
        made = cli_http.post(f"/v1/artifacts/{quoted}/warm", {"warm": not args.off})
        said = "warm: every member keeps it resident" if made["warm"] else "not warm"
        print(f"{made['name']}: {said}")
    return 0


def _members(artifact: dict[str, Any]) -> str:
    """Each member's copy, as the members' records say: `a:resident b:fetching 40%`."""
    return " ".join(f"{name}:{state}" for name, state in sorted(artifact["members"].items()))


def _fetch(args: argparse.Namespace) -> int:
    name = urllib.parse.quote(args.name, safe="")
    state = cli_http.post(f"/v1/artifacts/{name}/fetch")
    shown = Progress(state["pieceCount"], tty=sys.stdout.isatty())
    while args.wait and state["here"] == "fetching":
        shown.show(state.get("held", 0))
        time.sleep(0.5)  # a local call; the fetch reports what it holds each time
        state = next(a for a in cli_http.get("/v1/artifacts") if a["name"] == state["name"])
    shown.end()
    print(f"{state['name']}: {_here(state)}")
    if args.wait and state["here"] != "resident":
        raise CliError(f"{state['name']} is not resident here: {state.get('why', state['here'])}")
    return 0


def _rm(args: argparse.Namespace) -> int:
    name = urllib.parse.quote(args.name, safe="")
    state = cli_http.call("DELETE", f"/v1/artifacts/{name}/here")
    print(f"{state['name']}: {_here(state)} here")
    return 0


def _forget(args: argparse.Namespace) -> int:
    name = urllib.parse.quote(args.name, safe="")
    done = cli_http.call("DELETE", f"/v1/artifacts/{name}")
    print(f"{done['forgotten']} forgotten; the members follow")
    return 0


class Progress:
    """A fetch's progress: a bar redrawn in place on a terminal, else a plain line each
    tenth of the way (logs and pipes get no carriage returns)."""

    WIDTH: Final = 30

    def __init__(self, pieces: int, *, tty: bool) -> None:
        self.pieces = max(pieces, 1)
        self.tty = tty
        self._last = -1  # the tenth last printed (plain lines)
        self._drawn = False

    def show(self, held: int) -> None:
        """Show `held` pieces of the artifact's."""
        share = min(held, self.pieces) / self.pieces
        if self.tty:
            filled = int(share * self.WIDTH)
            bar = "#" * filled + "." * (self.WIDTH - filled)
            print(f"\r[{bar}] {share:4.0%} {held}/{self.pieces} pieces", end="", flush=True)
            self._drawn = True
        elif int(share * 10) > self._last:
            self._last = int(share * 10)
            print(f"fetching: {share:.0%} ({held}/{self.pieces} pieces)", flush=True)

    def end(self) -> None:
        """End the bar's line."""
        if self._drawn:
            print()


def _here(artifact: dict[str, Any]) -> str:
    here = str(artifact["here"])
    if here == "fetching":
        return f"fetching ({artifact.get('held', 0)}/{artifact['pieceCount']} pieces)"
    if here == "failed":
        return f"failed: {artifact.get('why', '')}"
    return here


def _size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
