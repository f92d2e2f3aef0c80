"""An engine's port: choosing a free one, and telling whose process listens on it.

Another process can hold the port a replica was given: an engine left running from before
(engines outlive the agent), another agent's engine on the same host (two agents with one
`[engines] port_range`), any other service. Its answers must never pass for the engine's,
so a port is the engine's only when Linux says so: `/proc/net/tcp` and `/proc/net/tcp6`
list the listening sockets (state `0A`) with their inodes, and `/proc/<pid>/fd/*` of the
processes in the engine's process group (it leads its own, `setsid`) link to
`socket:[inode]`. Parsing and judging are pure functions (`parse_listeners`,
`socket_inode`, `group_of`, `judge`); `check_port` and `holders_of` read `/proc`.

Only the sockets a connection to 127.0.0.1 can reach count (127.0.0.1, 0.0.0.0, `::` and
their IPv4-mapped forms): that is where the agent calls its engines.
"""

from __future__ import annotations

import ipaddress
import os
import random
import socket
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from agent.engines.proc_state import NoFreePort

__all__ = [
    "Listener",
    "PortCheck",
    "PortPool",
    "check_port",
    "group_of",
    "holders_of",
    "judge",
    "parse_listeners",
    "port_free",
    "socket_inode",
]

_PROC: Final = Path("/proc")
_LISTEN: Final = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column
_ESTABLISHED: Final = "01"
_LOOPBACK: Final = frozenset({ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("0.0.0.0")})
_ANY6: Final = ipaddress.IPv6Address("::")
MAX_HOLDERS: Final = 3  # named in a message


@dataclass(frozen=True, slots=True)
class Listener:
    """One listening TCP socket as `/proc/net/tcp(6)` shows it."""

    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int
    inode: int

    def reaches_loopback(self) -> bool:
        """A connection to 127.0.0.1 on its port can land on it."""
        address = self.address
        if isinstance(address, ipaddress.IPv6Address):
            if address == _ANY6:  # dual-stack unless IPV6_V6ONLY, which /proc does not show
                return True
            if address.ipv4_mapped is None:
                return False
            address = address.ipv4_mapped
        return address in _LOOPBACK


@dataclass(frozen=True, slots=True)
class PortCheck:
    """Who listens on a port (reachable from 127.0.0.1): the engine's sockets, the others."""

    port: int
    ours: tuple[int, ...] = ()  # inodes of the engine's process group
    foreign: tuple[int, ...] = ()  # inodes of any other process

    @property
    def taken(self) -> bool:
        """Another process listens there: its answers are not the engine's."""
        return bool(self.foreign)

    @property
    def engines(self) -> bool:
        """The engine listens there, and nothing else does."""
        return bool(self.ours) and not self.foreign


def parse_listeners(
    text: str, byteorder: Literal["little", "big"] = sys.byteorder
) -> list[Listener]:
    """The listening sockets in the text of `/proc/net/tcp` or `/proc/net/tcp6`.

    An address is hex of 32-bit words in the host's byte order (`0100007F` is 127.0.0.1
    on a little-endian machine); a line that does not parse is skipped.
    """
    found = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != _LISTEN:
            continue
        address, _, port = fields[1].partition(":")
        try:
            words = [int(address[i : i + 8], 16) for i in range(0, len(address), 8)]
            packed = b"".join(w.to_bytes(4, byteorder) for w in words)
            found.append(Listener(ipaddress.ip_address(packed), int(port, 16), int(fields[9])))
        except ValueError:
            continue
    return found


def socket_inode(link: str) -> int | None:
    """The inode of a `/proc/<pid>/fd/N` link that names a socket (`socket:[12345]`)."""
    if link.startswith("socket:[") and link.endswith("]") and link[8:-1].isdigit():
        return int(link[8:-1])
    return None


def group_of(stat: str) -> tuple[int, int] | None:
    """(process group, session) from the text of `/proc/<pid>/stat` (fields 5 and 6)."""
    try:
        fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces and ')'
        return int(fields[2]), int(fields[3])
    except (ValueError, IndexError):
        return None


def judge(listeners: Iterable[Listener], port: int, ours: set[int]) -> PortCheck:
    """Who listens on `port` where 127.0.0.1 reaches, given the engine's socket inodes."""
    reached = sorted({s.inode for s in listeners if s.port == port and s.reaches_loopback()})
    return PortCheck(
        port,
        ours=tuple(i for i in reached if i in ours),
        foreign=tuple(i for i in reached if i not in ours),
    )


# -- reading /proc --------------------------------------------------------------------------


def check_port(port: int, leader: int, known: frozenset[int] = frozenset()) -> PortCheck:
    """Who listens on `port`: the engine whose process group (or session) `leader` leads,
    or another process. The group's sockets are looked up only when something listens
    that is not in `known` (inodes found to be the engine's before: an inode is not
    reused while its socket is open)."""
    listeners = [s for s in _listeners() if s.port == port]
    if not listeners:
        return PortCheck(port)
    inodes = {s.inode for s in listeners}
    return judge(listeners, port, set(known) if inodes <= known else _group_sockets(leader))


