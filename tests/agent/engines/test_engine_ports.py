"""An engine's port (issue 25, item 4): whose process listens on it, read from /proc (the
parsers on sample text, the reading on real sockets), and a supervisor that never takes
another process's answers for its engine's -- it moves the replica to a free port instead
-- nor an engine serving another model for the replica's."""

from __future__ import annotations

import ipaddress
import os
import random
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.engines.ports import (
    Listener,
    PortCheck,
    PortPool,
    check_port,
    group_of,
    holders_of,
    judge,
    parse_listeners,
    socket_inode,
)
from agent.engines.proc_state import NoFreePort
from agent.engines.ready import Ready, Waiting, describe_taken, serving_verdict
from agent.engines.supervisor import ReplicaState
from tests.agent.engine_harness import Harness, open_harness, serves, state_of
from tests.agent.harness import start_engine
from tests.fixtures.waiting import eventually
from tests.workload_manager.cluster_harness import free_port

# /proc/net/tcp as Linux writes it (little-endian words): a listener on 127.0.0.1:18005,
# a connection from that port (st 01, not a listener), listeners on 0.0.0.0:18006 and on
# 10.0.0.5:18005, and a line cut short.
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:4655 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 111 1 0 100 0 0 10 0
   1: 0100007F:4655 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1000        0 112 1 0 20 4 30 10 -1
   2: 00000000:4656 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 113 1 0 100 0 0 10 0
   3: 0500000A:4655 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 114 1 0 100 0 0 10 0
   4: 0100007F:4655 00000000:0000 0A
"""  # noqa: E501
# /proc/net/tcp6: listeners on [::]:18005, [::1]:18005 and [::ffff:127.0.0.1]:18007.
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:4655 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 221 1 0 100 0 0 10 0
   1: 00000000000000000000000001000000:4655 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 222 1 0 100 0 0 10 0
   2: 0000000000000000FFFF00000100007F:4657 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 223 1 0 100 0 0 10 0
"""  # noqa: E501


def test_listening_sockets_are_read_from_proc_net_tcp() -> None:
    found = parse_listeners(TCP, "little")
    assert [(str(s.address), s.port, s.inode) for s in found] == [
        ("127.0.0.1", 18005, 111),
        ("0.0.0.0", 18006, 113),
        ("10.0.0.5", 18005, 114),
    ]
    assert [s.reaches_loopback() for s in found] == [True, True, False]
    six = parse_listeners(TCP6, "little")
    assert [(s.address, s.port, s.inode) for s in six] == [
        (ipaddress.ip_address("::"), 18005, 221),
        (ipaddress.ip_address("::1"), 18005, 222),
        (ipaddress.ip_address("::ffff:127.0.0.1"), 18007, 223),
    ]
    assert [s.reaches_loopback() for s in six] == [True, False, True]
    # A big-endian machine writes its words the other way round.
    big = TCP.replace("0100007F:4655 00000000:0000 0A", "7F000001:4655 00000000:0000 0A", 1)
    assert str(parse_listeners(big, "big")[0].address) == "127.0.0.1"
    assert parse_listeners("header\nnot a socket line at all 0A x y z w v u\n") == []


def test_socket_links_and_process_groups_are_read_from_proc() -> None:
    assert socket_inode("socket:[56182]") == 56182
    assert socket_inode("pipe:[66340]") is None
    assert socket_inode("socket:[x]") is None
    # The command name may hold spaces and ')': fields are counted after the last ')'.
    assert group_of("4242 (vllm ) worker) S 1 4200 4100 0 -1 4194560 ...") == (4200, 4100)
    assert group_of("4242 (cut") is None


def test_a_port_is_the_engines_only_when_nothing_else_listens_there() -> None:
    listeners = [
        Listener(ipaddress.ip_address("127.0.0.1"), 18005, 1),
        Listener(ipaddress.ip_address("10.0.0.5"), 18005, 2),  # not reached from 127.0.0.1
        Listener(ipaddress.ip_address("::"), 18005, 3),
        Listener(ipaddress.ip_address("127.0.0.1"), 18006, 4),
    ]
    assert judge(listeners, 18005, {1, 3}) == PortCheck(18005, ours=(1, 3))
    assert judge(listeners, 18005, {1, 3}).engines
    mixed = judge(listeners, 18005, {1})
    assert (mixed.taken, mixed.engines, mixed.foreign) == (True, False, (3,))
    assert not judge(listeners, 18007, {1}).engines  # nobody listens: not the engine's


