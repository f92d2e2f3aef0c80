"""Real agents behind fault proxies, and the process faults: kill -9, SIGSTOP and SIGCONT
of an agent or of its workload manager child, and restarts.

Each member gets one `FaultProxy` in front of its manager port and one in front of its node
API port (the two ports members talk to each other on) and advertises the proxies' ports,
so its peers reach it only through them. Every random choice is drawn from one seeded
`random.Random` (`fault_rng()`): the seed is printed and `NVPAIR_FAULT_SEED` replays it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, cast

from tests.agent.harness import Node, join, make_node, start_cluster
from tests.fixtures.waiting import eventually

from .proxy import FaultProxy

__all__ = [
    "PROXIED",
    "SEED_ENV",
    "Member",
    "fault_cluster",
    "fault_rng",
    "feature_on",
    "heal_partition",
    "manager_pid",
    "partition",
    "process_gone",
]

SEED_ENV: Final = "NVPAIR_FAULT_SEED"
PROXIED: Final = ("manager", "node")  # the ports members reach each other on
NAMES: Final = "abcdefgh"


def fault_rng(default_seed: int) -> random.Random:
    """The one source of randomness of a scenario: `NVPAIR_FAULT_SEED` if set, else the
    scenario's fixed seed; printed, so a failure names the seed that replays it."""
    raw = os.environ.get(SEED_ENV)
    try:
        seed = int(raw) if raw else default_seed
    except ValueError:
        raise ValueError(f"{SEED_ENV} must be an integer, not {raw!r}") from None
    print(f"fault seed: {seed} (replay with {SEED_ENV}={seed})")
    return random.Random(seed)


@dataclass
class Member:
    """One agent and the proxies in front of it."""

    node: Node
    proxies: dict[str, FaultProxy]  # port kind -> the proxy its peers dial
    address: str = "127.0.0.1"  # the address it dials members from (`dial_from`)
    node_id: str = ""  # known once started

    @property
    def name(self) -> str:
        return self.node.name

    # -- network faults (every member -> this member) ---------------------------------------

    def isolate(self) -> None:
        """No member reaches this one: every incoming link dropped and cut."""
        for proxy in self.proxies.values():
            proxy.drop()
            proxy.reset()

    def heal(self) -> None:
        """Every incoming link forwards again."""
        for proxy in self.proxies.values():
            proxy.heal()

    def cut_from(self, caller: Member) -> None:
        """One link, one way: `caller` no longer reaches this member; everyone else does,
        and this member still reaches `caller`."""
        for proxy in self.proxies.values():
            proxy.drop_from(caller.address)

    def heal_from(self, caller: Member) -> None:
        """`caller` reaches this member again."""
        for proxy in self.proxies.values():
            proxy.heal_from(caller.address)

    # -- process faults ------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """The agent's process id (it must be running)."""
        proc = self.node.proc
        assert proc is not None, f"{self.name} was never started"
        return proc.pid

    def signal_agent(self, sig: signal.Signals) -> None:
        """Send `sig` (SIGKILL, SIGSTOP, SIGCONT ...) to the agent itself."""
        os.kill(self.pid, sig)

    def signal_manager(self, sig: signal.Signals) -> int | None:
        """Send `sig` to the agent's workload manager child; its pid, or None when no
        manager runs now (it is being restarted)."""
        pid = manager_pid(self.pid)
        if pid is None:
            return None
        with contextlib.suppress(ProcessLookupError):  # it died between the look and the kill
            os.kill(pid, sig)
        return pid

    async def kill_agent(self) -> None:
        """kill -9 the agent and wait until it and its manager child are gone (the child
        exits when its stdin closes), so a restart finds its ports free."""
        proc = self.node.proc
        assert proc is not None
        child = manager_pid(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        if child is not None:
            await eventually(lambda: process_gone(child), f"{self.name}'s orphaned manager exits")

    async def restart(self) -> None:
        """Start the agent again on its home and ports; waits until /healthz says ok."""
        await self.node.start()

    async def manager_restarts(self) -> int:
        """How many times the supervisor restarted the workload manager."""
        health = await self.node.get("/v1/manager")
        return int(health["supervisor"]["restarts"])


def process_gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie nobody reaped yet counts as exited)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def manager_pid(agent_pid: int) -> int | None:
    """The workload manager child of `agent_pid`, found in /proc: the process whose parent
    is the agent and whose command line names `workload_manager`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        # The command name in stat may hold spaces and parentheses: the fields after the
        # last ')' are state, ppid, ...
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == agent_pid and b"workload_manager" in cmdline:
            return int(entry.name)
    return None


@contextlib.asynccontextmanager
async def fault_cluster(
    root: Path,
    size: int,
    rng: random.Random,
    *,
    anti_entropy_s: float = 5.0,
    toml: str = "",
    prepare_home: Callable[[str, Path], None] | None = None,
) -> AsyncIterator[list[Member]]:
    """`size` members on 127.0.0.1, each behind its proxies, in one cluster, all started;
    stopped and their proxies closed on exit. `toml` is more of every member's nvpair.toml
    (a `[plane]` table, say). `prepare_home(name, home)` is called with each member's empty
    home before anything is written there (to mount a disk on it, say); undoing it is the
    caller's, once this context has exited."""
    if not 1 <= size <= len(NAMES):
        raise ValueError(f"a fault cluster has 1 to {len(NAMES)} members, not {size}")
    async with contextlib.AsyncExitStack() as stack:
        members: list[Member] = []
        for index, name in enumerate(NAMES[:size]):
            member = await _new_member(
                stack, root, name, index, rng, anti_entropy_s, toml, prepare_home
            )
            members.append(member)
        # aclosing: start_cluster stops the agents in its `finally`, which an async
        # generator runs only when closed -- on a failure too, not only when exhausted.
        # (start_cluster is an async generator typed as an iterator: the cast says so.)
        generator = cast(AsyncGenerator[list[Node], None], start_cluster([m.node for m in members]))
        async with contextlib.aclosing(generator) as started:
            async for _ in started:
                try:
                    for member in members:
                        member.node_id = await member.node.node_id()
                    await eventually(
                        lambda: _all_see_all(members), f"{size} members see each other"
                    )
                    yield members
                finally:
                    await _stop_all(members)


