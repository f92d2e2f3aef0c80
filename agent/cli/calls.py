"""HTTP for the `nvpair` commands: finding the running agent and calling it (or a plane).

Commands other than `agent run` find their agent through `$NVPAIR_HOME/agent.json`, which the
running agent writes (its local API address and pid) and removes when it stops, and send
the token it wrote to `$NVPAIR_HOME/local-api.token` (`agent.apis.local_guard`). Every
failure is a `CliError` whose message says what is wrong and whose: `agent.cli.main.main` prints
it as one `nvpair: …` line and exits 1. Nothing here raises `SystemExit`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Final

from agent.apis.local_guard import TOKEN_FILE, read_token
from agent.config import nvpair_home
from netkit.processes import alive

__all__ = ["CliError", "agent_headers", "agent_url", "get", "post", "request", "table"]

TIMEOUT_S: Final = 10.0


class CliError(Exception):
    """A command cannot do what was asked; the message is the one line the user sees."""


def agent_url(home: Path | None = None) -> str:
    """The running agent's local API URL, from `agent.json` under `home` (default
    `$NVPAIR_HOME`); `CliError` when no agent runs there, naming a stale file's pid."""
    home = nvpair_home() if home is None else home
    path = home / "agent.json"
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        raise CliError(
            f"no agent is running for NVPAIR_HOME={home} (start one with `nvpair agent run`)"
        ) from None
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read {path}: {exc}") from None
    if not isinstance(state, dict) or not isinstance(state.get("api"), str):
        raise CliError(f"{path} is not an agent's state file (no api address in it)")
    pid = state.get("pid")
    if isinstance(pid, int) and not isinstance(pid, bool) and not alive(pid):
        # A killed agent cannot remove its file; the pid says which agent left it.
        raise CliError(f"no agent is running (stale agent.json from pid {pid})")
    return str(state["api"]).rstrip("/")


def agent_headers(home: Path | None = None) -> dict[str, str]:
    """The `Authorization` header the running agent's local API asks for, from its token
    file under `home` (default `$NVPAIR_HOME`); `CliError` when it cannot be read."""
    home = nvpair_home() if home is None else home
    try:
        return {"Authorization": f"Bearer {read_token(home)}"}
    except OSError as exc:
        raise CliError(f"cannot read the agent's token {home / TOKEN_FILE}: {exc}") from None


def get(path: str) -> Any:
    """GET `path` from the running agent's local API; the decoded JSON answer."""
    url = agent_url() + path
    return request(url, headers=agent_headers(), who="the agent")


def post(path: str, body: Any = None) -> Any:
    """POST `body` (JSON) to `path` on the running agent's local API; the decoded answer."""
    url, sent = agent_url() + path, {} if body is None else body
    return request(url, "POST", sent, headers=agent_headers(), who="the agent")


def call(method: str, path: str, body: Any = None, *, timeout_s: float = TIMEOUT_S) -> Any:
    """`method` `path` on the running agent's local API, `body` as JSON; the answer."""
    return request(
        agent_url() + path,
        method,
        body,
        headers=agent_headers(),
        who="the agent",
        timeout_s=timeout_s,
    )


def request(
    url: str,
    method: str = "GET",
    body: Any = None,
    *,
    headers: dict[str, str] | None = None,
    who: str = "the server",
    timeout_s: float = TIMEOUT_S,
) -> Any:
    """One JSON call to `url`; `CliError` naming `who` when it refuses or does not answer."""
    data = json.dumps(body).encode() if body is not None else None
    sent = {"Content-Type": "application/json", **(headers or {})}
    call = urllib.request.Request(url, data=data, headers=sent, method=method)
    try:
        with urllib.request.urlopen(call, timeout=timeout_s) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        raise CliError(f"{who} refused ({exc.code}): {_reason(exc)}") from None
    except urllib.error.URLError as exc:
        raise CliError(f"{who} does not answer at {url} ({exc.reason})") from None
    except (TimeoutError, ConnectionError) as exc:
        raise CliError(f"{who} does not answer at {url} ({exc})") from None
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        raise CliError(f"{who} answered something that is not JSON: {raw[:80]!r}") from None


def _reason(exc: urllib.error.HTTPError) -> str:
    """The error message in an answer's body (`{"error": …}` or plain text)."""
    try:
        text = exc.read().decode(errors="replace").strip()
    except OSError:
        return exc.reason if isinstance(exc.reason, str) else "no reason given"
    try:
        message = json.loads(text).get("error")
    except (ValueError, AttributeError):
        message = None
    return str(message) if message else text[:500] or str(exc.reason)


def table(rows: list[list[str]]) -> str:
    """Rows as left-aligned columns two spaces apart (the first row is the header)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def duration(text: str) -> datetime.timedelta:
    """An argparse type: `90s`, `15m`, `2h`, `1d`."""
    match = re.fullmatch(r"(\d+)([smhd])", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration like 90s, 15m, 2h or 1d: {text!r}")
    unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[match[2]]
    return datetime.timedelta(**{unit: int(match[1])})