def test_the_reasons_name_the_holder_and_the_model() -> None:
    held = describe_taken(PortCheck(18005, foreign=(7,)), [(4242, "python3")])
    assert (
        held
        == "port 18005 is held by another process (pid 4242 python3), not this replica's engine"
    )
    assert "(of another user)" in describe_taken(PortCheck(18005, foreign=(7,)), [])
    assert serving_verdict("chat", 200, ["other", "chat"]) == Ready()
    assert serving_verdict("chat", 200, ["other"]) == Waiting(
        "it serves ['other'], not 'chat' (GET /v1/models)"
    )
    assert serving_verdict("chat", 401, []) == Waiting("GET /v1/models answered 401")


def test_a_real_listener_is_told_apart_by_process_group() -> None:
    port = free_port()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        mine = check_port(port, os.getpgrp())  # this test's own group holds it
        assert mine.engines
        # Sockets already known to be the engine's are not looked up again.
        assert check_port(port, 1, frozenset(mine.ours)).engines
        other = check_port(port, 1)  # init's group does not hold it
        assert other.taken
        assert (os.getpid(), Path("/proc/self/comm").read_text().strip()) in holders_of(
            other.foreign
        )
    assert check_port(port, os.getpgrp()) == PortCheck(port)


def test_a_moved_replica_never_gets_its_old_port_back() -> None:
    low = free_port()
    pool = PortPool(low, low + 1)
    assert pool.take("a") == low
    assert pool.move("a") == low + 1  # whatever the bind test says of `low` now
    assert pool.take("b") == low
    with pytest.raises(NoFreePort):
        pool.move("b")  # low + 1 is a's


def test_agents_moving_off_one_port_at_once_part() -> None:
    # Three agents with one range all took its first port; each moves, from a random port
    # on (seeded here), not all to the next one, where they would collide again.
    low = free_port()
    pools = [PortPool(low, low + 49, random.Random(seed)) for seed in range(3)]
    assert {pool.take("r") for pool in pools} == {low}
    assert len({pool.move("r") for pool in pools}) == 3


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    async with open_harness(tmp_path) as opened:
        yield opened


def watched(harness: Harness) -> tuple[list[tuple[ReplicaState, int]], dict[str, object]]:
    """Options for a supervisor that records (state, port) at every change of its replica."""
    seen: list[tuple[ReplicaState, int]] = []

    def changed() -> None:
        for status in harness.supervisors[-1].replicas():
            seen.append((status.state, status.port))

    return seen, {"on_change": changed}


async def test_another_process_answering_on_the_port_is_never_taken_for_the_engine(
    harness: Harness,
) -> None:
    seen, options = watched(harness)
    supervisor = harness.supervisor(**options)
    spec = harness.spec("f", "late")  # binds only once `loaded` exists, as vLLM after loading
    supervisor.launch(spec)
    current = state_of(supervisor, spec)
    await eventually(lambda: current().pid is not None, "the engine runs, loading")
    port = current().port
    # Another mock engine takes the port meanwhile, serving the very model (the later
    # --port wins): an engine left from before, another agent's.
    foreign = await start_engine(spec.served, "--port", str(port))
    try:
        await eventually(lambda: current().port != port, "the replica leaves the taken port")
        why = current().last_error or ""
        assert f"port {port} is held by another process (pid {foreign.proc.pid} " in why, why
        assert f"moved to port {current().port}" in why
        assert current().reason == why  # its node record's `error`, on every member
        (harness.home / "loaded").touch()
        await eventually(lambda: current().state is ReplicaState.READY, "ready on its new port")
        assert current().reason == ""
        assert (ReplicaState.READY, port) not in seen
        assert await serves(f"http://127.0.0.1:{port}", spec.served)  # the other one, still
        assert current().restarts == 0  # a move is not a crash
    finally:
        await foreign.stop()


async def test_a_port_taken_before_the_engine_binds_it_is_left_for_a_free_one(
    harness: Harness,
) -> None:
    seen, options = watched(harness)
    supervisor = harness.supervisor(**options)
    spec = harness.spec("t", "fake")
    port = supervisor.launch(spec).port
    with socket.socket() as squatter:  # another program binds it before the engine starts
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        current = state_of(supervisor, spec)
        await eventually(lambda: current().state is ReplicaState.READY, "ready elsewhere")
    assert current().port != port
    assert f"port {port} is in use" in (current().last_error or "")
    assert (ReplicaState.READY, port) not in seen


async def test_an_engine_serving_another_model_is_never_ready(harness: Harness) -> None:
    supervisor = harness.supervisor()
    spec = harness.spec("i", "impostor")  # its template names {served}; it serves "other"
    supervisor.launch(spec)
    current = state_of(supervisor, spec)
    await eventually(lambda: current().state is not ReplicaState.STARTING, "it is judged")
    assert current().state is ReplicaState.FAILED
    assert current().last_error == (
        "not ready within 3s (GET /health): it serves ['other'], not 'model-i' (GET /v1/models)"
    )