def client_of(peer_port: int, port: int, leader: int) -> bool:
    """Whether the loopback connection from `peer_port` to our `port` was opened by the
    process group (or session) `leader` leads: its socket is one of that group's (a tunnel's
    head end takes its engine's connections only, not any local user's)."""
    inodes = set()
    for name in ("tcp", "tcp6"):
        try:
            text = (_PROC / "net" / name).read_text()
        except OSError:
            continue
        for line in text.splitlines()[1:]:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _ESTABLISHED:
                continue
            local, remote = fields[1].rpartition(":")[2], fields[2].rpartition(":")[2]
            try:
                if int(local, 16) == peer_port and int(remote, 16) == port:
                    inodes.add(int(fields[9]))
            except ValueError:
                continue
    return bool(inodes) and inodes <= _group_sockets(leader)


def holders_of(inodes: Iterable[int]) -> list[tuple[int, str]]:
    """(pid, command name) of the processes holding these sockets that this agent can see
    (another user's are not: their `fd` is not ours to read)."""
    wanted = set(inodes)
    found = []
    for pid in _pids():
        if wanted & _sockets_of(pid):
            found.append((pid, _comm(pid)))
            if len(found) >= MAX_HOLDERS:
                break
    return found


def _listeners() -> list[Listener]:
    found = []
    for name in ("tcp", "tcp6"):
        try:
            found += parse_listeners((_PROC / "net" / name).read_text())
        except OSError:
            continue  # no IPv6 on this host
    return found


def _group_sockets(leader: int) -> set[int]:
    inodes: set[int] = set()
    for pid in _pids():
        try:
            ids = group_of((_PROC / str(pid) / "stat").read_text())
        except OSError:
            continue
        if ids is not None and leader in ids:
            inodes |= _sockets_of(pid)
    return inodes


def _pids() -> list[int]:
    return [int(e.name) for e in _PROC.iterdir() if e.name.isdigit()]


def _sockets_of(pid: int) -> set[int]:
    fds = _PROC / str(pid) / "fd"
    try:
        names = os.listdir(fds)
    except OSError:
        return set()  # gone, or another user's
    inodes = set()
    for name in names:
        try:
            inode = socket_inode(os.readlink(fds / name))
        except OSError:
            continue
        if inode is not None:
            inodes.add(inode)
    return inodes


def _comm(pid: int) -> str:
    try:
        return (_PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"


# -- choosing a port --------------------------------------------------------------------------


def port_free(port: int) -> bool:
    """Nothing listens on `port` on 127.0.0.1 nor on any IPv4 address (a bind test on both:
    the built-in templates bind 127.0.0.1, a custom one may bind 0.0.0.0)."""
    for host in ("127.0.0.1", "0.0.0.0"):
        # SO_REUSEADDR as servers set it: a port in TIME_WAIT is free, one with a listener
        # is not.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError:
                return False
    return True


class PortPool:
    """Ports for replicas from `[engines] port_range`: one per replica, never one in use.

    A port is free when no replica holds it and `port_free()` says so (another program's
    listener is skipped). The search goes round the range from where it last stopped, so a
    port just given back is not handed out again at once; a move searches from a random
    port (`rng`), so agents moving off one port at once do not all land on the next one.
    """

    def __init__(self, low: int, high: int, rng: random.Random | None = None) -> None:
        if not 0 < low <= high <= 65535:
            raise ValueError(f"port range {low}-{high}")
        self.low, self.high = low, high
        self._held: dict[str, int] = {}
        self._next = low
        self._rng = rng or random.Random()

    def take(self, owner: str, wanted: int = 0, *, skip: int = 0) -> int:
        """A port for `owner` (`wanted` when it is free or already `owner`'s; never `skip`)."""
        if owner in self._held:
            return self._held[owner]
        size = self.high - self.low + 1
        candidates: Iterable[int] = (
            self.low + (self._next - self.low + n) % size for n in range(size)
        )
        if wanted:
            candidates = [wanted]
        taken = {*self._held.values(), skip}
        for port in candidates:
            if port not in taken and port_free(port):
                self._held[owner] = port
                self._next = port + 1 if port < self.high else self.low
                return port
        what = f"port {wanted}" if wanted else f"every port of {self.low}-{self.high}"
        raise NoFreePort(f"{owner}: {what} is taken (by a replica or another program)")

    def move(self, owner: str) -> int:
        """Another free port for `owner`: another program took the one it held."""
        self._next = self._rng.randint(self.low, self.high)
        return self.take(owner, skip=self._held.pop(owner, 0))

    def claim(self, owner: str, port: int) -> None:
        """Record `port` as `owner`'s without a bind test (an adopted engine listens on it)."""
        self._held[owner] = port

    def release(self, owner: str) -> None:
        """`owner` no longer holds a port."""
        self._held.pop(owner, None)
