"""`agent.advertise` / `--advertise`: the address (and ports) peers reach this node at.

`HOST` or `HOST:MANAGER_PORT,NODE_PORT,FACADE_PORT`; an IPv6 address with ports goes in
brackets. A bad value is a `ValueError` whose message names the key (the config loader
turns it into its `ConfigError`).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Final

__all__ = ["parse_advertise"]

_HOST_NAME: Final = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)
_ADVERTISE_FORM: Final = (
    'is "HOST" or "HOST:MANAGER_PORT,NODE_PORT,FACADE_PORT" (an IPv6 address with ports in '
    "brackets: [ADDR]:PORTS)"
)


def parse_advertise(value: str) -> tuple[str, tuple[int, int, int] | None]:
    """`agent.advertise` / `--advertise`: the host peers use and, when given, the
    (manager, node, facade) ports they use; `ValueError` naming `agent.advertise`."""
    text = value.strip()
    ports_text: str | None = None
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise _bad_advertise(value, "an opening [ without its closing ]")
        ports_text = rest[1:] if rest else None
        if not _is_ip(host, version=6):
            raise _bad_advertise(value, f"{host!r} is not an IPv6 address")
    elif text.count(":") > 1:
        host = text  # a bare IPv6 address: no ports (they would be ambiguous)
        if not _is_ip(host, version=6):
            raise _bad_advertise(value, f"{host!r} is not an IPv6 address")
    else:
        host, colon, rest = text.partition(":")
        ports_text = rest if colon else None
        if not (_is_ip(host, version=4) or _HOST_NAME.fullmatch(host)):
            raise _bad_advertise(value, f"{host!r} is not a host name or an IP address")
    if ports_text is None:
        return host, None
    parts = ports_text.split(",")
    if len(parts) != 3 or not all(
        p.isascii() and p.isdigit() and 1 <= int(p) <= 65535 for p in parts
    ):
        raise _bad_advertise(value, "the ports are three numbers from 1 to 65535")
    manager, node, facade = (int(p) for p in parts)
    return host, (manager, node, facade)


def _is_ip(text: str, *, version: int) -> bool:
    try:
        return ipaddress.ip_address(text).version == version
    except ValueError:
        return False


def _bad_advertise(value: str, why: str) -> ValueError:
    return ValueError(f"agent.advertise {_ADVERTISE_FORM}; {why} in {value[:300]!r}")
