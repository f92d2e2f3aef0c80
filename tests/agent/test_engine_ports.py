"""An engine's port (issue 25, item 4): whose process listens on it, read from /proc (the
parsers on sample text, the reading on real sockets), and the pool that hands ports out."""

from __future__ import annotations

import ipaddress
import os
import random
import socket
from pathlib import Path

import pytest

from agent.engine_ports import (
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
from agent.engine_proc_state import NoFreePort
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