async def _new_member(
    stack: contextlib.AsyncExitStack,
    root: Path,
    name: str,
    index: int,
    rng: random.Random,
    anti_entropy_s: float,
    toml: str = "",
    prepare_home: Callable[[str, Path], None] | None = None,
) -> Member:
    # A member's home, nvpair.toml and proxies (entered into `stack`); not started.
    node = make_node(root, name, "l4:1")
    node.home.mkdir(parents=True)
    if prepare_home is not None:
        prepare_home(name, node.home)
    # Each member dials its peers from its own loopback address, so a proxy can tell the
    # callers apart (one-way partitions of a single link, `Member.cut_from`).
    address = f"127.0.0.{2 + index}"
    config = f'[agent]\nanti_entropy_s = {anti_entropy_s}\ndial_from = "{address}"\n{toml}'
    (node.home / "nvpair.toml").write_text(config)
    (node.home / "nvpair.toml").chmod(0o600)  # a [plane] table holds a token
    # Each proxy draws its jitter from its own generator, seeded from the scenario's: how
    # many chunks pass is up to the machine, and must not move the scenario's draws.
    proxies = {
        kind: await stack.enter_async_context(
            FaultProxy(f"->{name}:{kind}", node.ports[kind], random.Random(rng.random()))
        )
        for kind in PROXIED
    }
    ports = (proxies["manager"].port, proxies["node"].port, node.ports["facade"])
    node.extra = ["--advertise", "127.0.0.1:{},{},{}".format(*ports)]
    return Member(node, proxies, address)


@contextlib.asynccontextmanager
async def joined(
    root: Path, members: list[Member], rng: random.Random, *, anti_entropy_s: float = 5.0
) -> AsyncIterator[Member]:
    """One more member behind its proxies, admitted by the first member (invite, then join
    over the network) and started; `members` gets it appended while it runs. Stopped, and
    its proxies closed, on exit."""
    name = NAMES[len(members)]
    async with contextlib.AsyncExitStack() as stack:
        member = await _new_member(stack, root, name, len(members), rng, anti_entropy_s)
        await join(members[0].node, member.node)
        try:
            await member.node.start()
            member.node_id = await member.node.node_id()
            members.append(member)
            yield member
        finally:
            await _stop_all([member])


async def feature_on(members: list[Member], feature: str) -> None:
    """Wait until `feature` (`facts.wire.FEATURES`) is on at every member."""

    async def everywhere() -> bool:
        for member in members:
            status = await member.node.get("/v1/cluster/status")
            if feature not in status["features"]["on"]:
                return False
        return True

    await eventually(everywhere, f"the {feature} feature on at every member")


def partition(member: Member, members: list[Member]) -> None:
    """Cut `member` off both ways: nobody reaches it and it reaches nobody."""
    member.isolate()
    for other in members:
        if other is not member:
            other.cut_from(member)


def heal_partition(member: Member, members: list[Member]) -> None:
    """Undo `partition(member, members)`."""
    member.heal()
    for other in members:
        if other is not member:
            other.heal_from(member)


async def _stop_all(members: list[Member]) -> None:
    # A member a failed scenario left stopped (SIGSTOP) cannot take its SIGTERM: continue
    # it and its manager first; one that does not exit in time is killed, so no agent
    # outlives the test.
    for member in members:
        proc = member.node.proc
        if proc is None or proc.returncode is not None:
            continue
        member.signal_manager(signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError):
            member.signal_agent(signal.SIGCONT)
        try:
            await member.node.stop()
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def _all_see_all(members: list[Member]) -> bool:
    # Every member's peer list holds every other member, at its advertised (proxy) ports.
    for member in members:
        status = await member.node.get("/v1/manager")
        peers = {(p["nodeId"], p["port"]) for p in status["status"]["peers"]}
        want = {(m.node_id, m.proxies["manager"].port) for m in members if m is not member}
        if not want <= peers:
            return False
    return True


async def wait_manager_up(member: Member) -> None:
    """Until the member's workload manager child runs again."""
    await eventually(lambda: manager_pid(member.pid) is not None, f"{member.name}'s manager runs")


async def settle(delay_s: float) -> None:
    """Let a fault last `delay_s`: the fault's duration, never a wait for a result."""
    await asyncio.sleep(delay_s)
